"""`efim bench saved`: the commands it runs — the traces synthesised once, then `efim replay
--compare adapters` on a server that gets `--quant` (or the `--server` given) — without
running them."""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys

import pytest

from bench import characters_saved
from efim_tools.cli import build_parser


def bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    characters_saved.add_arguments(parser)
    return parser.parse_args(list(argv))


def server_of(replay: list[str]) -> list[str] | None:
    return shlex.split(replay[replay.index("--server") + 1]) if "--server" in replay else None


def test_without_quant_or_server_replay_starts_its_own_server():
    replay = characters_saved.replay_command(bench_args("--adapters", "auto"), "/tmp/traces")
    assert replay[3:] == ["replay", "/tmp/traces", "--compare", "adapters", "--speed", "max", "--adapters", "auto"]
    assert server_of(replay) is None


def test_quant_goes_to_efim_serve():
    replay = characters_saved.replay_command(bench_args("--quant", "int4", "--seed", "1"), "/tmp/traces")
    server = server_of(replay)
    assert server == [sys.executable, "-m", "efim_tools.cli", "serve", "--quant", "int4"]
    for quant in characters_saved.QUANT_CHOICES:  # each a weight form `efim serve --quant` takes
        assert build_parser().parse_args([*server[3:-1], quant]).quant == quant


def test_quant_is_added_to_a_given_server_command():
    args = bench_args("--server", "python -m efim_tools.cli serve --threads 1", "--quant", "mixed", "--config", '{"context": "off"}')
    replay = characters_saved.replay_command(args, "/tmp/traces")
    assert server_of(replay) == ["python", "-m", "efim_tools.cli", "serve", "--threads", "1", "--quant", "mixed"]
    assert replay[replay.index("--config") + 1] == '{"context": "off"}'
    assert server_of(characters_saved.replay_command(bench_args("--server", "my-server --x 'a b'"), "t")) == ["my-server", "--x", "a b"]


def test_quant_choices_are_the_engines():
    from engine.model.loader import QUANT_CHOICES

    assert characters_saved.QUANT_CHOICES == QUANT_CHOICES
    with pytest.raises(SystemExit):
        bench_args("--quant", "q3")


def test_run_synthesises_then_replays_on_the_quant_server(monkeypatch, tmp_path):
    ran = []
    monkeypatch.setattr(characters_saved.subprocess, "run", lambda cmd, **kw: ran.append(cmd) or subprocess.CompletedProcess(cmd, 0))
    assert characters_saved.run_cli(bench_args("--sessions", "2", "--seed", "1", "--quant", "none", "--json", str(tmp_path / "s.json"))) == 0
    synth, replay = ran
    assert synth[3:5] == ["trace", "synth"] and synth[-4:] == ["--sessions", "2", "--seed", "1"]
    assert replay[4] == synth[synth.index("-o") + 1]  # the traces just written
    assert server_of(replay)[-2:] == ["--quant", "none"] and replay[-2:] == ["--json", str(tmp_path / "s.json")]
