"""A step of a few rows through every layer in one C call (kernels/cpu/decode_layers.py): the
bits of the calls it replaces, in a model with an adapter's low-rank terms and one with biases;
where a model does not get it; and the model's fallbacks when the call does not run."""

from __future__ import annotations

import logging

import pytest
import torch

from kernels.cpu import build
from kernels.cpu.decode_layers import DecodeLayers, LayerPlan, Segment
from kernels.cpu.int4_gemv import Int4Gemv
from tests.kernels.threads import torch_threads

needs_cc = pytest.mark.skipif(build.compiler() is None, reason="no C compiler on this machine")

HIDDEN, INTER, VOCAB = 128, 192, 300


def weights(bias: bool, seed: int) -> dict[str, torch.Tensor]:
    """A 2-layer Llama-layout checkpoint: 2 query heads on 1 KV head of 64 dims (the AVX-512 head
    size), random weights; q/k/v biases when `bias` (Qwen2's layout)."""
    g = torch.Generator().manual_seed(seed)
    w = {"model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=g) * 0.5,
         "model.norm.weight": torch.ones(HIDDEN), "lm_head.weight": torch.randn(VOCAB, HIDDEN, generator=g) * 0.1}
    for layer in range(2):
        p = f"model.layers.{layer}."
        for name, shape in (("self_attn.q_proj", (128, HIDDEN)), ("self_attn.k_proj", (64, HIDDEN)),
                            ("self_attn.v_proj", (64, HIDDEN)), ("self_attn.o_proj", (HIDDEN, 128)),
                            ("mlp.gate_proj", (INTER, HIDDEN)), ("mlp.up_proj", (INTER, HIDDEN)),
                            ("mlp.down_proj", (HIDDEN, INTER))):
            w[p + name + ".weight"] = torch.randn(*shape, generator=g) * 0.1
        if bias:
            for name, n in (("q", 128), ("k", 64), ("v", 64)):
                w[p + f"self_attn.{name}_proj.bias"] = torch.randn(n, generator=g) * 0.1
        w[p + "input_layernorm.weight"] = 1 + 0.1 * torch.randn(HIDDEN, generator=g)
        w[p + "post_attention_layernorm.weight"] = 1 + 0.1 * torch.randn(HIDDEN, generator=g)
    return w


@pytest.fixture(scope="module")
def kernels_here(tmp_path_factory):
    """One kernel folder for this file's tests (each library is compiled once), C kernels on."""
    import engine.model.cpu_kernels as cpu_kernels
    import engine.model.quant as quant

    cache = tmp_path_factory.mktemp("cache") / "kernels"
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("EFIM_C_KERNELS", raising=False)
        mp.setattr(cpu_kernels, "cache_root", lambda: cache.parent)
        mp.setattr(quant, "cache_root", lambda: cache.parent)
        build.library.cache_clear()
        gemv = Int4Gemv.load(cache)
        if gemv is None or not gemv.vector:
            pytest.skip("no AVX512-BF16 here: the int4 kernel (and so the one-call step) does not run")
        yield cache
    build.library.cache_clear()


def model(*, bias: bool = False, low_rank: bool = False, quant: str | None = "int4", mixed: bool = False):
    """The checkpoint above as the engine builds it; with `low_rank`, a rank-16 adapter term on
    every projection inside the int4 product, as the shipped adapter runs beside kept groups."""
    import transformers

    from engine.model import ModelConfig
    from engine.model.quant import Int4Linear, LowRank, quantize_groups
    from engine.model.transformer import Transformer

    config = (transformers.Qwen2Config if bias else transformers.LlamaConfig)(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=1024, tie_word_embeddings=False,
    ).to_dict()
    w = weights(bias, seed=3)
    if not low_rank:
        return Transformer(ModelConfig.from_hf(config), w, dtype=torch.bfloat16, quant=quant, dense_prefill=mixed)
    g = torch.Generator().manual_seed(4)

    def with_adapter(weight: torch.Tensor, b_: torch.Tensor | None) -> Int4Linear:
        a = (torch.randn(16, weight.shape[1], generator=g) * 0.05).bfloat16().float()
        b = (torch.randn(weight.shape[0], 16, generator=g) * 0.05).bfloat16().float()
        return Int4Linear.from_groups(quantize_groups(weight, torch.bfloat16), b_, torch.bfloat16, LowRank(a, b))

    import engine.model.transformer as transformer

    made = []
    real = transformer.make_linear

    def make_linear(weight, b_, dtype, quant_, *, dense_copy=False):
        if weight.shape[0] == VOCAB:  # the head
            return real(weight, b_, dtype, quant_, dense_copy=dense_copy)
        made.append(with_adapter(weight, b_))
        return made[-1]

    transformer.make_linear = make_linear
    try:
        out = Transformer(ModelConfig.from_hf(config), w, dtype=torch.bfloat16, quant=quant)
    finally:
        transformer.make_linear = real
    assert all(lin.rows_c is not None and lin.rows_c.low_rank is not None for lin in made)
    return out


def steps(m, ids: torch.Tensor, one_call: bool) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """A 300-token prefill, then steps of 1-8 rows (decode, verifies, keystrokes) across the 256-key
    chunk boundary of the attention: every step's logits and the KV rows written."""
    plan = m.decode_layers
    m.decode_layers = plan if one_call else None
    try:
        kv = m.new_kv(400)
        out, pos = [], 300
        with torch.inference_mode():
            m.forward(ids[:pos], kv, 0, "none")
            for t in (1, 2, 3, 1, 8, 5, 1, 4, 7, 6, 1):
                out.append(m.forward(ids[pos : pos + t], kv, pos, "all"))
                pos += t
        return out, kv.k[:, :, :pos].clone(), kv.v[:, :, :pos].clone()
    finally:
        m.decode_layers = plan


@needs_cc
@pytest.mark.parametrize(("bias", "low_rank"), [(False, False), (False, True), (True, False)])
@pytest.mark.parametrize("threads", [1, 2])
def test_one_call_gives_the_bits_of_the_calls_it_replaces(kernels_here, bias, low_rank, threads):
    with torch_threads(threads):
        m = model(bias=bias, low_rank=low_rank)
        assert isinstance(m.decode_layers, LayerPlan) and "decode_layers" in m.c_kernels()
        ids = torch.randint(0, VOCAB, (360,), generator=torch.Generator().manual_seed(5))
        calls, k_calls, v_calls = steps(m, ids, one_call=False)
        ours, k_ours, v_ours = steps(m, ids, one_call=True)
    assert all(torch.equal(a, b) for a, b in zip(calls, ours))
    assert torch.equal(k_calls, k_ours) and torch.equal(v_calls, v_ours)
    assert not torch.equal(calls[0], calls[1][:1])  # the steps compute something that differs


@needs_cc
def test_a_mixed_model_takes_its_few_row_form_up_to_its_threshold(kernels_here):
    from engine.model.quant import MIXED_PACKED_ROWS

    m = model(mixed=True)
    assert m.decode_layers is not None and m._decode_layers_rows == min(MIXED_PACKED_ROWS, LayerPlan.max_rows)
    ran = []
    real = LayerPlan.run
    m.decode_layers.run = lambda *a: ran.append(a[0].shape[0]) or real(m.decode_layers, *a)
    kv = m.new_kv(64)
    with torch.inference_mode():
        for start, t in ((0, 20), (20, 9), (29, 8), (37, 1)):
            m.forward(torch.arange(t) + 3, kv, start, "last")
    assert ran == [8, 1]  # 20 and 9 rows are prefill steps on the dense copy


@needs_cc
def test_models_it_cannot_run_keep_their_calls(kernels_here, monkeypatch):
    assert model(quant=None).decode_layers is None  # bf16: no packed weights
    m = model(low_rank=True)
    plan = m.decode_layers
    layer = m.layers[1]
    monkeypatch.setattr(layer.up, "lora_c", object())  # a term outside the product
    import engine.model.cpu_kernels as cpu_kernels

    assert cpu_kernels.decode_layer_plan(m) is None
    monkeypatch.undo()
    assert plan is not None and DecodeLayers.load(kernels_here).plan([], n_heads=2, n_kv_heads=1, head_dim=64, eps=1e-6) is None
    monkeypatch.setenv("EFIM_C_KERNELS", "0")
    build.library.cache_clear()
    try:
        assert model().decode_layers is None
    finally:
        build.library.cache_clear()


@needs_cc
def test_a_call_it_does_not_take_runs_the_calls_from_the_same_input(kernels_here):
    m = model()
    plan = m.decode_layers
    ids = torch.randint(0, VOCAB, (360,), generator=torch.Generator().manual_seed(6))
    want, _, _ = steps(m, ids, one_call=True)

    def refuse_after_scribbling(h, *a):  # as a C refusal mid-way leaves h
        h.fill_(7)
        return False

    plan_run = plan.run
    plan.run = refuse_after_scribbling
    try:
        got, _, _ = steps(m, ids, one_call=True)
    finally:
        plan.run = plan_run
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    h = torch.zeros(9, HIDDEN, dtype=torch.bfloat16)
    cos = sin = torch.zeros(9, 32, dtype=torch.bfloat16)
    kv = m.new_kv(16)
    assert not plan.run(h, cos, sin, [Segment(kv.k, kv.v, 0, 9)], 0.125)  # 9 rows
    assert not plan.run(h[:2].float(), cos[:2], sin[:2], [Segment(kv.k, kv.v, 0, 2)], 0.125)  # not bf16
    assert not plan.run(h[:2], cos[:2], sin[:2], [Segment(kv.k, kv.v, 15, 2)], 0.125)  # past the capacity
    assert not plan.run(h[:2], cos[:2], sin[:2], [Segment(kv.k, kv.v, 0, 1)], 0.125)  # rows not all in segments


@needs_cc
def test_a_plan_that_fails_its_check_at_load_is_dropped_with_one_warning(kernels_here, monkeypatch, caplog):
    real = LayerPlan.run

    def off_by_one(self, h, *a):
        ok = real(self, h, *a)
        h[0, 0] += 1
        return ok

    monkeypatch.setattr(LayerPlan, "run", off_by_one)
    with caplog.at_level(logging.WARNING, logger="engine.model.cpu_kernels"):
        m = model()
    assert m.decode_layers is None and "decode_layers" not in m.c_kernels()
    assert sum("did not give the bits" in r.message for r in caplog.records) == 1


@needs_cc
def test_a_pure_int4_model_reports_its_int4_kernel(kernels_here):
    assert {"int4_gemv", "decode_layers", "row_ops", "decode_attention"} <= set(model().c_kernels())


@needs_cc
@pytest.mark.parametrize("threads", [1, 2])
def test_a_decode_step_of_several_sequences_gives_each_its_own_steps_bits(kernels_here, threads):
    """`decode_batch` in one call: each sequence's logits and KV rows are those of its own one-row
    `forward` (and with the plan off, the per-kernel batch agrees to bf16 rounding)."""
    with torch_threads(threads):
        m = model(low_rank=True)
        gen = torch.Generator().manual_seed(9)
        lengths = (40, 300, 7)  # the middle one past the attention's 256-key chunk
        prompts = [torch.randint(0, VOCAB, (n,), generator=gen) for n in lengths]
        nxt = torch.randint(0, VOCAB, (3,), generator=gen)

        def prefilled():
            kvs = [m.new_kv(320) for _ in prompts]
            with torch.inference_mode():
                for kv, ids in zip(kvs, prompts):
                    m.forward(ids, kv, 0, "none")
            return kvs

        alone_kvs = prefilled()
        with torch.inference_mode():
            alone = torch.cat([m.forward(nxt[b : b + 1], kv, n, "all") for b, (kv, n) in enumerate(zip(alone_kvs, lengths))])
        batch_kvs = prefilled()
        with torch.inference_mode():
            batch = m.decode_batch(nxt, batch_kvs, list(lengths))
        assert torch.equal(batch, alone)
        for a, b, n in zip(alone_kvs, batch_kvs, lengths):
            assert torch.equal(a.k[:, :, : n + 1], b.k[:, :, : n + 1]) and torch.equal(a.v[:, :, : n + 1], b.v[:, :, : n + 1])
        plan, m.decode_layers = m.decode_layers, None
        try:
            with torch.inference_mode():
                per_kernel = m.decode_batch(nxt, prefilled(), list(lengths))
        finally:
            m.decode_layers = plan
        assert (per_kernel.argmax(-1) == batch.argmax(-1)).all()
        torch.testing.assert_close(per_kernel, batch, atol=0.05, rtol=0.02)
