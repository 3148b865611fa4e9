"""`efim replay --compare` through the real `efim serve` (real engine, tiny random model):
every field of the comparison is produced, for every configuration.

Token counts are deterministic, so the test checks what the configurations must do with
them (no-cache reuses nothing; EFIM prefills less than recomputing everything); timings
are only checked for being present."""

from __future__ import annotations

import json

import pytest

from efim_tools import cli
from efim_lsp.trace_format import write_trace
from efim_tools.trace.report import JSON_KEYS
from efim_tools.trace.synth import SynthOptions, synthesize
from efim_tools.trace.typist import TypingStyle


def test_compare_on_tiny_model_produces_every_field(tiny_model_dir, tmp_path, capsys):
    import sysconfig
    from pathlib import Path

    src = Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py"
    traces = synthesize([src], SynthOptions(seed=2, sessions=2, style=TypingStyle(jump_rate=0.0), max_chars=300))
    for i, trace in enumerate(traces):
        write_trace(tmp_path / f"s{i}.jsonl", trace)
    out = tmp_path / "compare.json"
    limit = 6
    code = cli.main([
        "replay", str(tmp_path), "--compare", "--limit", str(limit), "--users", "2", "-q",
        "--config", json.dumps({"model": str(tiny_model_dir), "maxTokens": 8}), "--json", str(out),
    ])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    data = json.loads(out.read_text())
    configs = data["configs"]
    assert list(configs) == ["fim-nocache", "fim", "efim"]
    for name, summary in configs.items():
        for key in JSON_KEYS:
            assert isinstance(summary[key], (int, float)), (name, key, summary[key])
        assert summary["requests"] == 2 * limit
        assert summary["ttft_source"] == "server-stats"
        assert summary["crashed"] is None
        assert summary["ttft_ms_p50"] <= summary["ttft_ms_p95"] <= summary["ttft_ms_p99"]
        assert summary["latency_ms_p50"] <= summary["latency_ms_p95"]
    assert configs["fim-nocache"]["reuse_ratio"] == 0.0
    assert configs["efim"]["reuse_ratio"] > 0.5
    assert configs["efim"]["prefilled_per_request"] < configs["fim-nocache"]["prefilled_per_request"]
    assert set(data["ratios_vs_fim"]) == {"fim-nocache", "fim", "efim"}
    assert data["ratios_vs_fim"]["fim"]["ttft_ms_p50"] == 1.0
    for name in configs:
        assert name in printed.out  # the table


@pytest.mark.slow
def test_demo_runs_end_to_end_on_a_tiny_model(tiny_model_dir, capsys):
    code = cli.main(["demo", "--model", str(tiny_model_dir), "--limit", "8", "--compare-limit", "3"])
    out = capsys.readouterr().out
    assert code == 0
    assert "efim demo: retyping textwrap.py:" in out
    assert out.count(" ms  ") >= 8  # one line per answered key press
    for name in ("fim-nocache", "fim", "efim"):
        assert f"\n{name} " in out
    assert "efim replay " in out and "--compare --limit 3" in out


def test_adapters_to_compare_are_checked_before_any_replay(tmp_path, capsys):
    from efim_tools.commands.replay import _adapter_config
    from efim_tools.training.lora import CONFIG_FILE

    trace_dir = tmp_path / "traces"
    trace_dir.mkdir()
    assert cli.main(["replay", str(trace_dir), "--adapters", "auto"]) == 2
    assert "--compare adapters" in capsys.readouterr().err
    with pytest.raises(ValueError, match="not an adapter folder"):
        _adapter_config(str(tmp_path))
    run = tmp_path / "round2" / "adapter"
    run.mkdir(parents=True)
    (run / CONFIG_FILE).write_text("{}")
    assert _adapter_config(str(run)) == ("round2", {"adapter": str(run.resolve())})
    assert _adapter_config("none") == ("base", {"adapter": "none"}) and _adapter_config("auto")[0] == "adapter"
