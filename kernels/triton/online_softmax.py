"""The online-softmax step shared by the prefill and decode attention kernels, and the
pass that merges split-K partial results.

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


@triton.jit
def _store_split(
    PART_OUT,  # [R, H, NUM_SPLITS, D] float32
    PART_LSE,  # [R, H, NUM_SPLITS] float32
    part,  # [M] index of (row, head, split) = (row * H + head) * NUM_SPLITS + split
    d,  # [BLOCK_D]
    mask,  # [M, BLOCK_D]
    m_i,
    l_i,
    acc,
    HEAD_DIM: tl.constexpr,
):
    """Write one split's normalised partial output and its log-sum-exp (base 2, -inf when
    the split saw no visible key)."""
    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    tl.store(PART_OUT + part[:, None] * HEAD_DIM + d[None, :], out, mask=mask)
    tl.store(PART_LSE + part, lse, mask=tl.max(mask.to(tl.int32), 1) > 0)


@triton.jit
def _merge_splits_kernel(
    PART_OUT,  # [R, H, NUM_SPLITS, D] float32
    PART_LSE,  # [R, H, NUM_SPLITS] float32
    OUT,  # [R, H, D]
    stride_or, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_SPLITS: tl.constexpr,
):
    """Program (row, head): the softmax over all keys from the per-split results, each
    weighted by exp2(lse_split - max lse). Splits with no visible key weigh 0; a row with
    none at all gets 0, like the unsplit kernels."""
    r = tl.program_id(0)
    head = tl.program_id(1)
    base = (r * tl.num_programs(1) + head) * NUM_SPLITS
    s = tl.arange(0, BLOCK_SPLITS)
    s_ok = s < NUM_SPLITS
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    lse = tl.load(PART_LSE + base + s, mask=s_ok, other=float("-inf"))  # [BLOCK_SPLITS]
    lse_max = tl.max(lse, 0)
    lse_ref = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    w = tl.exp2(lse - lse_ref)  # [BLOCK_SPLITS]
    part = tl.load(PART_OUT + (base + s)[:, None] * HEAD_DIM + d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    total = tl.sum(w, 0)
    out = tl.sum(part * w[:, None], 0) / tl.where(total > 0, total, 1.0)  # [BLOCK_D]
    tl.store(OUT + r * stride_or + head * stride_oh + d * stride_od, out.to(OUT.dtype.element_ty), mask=d_ok)


MIN_KEYS_PER_SPLIT = 256  # below this a split's fixed cost outweighs the parallelism it adds
TARGET_PROGRAMS = 256  # enough programs to fill a large GPU a few times over


def choose_num_splits(programs: int, keys: int) -> int:
    """Key splits for a launch of `programs` programs over `keys` keys: enough programs to
    fill the device, never a split shorter than MIN_KEYS_PER_SPLIT keys. Decode (one query
    per sequence) and EFIM's keystroke prefill (1-3 new tokens over a long context) are the
    launches that need it; a long prefill already has programs enough."""
    by_length = max(1, keys // MIN_KEYS_PER_SPLIT)
    by_occupancy = max(1, -(-TARGET_PROGRAMS // max(1, programs)))
    return min(by_length, by_occupancy)
