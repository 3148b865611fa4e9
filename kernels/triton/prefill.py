"""Prefill attention with an explicit position per query row and per key (GQA).

One kernel serves both `paged_attention_prefill` (keys gathered from the token pool
through `slots`) and `attention` (keys in a contiguous `[H_kv, S, D]` buffer): the
layouts differ only in strides and in whether key n lives at row `slots[n]` or row n.

Mask: key n is visible to query row t iff `k_pos[n] <= q_pos[t]`. Nothing assumes the
queries are the last rows or that positions are sorted — CacheBlend recomputes a
scattered subset of rows, and a bottom-right causal mask would be wrong for them.

Work split: program (i, kv_head) owns BLOCK_M rows of the flattened (query, group head)
axis of one KV head, so the G query heads sharing a KV head read each key block once.
Key blocks no row of the program can see (every k_pos above the block's largest
q_pos) are skipped, which recovers causal skipping when positions are sorted.

Few rows over many keys (EFIM's keystroke: 1-3 new tokens against a long context) is a
decode-shaped launch: the keys are then split across a third grid axis and the partial
results merged by `online_softmax._merge_splits_kernel`, as in decode.
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

BLOCK_M = 64
BLOCK_N = 64
LOG2_E = 1.4426950408889634


@triton.jit
def _prefill_kernel(
    Q,  # [T, H, D] (any strides)
    K,  # key rows: pool [N, H_kv, D] or contiguous [S, H_kv, D] view
    V,
    OUT,  # [T, H, D] (used when NUM_SPLITS == 1)
    PART_OUT,  # [T, H, NUM_SPLITS, D] float32 (used when NUM_SPLITS > 1)
    PART_LSE,  # [T, H, NUM_SPLITS] float32
    SLOTS,  # [S] row of key n in K/V (ignored unless HAS_SLOTS)
    Q_POS,  # [T]
    K_POS,  # [S]
    T,
    S,
    chunk,  # keys per split, a multiple of BLOCK_N
    scale_log2,
    stride_qt, stride_qh, stride_qd,
    stride_kn, stride_kh, stride_kd,
    stride_vn, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_SLOTS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # flattened (t, g)
    t = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = t < T
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM

    q_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + t[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :] * stride_qd, mask=q_mask, other=0.0)
    q_pos = tl.load(Q_POS + t, mask=row_ok, other=0)  # [BLOCK_M]
    pos_max = tl.max(tl.where(row_ok, q_pos, -1))  # padded rows see nothing

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    key_end = tl.minimum((split + 1) * chunk, S)
    for start in range(split * chunk, key_end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < key_end
        k_pos = tl.load(K_POS + n, mask=n_ok, other=0)  # [BLOCK_N]
        if tl.min(tl.where(n_ok, k_pos, pos_max)) <= pos_max:  # some key of the block is visible
            if HAS_SLOTS:
                row = tl.load(SLOTS + n, mask=n_ok, other=0).to(tl.int64)
            else:
                row = n.to(tl.int64)
            kv_mask = n_ok[:, None] & d_ok[None, :]
            k = tl.load(K + row[:, None] * stride_kn + kv_head * stride_kh + d[None, :] * stride_kd, mask=kv_mask, other=0.0)
            v = tl.load(V + row[:, None] * stride_vn + kv_head * stride_vh + d[None, :] * stride_vd, mask=kv_mask, other=0.0)
            visible = n_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])  # [BLOCK_M, BLOCK_N]
            m_i, l_i, acc = _online_softmax_step(q, k, v, visible, m_i, l_i, acc, scale_log2, UPCAST, PRECISION)

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # fully masked rows stay 0
        o_ptrs = OUT + t[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :] * stride_od
        tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=q_mask)
    else:
        part = (t * (GROUP * tl.num_programs(1)) + head) * NUM_SPLITS + split  # [BLOCK_M]
        _store_split(PART_OUT, PART_LSE, part, d, q_mask, m_i, l_i, acc, HEAD_DIM)


def _launch(
    q_tHD: torch.Tensor,  # [T, H, D] view
    k_rows: torch.Tensor,  # [rows, H_kv, D] view
    v_rows: torch.Tensor,  # [rows, H_kv, D] view
    out_tHD: torch.Tensor,  # [T, H, D] view
    slots: torch.Tensor | None,  # [S]
    q_pos: torch.Tensor,  # [T]
    k_pos: torch.Tensor,  # [S]
    scale: float,
    num_splits: int | None,
) -> None:
    T, H, D = q_tHD.shape
    H_kv = k_rows.shape[1]
    S = k_pos.shape[0]
    if T == 0 or H == 0:
        return
    group = H // H_kv
    row_blocks = triton.cdiv(T * group, BLOCK_M)
    # A keystroke's 1-3 new tokens over a long context give a handful of programs: split
    # the keys as decode does, or most of the GPU idles.
    splits = num_splits if num_splits is not None else choose_num_splits(row_blocks * H_kv, S)
    checks.require(splits >= 1, f"num_splits must be >= 1, got {splits}")
    chunk = max(BLOCK_N, triton.cdiv(triton.cdiv(S, splits), BLOCK_N) * BLOCK_N)
    splits = max(1, triton.cdiv(S, chunk))  # no split that starts past the last key
    dev = q_tHD.device
    part_out = torch.empty((T, H, splits, D) if splits > 1 else (0,), dtype=torch.float32, device=dev)
    part_lse = torch.empty((T, H, splits) if splits > 1 else (0,), dtype=torch.float32, device=dev)
    upcast = q_tHD.dtype == torch.bfloat16 and checks.interpreted(_prefill_kernel)
    _prefill_kernel[(row_blocks, H_kv, splits)](
        q_tHD, k_rows, v_rows, out_tHD, part_out, part_lse,
        slots if slots is not None else k_pos, q_pos, k_pos,
        T, S, chunk, float(scale) * LOG2_E,
        *q_tHD.stride(), *k_rows.stride(), *v_rows.stride(), *out_tHD.stride(),
        GROUP=group,
        HEAD_DIM=D,
        BLOCK_D=max(16, checks.next_pow2(D)),
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        HAS_SLOTS=slots is not None,
        NUM_SPLITS=splits,
        UPCAST=upcast,
        PRECISION="ieee" if q_tHD.dtype == torch.float32 else "tf32",
        num_warps=4,
        num_stages=2,
    )
    if splits > 1:
        _merge_splits_kernel[(T, H)](
            part_out, part_lse, out_tHD, *out_tHD.stride(),
            HEAD_DIM=D,
            BLOCK_D=max(16, checks.next_pow2(D)),
            NUM_SPLITS=splits,
            BLOCK_SPLITS=checks.next_pow2(splits),
            num_warps=4,
        )


def _check_heads(H: int, H_kv: int, q_name: str, k_name: str) -> None:
    checks.require(H_kv > 0 and H % H_kv == 0, f"{q_name} has {H} heads, not a multiple of {k_name}'s {H_kv} KV heads")


def _check_scale(scale: float) -> None:
    checks.require(isinstance(scale, (int, float)) and math.isfinite(scale), f"scale must be a finite number, got {scale!r}")


def paged_attention_prefill(
    q: torch.Tensor,  # [T, H, D]
    k_pool: torch.Tensor,  # [N, H_kv, D]
    v_pool: torch.Tensor,  # [N, H_kv, D]
    slots: torch.Tensor,  # [S] int64: pool slot of each key of the sequence, in order
    k_pos: torch.Tensor,  # [S] int64
    q_pos: torch.Tensor,  # [T] int64
    scale: float,
) -> torch.Tensor:  # [T, H, D]
    """Same contract as `kernels.reference.paged_attention_prefill`."""
    return paged_prefill(q, k_pool, v_pool, slots, k_pos, q_pos, scale)


def paged_prefill(
    q: torch.Tensor,  # [T, H, D]
    k_pool: torch.Tensor,  # [N, H_kv, D]
    v_pool: torch.Tensor,  # [N, H_kv, D]
    slots: torch.Tensor,  # [S]
    k_pos: torch.Tensor,  # [S]
    q_pos: torch.Tensor,  # [T]
    scale: float,
    *,
    num_splits: int | None = None,  # None: online_softmax.choose_num_splits
) -> torch.Tensor:  # [T, H, D]
    """`paged_attention_prefill` with the key split count exposed (tests force splits on
    short sequences)."""
    checks.tensor("q", q, ndim=3, dtypes=checks.FLOAT_DTYPES)
    checks.tensor("k_pool", k_pool, ndim=3, dtypes=checks.FLOAT_DTYPES)
    checks.tensor("v_pool", v_pool, ndim=3, dtypes=checks.FLOAT_DTYPES)
    checks.tensor("slots", slots, ndim=1, dtypes=checks.INDEX_DTYPES)
    checks.tensor("k_pos", k_pos, ndim=1, dtypes=checks.INDEX_DTYPES)
    checks.tensor("q_pos", q_pos, ndim=1, dtypes=checks.INDEX_DTYPES)
    checks.device(_prefill_kernel, q=q, k_pool=k_pool, v_pool=v_pool, slots=slots, k_pos=k_pos, q_pos=q_pos)
    checks.same_dtype(q=q, k_pool=k_pool, v_pool=v_pool)
    T, H, D = q.shape
    N, H_kv, _ = k_pool.shape
    checks.shape("k_pool", k_pool, (N, H_kv, D))
    checks.shape("v_pool", v_pool, (N, H_kv, D))
    checks.shape("k_pos", k_pos, tuple(slots.shape))
    checks.shape("q_pos", q_pos, (T,))
    _check_heads(H, H_kv, "q", "k_pool")
    _check_scale(scale)
    checks.index_range("slots", slots, N)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)  # [T, H, D]
    _launch(q, k_pool, v_pool, out, slots, q_pos, k_pos, scale, num_splits)
    return out


def attention(
    q: torch.Tensor,  # [H, T, D]
    k: torch.Tensor,  # [H_kv, S, D]
    v: torch.Tensor,  # [H_kv, S, D]
    q_pos: torch.Tensor | None,  # [T] int64; None = the T queries are the last T keys
    k_pos: torch.Tensor | None,  # [S] int64; None = 0..S-1
    scale: float,
) -> torch.Tensor:  # [H, T, D]
    """Same contract as `kernels.reference.attention` (contiguous per-sequence KV)."""
    return contiguous_attention(q, k, v, q_pos, k_pos, scale)


def contiguous_attention(
    q: torch.Tensor,  # [H, T, D]
    k: torch.Tensor,  # [H_kv, S, D]
    v: torch.Tensor,  # [H_kv, S, D]
    q_pos: torch.Tensor | None,  # [T]
    k_pos: torch.Tensor | None,  # [S]
    scale: float,
    *,
    num_splits: int | None = None,  # None: online_softmax.choose_num_splits
) -> torch.Tensor:  # [H, T, D]
    """`attention` with the key split count exposed."""
    checks.tensor("q", q, ndim=3, dtypes=checks.FLOAT_DTYPES)
    checks.tensor("k", k, ndim=3, dtypes=checks.FLOAT_DTYPES)
    checks.tensor("v", v, ndim=3, dtypes=checks.FLOAT_DTYPES)
    H, T, D = q.shape
    H_kv, S, _ = k.shape
    checks.shape("k", k, (H_kv, S, D))
    checks.shape("v", v, (H_kv, S, D))
    _check_heads(H, H_kv, "q", "k")
    _check_scale(scale)
    named = {"q": q, "k": k, "v": v}
    for name, pos, n in (("q_pos", q_pos, T), ("k_pos", k_pos, S)):
        if pos is not None:
            checks.tensor(name, pos, ndim=1, dtypes=checks.INDEX_DTYPES)
            checks.shape(name, pos, (n,))
            named[name] = pos
    checks.device(_prefill_kernel, **named)
    checks.same_dtype(q=q, k=k, v=v)
    # The reference's defaults: keys at 0..S-1, queries at the positions of the last T keys.
    if k_pos is None and q_pos is None and T > S:
        q_pos = torch.arange(S - T, S, device=q.device)  # the reference's reading: the first queries see nothing
    if k_pos is None:
        k_pos = torch.arange(S, device=q.device)
    if q_pos is None:
        checks.require(T <= S, f"q_pos=None means the {T} queries are the last keys, but there are only {S} keys")
        q_pos = k_pos[S - T :]
    out = torch.empty_like(q, memory_format=torch.contiguous_format)  # [H, T, D]
    q_tHD, k_rows, v_rows = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [T, H, D], [S, H_kv, D]
    _launch(q_tHD, k_rows, v_rows, out.transpose(0, 1), None, q_pos, k_pos, scale, num_splits)
    return out
