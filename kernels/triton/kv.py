"""Moving K/V rows between sequences and the token pool, and CacheBlend's deviation score.

- `kv_store`: scatter T new rows into their pool slots (slot -1 = not stored).
- `kv_gather`: copy pool rows into a heads-first contiguous buffer.
- `kv_deviation`: per-token squared L2 distance between fresh and cached K or V, summed
  over heads and head dim (CacheBlend's HKVD score), accumulated in float32.
- `select_top_rows`: the k highest-deviation rows. Selection is not where the time goes
  (S is a few thousand at most), so it stays `torch.topk` — the same as the reference.

Each program moves one token's whole [H_kv, D] row: long contiguous runs in the common
layout, and one slot load per row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton import checks

BLOCK_S = 16


@triton.jit
def _row_tile(h, d, H_KV, HEAD_DIM: tl.constexpr):
    """The [BLOCK_H, BLOCK_D] mask of one token's row (padding heads and dims off)."""
    return (h < H_KV)[:, None] & (d < HEAD_DIM)[None, :]


@triton.jit
def _kv_store_kernel(
    K_POOL, V_POOL,  # [N, H_kv, D]
    K, V,  # [T, H_kv, D]
    SLOTS,  # [T]
    H_KV,
    stride_kpn, stride_kph, stride_kpd,
    stride_vpn, stride_vph, stride_vpd,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(SLOTS + t).to(tl.int64)
    if slot >= 0:
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        ok = _row_tile(h, d, H_KV, HEAD_DIM)
        k = tl.load(K + t * stride_kt + h[:, None] * stride_kh + d[None, :] * stride_kd, mask=ok)
        v = tl.load(V + t * stride_vt + h[:, None] * stride_vh + d[None, :] * stride_vd, mask=ok)
        k_dst = K_POOL + slot * stride_kpn + h[:, None] * stride_kph + d[None, :] * stride_kpd
        v_dst = V_POOL + slot * stride_vpn + h[:, None] * stride_vph + d[None, :] * stride_vpd
        tl.store(k_dst, k.to(K_POOL.dtype.element_ty), mask=ok)
        tl.store(v_dst, v.to(V_POOL.dtype.element_ty), mask=ok)


@triton.jit
def _kv_gather_kernel(
    POOL,  # [N, H_kv, D]
    SLOTS,  # [S]
    OUT,  # [H_kv, >=S, D]
    H_KV,
    stride_pn, stride_ph, stride_pd,
    stride_oh, stride_os, stride_od,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    s = tl.program_id(0)
    slot = tl.load(SLOTS + s).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    ok = _row_tile(h, d, H_KV, HEAD_DIM)
    row = tl.load(POOL + slot * stride_pn + h[:, None] * stride_ph + d[None, :] * stride_pd, mask=ok)
    tl.store(OUT + s * stride_os + h[:, None] * stride_oh + d[None, :] * stride_od, row.to(OUT.dtype.element_ty), mask=ok)


@triton.jit
def _kv_deviation_kernel(
    FRESH,  # [S, H_kv, D]
    CACHED,  # [S, H_kv, D]
    OUT,  # [S] float32
    S,
    H_KV,
    stride_fs, stride_fh, stride_fd,
    stride_cs, stride_ch, stride_cd,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    s = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    ok = (s < S)[:, None] & (d < HEAD_DIM)[None, :]
    total = tl.zeros([BLOCK_S, BLOCK_D], tl.float32)
    for h in range(H_KV):
        f = tl.load(FRESH + s[:, None] * stride_fs + h * stride_fh + d[None, :] * stride_fd, mask=ok, other=0.0)
        c = tl.load(CACHED + s[:, None] * stride_cs + h * stride_ch + d[None, :] * stride_cd, mask=ok, other=0.0)
        diff = f.to(tl.float32) - c.to(tl.float32)
        total += diff * diff
    tl.store(OUT + s, tl.sum(total, 1), mask=s < S)


def _row_blocks(H_kv: int, D: int) -> dict[str, int]:
    return {"HEAD_DIM": D, "BLOCK_H": checks.next_pow2(H_kv), "BLOCK_D": checks.next_pow2(D)}


def kv_store(
    k_pool: torch.Tensor,  # [N, H_kv, D]
    v_pool: torch.Tensor,  # [N, H_kv, D]
    k: torch.Tensor,  # [T, H_kv, D]
    v: torch.Tensor,  # [T, H_kv, D]
    slots: torch.Tensor,  # [T] int64; -1 = do not store this row
) -> None:
    """Same contract as `kernels.reference.kv_store` (in place; rows cast to the pool dtype)."""
    for name, t in (("k_pool", k_pool), ("v_pool", v_pool), ("k", k), ("v", v)):
        checks.tensor(name, t, ndim=3, dtypes=checks.FLOAT_DTYPES)
    checks.tensor("slots", slots, ndim=1, dtypes=checks.INDEX_DTYPES)
    checks.device(_kv_store_kernel, k_pool=k_pool, v_pool=v_pool, k=k, v=v, slots=slots)
    N, H_kv, D = k_pool.shape
    T = slots.shape[0]
    checks.shape("v_pool", v_pool, (N, H_kv, D))
    checks.shape("k", k, (T, H_kv, D))
    checks.shape("v", v, (T, H_kv, D))
    checks.writable("k_pool", k_pool)
    checks.writable("v_pool", v_pool)
    checks.index_range("slots", slots, N, allow_minus_one=True)
    if T == 0:
        return
    _kv_store_kernel[(T,)](
        k_pool, v_pool, k, v, slots, H_kv,
        *k_pool.stride(), *v_pool.stride(), *k.stride(), *v.stride(),
        **_row_blocks(H_kv, D),
        num_warps=4,
    )


def kv_gather(
    pool: torch.Tensor,  # [N, H_kv, D]
    slots: torch.Tensor,  # [S] int64
    out: torch.Tensor,  # [H_kv, >=S, D] destination (e.g. a sequence workspace)
) -> None:
    """Same contract as `kernels.reference.kv_gather` (writes out[:, :S])."""
    checks.tensor("pool", pool, ndim=3, dtypes=checks.FLOAT_DTYPES)
    checks.tensor("slots", slots, ndim=1, dtypes=checks.INDEX_DTYPES)
    checks.tensor("out", out, ndim=3, dtypes=checks.FLOAT_DTYPES)
    checks.device(_kv_gather_kernel, pool=pool, slots=slots, out=out)
    N, H_kv, D = pool.shape
    S = slots.shape[0]
    checks.require(
        out.shape[0] == H_kv and out.shape[2] == D and out.shape[1] >= S,
        f"out: expected shape ({H_kv}, >={S}, {D}), got {tuple(out.shape)}",
    )
    checks.writable("out", out)
    checks.index_range("slots", slots, N)
    if S == 0:
        return
    _kv_gather_kernel[(S,)](
        pool, slots, out, H_kv, *pool.stride(), *out.stride(), **_row_blocks(H_kv, D), num_warps=4
    )


def kv_deviation(
    fresh: torch.Tensor,  # [S, H_kv, D]
    cached: torch.Tensor,  # [S, H_kv, D]
) -> torch.Tensor:  # [S] float32
    """Same contract as `kernels.reference.kv_deviation`."""
    checks.tensor("fresh", fresh, ndim=3, dtypes=checks.FLOAT_DTYPES)
    checks.tensor("cached", cached, ndim=3, dtypes=checks.FLOAT_DTYPES)
    checks.device(_kv_deviation_kernel, fresh=fresh, cached=cached)
    S, H_kv, D = fresh.shape
    checks.shape("cached", cached, (S, H_kv, D))
    out = torch.empty(S, dtype=torch.float32, device=fresh.device)  # [S]
    if S == 0:
        return out
    if H_kv == 0 or D == 0:
        return out.zero_()
    _kv_deviation_kernel[(triton.cdiv(S, BLOCK_S),)](
        fresh, cached, out, S, H_kv, *fresh.stride(), *cached.stride(),
        HEAD_DIM=D,
        BLOCK_S=BLOCK_S,
        BLOCK_D=checks.next_pow2(D),
        num_warps=4,
    )
    return out


def select_top_rows(deviation: torch.Tensor, k: int) -> torch.Tensor:  # [k] int64, ascending
    """Same contract as `kernels.reference.select_top_rows` (torch.topk on any device)."""
    checks.tensor("deviation", deviation, ndim=1)
    k = max(0, min(int(k), deviation.shape[0]))
    if k == 0:
        return torch.empty(0, dtype=torch.int64, device=deviation.device)
    return torch.topk(deviation, k, sorted=False).indices.sort().values
