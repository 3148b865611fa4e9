"""Fused RMSNorm: one read of each row, float32 statistics, one write in x's dtype.

Unfused torch launches five kernels (square, mean, rsqrt, two multiplies) and reads the
row several times; here one program normalises one row held entirely in registers
(hidden sizes up to a few thousand fit one block).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.triton import checks

MAX_HIDDEN = 1 << 16  # one block holds the whole row


@triton.jit
def _rms_norm_kernel(
    X,  # [R, HIDDEN]
    W,  # [HIDDEN]
    OUT,  # [R, HIDDEN]
    eps,
    stride_xr, stride_xc,
    stride_w,
    stride_or, stride_oc,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    ok = c < HIDDEN
    x = tl.load(X + r * stride_xr + c * stride_xc, mask=ok, other=0.0).to(tl.float32)
    w = tl.load(W + c * stride_w, mask=ok, other=0.0).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, 0) / HIDDEN + eps)
    tl.store(OUT + r * stride_or + c * stride_oc, ((x * inv_rms) * w).to(OUT.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Same contract as `kernels.reference.rms_norm`: float32 math, result in x's dtype."""
    checks.tensor("x", x, dtypes=checks.FLOAT_DTYPES)
    checks.tensor("weight", weight, ndim=1, dtypes=checks.FLOAT_DTYPES)
    checks.require(x.dim() >= 1, "x: expected at least one dim [..., hidden]")
    checks.device(_rms_norm_kernel, x=x, weight=weight)
    hidden = x.shape[-1]
    checks.shape("weight", weight, (hidden,))
    checks.require(0 < hidden <= MAX_HIDDEN, f"x: hidden size {hidden} outside (0, {MAX_HIDDEN}]")
    checks.require(isinstance(eps, (int, float)) and math.isfinite(eps) and eps >= 0, f"eps must be >= 0, got {eps!r}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # [..., hidden]
    rows = x.reshape(-1, hidden)  # [R, hidden] (a view when possible)
    out2 = out.view(-1, hidden)  # [R, hidden]
    if rows.shape[0] == 0:
        return out
    block = checks.next_pow2(hidden)
    _rms_norm_kernel[(rows.shape[0],)](
        rows, weight, out2, float(eps),
        *rows.stride(), *weight.stride(), *out2.stride(),
        HIDDEN=hidden,
        BLOCK=block,
        num_warps=min(16, max(1, block // 256)),
    )
    return out
