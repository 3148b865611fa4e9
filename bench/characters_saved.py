"""`efim bench saved`: characters saved — the share of what a person types that accepted
suggestions supply — on typing traces synthesised from the training's held-out stdlib
modules (`efim_tools.training.data.HELD_OUT_MODULES`, never trained on), for the default model
without and with its shipped FIM adapter (`efim replay --compare adapters`).

The replayed person accepts a suggestion when it equals what they type next (at least 3
characters, or the whole suggestion): the same rule for every configuration. Printed per
configuration: suggestions shown, accepted, acceptance rate, characters saved. With
`--alternatives 3` the server answers up to 3 items; the person takes the first item that
matches (the greedy one first, then the others as an editor cycles them) and the report adds,
of the answers checked against the next typed text, the share whose first item matched and
the share where any item did.

    efim bench saved                   # 8 sessions, seed 0
    efim bench saved --sessions 20 --seed 3 --json saved.json
    efim bench saved --alternatives 3
    efim bench saved --adapters auto runs/r2/adapter   # the shipped adapter against a new round
    efim bench saved --adapters auto --quant mixed     # the server's engine in another weight form

`--quant` is passed to the server as `efim serve --quant`; `--server` replaces the server
command (e.g. to give it `--threads 1`), `--quant` is added to it. Run one weight form after
another with the same `--seed` and `--sessions`: the traces are the same.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

EFIM = [sys.executable, "-m", "efim_tools.cli"]
# `efim serve --quant`'s weight forms (engine.model.loader.QUANT_CHOICES, not imported: that
# loads torch, and every `efim` command builds this parser).
QUANT_CHOICES = ("none", "int8", "int4", "auto", "mixed")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sessions", type=int, default=8, help="traces (one function body retyped each)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--limit", type=int, help="completion requests per trace (default: all)")
    parser.add_argument("--config", action="append", default=[], help="settings JSON merged into both configurations")
    parser.add_argument("--alternatives", type=int, default=1, choices=(1, 2, 3, 4),
                        help="items per answer (server setting `alternatives`)")
    parser.add_argument("--adapters", nargs="+", metavar="ADAPTER",
                        help="the `adapter` settings to compare ('none', 'auto' or a folder; default: none auto)")
    parser.add_argument("--quant", choices=QUANT_CHOICES,
                        help="the server engine's weight form, passed as `efim serve --quant` (default: the server's own)")
    parser.add_argument("--server", metavar="CMD", help="server command line (default: this Python's `efim serve`); --quant is added to it")
    parser.add_argument("--json", type=Path, help="write the comparison as JSON")


def server_command(args: argparse.Namespace) -> list[str] | None:
    """The server `efim replay --server` starts: None (replay's own default) unless
    `--server` or `--quant` asks for another."""
    if args.server is None and args.quant is None:
        return None
    argv = shlex.split(args.server) if args.server else [*EFIM, "serve"]
    return argv + (["--quant", args.quant] if args.quant else [])


def replay_command(args: argparse.Namespace, traces: str) -> list[str]:
    """`efim replay` of the synthesised `traces` with this benchmark's options."""
    replay = [*EFIM, "replay", traces, "--compare", "adapters", "--speed", "max"]
    server = server_command(args)
    if server is not None:
        replay += ["--server", shlex.join(server)]
    for extra in args.config:
        replay += ["--config", extra]
    if args.alternatives > 1:
        replay += ["--config", json.dumps({"alternatives": args.alternatives})]
    if args.adapters:
        replay += ["--adapters", *args.adapters]
    if args.limit:
        replay += ["--limit", str(args.limit)]
    if args.json:
        replay += ["--json", str(args.json)]
    return replay


def run_cli(args: argparse.Namespace) -> int:
    from efim_tools.training.data import held_out_files  # noqa: PLC0415

    if args.sessions < 1:
        raise ValueError("--sessions must be >= 1")
    files = [str(f.path) for f in held_out_files()]
    with tempfile.TemporaryDirectory(prefix="efim-bench-saved-") as tmp:
        synth = [*EFIM, "trace", "synth", *files, "-o", tmp, "--sessions", str(args.sessions), "--seed", str(args.seed)]
        subprocess.run(synth, check=True)
        return subprocess.run(replay_command(args, tmp)).returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run_cli(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
