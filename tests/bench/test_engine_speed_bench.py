"""The pieces of `efim bench engine`'s speed sections (the bench itself runs outside pytest):
random models in real shapes, decode floors, llama.cpp's figures, single-line latency."""

from __future__ import annotations

import argparse

import pytest
import torch

from bench import decode_formats, engine_bench, llama_cpp_figures, model_shapes, suggestion_latency


def _tiny_qwen2(**over) -> dict:
    import transformers

    cfg = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True, max_position_embeddings=512)
    cfg.update(over)
    return transformers.Qwen2Config(**cfg).to_dict()


def test_shape_configs_have_the_published_parameter_counts():
    # Qwen2.5-Coder-0.5B has 0.49 B parameters, -1.5B 1.54 B (tied embeddings counted once).
    def params(c: dict) -> int:
        h, i, n, v = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
        d = h // c["num_attention_heads"]
        kv = c["num_key_value_heads"] * d
        per_layer = h * h * 2 + 2 * h * kv + (h + 2 * kv) + 3 * h * i + 2 * h
        return n * per_layer + v * h + h

    assert 0.48e9 < params(model_shapes.qwen2_config("0.5b")) < 0.51e9
    assert 1.50e9 < params(model_shapes.qwen2_config("1.5b")) < 1.58e9
    with pytest.raises(ValueError, match="no Qwen2.5-Coder shape"):
        model_shapes.qwen2_config("7b")


def test_random_model_runs_and_counts_its_bytes():
    cfg = _tiny_qwen2()
    model = model_shapes.random_model(cfg, None)
    kv = model.new_kv(16)
    logits = model.forward(torch.arange(8), kv, 0)
    assert logits.shape == (1, 512) and torch.isfinite(logits).all()
    # bf16: 2 bytes per weight of every linear incl. the (tied) lm_head, plus the qkv biases
    h, i, kvd = 128, 256, 2 * 32
    linear = 2 * (h * (h + 2 * kvd) + h * h + 2 * i * h + h * i) + 2 * (h + 2 * kvd)
    assert model.weight_bytes() == 2 * linear + 512 * h * 2
    assert model_shapes.kv_bytes_per_token(model, 100) == 2 * 2 * 2 * 32 * 100 * 2
    int8 = model_shapes.random_model(cfg, "int8")
    assert int8.weight_bytes() < 0.6 * model.weight_bytes()


def test_unknown_format_is_reported_not_raised(monkeypatch):
    monkeypatch.setattr(model_shapes, "qwen2_config", lambda shape: _tiny_qwen2())
    with pytest.raises(model_shapes.FormatUnavailable, match="int3"):
        model_shapes.build("0.5b", "int3")
    monkeypatch.setattr(model_shapes, "build", lambda shape, quant, **kw: model_shapes.BenchModel(
        shape, quant, _raise_unavailable(quant) if quant == "int4" else model_shapes.random_model(_tiny_qwen2(), quant), None))
    probes = iter([5.0, 20.0, 10.0])  # GB/s: before bf16, before int4, after the last
    monkeypatch.setattr(decode_formats.speed_probes, "memory_bandwidth_gbs", lambda: next(probes))
    rows = decode_formats.measure_shape("0.5b", ["bf16", "int4"], context=8, steps=2, rounds=1, prefill_tokens=16)
    assert [r.format for r in rows] == ["bf16", "int4"]
    assert rows[0].bandwidth_gbs == 20.0  # the best probe of the shape sets its floors
    assert rows[0].floor_ms == pytest.approx((rows[0].weight_bytes + rows[0].kv_bytes) / 20e9 * 1e3)
    assert rows[0].decode_ms > 0 and rows[0].floor_ms > 0 and rows[0].vs_floor == rows[0].decode_ms / rows[0].floor_ms
    assert rows[1].decode_ms is None and rows[1].note.startswith("n/a (not available")
    text = "\n".join(decode_formats.render(rows, 8, {"0.5b": None}))
    assert "n/a (not available" in text and "Qwen2.5-Coder-0.5B shape" in text


def _raise_unavailable(quant):
    raise model_shapes.FormatUnavailable(f"unknown quantisation {quant!r}")


def test_bench_mirrors_the_shape_and_format_names():
    # engine_bench keeps copies so that `efim --help` need not import torch
    assert engine_bench.SHAPES == model_shapes.SHAPES
    assert engine_bench.FORMATS == decode_formats.FORMATS
    assert engine_bench._csv("135M, int8", ("135m", "int8"), "x") == ["135m", "int8"]
    with pytest.raises(ValueError, match="unknown weight format 'fp8'"):
        engine_bench._csv("bf16,fp8", engine_bench.FORMATS, "weight format")


def test_llama_bench_records_and_missing_build(monkeypatch, tmp_path):
    records = [{"n_prompt": 512, "n_gen": 0, "avg_ts": 286.5}, {"n_prompt": 0, "n_gen": 64, "avg_ts": 130.0}]
    assert llama_cpp_figures.figures_from_records(records, 512, 64) == (286.5, 130.0)
    assert llama_cpp_figures.figures_from_records(records[:1], 512, 64) == (286.5, None)
    monkeypatch.setenv("EFIM_LLAMA_CPP_BIN", str(tmp_path))  # a folder without the binaries
    got = llama_cpp_figures.measure(tmp_path / "model.gguf")
    assert got.pp_tok_s is None and got.tg_ms is None and "not built" in got.note


def test_line_series_same_text_with_and_without_speculation(tiny_model_factory):
    from engine.local import load_engine

    eng = load_engine(str(tiny_model_factory("llama")), dtype="fp32", kv_budget="32M")
    try:
        P, line, S = engine_bench.keystroke_window(engine_bench.stdlib_text(), eng.count_tokens,
                                                   prefix_tokens=300, suffix_tokens=100)
        spec = 8 if suggestion_latency.has_speculation() else None
        plain = suggestion_latency.line_series(eng, P, line, S, 4, 0 if spec else None, "plain")
        specd = suggestion_latency.line_series(eng, P, line, S, 4, spec, "spec")
    finally:
        eng.close()
    assert len(plain.total_ms) == 4 and all(t >= f for t, f in zip(plain.total_ms, plain.ttft_ms))
    assert all(p <= 4 for p in plain.prefilled)  # each keystroke extends the EFIM prompt
    assert specd.texts == plain.texts and specd.generated == plain.generated  # greedy: the same line either way
    assert suggestion_latency.summary(plain)["line_ms_p50"] > 0


def test_quick_flag_is_parsed():
    p = argparse.ArgumentParser()
    engine_bench.add_arguments(p)
    args = p.parse_args(["--quick", "--formats", "bf16,int4", "--no-llama-cpp"])
    assert args.quick and args.formats == "bf16,int4" and args.no_llama_cpp


def test_decode_profile_cases_and_dispatch_floor():
    from bench import decode_profile

    model = model_shapes.random_model(_tiny_qwen2(), None)
    names = []
    for name, fn in decode_profile.cases(model, 40):
        fn()  # each case runs on the prefilled 40-token context
        names.append(name.split(" (")[0])
    assert names == ["decode", "keystroke", "prefill step"]
    table = decode_profile.profile_top(decode_profile.cases(model, 40)[0][1], 2, 5)
    assert "Self CPU" in table and ("mkldnn::" in table or "aten::" in table)
    assert decode_profile.dispatch_floor_ms(model, 3) > 0


def test_fixed_cost_probe_times_both_paths_where_the_one_call_runs():
    from bench import speed_probes
    from kernels.cpu.int4_gemv import Int4Gemv

    got = speed_probes.fixed_cost_ms(3, steps=4, rounds=2)
    assert got["calls"] > 0
    gemv = Int4Gemv.load()
    if gemv is not None and gemv.vector:  # the one call runs where the int4 kernel does
        assert got["one_call"] > 0
    else:
        assert "one_call" not in got


def test_shared_random_weights_are_left_intact():
    cfg = _tiny_qwen2()
    weights = model_shapes.random_weights(cfg)
    before = {k: v.clone() for k, v in weights.items()}
    for quant in (None, "int8"):
        model_shapes.random_model(cfg, quant, weights=weights)
    assert weights.keys() == before.keys() and all(torch.equal(weights[k], before[k]) for k in before)


def test_random_shape_llama_figures_need_a_vocabulary(tmp_path):
    got = llama_cpp_figures.measure_random_shape("0.5b", None)
    assert got.tg_tok_s is None and "--qwen-vocab" in got.note
    got = llama_cpp_figures.measure_random_shape("1.5b", tmp_path / "missing.gguf")
    assert got.tg_tok_s is None and "--qwen-vocab" in got.note
    with pytest.raises(ValueError, match="no random GGUF shape"):
        llama_cpp_figures.measure_random_shape("135m", None)
