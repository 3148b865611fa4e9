"""A decode step's attention in C (kernels/cpu/decode_attention.py) against exact attention,
on the AVX-512 loops (head size 64, where this machine has them) and the portable ones (other
head sizes, and a build without -march=native), and inside a bf16 model's decode step."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu import build
from kernels.cpu.decode_attention import DecodeAttention

pytestmark = pytest.mark.skipif(build.compiler() is None, reason="no C compiler on this machine")


@pytest.fixture
def kernel_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("EFIM_C_KERNELS", raising=False)
    build.library.cache_clear()
    yield tmp_path / "kernels"
    build.library.cache_clear()


def exact(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:  # float64 [H, 1, D]
    h, h_kv = q.shape[0], k.shape[0]
    kk = k.double().repeat_interleave(h // h_kv, 0)
    vv = v.double().repeat_interleave(h // h_kv, 0)
    p = torch.softmax(q.double() @ kk.transpose(1, 2) * scale, -1)
    return p @ vv


def cache_views(h_kv: int, n: int, d: int, capacity: int, seed: int):
    """Keys and values as the model hands them over: the first n rows of a larger cache."""
    g = torch.Generator().manual_seed(seed)
    kc = (torch.randn(h_kv, capacity, d, generator=g) * 2).bfloat16()
    vc = torch.randn(h_kv, capacity, d, generator=g).bfloat16()
    return kc.narrow(1, 0, n), vc.narrow(1, 0, n)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize(
    ("h", "h_kv", "d", "n"),
    [(9, 3, 64, 1), (9, 3, 64, 17), (9, 3, 64, 1031), (8, 8, 64, 40), (16, 2, 64, 300), (4, 2, 32, 77), (6, 3, 128, 2050)],
)
def test_matches_exact_attention(kernel_cache, native, h, h_kv, d, n):
    attend = DecodeAttention.load(kernel_cache, native=native)
    assert attend is not None
    k, v = cache_views(h_kv, n, d, n + 13, seed=n + d)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, h, d, generator=g).bfloat16().transpose(0, 1)  # [H, 1, D], as _qkv slices it
    scale = d**-0.5
    got = attend.attend(q, k, v, scale)
    assert got is not None and got.shape == (h, 1, d) and got.dtype == torch.bfloat16
    want = exact(q, k, v, scale)
    # bf16 output: one rounding of a float32 result.
    torch.testing.assert_close(got.double(), want, atol=4e-3, rtol=1e-2)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.float().unsqueeze(0), k.float().unsqueeze(0), v.float().unsqueeze(0), scale=scale, enable_gqa=h != h_kv
    )[0]
    assert (got.double() - want).abs().max() <= (sdpa.bfloat16().double() - want).abs().max() * 2 + 1e-3


def test_scores_far_below_the_maximum_underflow_to_zero_weight(kernel_cache):
    """A key the query all but ignores (score ~ -200 below the best) gets weight 0, not a NaN."""
    attend = DecodeAttention.load(kernel_cache)
    d = 64
    k = torch.zeros(1, 40, d)
    k[0, :, 0] = -1.0
    k[0, 7, 0] = 400.0  # the one key that counts
    v = torch.arange(40, dtype=torch.float32).view(1, 40, 1).expand(1, 40, d).contiguous()
    q = torch.zeros(1, 1, d)
    q[0, 0, 0] = 0.5
    got = attend.attend(q.bfloat16(), k.bfloat16(), v.bfloat16(), 1.0)
    assert torch.isfinite(got.float()).all()
    assert torch.equal(got.float(), torch.full((1, 1, d), 7.0))


def test_calls_it_does_not_take_are_declined(kernel_cache):
    attend = DecodeAttention.load(kernel_cache)
    k, v = cache_views(2, 10, 64, 16, seed=0)
    q = torch.randn(4, 1, 64).bfloat16()
    assert attend.attend(torch.randn(4, 2, 64).bfloat16(), k, v, 0.1) is None  # two query rows: a prefill's
    assert attend.attend(q.float(), k.float(), v.float(), 0.1) is None  # float32
    assert attend.attend(torch.randn(3, 1, 64).bfloat16(), k, v, 0.1) is None  # 3 heads on 2 KV heads
    assert attend.attend(q, k.transpose(1, 2).contiguous().transpose(1, 2), v, 0.1) is None  # rows not contiguous
    assert attend.attend(q, k[:, :0], v[:, :0], 0.1) is None  # no keys


def test_off_gives_no_kernel(kernel_cache, monkeypatch):
    monkeypatch.setenv("EFIM_C_KERNELS", "0")
    assert DecodeAttention.load(kernel_cache) is None


def test_a_bf16_models_decode_step_uses_it_and_agrees_with_sdpa(tiny_model_dir, kernel_cache, monkeypatch):
    from engine.model import load_model

    monkeypatch.setenv("EFIM_CACHE_DIR", str(kernel_cache.parent))
    model = load_model(tiny_model_dir, dtype="bf16", quant="none").model
    assert model._decode_attention is not None and model.c_kernels() == ("decode_attention",)
    ids = torch.arange(5, 45)
    kv = model.new_kv(64)
    with torch.inference_mode():
        model.forward(ids[:-1], kv, 0, "none")
        with_c = model.forward(ids[-1:], kv, len(ids) - 1, "all")
        model._decode_attention = None
        with_sdpa = model.forward(ids[-1:], kv, len(ids) - 1, "all")
    torch.testing.assert_close(with_c, with_sdpa, atol=0.05, rtol=0.05)
    assert with_c.argmax() == with_sdpa.argmax()
