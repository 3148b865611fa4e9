"""Quantised weight formats: `Int4Linear` against its dequantised matrix, GGUF blocks kept
as int4 groups bit-exactly, and tiny random GGUFs of each type gguf can write loaded with
`quant="auto"` / `"int4"` against the dequantised reference (docs/model.md "Formats")."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from engine.model import gguf as gguf_model
from engine.model import load_model
from engine.model.quant import Int4Groups, Int4Linear, Int8Linear, WeightSource, make_linear, quantize_groups
from tiny_models import stdlib_sources, write_tiny_gguf

CODE = stdlib_sources(("textwrap.py",))[0][:3000]


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("EFIM_CACHE_DIR", str(d))
    return d


def logits_of(loaded, n: int = 64) -> torch.Tensor:
    ids = loaded.tokenizer.encode(CODE).ids[:n]
    model = loaded.model
    return model.forward(torch.tensor(ids), model.new_kv(len(ids)), 0, "all")  # [n, V]


# ---------------------------------------------------------------- Int4Linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 130])  # the fused kernel, and dequantise-then-GEMM above _INT4_GEMM_ROWS
def test_int4_linear_computes_with_its_dequantised_matrix(dtype, rows):
    torch.manual_seed(0)
    w = torch.randn(192, 96) * 0.05
    bias = torch.randn(192) * 0.1
    lin = Int4Linear.quantize(w, bias, dtype)
    groups = quantize_groups(w, dtype)
    deq = groups.dequantize()  # [N, K] float32
    # The kernel's layout decodes back to exactly the codes chosen (scale/zero in dtype).
    torch.testing.assert_close(lin.dequantize().float(), deq, atol=1e-6 if dtype == torch.float32 else 2e-3, rtol=0)
    assert (deq - w).abs().max() <= groups.scale.max() * 0.51  # round to nearest: within half a step
    x = torch.randn(rows, 96).to(dtype)
    want = x.float() @ deq.T + bias.to(dtype).float()
    got = lin(x).float()
    # fp32: the kernel is exact up to summation order; bf16: the output and the products round to bf16.
    tol = 1e-4 if dtype == torch.float32 else 0.02 * want.abs().max().item()
    torch.testing.assert_close(got, want, atol=tol, rtol=0)


def test_int4_linear_takes_strided_rows():
    """Regression: the kernel raised "expect A to be contiguous" for a column slice, which is
    what the transformer's fused RMSNorm of 2-16 rows returns (`efim complete --quant int4`
    failed on a 23-token prompt's keystroke-sized steps)."""
    lin = Int4Linear.quantize(torch.randn(64, 64), None, torch.float32)
    wide = torch.randn(5, 128)
    x = wide[:, :64]  # [5, 64], row stride 128
    assert not x.is_contiguous()
    torch.testing.assert_close(lin(x), lin(x.contiguous()))


def test_a_few_tokens_through_an_int4_model(tiny_model_factory, tmp_path, cache_dir):
    path = tiny_gguf(tiny_model_factory, tmp_path, "Q4_1")
    reference, int4 = load_model(path, dtype="bf16", quant="none"), load_model(path, dtype="bf16", quant="auto")
    kl, _ = kl_top1(logits_of(reference, n=8), logits_of(int4, n=8))  # 8 rows: the small-row norm path
    assert kl < 0.01


def test_int4_linear_reports_its_true_bytes():
    lin = Int4Linear.quantize(torch.randn(128, 64), None, torch.bfloat16)
    assert lin.nbytes() == 128 * 64 // 2 + (64 // 32) * 128 * 2 * 2  # nibbles + a bf16 scale and zero per group
    assert lin.nbytes() < Int8Linear.quantize(torch.randn(128, 64), None, torch.bfloat16).nbytes() * 0.7


def test_int4_on_a_shape_the_kernel_cannot_take_falls_back_to_int8(caplog):
    with caplog.at_level(logging.INFO, logger="engine.model.quant"):
        lin = make_linear(torch.randn(100, 64), None, torch.bfloat16, "int4")  # 100 rows: not a multiple of 64
    assert isinstance(lin, Int8Linear)
    assert "is int8" in caplog.text


def test_weight_sources_concatenate_as_the_transformer_does():
    g = [quantize_groups(torch.randn(64, 64), torch.float32) for _ in range(3)]
    cat = torch.cat([WeightSource("int4", groups=x) for x in g])
    assert isinstance(cat, WeightSource) and cat.groups is not None  # groups stay groups
    torch.testing.assert_close(cat.float(), torch.cat([x.dequantize() for x in g]))
    mixed = torch.cat([WeightSource("int4", groups=g[0]), WeightSource("int8", dense=torch.randn(64, 64))])
    assert mixed.kind == "int8" and mixed.groups is None  # the widest kind
    plain = torch.cat([WeightSource("int4", groups=g[0]), torch.randn(64, 64)])
    assert isinstance(plain, torch.Tensor)  # a plain part: the model-wide quant decides
    with pytest.raises(TypeError):
        torch.cat([WeightSource("int4", groups=g[0])], dim=1)


# --------------------------------------------------------------- GGUF blocks


def quantize_q4_k(w: np.ndarray, _type=None) -> np.ndarray:
    """A plain (not llama.cpp's optimising) Q4_K quantiser: per 32-weight sub-block an
    asymmetric scale and minimum, both as 6-bit multiples of the super-block's fp16 d / dmin."""
    n, k = w.shape
    sub = w.reshape(-1, 8, 32).astype(np.float32)  # [B, 8, 32]
    lo = np.minimum(sub.min(-1), 0.0)  # [B, 8]: Q4_K's minimum is -dmin * m with m >= 0
    scale = (sub.max(-1) - lo) / 15.0  # [B, 8]
    d = np.maximum(scale.max(-1, keepdims=True) / 63.0, 1e-8).astype(np.float16)  # [B, 1]
    dmin = np.maximum((-lo).max(-1, keepdims=True) / 63.0, 1e-8).astype(np.float16)  # [B, 1]
    sc = np.clip(np.round(scale / d.astype(np.float32)), 1, 63).astype(np.uint8)  # [B, 8]
    mn = np.clip(np.round(-lo / dmin.astype(np.float32)), 0, 63).astype(np.uint8)  # [B, 8]
    step = (d.astype(np.float32) * sc)[..., None]  # [B, 8, 1]
    low = (dmin.astype(np.float32) * mn)[..., None]
    q = np.clip(np.round((sub + low) / step), 0, 15).astype(np.uint8).reshape(-1, 4, 2, 32)  # [B, 4, 2, 32]
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)  # 64-weight chunks: low nibbles, then high
    packed = np.empty((sub.shape[0], 12), dtype=np.uint8)  # inverse of gguf.quants.Q4_K.get_scale_min
    packed[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    blocks = np.concatenate([d.view(np.uint8), dmin.view(np.uint8), packed, qs], axis=1)  # [B, 144]
    return blocks.reshape(n, -1)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K"])
def test_gguf_int4_blocks_decode_exactly(qtype):
    """The groups read from the blocks reproduce gguf's reference dequantiser bit for bit."""
    import gguf

    rng = np.random.default_rng(1)
    w = (rng.standard_normal((64, 512)) * 0.05).astype(np.float32)
    qt = gguf.GGMLQuantizationType[qtype]
    blocks = quantize_q4_k(w) if qtype == "Q4_K" else gguf.quants.quantize(w, qt)
    want = gguf.quants.dequantize(blocks, qt)
    assert np.abs(want - w).max() < 0.05  # the quantiser is sane (Q4_K's 6-bit factors included)
    q, scale, minimum = gguf_model._DECODERS[qtype](blocks)
    got = Int4Groups(torch.from_numpy(q), torch.from_numpy(scale), torch.from_numpy(minimum)).dequantize()
    assert torch.equal(got, torch.from_numpy(want))


# -------------------------------------------- tiny GGUFs: kept vs dequantised

# type -> (what "auto" makes of the linears, kept as the file's int4 blocks)
FORMATS = {
    "Q4_0": ("int4", True),
    "Q4_1": ("int4", True),
    "Q4_K": ("int4", True),
    "Q5_0": ("int8", False),
    "Q5_1": ("int8", False),
    "Q8_0": ("int8", False),
}


def tiny_gguf(factory, tmp_path, qtype: str, arch: str = "llama", names=("_proj", "mlp.c_", "embed_tokens", "lm_head")):
    # 256-wide rows: Q4_K's super-blocks are 256 weights. Every linear quantised, the embedding too.
    folder = factory(arch, hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
    quantize = quantize_q4_k if qtype == "Q4_K" else None
    return write_tiny_gguf(folder, tmp_path / f"{arch}-{qtype}.gguf", q8_0=names, qtype=qtype, quantize=quantize)


def kl_top1(want: torch.Tensor, got: torch.Tensor) -> tuple[float, float]:
    lp, lq = torch.log_softmax(want, -1), torch.log_softmax(got, -1)
    kl = (lp.exp() * (lp - lq)).sum(-1).mean().item()
    return kl, (got.argmax(-1) == want.argmax(-1)).float().mean().item()


@pytest.mark.parametrize("qtype", list(FORMATS))
def test_tiny_gguf_of_each_type_keeps_its_class_under_auto(qtype, tiny_model_factory, tmp_path, cache_dir):
    """fp32 compute, so the comparison sees the format alone.

    Kept int4: each layer's matrix is the file's dequantised tensor (gguf's reference, in
    fp32) up to fp32 rounding of `zero = m + 8 d`; the logits then differ from the
    reference model only by that model's fp16 storage of the dequantised weights (2^-11
    relative per weight): measured KL ~3e-6, bound 1e-4. The int8 class requantises the
    file's values per channel (half an amax/127 step per weight): measured KL <= 0.006 on
    these random models, bound 0.02; their greedy tokens are near ties, hence top-1 >= 0.8."""
    import gguf

    kind, kept = FORMATS[qtype]
    path = tiny_gguf(tiny_model_factory, tmp_path, qtype)
    reference = load_model(path, dtype="fp32", quant="none")
    auto = load_model(path, dtype="fp32", quant="auto")
    layer = auto.model.layers[0]
    want_cls = Int4Linear if kind == "int4" else Int8Linear
    assert all(isinstance(lin, want_cls) for lin in (layer.qkv, layer.o, layer.up, layer.down, auto.model.lm_head))
    kl, top1 = kl_top1(logits_of(reference), logits_of(auto))
    if kept:
        tensor = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == "blk.0.attn_output.weight")
        file_values = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type))  # [N, K] fp32
        torch.testing.assert_close(layer.o.dequantize(), file_values, atol=1e-6, rtol=1e-6)
        assert kl < 1e-4 and top1 >= 0.95
    else:
        assert kl < 0.02 and top1 >= 0.8
    assert auto.model.weight_bytes() < reference.model.weight_bytes() / (3 if kind == "int8" else 5)


@pytest.mark.parametrize("arch", ["qwen2", "starcoder2"])
def test_int4_kept_for_the_other_architectures(arch, tiny_model_factory, tmp_path, cache_dir):
    """Untied lm_head (qwen2) and biased linears (starcoder2) with kept Q4_1 groups; the
    head under "int4" is int8, requantised from the file's 4-bit values (int8's bound as above)."""
    path = tiny_gguf(tiny_model_factory, tmp_path, "Q4_1", arch)
    reference = load_model(path, dtype="fp32", quant="none")
    int4 = load_model(path, dtype="fp32", quant="int4")
    assert isinstance(int4.model.layers[1].up, Int4Linear)
    assert isinstance(int4.model.lm_head, Int8Linear)
    kl, top1 = kl_top1(logits_of(reference), logits_of(int4))
    assert kl < 0.02 and top1 >= 0.8


def test_bf16_int4_against_the_dequantised_bf16_reference(tiny_model_factory, tmp_path, cache_dir):
    """The serving dtype: scales rounded to bf16 (<= 1/64 of a 4-bit step) and bf16 products."""
    path = tiny_gguf(tiny_model_factory, tmp_path, "Q4_1")
    want = logits_of(load_model(path, dtype="bf16", quant="none"))
    got = logits_of(load_model(path, dtype="bf16", quant="auto"))
    kl, top1 = kl_top1(want, got)
    assert kl < 0.01 and top1 >= 0.8


def test_int4_from_a_safetensors_folder_quantises_group_wise(tiny_model_factory, cache_dir):
    """A float checkpoint: "auto" keeps it dense (bit-equal), "int4" rounds each group of 32
    to its nearest of 16 levels. Random tiny models amplify that noise (4-bit KL ~0.3 vs
    int8's 0.004 here), so the check is per matrix: within half a step of the original."""
    folder = tiny_model_factory("llama", hidden_size=256, intermediate_size=256)
    reference = load_model(folder, dtype="fp32")
    auto = load_model(folder, dtype="fp32", quant="auto")
    torch.testing.assert_close(logits_of(auto), logits_of(reference), atol=0, rtol=0)
    int4 = load_model(folder, dtype="fp32", quant="int4")
    lin = int4.model.layers[0].o
    assert isinstance(lin, Int4Linear)
    original = reference.model.layers[0].o.weight  # [N, K] fp32 (DenseLinear keeps fp32 plain)
    step = int4.model.layers[0].o.scales_zeros[:, :, 0].t().repeat_interleave(32, 1)  # [N, K]
    assert ((lin.dequantize() - original).abs() <= step * 0.5 + 1e-6).all()
    kl, _ = kl_top1(logits_of(reference), logits_of(int4))
    assert 0 < kl < 1.0


def test_one_log_line_for_types_no_kernel_keeps(tiny_model_factory, tmp_path, cache_dir, caplog):
    path = tiny_gguf(tiny_model_factory, tmp_path, "Q5_1")
    with caplog.at_level(logging.INFO, logger="engine.model.weight_plan"):
        load_model(path, dtype="fp32", quant="auto")
    lines = [r.getMessage() for r in caplog.records if "no packed kernel" in r.getMessage()]
    assert len(lines) == 1 and "Q5_1" in lines[0] and "int8" in lines[0]


def test_an_adapter_runs_beside_kept_int4_groups(tiny_model_factory, tmp_path, cache_dir):
    """LoRA pairs on q, v (one of three fused parts each: a block-diagonal B) and down, plus
    extra vocabulary rows: the kept groups stay the file's and the low-rank term is computed
    beside them, so the model equals the dense model with the adapter merged (fp32: up to
    that model's fp16 storage of the dequantised file, as above)."""
    import json

    from safetensors.torch import save_file

    # The embedding (the tied head) stays F32: with 2 rows appended its 1,538 rows are no
    # multiple of 64, so a quantised head would be requantised to int8 (measured KL 0.002).
    path = tiny_gguf(tiny_model_factory, tmp_path, "Q4_1", names=("_proj",))
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for module, (n_out, n_in) in {"self_attn.q_proj": (256, 256), "self_attn.v_proj": (128, 256), "mlp.down_proj": (256, 256)}.items():
        tensors[f"model.layers.1.{module}.lora_A"] = torch.randn(4, n_in, generator=g) * 0.1  # [r, in]
        tensors[f"model.layers.1.{module}.lora_B"] = torch.randn(n_out, 4, generator=g) * 0.1  # [out, r]
    v = load_model(path, dtype="fp32").model.vocab_size
    tensors["model.embed_tokens.extra"] = torch.randn(2, 256, generator=g) * 0.1
    adapter = tmp_path / "adapter.safetensors"
    save_file(tensors, str(adapter), metadata={"alpha": "8", "added_tokens": json.dumps([[v, "<a>"], [v + 1, "<b>"]])})
    merged = load_model(path, dtype="fp32", quant="none", adapter=adapter)
    beside = load_model(path, dtype="fp32", quant="auto", adapter=adapter)
    qkv = beside.model.layers[1].qkv
    assert isinstance(qkv, Int4Linear) and qkv.lora_a.shape[1] == 8  # q's and v's ranks, k none
    assert beside.model.vocab_size == v + 2
    torch.testing.assert_close(qkv.dequantize(), merged.model.layers[1].qkv.weight, atol=2e-3, rtol=1e-3)
    kl, top1 = kl_top1(logits_of(merged), logits_of(beside))
    assert kl < 1e-4 and top1 >= 0.95
    rows = torch.randn(128, 256)  # the dequantise-then-GEMM path adds the same term
    torch.testing.assert_close(qkv(rows), rows @ qkv.dequantize().T, atol=1e-4, rtol=1e-4)


def test_a_bf16_step_adds_the_low_rank_term_in_c_as_torch_would(cache_dir, monkeypatch):
    """bf16 int4 weights with an adapter beside them: few rows take the C term
    (kernels/cpu/low_rank.py) and give what the torch term gives, up to bf16's last bit;
    many rows and `EFIM_C_KERNELS=0` keep torch's."""
    from kernels.cpu import build
    from engine.model.quant import LowRank

    if build.compiler() is None:
        pytest.skip("no C compiler on this machine")
    torch.manual_seed(3)
    groups = quantize_groups(torch.randn(192, 64) * 0.05, torch.bfloat16)
    lora = LowRank(torch.randn(8, 64).bfloat16().float() * 0.05, torch.randn(192, 8).bfloat16().float() * 0.05)
    lin = Int4Linear.from_groups(groups, None, torch.bfloat16, lora)
    assert lin.lora_c is not None and lin.step_nbytes() < lin.nbytes()
    x = torch.randn(4, 64).bfloat16()
    with_c = lin(x)
    term, lin.lora_c = lin.lora_c, None
    without = lin(x)
    assert (with_c.float() - without.float()).abs().max().item() <= without.float().abs().max().item() * 2**-7
    lin.lora_c = term
    many = torch.randn(64, 64).bfloat16()
    torch.testing.assert_close(lin(many).float(), many.float() @ lin.dequantize().float().T, atol=3e-2, rtol=2e-2)
    build.library.cache_clear()
    monkeypatch.setenv("EFIM_C_KERNELS", "0")
    assert Int4Linear.from_groups(groups, None, torch.bfloat16, lora).lora_c is None
    build.library.cache_clear()


# ---------------------------------------------------------------- mixed: int4 decode, bf16 prefill


def test_mixed_linear_sends_few_rows_to_the_packed_weight_and_many_to_the_bf16_copy():
    from engine.model.quant import MIXED_PACKED_ROWS, DenseLinear, MixedLinear

    torch.manual_seed(1)
    w, bias = torch.randn(128, 64) * 0.05, torch.randn(128) * 0.1
    lin = make_linear(w, bias, torch.float32, "int4", dense_copy=True)
    assert isinstance(lin, MixedLinear) and isinstance(lin.packed, Int4Linear) and isinstance(lin.dense, DenseLinear)
    # A float checkpoint: the copy keeps the original values (prefill at full precision).
    torch.testing.assert_close(lin.dense.dense_weight().float(), w, atol=1e-6, rtol=0)
    few, many = torch.randn(MIXED_PACKED_ROWS, 64), torch.randn(MIXED_PACKED_ROWS + 1, 64)
    torch.testing.assert_close(lin(few), lin.packed(few))
    torch.testing.assert_close(lin(many), many @ w.T + bias, atol=1e-4, rtol=1e-4)
    # Kept int4 groups (a GGUF's blocks): the copy holds the groups' own values.
    groups = quantize_groups(w, torch.float32)
    kept = make_linear(WeightSource("int4", groups=groups), None, torch.float32, "int4", dense_copy=True)
    torch.testing.assert_close(kept.dense.dense_weight().float(), groups.dequantize(), atol=1e-6, rtol=0)
    torch.testing.assert_close(kept(many), kept.packed(many), atol=1e-4, rtol=1e-4)
    assert lin.step_nbytes() == lin.packed.nbytes() < lin.nbytes()
    # A dense layer needs no second form.
    assert isinstance(make_linear(w, bias, torch.float32, None, dense_copy=True), DenseLinear)


def test_a_mixed_model_prefills_like_bf16_and_decodes_like_int4(tiny_model_factory, tmp_path, cache_dir):
    """quant "mixed" on a Q4_1 file: the layers keep the file's groups for decode steps and a
    bf16 copy of the same values for prefill steps; the head is int8 as under "int4"; the
    resident bytes stay within 1.5x of the bf16 model's."""
    from engine.model.quant import MixedLinear

    path = tiny_gguf(tiny_model_factory, tmp_path, "Q4_1")
    bf16, int4 = load_model(path, dtype="bf16", quant="none"), load_model(path, dtype="bf16", quant="int4")
    mixed = load_model(path, dtype="bf16", quant="mixed")
    assert isinstance(mixed.model.layers[0].up, MixedLinear) and isinstance(mixed.model.lm_head, Int8Linear)
    # Prefill (64 rows): the bf16 copy, so the logits are bf16's up to the int8 head.
    kl, top1 = kl_top1(logits_of(bf16), logits_of(mixed))
    assert kl < 0.01 and top1 >= 0.8
    # Decode-sized steps (a few rows): exactly the int4 model's arithmetic.
    torch.testing.assert_close(logits_of(mixed, n=4), logits_of(int4, n=4), atol=0, rtol=0)
    assert mixed.model.weight_bytes() == int4.model.weight_bytes()
    assert mixed.model.resident_bytes() <= 1.5 * bf16.model.resident_bytes()
