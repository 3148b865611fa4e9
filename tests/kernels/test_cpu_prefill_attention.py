"""A prefill step's causal attention in C (kernels/cpu/prefill_attention.py) against exact
attention and torch's kernel, its refusals, and its use inside a bf16 model's prefill."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu import build
from kernels.cpu.prefill_attention import MIN_ROWS, PrefillAttention
from tests.kernels.threads import torch_threads

pytestmark = pytest.mark.skipif(build.compiler() is None, reason="no C compiler on this machine")


def kernel(cache) -> PrefillAttention:
    attend = PrefillAttention.load(cache)
    if attend is None:
        pytest.skip("this CPU has no AVX512-BF16 (the kernel declines to load)")
    return attend


def exact(q, k, v, start: int, scale: float) -> torch.Tensor:  # float64 [H, T, D]
    h, t, _ = q.shape
    h_kv, s = k.shape[0], k.shape[1]
    kk = k.double().repeat_interleave(h // h_kv, 0)
    vv = v.double().repeat_interleave(h // h_kv, 0)
    scores = q.double() @ kk.transpose(1, 2) * scale  # [H, T, S]
    allowed = torch.arange(s).unsqueeze(0) <= (start + torch.arange(t)).unsqueeze(1)  # [T, S]
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ vv


def inputs(h: int, h_kv: int, d: int, start: int, t: int, seed: int):
    """q as the model slices it from the fused projection ([H, T, D] with a head stride), keys
    and values as the first rows of a larger cache."""
    g = torch.Generator().manual_seed(seed)
    n = start + t
    qkv = (torch.randn(t, h + 2 * h_kv, d, generator=g) * 2).bfloat16().transpose(0, 1)  # [H + 2 H_kv, T, D]
    kc = (torch.randn(h_kv, n + 11, d, generator=g) * 2).bfloat16()
    vc = torch.randn(h_kv, n + 11, d, generator=g).bfloat16()
    return qkv[:h], kc.narrow(1, 0, n), vc.narrow(1, 0, n)


@pytest.mark.parametrize(
    ("h", "h_kv", "d", "start", "t"),
    [(9, 3, 64, 0, 17), (9, 3, 64, 0, 90), (9, 3, 64, 37, 150), (9, 3, 64, 1000, 33), (8, 8, 64, 5, 40),
     (16, 2, 64, 0, 300), (4, 2, 32, 3, 77), (6, 3, 128, 200, 64)],
)
def test_matches_exact_causal_attention(kernel_cache, h, h_kv, d, start, t):
    attend = kernel(kernel_cache)
    q, k, v = inputs(h, h_kv, d, start, t, seed=start + t + d)
    scale = d**-0.5
    got = attend.attend(q, k, v, scale)
    assert got is not None and got.shape == (h, t, d) and got.dtype == torch.bfloat16
    want = exact(q, k, v, start, scale)
    # bf16 output: one rounding of a float32 result, as close as torch's own kernel gets.
    mask = torch.arange(start + t).unsqueeze(0) <= (start + torch.arange(t)).unsqueeze(1)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask, scale=scale, enable_gqa=h != h_kv
    )[0]
    assert (got.double() - want).abs().max() <= (sdpa.double() - want).abs().max() * 1.5 + 1e-3
    torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=1e-2)


def test_first_rows_see_only_their_own_keys(kernel_cache):
    """Row 0 of a prefill from position 0 attends its own key alone: its output is its value."""
    attend = kernel(kernel_cache)
    q, k, v = inputs(9, 3, 64, 0, 40, seed=3)
    got = attend.attend(q, k, v, 0.125)
    for head in range(9):
        assert torch.equal(got[head, 0], v[head // 3, 0])


def test_one_thread_and_two_give_the_same_bits(kernel_cache):
    """Each (KV head, block of rows) is computed whole by one thread: the split changes nothing."""
    attend = kernel(kernel_cache)
    q, k, v = inputs(9, 3, 64, 100, 130, seed=4)
    with torch_threads(1):
        one = attend.attend(q, k, v, 0.125)
    with torch_threads(2):
        two = attend.attend(q, k, v, 0.125)
    assert torch.equal(one, two)


def test_output_reads_as_rows_without_a_copy(kernel_cache):
    """[H, T, D] over a [T, H, D] tensor: the output projection's [T, H D] rows are a view."""
    attend = kernel(kernel_cache)
    q, k, v = inputs(9, 3, 64, 0, 20, seed=5)
    got = attend.attend(q, k, v, 0.125)
    rows = got.transpose(0, 1).reshape(20, 9 * 64)
    assert rows.data_ptr() == got.data_ptr()


def test_declines_what_it_does_not_take(kernel_cache):
    attend = kernel(kernel_cache)
    q, k, v = inputs(9, 3, 64, 0, 40, seed=6)
    assert attend.attend(q[:, : MIN_ROWS - 1], k[:, : MIN_ROWS - 1], v[:, : MIN_ROWS - 1], 0.125) is None  # a decode step's rows
    assert attend.attend(q.float(), k, v, 0.125) is None  # float32 queries
    assert attend.attend(q, k[:, :30], v[:, :30], 0.125) is None  # more queries than keys
    assert attend.attend(q[:8], k, v, 0.125) is None  # 8 heads over 3 KV heads
    assert attend.attend(q[..., :48], k[..., :48], v[..., :48], 0.125) is None  # head size not a multiple of 32
    assert attend.attend(q, k, v.contiguous().transpose(1, 2).contiguous().transpose(1, 2), 0.125) is None  # strides differ


def test_a_bf16_model_prefills_with_it(kernel_cache, monkeypatch):
    """A bf16 model on this CPU runs its prefill steps' attention here (model.info.c_kernels says
    so), and its logits stay those of torch's kernel up to bf16 rounding."""
    import transformers  # noqa: PLC0415

    import engine.model.cpu_kernels as cpu_kernels  # noqa: PLC0415
    import engine.model.transformer as transformer  # noqa: PLC0415
    from engine.model import ModelConfig  # noqa: PLC0415

    kernel(kernel_cache)
    monkeypatch.setattr(cpu_kernels, "cache_root", lambda: kernel_cache.parent)
    cfg = transformers.LlamaConfig(
        vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256,
    ).to_dict()
    torch.manual_seed(7)
    w = {"model.embed_tokens.weight": torch.randn(300, 128) * 0.5, "model.norm.weight": torch.ones(128),
         "lm_head.weight": torch.randn(300, 128) * 0.1}
    for layer in range(2):
        p = f"model.layers.{layer}."
        for name, shape in (("self_attn.q_proj", (128, 128)), ("self_attn.k_proj", (64, 128)),
                            ("self_attn.v_proj", (64, 128)), ("self_attn.o_proj", (128, 128)),
                            ("mlp.gate_proj", (256, 128)), ("mlp.up_proj", (256, 128)), ("mlp.down_proj", (128, 256))):
            w[p + name + ".weight"] = torch.randn(*shape) * 0.1
        w[p + "input_layernorm.weight"] = torch.ones(128)
        w[p + "post_attention_layernorm.weight"] = torch.ones(128)
    model = transformer.Transformer(ModelConfig.from_hf(cfg), w, dtype=torch.bfloat16)
    assert "prefill_attention" in model.c_kernels()
    ids = torch.randint(0, 300, (60,), generator=torch.Generator().manual_seed(8))

    def logits(c: bool) -> torch.Tensor:
        saved = model._prefill_attention
        model._prefill_attention = saved if c else None
        try:
            kv = model.new_kv(64)
            with torch.inference_mode():
                return model.forward(ids, kv, 0, "all").float()
        finally:
            model._prefill_attention = saved

    ours, torchs = logits(True), logits(False)
    assert (ours.argmax(-1) == torchs.argmax(-1)).float().mean() >= 0.95
    torch.testing.assert_close(ours, torchs, atol=0.1, rtol=0.05)
