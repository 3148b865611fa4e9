"""`efim bench jump` end to end on a tiny model (the numbers are not asserted, the
structure and the exact ratio-1.0 point are)."""

from __future__ import annotations

import argparse
import json

from bench import jump_blend


def test_bench_jump_json_on_a_tiny_model(tiny_model_factory, capsys):
    parser = argparse.ArgumentParser()
    jump_blend.add_arguments(parser)
    args = parser.parse_args([
        "--model", str(tiny_model_factory("llama")), "--adapter", "none", "--dtype", "fp32",
        "--modules", "textwrap,shutil", "--samples", "2", "--prefix-tokens", "240", "--suffix-tokens", "80",
        "--piece-tokens", "800", "--gen", "4", "--max-line-tokens", "6", "--repeats", "1",
        "--speed-samples", "1", "--threads", "1", "--json",
    ])
    assert jump_blend.run_cli(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["ratios"]) == {"0", "0.05", "0.15", "0.3", "1"}
    exact = out["ratios"]["1"]
    assert exact["agreement"] == 1.0  # ratio 1.0 recomputes every row: a full prefill
    assert abs(exact["kl"]) < 1e-4
    assert exact["same_as_full"] == 1.0  # so its held-out line is the full prefill's
    assert exact["exact"] == out["full"]["exact"]
    for r in out["ratios"].values():
        assert 0.0 <= r["agreement"] <= 1.0 and r["kl"] >= -1e-6 and 0.0 <= r["exact"] <= 1.0
    setup = out["setup"]
    assert setup["samples"] == 2 and setup["dtype"] == "float32"
    assert 0.0 < setup["coverage_mean"] <= 1.0  # the document's pieces were found in the prompt
    assert all(row["piece_tokens_prefilled"] > 0 or row["covered_rows"] > 0 for row in setup["per_sample"])
    assert out["recommended_ratio"] in (0.0, 0.05, 0.15, 0.3, 1.0)
    assert {"full", "blend@0.15", f"blend@{out['recommended_ratio']:g}"} == set(out["ttft_ms"])
    speed = setup["speed"]
    assert speed["recomputed_rows"]["blend@0.15"] < speed["prompt_tokens"]  # rows were reused
    assert "recommended ratio" in jump_blend.format_table(out)
