"""RoPE: apply a rotation (`rope_apply`) and move cached keys to new positions (`rope_shift`).

Layouts of the rotated pairs (pair j of a D-dim head, j < D/2):
- neox (Llama, Qwen2, StarCoder2): (x[j], x[j + D/2]) — rotate halves;
- gptj: (x[2j], x[2j + 1]) — interleaved.
Each pair becomes (x1 cos - x2 sin, x2 cos + x1 sin).

`rope_shift` is CacheBlend's re-positioning of a reused chunk: RoPE rotations compose,
so rotating keys cached at `old_pos` once more by `(new_pos - old_pos) * inv_freq`
gives exactly the keys a prefill at `new_pos` would have produced (up to rounding).
The angle, cos/sin and the rotation are computed in float32 and the result is stored
in k's dtype. Like the reference it returns a new tensor (no in-place variant: the
caller decides where the shifted keys go, e.g. `kv_store` them into fresh slots).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton import checks

BLOCK_T = 16
BLOCK_S = 16
STYLES = ("neox", "gptj")


@triton.jit
def _rotate_pairs(X, OUT, t, j, ok, cos, sin, stride_xt, stride_xd, stride_ot, stride_od, HALF: tl.constexpr, NEOX: tl.constexpr):
    """Load the pairs (x1, x2) of rows `t` at pair index `j`, rotate, store in OUT's dtype."""
    if NEOX:
        i1 = j
        i2 = j + HALF
    else:
        i1 = 2 * j
        i2 = 2 * j + 1
    x1 = tl.load(X + t[:, None] * stride_xt + i1[None, :] * stride_xd, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(X + t[:, None] * stride_xt + i2[None, :] * stride_xd, mask=ok, other=0.0).to(tl.float32)
    y1 = x1 * cos - x2 * sin
    y2 = x2 * cos + x1 * sin
    tl.store(OUT + t[:, None] * stride_ot + i1[None, :] * stride_od, y1.to(OUT.dtype.element_ty), mask=ok)
    tl.store(OUT + t[:, None] * stride_ot + i2[None, :] * stride_od, y2.to(OUT.dtype.element_ty), mask=ok)


@triton.jit
def _rope_apply_kernel(
    X,  # [L, T, D]
    COS,  # [T, D/2]
    SIN,  # [T, D/2]
    OUT,  # [L, T, D]
    T,
    stride_xl, stride_xt, stride_xd,
    stride_ct, stride_cj,
    stride_st, stride_sj,
    stride_ol, stride_ot, stride_od,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_T: tl.constexpr,
    NEOX: tl.constexpr,
):
    lead = tl.program_id(0)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    j = tl.arange(0, BLOCK_HALF)
    ok = (t < T)[:, None] & (j < HALF)[None, :]
    cos = tl.load(COS + t[:, None] * stride_ct + j[None, :] * stride_cj, mask=ok, other=0.0).to(tl.float32)
    sin = tl.load(SIN + t[:, None] * stride_st + j[None, :] * stride_sj, mask=ok, other=0.0).to(tl.float32)
    _rotate_pairs(
        X + lead * stride_xl, OUT + lead * stride_ol, t, j, ok, cos, sin,
        stride_xt, stride_xd, stride_ot, stride_od, HALF, NEOX,
    )


@triton.jit
def _rope_shift_kernel(
    K,  # [S, H_kv, D]
    OLD_POS,  # [S]
    NEW_POS,  # [S]
    INV_FREQ,  # [D/2] float32
    OUT,  # [S, H_kv, D]
    S,
    H_KV,
    stride_ks, stride_kh, stride_kd,
    stride_os, stride_oh, stride_od,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_S: tl.constexpr,
    NEOX: tl.constexpr,
):
    s = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    j = tl.arange(0, BLOCK_HALF)
    s_ok = s < S
    ok = s_ok[:, None] & (j < HALF)[None, :]
    delta = tl.load(NEW_POS + s, mask=s_ok, other=0) - tl.load(OLD_POS + s, mask=s_ok, other=0)  # [BLOCK_S]
    inv_freq = tl.load(INV_FREQ + j, mask=j < HALF, other=0.0)  # [BLOCK_HALF]
    angle = delta.to(tl.float32)[:, None] * inv_freq[None, :]  # [BLOCK_S, BLOCK_HALF]
    cos = tl.cos(angle)
    sin = tl.sin(angle)
    for h in range(H_KV):  # one angle table serves every head of the row
        _rotate_pairs(
            K + h * stride_kh, OUT + h * stride_oh, s, j, ok, cos, sin,
            stride_ks, stride_kd, stride_os, stride_od, HALF, NEOX,
        )


def _check_style(style: str) -> None:
    if style not in STYLES:
        raise ValueError(f"unknown RoPE style {style!r}; expected 'neox' or 'gptj'")


def rope_apply(
    x: torch.Tensor,  # [..., T, D]: heads first ([H, T, D]) or any leading dims
    cos: torch.Tensor,  # [T, D/2]
    sin: torch.Tensor,  # [T, D/2]
    style: str = "neox",
) -> torch.Tensor:  # same shape as x
    """Same contract as `kernels.reference.rope_apply`. The result's dtype follows torch
    promotion of (x, cos, sin) as in the reference; the arithmetic is float32."""
    _check_style(style)
    checks.tensor("x", x, dtypes=checks.FLOAT_DTYPES)
    checks.tensor("cos", cos, dtypes=checks.FLOAT_DTYPES)
    checks.tensor("sin", sin, dtypes=checks.FLOAT_DTYPES)
    checks.require(x.dim() >= 2, f"x: expected [..., T, D], got shape {tuple(x.shape)}")
    checks.device(_rope_apply_kernel, x=x, cos=cos, sin=sin)
    T, D = x.shape[-2:]
    checks.require(D % 2 == 0, f"x: head dim {D} is odd; RoPE rotates pairs")
    half = D // 2
    for name, table in (("cos", cos), ("sin", sin)):
        lead_ok = all(n == 1 for n in table.shape[:-2])
        checks.require(
            2 <= table.dim() <= x.dim() and tuple(table.shape[-2:]) == (T, half) and lead_ok,
            f"{name}: expected shape ({T}, {half}) for x of shape {tuple(x.shape)}, got {tuple(table.shape)}",
        )
    cos2 = cos.reshape(T, half)  # [T, D/2]
    sin2 = sin.reshape(T, half)  # [T, D/2]
    out_dtype = torch.promote_types(torch.promote_types(x.dtype, cos.dtype), sin.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)  # [..., T, D]
    x3 = x.reshape(-1, T, D)  # [L, T, D] (a view when the leading dims allow it)
    out3 = out.view(-1, T, D)  # [L, T, D]
    if x3.numel() == 0:
        return out
    grid = (x3.shape[0], triton.cdiv(T, BLOCK_T))
    _rope_apply_kernel[grid](
        x3, cos2, sin2, out3, T,
        *x3.stride(), *cos2.stride(), *sin2.stride(), *out3.stride(),
        HALF=half,
        BLOCK_HALF=checks.next_pow2(half),
        BLOCK_T=BLOCK_T,
        NEOX=style == "neox",
        num_warps=4,
    )
    return out


def rope_shift(
    k: torch.Tensor,  # [S, H_kv, D] keys already rotated for old_pos
    old_pos: torch.Tensor,  # [S] int64
    new_pos: torch.Tensor,  # [S] int64
    inv_freq: torch.Tensor,  # [D/2] float32
    style: str = "neox",
) -> torch.Tensor:  # [S, H_kv, D]
    """Same contract as `kernels.reference.rope_shift`: a new tensor in k's dtype."""
    _check_style(style)
    checks.tensor("k", k, ndim=3, dtypes=checks.FLOAT_DTYPES)
    checks.tensor("old_pos", old_pos, ndim=1, dtypes=checks.INDEX_DTYPES)
    checks.tensor("new_pos", new_pos, ndim=1, dtypes=checks.INDEX_DTYPES)
    checks.tensor("inv_freq", inv_freq, ndim=1, dtypes=checks.FLOAT_DTYPES)
    checks.device(_rope_shift_kernel, k=k, old_pos=old_pos, new_pos=new_pos, inv_freq=inv_freq)
    S, H_kv, D = k.shape
    checks.require(D % 2 == 0, f"k: head dim {D} is odd; RoPE rotates pairs")
    checks.shape("old_pos", old_pos, (S,))
    checks.shape("new_pos", new_pos, (S,))
    checks.shape("inv_freq", inv_freq, (D // 2,))
    inv_freq = inv_freq.float()  # the reference's angle is float32 whatever inv_freq's dtype
    out = torch.empty((S, H_kv, D), dtype=k.dtype, device=k.device)  # [S, H_kv, D]
    if out.numel() == 0:
        return out
    _rope_shift_kernel[(triton.cdiv(S, BLOCK_S),)](
        k, old_pos, new_pos, inv_freq, out, S, H_kv,
        *k.stride(), *out.stride(),
        HALF=D // 2,
        BLOCK_HALF=checks.next_pow2(D // 2),
        BLOCK_S=BLOCK_S,
        NEOX=style == "neox",
        num_warps=4,
    )
    return out
