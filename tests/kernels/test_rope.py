"""RoPE apply and shift kernels against the reference, under TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed; the Triton kernels cannot be verified")

from kernel_tolerance import DTYPES, assert_close  # noqa: E402

from kernels import reference  # noqa: E402
from kernels.triton import rope as triton_rope  # noqa: E402

STYLES = ("neox", "gptj")


def _inv_freq(head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    return 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)  # [D/2]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("style", STYLES)
def test_rope_apply_matches_reference(style, head_dim, dtype):
    gen = torch.Generator().manual_seed(head_dim)
    T = 19  # not a multiple of the 16-row block
    x = torch.randn(3, T, head_dim, generator=gen).to(dtype)  # [H, T, D]
    cos, sin = reference.rope_cos_sin(torch.arange(100, 100 + T), _inv_freq(head_dim), dtype)  # [T, D/2]
    assert_close(triton_rope.rope_apply(x, cos, sin, style), reference.rope_apply(x, cos, sin, style))


def test_rope_apply_leading_dims_strided_input_and_dtype_promotion():
    """[B, H, T, D] input that is a transposed view, and float32 tables on bfloat16 x
    (the reference promotes to float32; so must the kernel)."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 7, 4, 64, generator=gen).transpose(1, 2)  # [B=2, H=4, T=7, D] view
    cos, sin = reference.rope_cos_sin(torch.arange(7), _inv_freq(64), torch.float32)
    for style in STYLES:
        assert_close(triton_rope.rope_apply(x, cos, sin, style), reference.rope_apply(x, cos, sin, style))
    xb = x.bfloat16()
    out = triton_rope.rope_apply(xb, cos, sin, "neox")
    assert out.dtype == torch.float32
    assert_close(out, reference.rope_apply(xb, cos, sin, "neox"))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("style", STYLES)
def test_rope_shift_matches_reference(style, head_dim, dtype):
    gen = torch.Generator().manual_seed(head_dim + 1)
    S, H_kv = 21, 3
    k = torch.randn(S, H_kv, head_dim, generator=gen).to(dtype)  # [S, H_kv, D]
    old_pos = torch.arange(S)
    new_pos = old_pos + torch.randint(-5, 900, (S,), generator=gen)  # per-row deltas, some negative
    out = triton_rope.rope_shift(k, old_pos, new_pos, _inv_freq(head_dim), style)
    assert_close(out, reference.rope_shift(k, old_pos, new_pos, _inv_freq(head_dim), style))


@pytest.mark.parametrize("style", STYLES)
def test_rope_shift_equals_rotating_at_the_new_positions(style):
    """The property CacheBlend relies on: keys rotated for positions 0..S-1 and shifted by
    o equal the raw keys rotated for o..o+S-1."""
    gen = torch.Generator().manual_seed(2)
    S, H_kv, D, offset = 12, 2, 64, 517
    raw = torch.randn(S, H_kv, D, generator=gen)  # [S, H_kv, D]
    inv = _inv_freq(D)
    old_pos, new_pos = torch.arange(S), torch.arange(offset, offset + S)
    at_old = triton_rope.rope_apply(raw.transpose(0, 1), *reference.rope_cos_sin(old_pos, inv, torch.float32), style)
    at_new = triton_rope.rope_apply(raw.transpose(0, 1), *reference.rope_cos_sin(new_pos, inv, torch.float32), style)
    shifted = triton_rope.rope_shift(at_old.transpose(0, 1), old_pos, new_pos, inv, style)  # [S, H_kv, D]
    torch.testing.assert_close(shifted, at_new.transpose(0, 1), atol=2e-4, rtol=1e-4)


def test_rope_refuses_bad_input():
    x = torch.randn(2, 5, 64)
    cos, sin = reference.rope_cos_sin(torch.arange(5), _inv_freq(64), torch.float32)
    with pytest.raises(ValueError, match="unknown RoPE style"):
        triton_rope.rope_apply(x, cos, sin, "llama")
    with pytest.raises(ValueError, match=r"cos: expected shape \(5, 32\)"):
        triton_rope.rope_apply(x, cos[:4], sin, "neox")
    with pytest.raises(ValueError, match="inv_freq: expected shape"):
        triton_rope.rope_shift(x.transpose(0, 1), torch.arange(5), torch.arange(5), _inv_freq(128), "neox")
