"""The online-softmax step shared by the prefill and decode attention kernels.

Scores are kept in base 2 (`scale * log2(e)` folded into the score scale) so the kernel
uses `exp2`. A row that has seen no visible key yet keeps `m = -inf`, `l = 0`, `acc = 0`;
the step substitutes 0 for its running max so no `-inf - -inf` NaN appears, and the
epilogue writes 0 for a row whose `l` is still 0 — which is what the reference's SDPA
returns for a fully masked row.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """`a @ b` with float32 accumulation.

    UPCAST works around the Triton interpreter, whose `tl.dot` multiplies bfloat16
    operands as their raw uint16 bit patterns (triton 3.x `create_dot` calls np.matmul on
    the storage); wrappers set it only for bfloat16 under TRITON_INTERPRET=1. Upcasting
    bfloat16 is exact, so the result is what a bfloat16 tensor-core dot computes."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    else:
        return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _online_softmax_step(
    q,  # [M, BLOCK_D] queries (storage dtype)
    k,  # [BLOCK_N, BLOCK_D] keys
    v,  # [BLOCK_N, BLOCK_D] values
    visible,  # [M, BLOCK_N] bool: key may be attended by the row
    m_i,  # [M] float32 running max (base 2)
    l_i,  # [M] float32 running denominator
    acc,  # [M, BLOCK_D] float32 running numerator
    scale_log2,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    s = _dot(q, tl.trans(k), UPCAST, PRECISION) * scale_log2  # [M, BLOCK_N]
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))  # [M]
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
    alpha = tl.exp2(m_i - m_ref)  # [M] rescales the old partial sums (0 when m_i = -inf)
    p = tl.exp2(s - m_ref[:, None])  # [M, BLOCK_N], 0 where masked
    l_i = l_i * alpha + tl.sum(p, 1)
    if UPCAST:
        pv = _dot(p, v, UPCAST, PRECISION)
    else:
        pv = _dot(p.to(v.dtype), v, UPCAST, PRECISION)  # 16-bit P like flash attention
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc
