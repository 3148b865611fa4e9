"""Prefill on int8 GEMMs (engine/model/int8_prefill.py): the linear against its float
product, the smoothing's effect on an outlier channel, and a mixed model converted whole."""

from __future__ import annotations

import logging

import pytest
import torch

from engine.api import EngineError
from engine.model import int8_prefill, load_model
from engine.model.int8_prefill import Int8GemmLinear
from engine.model.quant import MIXED_PACKED_ROWS, MixedLinear
from kernels.cpu import build
from kernels.cpu.int8_rows import Int8Rows
from tiny_models import stdlib_sources, write_tiny_gguf

pytestmark = pytest.mark.skipif(build.compiler() is None, reason="no C compiler on this machine")

CODE = stdlib_sources(("shlex.py",))[0][:4000]


@pytest.fixture
def rows(tmp_path, monkeypatch):
    monkeypatch.setenv("EFIM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("EFIM_C_KERNELS", raising=False)
    build.library.cache_clear()
    yield Int8Rows.load()
    build.library.cache_clear()


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).norm() / want.norm()).item()


def test_the_int8_linear_is_its_float_product_up_to_rounding(rows):
    g = torch.Generator().manual_seed(3)
    w, bias = torch.randn(96, 80, generator=g) * 0.05, torch.randn(96, generator=g) * 0.1
    x = torch.randn(21, 80, generator=g).bfloat16()
    lin = Int8GemmLinear.from_weight(w, bias, None, rows)
    got = lin(x)
    assert got.dtype == torch.bfloat16 and got.shape == (21, 96)
    assert relative_error(got, x.float() @ w.T + bias) < 0.02
    assert lin.nbytes() == 96 * 80 + 4 * (96 + 80) + 2 * 96


def test_products_share_one_buffer_per_thread_and_stay_each_calls_own(rows):
    """Each call's int32 product goes into its thread's reused buffer (not a fresh mapping per
    call); consecutive calls of different shapes still give their own exact results."""
    import threading

    g = torch.Generator().manual_seed(5)
    wide = Int8GemmLinear.from_weight(torch.randn(320, 64, generator=g) * 0.05, None, None, rows)
    narrow = Int8GemmLinear.from_weight(torch.randn(48, 64, generator=g) * 0.05, None, None, rows)

    def fresh(lin: Int8GemmLinear, x: torch.Tensor) -> torch.Tensor:
        q, row_scales = rows.quantize(x, lin.inverse_smoothing)
        return rows.dequantize(torch._int_mm(q, lin.weight_t), row_scales, lin.scales)

    xs = [torch.randn(m, 64, generator=g).bfloat16() for m in (40, 17, 33)]
    outs = [(wide(x), narrow(x)) for x in xs]  # interleaved shapes reuse the same buffer
    for x, (a, b) in zip(xs, outs):
        assert torch.equal(a, fresh(wide, x)) and torch.equal(b, fresh(narrow, x))
    here = int8_prefill._product_buffer(40, 320)
    assert here.data_ptr() == int8_prefill._product_buffer(17, 48).data_ptr()  # one buffer, reused
    elsewhere = []
    thread = threading.Thread(target=lambda: elsewhere.append(int8_prefill._product_buffer(40, 320).data_ptr()))
    thread.start()
    thread.join()
    assert elsewhere[0] != here.data_ptr()  # another thread, its own


def test_smoothing_moves_an_outlier_channel_into_the_weights(rows):
    """Rows with one channel 50x the others: quantised as they are, that channel sets each
    row's scale and the rest round to a few levels; smoothed on the channel maxima, the
    product is several times closer to the float one."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(128, 64, generator=g) * 0.05
    x = torch.randn(40, 64, generator=g)
    x[:, 7] *= 50
    x = x.bfloat16()
    want = x.float() @ w.T
    plain = relative_error(Int8GemmLinear.from_weight(w, None, None, rows)(x), want)
    smoothed = relative_error(Int8GemmLinear.from_weight(w, None, x.float().abs().amax(0), rows)(x), want)
    assert smoothed * 3 < plain


def tiny_mixed(tiny_model_factory, tmp_path):
    folder = tiny_model_factory("llama", hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
    path = write_tiny_gguf(folder, tmp_path / "tiny-Q4_1.gguf", q8_0=("_proj", "embed_tokens", "lm_head"), qtype="Q4_1")
    return load_model(path, dtype="bf16", quant="mixed")


def logits_of(loaded, n: int = 64) -> torch.Tensor:
    ids = loaded.tokenizer.encode(CODE).ids[:n]
    return loaded.model.forward(torch.tensor(ids), loaded.model.new_kv(len(ids)), 0, "all")  # [n, V]


def test_a_converted_mixed_model_prefills_near_bf16_and_decodes_as_before(rows, tiny_model_factory, tmp_path):
    loaded = tiny_mixed(tiny_model_factory, tmp_path)
    model = loaded.model
    assert int8_prefill.supported(model)
    before, decode_before = logits_of(loaded), logits_of(loaded, n=MIXED_PACKED_ROWS)
    resident = model.resident_bytes()
    calibration = [loaded.tokenizer.encode(text).ids[:128] for text in stdlib_sources(("textwrap.py", "heapq.py"))]
    freed = int8_prefill.convert(model, calibration, rows)
    assert all(isinstance(getattr(layer, n).dense, Int8GemmLinear) for layer in model.layers for n in ("qkv", "o", "up"))
    assert not any(isinstance(layer.down.dense, Int8GemmLinear) for layer in model.layers)  # kept bf16
    assert freed > 0 and model.resident_bytes() == resident - freed
    assert "int8_rows" in model.c_kernels()
    after = logits_of(loaded)
    lp, lq = torch.log_softmax(before, -1), torch.log_softmax(after, -1)
    kl = (lp.exp() * (lp - lq)).sum(-1).mean().item()
    top1 = (before.argmax(-1) == after.argmax(-1)).float().mean().item()
    assert kl < 0.03 and top1 >= 0.6, (kl, top1)  # a random tiny model: flat distributions, fragile argmaxes
    assert not torch.equal(before, after)  # the many-row steps did change form
    # Decode-sized steps never reach the copy: the packed weights' arithmetic, unchanged.
    torch.testing.assert_close(logits_of(loaded, n=MIXED_PACKED_ROWS), decode_before, atol=0, rtol=0)


def test_the_loading_option(rows, tiny_model_factory, tmp_path, caplog, monkeypatch):
    from engine.runtime.loading import load_model_for_engine

    folder = tiny_model_factory("llama")
    with pytest.raises(EngineError, match="prefill must be"):
        load_model_for_engine(folder, adapter="none", prefill="fp8")
    with caplog.at_level(logging.WARNING):
        got = load_model_for_engine(folder, adapter="none", prefill="int8")  # a float folder: not mixed
    assert "int8 prefill needs a mixed" in caplog.text
    assert "int8_rows" not in got.loaded.model.c_kernels()
    folder = tiny_model_factory("llama", hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
    path = write_tiny_gguf(folder, tmp_path / "q.gguf", q8_0=("_proj", "embed_tokens", "lm_head"), qtype="Q4_1")
    got = load_model_for_engine(path, adapter="none", quant="mixed", prefill="int8")
    assert "int8_rows" in got.loaded.model.c_kernels()
    caplog.clear()
    monkeypatch.setattr(int8_prefill, "calibration_ids", lambda tokenizer: [])
    with caplog.at_level(logging.WARNING):
        got = load_model_for_engine(path, adapter="none", quant="mixed", prefill="int8")
    assert "no calibration text" in caplog.text and "int8_rows" not in got.loaded.model.c_kernels()


def test_a_second_load_reads_the_stored_conversion_and_a_broken_file_is_converted_again(
    rows, tiny_model_factory, tmp_path, caplog, monkeypatch
):
    import os
    import stat

    from engine.runtime import int8_prefill_cache
    from engine.runtime.loading import load_model_for_engine

    folder = tiny_model_factory("llama", hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
    path = write_tiny_gguf(folder, tmp_path / "q.gguf", q8_0=("_proj", "embed_tokens", "lm_head"), qtype="Q4_1")

    def load():
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="engine.runtime"):
            return load_model_for_engine(path, adapter="none", quant="mixed", prefill="int8").loaded

    folder = tmp_path / "cache" / "int8-prefill"
    folder.mkdir(mode=0o700, parents=True)
    older = folder / "0123.safetensors"  # another model's conversion, used longer ago
    older.write_bytes(b"x")
    os.utime(older, (1, 1))
    monkeypatch.setattr(int8_prefill_cache, "KEEP", 1)
    first = load()
    assert "smoothed on" in caplog.text and "stored in" in caplog.text
    assert not older.exists()  # pruned: only the KEEP most recently used stay
    (stored,) = folder.iterdir()  # one file, no temporary left behind
    assert stored.suffix == ".safetensors" and stat.S_IMODE(stored.stat().st_mode) == 0o600
    second = load()
    assert "read from" in caplog.text and "smoothed on" not in caplog.text
    assert "int8_rows" in second.model.c_kernels()
    torch.testing.assert_close(logits_of(second), logits_of(first), atol=0, rtol=0)

    stored.write_bytes(stored.read_bytes()[:1000])  # a writer killed half-way (or a foreign file)
    third = load()
    assert "not usable" in caplog.text and "smoothed on" in caplog.text and "stored in" in caplog.text
    torch.testing.assert_close(logits_of(third), logits_of(first), atol=0, rtol=0)
    assert [p.name for p in folder.iterdir()] == [stored.name]

    # Tensors that do not fit the model are refused before anything is replaced.
    tensors = int8_prefill.state(first.model)
    tensors["0.qkv.scales"] = torch.ones(3)
    fresh = load_model_for_engine(path, adapter="none", quant="mixed", prefill="bf16").loaded
    with pytest.raises(ValueError, match="do not fit"):
        int8_prefill.restore(fresh.model, tensors, rows)
    assert not any(isinstance(layer.qkv.dense, Int8GemmLinear) for layer in fresh.model.layers)


def test_int8_prefill_is_the_default_of_a_mixed_model_only(rows, tiny_model_factory, tmp_path, caplog):
    from engine.runtime.loading import load_model_for_engine

    folder = tiny_model_factory("llama", hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
    path = write_tiny_gguf(folder, tmp_path / "q.gguf", q8_0=("_proj", "embed_tokens", "lm_head"), qtype="Q4_1")
    assert int8_prefill.in_use(load_model_for_engine(path, adapter="none", quant="mixed").loaded.model)
    assert not int8_prefill.in_use(load_model_for_engine(path, adapter="none", quant="mixed", prefill="bf16").loaded.model)
    with caplog.at_level(logging.INFO):
        dense = load_model_for_engine(path, adapter="none", quant="none").loaded.model  # not mixed: bf16, no warning
    assert not int8_prefill.in_use(dense) and not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_efim_serve_passes_the_prefill_form_to_the_engine_it_loads(monkeypatch):
    """`efim serve --prefill int8` reaches `load_engine` in-process, and a daemon's config
    (so a front asking for int8 prefill reaches a daemon that runs it, not a bf16 one)."""
    import argparse

    from efim_lsp import serve
    from engine import local
    from engine.daemon.config import DaemonConfig

    parser = argparse.ArgumentParser()
    serve.register(parser.add_subparsers())
    args = parser.parse_args(["serve", "--prefill", "int8", "--no-daemon"])
    seen = {}
    monkeypatch.setattr(local, "load_engine", lambda model, **kw: seen.update(kw, model=model) or "engine")
    assert serve.engine_factory(args)("default") == "engine"
    assert seen["prefill"] == "int8"
    config = DaemonConfig.of("default", prefill="int8")
    assert config.load_arguments()["prefill"] == "int8"
    assert config.digest() != DaemonConfig.of("default").digest()
