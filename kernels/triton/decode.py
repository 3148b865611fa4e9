"""Decode attention: one query per sequence, B sequences of different lengths, one launch.

Pass 1, program (b, kv_head, split): the G query heads of one KV head (padded to
BLOCK_G rows so `tl.dot` gets a legal tile) attend to keys
`[split * chunk, (split + 1) * chunk) ∩ [0, seq_lens[b])`, read from the pool through
`slot_table[b]`. With one split it writes the normalised output directly; otherwise it
writes the split's normalised partial output and its log-sum-exp (base 2).

Pass 2 (`online_softmax._merge_splits_kernel`), program (b, head): merges the splits,
weighting each partial output by `exp2(lse_split - lse_max)`. An empty split (past the
sequence's end) has lse = -inf and weight 0.

Splitting the keys is what keeps a GPU busy when B * H_kv is small and the context is
long (flash-decoding). The split count is chosen from `S_max` (the table's width), not
from `seq_lens`, so no host synchronisation is needed to size the launch.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.triton import checks
from kernels.triton.online_softmax import (
    _merge_splits_kernel,
    _online_softmax_step,
    _store_split,
    choose_num_splits,
)
from kernels.triton.prefill import LOG2_E

BLOCK_N = 64


@triton.jit
def _decode_split_kernel(
    Q,  # [B, H, D]
    K,  # [N, H_kv, D]
    V,  # [N, H_kv, D]
    SLOT_TABLE,  # [B, S_max]
    SEQ_LENS,  # [B]
    OUT,  # [B, H, D] (used when NUM_SPLITS == 1)
    PART_OUT,  # [B, H, NUM_SPLITS, D] float32 (used when NUM_SPLITS > 1)
    PART_LSE,  # [B, H, NUM_SPLITS] float32
    chunk,  # keys per split, a multiple of BLOCK_N
    scale_log2,
    stride_qb, stride_qh, stride_qd,
    stride_kn, stride_kh, stride_kd,
    stride_vn, stride_vh, stride_vd,
    stride_tb, stride_tn,
    stride_ob, stride_oh, stride_od,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SEQ_LENS + b)
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)

    g = tl.arange(0, BLOCK_G)
    g_ok = g < GROUP
    head = kv_head * GROUP + g
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q_mask = g_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + b * stride_qb + head[:, None] * stride_qh + d[None, :] * stride_qd, mask=q_mask, other=0.0)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < end
        row = tl.load(SLOT_TABLE + b * stride_tb + n * stride_tn, mask=n_ok, other=0).to(tl.int64)
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(K + row[:, None] * stride_kn + kv_head * stride_kh + d[None, :] * stride_kd, mask=kv_mask, other=0.0)
        v = tl.load(V + row[:, None] * stride_vn + kv_head * stride_vh + d[None, :] * stride_vd, mask=kv_mask, other=0.0)
        visible = g_ok[:, None] & n_ok[None, :]  # the decode query sees every key of its sequence
        m_i, l_i, acc = _online_softmax_step(q, k, v, visible, m_i, l_i, acc, scale_log2, UPCAST, PRECISION)

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # [BLOCK_G, BLOCK_D]
        o_ptrs = OUT + b * stride_ob + head[:, None] * stride_oh + d[None, :] * stride_od
        tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=q_mask)
    else:
        part = (b * (GROUP * tl.num_programs(1)) + head) * NUM_SPLITS + split  # [BLOCK_G]
        _store_split(PART_OUT, PART_LSE, part, d, q_mask, m_i, l_i, acc, HEAD_DIM)


def decode(
    q: torch.Tensor,  # [B, H, D]
    k_pool: torch.Tensor,  # [N, H_kv, D]
    v_pool: torch.Tensor,  # [N, H_kv, D]
    slot_table: torch.Tensor,  # [B, S_max]
    seq_lens: torch.Tensor,  # [B]
    scale: float,
    *,
    num_splits: int | None = None,  # None: online_softmax.choose_num_splits
) -> torch.Tensor:  # [B, H, D]
    """`paged_attention_decode` with the split count exposed (tests force several splits
    on short sequences)."""
    checks.tensor("q", q, ndim=3, dtypes=checks.FLOAT_DTYPES)
    checks.tensor("k_pool", k_pool, ndim=3, dtypes=checks.FLOAT_DTYPES)
    checks.tensor("v_pool", v_pool, ndim=3, dtypes=checks.FLOAT_DTYPES)
    checks.tensor("slot_table", slot_table, ndim=2, dtypes=checks.INDEX_DTYPES)
    checks.tensor("seq_lens", seq_lens, ndim=1, dtypes=checks.INDEX_DTYPES)
    checks.device(_decode_split_kernel, q=q, k_pool=k_pool, v_pool=v_pool, slot_table=slot_table, seq_lens=seq_lens)
    checks.same_dtype(q=q, k_pool=k_pool, v_pool=v_pool)
    B, H, D = q.shape
    N, H_kv, _ = k_pool.shape
    S_max = slot_table.shape[1]
    checks.shape("k_pool", k_pool, (N, H_kv, D))
    checks.shape("v_pool", v_pool, (N, H_kv, D))
    checks.shape("slot_table", slot_table, (B, S_max))
    checks.shape("seq_lens", seq_lens, (B,))
    checks.require(H_kv > 0 and H % H_kv == 0, f"q has {H} heads, not a multiple of k_pool's {H_kv} KV heads")
    checks.require(math.isfinite(scale), f"scale must be finite, got {scale!r}")
    # Only the first seq_lens[b] entries of a row are used; the rest may hold anything.
    if B and checks.values_checked():
        lo, hi = int(seq_lens.min()), int(seq_lens.max())
        checks.require(1 <= lo and hi <= S_max, f"seq_lens: lengths must lie in [1, {S_max}] (slot_table width), got {lo}..{hi}")
    used = torch.arange(S_max, device=q.device).unsqueeze(0) < seq_lens.unsqueeze(1)  # [B, S_max]
    checks.index_range("slot_table", slot_table[used], N)

    out = torch.empty_like(q, memory_format=torch.contiguous_format)  # [B, H, D]
    if B == 0:
        return out
    splits = num_splits if num_splits is not None else choose_num_splits(B * H_kv, S_max)
    checks.require(splits >= 1, f"num_splits must be >= 1, got {splits}")
    chunk = triton.cdiv(triton.cdiv(S_max, splits), BLOCK_N) * BLOCK_N
    splits = triton.cdiv(S_max, chunk)  # no split that starts past S_max
    group = H // H_kv
    block_d = max(16, checks.next_pow2(D))
    part_out = torch.empty((B, H, splits, D) if splits > 1 else (0,), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((B, H, splits) if splits > 1 else (0,), dtype=torch.float32, device=q.device)
    _decode_split_kernel[(B, H_kv, splits)](
        q, k_pool, v_pool, slot_table, seq_lens, out, part_out, part_lse,
        chunk, float(scale) * LOG2_E,
        *q.stride(), *k_pool.stride(), *v_pool.stride(), *slot_table.stride(), *out.stride(),
        GROUP=group,
        HEAD_DIM=D,
        BLOCK_D=block_d,
        BLOCK_G=max(16, checks.next_pow2(group)),
        BLOCK_N=BLOCK_N,
        NUM_SPLITS=splits,
        UPCAST=q.dtype == torch.bfloat16 and checks.interpreted(_decode_split_kernel),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4,
        num_stages=2,
    )
    if splits > 1:
        _merge_splits_kernel[(B, H)](
            part_out, part_lse, out, *out.stride(),
            HEAD_DIM=D,
            BLOCK_D=block_d,
            NUM_SPLITS=splits,
            BLOCK_SPLITS=checks.next_pow2(splits),
            num_warps=4,
        )
    return out


def paged_attention_decode(
    q: torch.Tensor,  # [B, H, D]: one query per sequence, at the last position
    k_pool: torch.Tensor,  # [N, H_kv, D]
    v_pool: torch.Tensor,  # [N, H_kv, D]
    slot_table: torch.Tensor,  # [B, S_max] int64, row b valid for its first seq_lens[b] entries
    seq_lens: torch.Tensor,  # [B] int64
    scale: float,
) -> torch.Tensor:  # [B, H, D]
    """Same contract as `kernels.reference.paged_attention_decode`."""
    return decode(q, k_pool, v_pool, slot_table, seq_lens, scale)
