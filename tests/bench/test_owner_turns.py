"""`efim bench turns` end to end on a tiny model (the numbers are not asserted, the structure
and that both owners ran are)."""

from __future__ import annotations

import argparse
import json

from bench import owner_turns


def test_bench_turns_on_a_tiny_model(tiny_model_factory, capsys):
    parser = argparse.ArgumentParser()
    owner_turns.add_arguments(parser)
    args = parser.parse_args([
        "--model", str(tiny_model_factory("llama")), "--adapter", "none", "--dtype", "fp32",
        "--keys", "6", "--rounds", "2", "--rate", "20", "--max-tokens", "4", "--pause", "0",
        "--prefix-chars", "600", "--suffix-chars", "200",
    ])
    assert owner_turns.run_cli(args) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["keys"] == 6 and out["requests_per_phase"] == 12 and len(out["round_p99_ratios"]) == 2
    assert 0 < out["solo_ms"]["50"] <= out["solo_ms"]["99"] and 0 < out["with_burst_ms"]["50"] <= out["with_burst_ms"]["99"]
    assert out["ratios"]["99"] == round(out["with_burst_ms"]["99"] / out["solo_ms"]["99"], 2)
    assert all(rate > 0 for rate in out["burst_per_s"])
    assert out["engine_s"]["A"] > 0 and out["engine_s"]["B"] > 0  # both owners were served


def test_typed_function_splits_a_function_around_its_body():
    import sysconfig
    from pathlib import Path

    source = (Path(sysconfig.get_paths()["stdlib"]) / "heapq.py").read_text()
    before, body, after = owner_turns.typed_function("heapq.py", "_siftup")
    assert before + body + after == source
    assert before.endswith(":\n") and "def _siftup(" in before.splitlines()[-1]
    assert body.startswith("    ") and not body.endswith("\n") and after.startswith("\n\n")
