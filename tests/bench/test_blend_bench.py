"""`efim bench blend` end to end on a tiny model (the numbers are not asserted, the
structure and the exact ratio-1.0 point are)."""

from __future__ import annotations

import argparse
import json

from bench import blend_bench


def test_bench_blend_json_on_a_tiny_model(tiny_model_factory, capsys):
    parser = argparse.ArgumentParser()
    blend_bench.add_arguments(parser)
    args = parser.parse_args([
        "--model", str(tiny_model_factory("llama")), "--dtype", "fp32", "--package", "json",
        "--samples", "1", "--chunks", "2", "--chunk-tokens", "48", "--local-tokens", "120",
        "--gen", "4", "--repeats", "1", "--threads", "1", "--json",
    ])
    assert blend_bench.run_cli(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["ratios"]) == {"0", "0.05", "0.15", "0.3", "1"}
    assert set(out["ttft_ms"]) == {"full", "prefix", "blend"}
    for setting in ("ratios", "ratios_reordered"):
        exact = out[setting]["1"]
        assert exact["agreement"] == 1.0  # ratio 1.0 is a full prefill
        assert abs(exact["kl"]) < 1e-4
        for r in out[setting].values():
            assert 0.0 <= r["agreement"] <= 1.0 and r["kl"] >= -1e-6
    speed = out["setup"]["speed"]
    assert speed["blend_recomputed_rows"] < speed["prompt_tokens"]
    assert len(out["setup"]["samples"]) == 1
