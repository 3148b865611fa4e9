"""Pure-torch reference ops. On a CPU these ARE the fast path; on a GPU they are the
oracle the Triton kernels are tested against (same signatures, see kernels/triton/).

Layouts (shared by every implementation):
- KV pool, one layer: `k_pool, v_pool: [N_slots, H_kv, D]`. The pool is token-granular
  (one slot per token): EFIM adds 1–3 tokens per keystroke, and a coarser page would
  force re-prefilling the partly filled last page every time.
- Contiguous per-sequence KV, one layer: `k, v: [H_kv, S, D]` (what SDPA wants).
- Queries: `q: [H, T, D]` for one sequence; `[B, H, D]` for batched decode.
- Positions are int64 tensors; attention masks `key_pos > query_pos` exactly
  (never a bottom-right causal mask: CacheBlend recomputes scattered rows).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

RopeStyle = str  # "neox" (rotate halves, Llama/Qwen/StarCoder2) or "gptj" (interleaved pairs)


def attention(
    q: torch.Tensor,  # [H, T, D]
    k: torch.Tensor,  # [H_kv, S, D]
    v: torch.Tensor,  # [H_kv, S, D]
    q_pos: torch.Tensor | None,  # [T] int64; None = the T queries are the last T keys
    k_pos: torch.Tensor | None,  # [S] int64; None = 0..S-1
    scale: float,
) -> torch.Tensor:  # [H, T, D]
    """Attention of T queries over S keys with the exact mask `k_pos <= q_pos`, GQA by
    head-group broadcasting. With both positions None the queries are the tail of the
    key sequence (the common prefill/decode case): no mask tensor is built for T == 1
    (decode) nor for T == S (a prefill from position 0, SDPA's own causal mask)."""
    H, T, D = q.shape
    H_kv, S = k.shape[0], k.shape[1]
    gqa = H != H_kv
    if q_pos is None and k_pos is None:
        if T == 1:
            # Decode: the G query heads sharing a KV head become G query rows of that head,
            # one SDPA over H_kv heads with no mask (~5x faster than enable_gqa on a CPU).
            out = F.scaled_dot_product_attention(
                q.reshape(1, H_kv, H // H_kv, D), k.unsqueeze(0), v.unsqueeze(0), scale=scale
            )  # [1, H_kv, G, D]
            return out.reshape(H, 1, D)
        if T == S:
            out = F.scaled_dot_product_attention(
                q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), is_causal=True, scale=scale, enable_gqa=gqa
            )  # [1, H, T, D]
            return out.squeeze(0)
        if T <= _TAIL_ROWS and S - T >= _TAIL_MIN_PREFIX and _FLASH_LSE is not None and q.device.type == "cpu":
            return _attention_tail(q, k, v, scale)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=_tail_mask(T, S, q.dtype, q.device),
            scale=scale, enable_gqa=gqa,
        )  # [1, H, T, D]
        return out.squeeze(0)
    if k_pos is None:
        k_pos = torch.arange(S, device=q.device)
    if q_pos is None:
        q_pos = k_pos[-T:]
    mask = k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)  # [T, S] True = may attend
    out = F.scaled_dot_product_attention(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask, scale=scale, enable_gqa=gqa
    )  # [1, H, T, D]
    return out.squeeze(0)


# A prefill step after a prefix (T queries at the tail of S keys) runs every layer with
# the same mask. SDPA turns a boolean mask into an additive one on every call (fill +
# where: ~10 % of a 256-token step's attention on a CPU), so the additive mask is built
# once and kept for the next call of the same shape — the 29 other layers of the step.
_last_tail_mask: tuple[tuple, torch.Tensor] | None = None


def _tail_mask(T: int, S: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:  # [T, S]
    """Additive mask (0 where key <= query, -inf after) of T queries at positions S-T..S-1."""
    global _last_tail_mask
    key = (T, S, dtype, device)
    cached = _last_tail_mask  # one read: another thread may replace it, never mutate it
    if cached is not None and cached[0] == key:
        return cached[1]
    future = torch.ones(T, S, dtype=torch.bool, device=device).triu_(S - T + 1)  # key after query
    mask = torch.zeros(T, S, dtype=dtype, device=device).masked_fill_(future, float("-inf"))
    _last_tail_mask = (key, mask)
    return mask


# A few new tokens at the end of a long sequence (an EFIM keystroke): the G query heads of
# a KV group become G*T query rows of that head (as in decode), and one flash call runs
# them over all S keys with an additive [G*T, S] mask that hides each row's future tail
# keys. The mask is built once per (T, G, S) and kept for the other layers of the step.
# At T = 2..16, S = 2000 on a 2-core CPU (1 thread): 1.35-1.8x faster than the earlier
# unmasked-prefix + fp32 tail merged by log-sum-exps (~20 small ops per layer), whose
# merge cost more than the prefix itself (T=3: 276 vs 525 us; decode's T=1: 170 us).
_TAIL_ROWS = 16
_TAIL_MIN_PREFIX = 256
_FLASH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_last_rows_mask: tuple[tuple, torch.Tensor] | None = None


def _rows_tail_mask(T: int, G: int, S: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:  # [G T, S]
    """Additive mask of query row g*T + t (token t, at position S-T+t): -inf on keys after it."""
    global _last_rows_mask
    key = (T, G, S, dtype, device)
    cached = _last_rows_mask  # one read: another thread may replace it, never mutate it
    if cached is not None and cached[0] == key:
        return cached[1]
    token = torch.arange(G * T, device=device) % T  # [G T] row -> its token
    tail_index = torch.arange(S, device=device) - (S - T)  # [S] key -> index in the tail (< 0: prefix)
    mask = torch.zeros(G * T, S, dtype=dtype, device=device).masked_fill_(
        tail_index.unsqueeze(0) > token.unsqueeze(1), float("-inf")
    )
    _last_rows_mask = (key, mask)
    return mask


def _attention_tail(
    q: torch.Tensor,  # [H, T, D]
    k: torch.Tensor,  # [H_kv, S, D]
    v: torch.Tensor,  # [H_kv, S, D]
    scale: float,
) -> torch.Tensor:  # [H, T, D]
    H, T, D = q.shape
    H_kv, S = k.shape[0], k.shape[1]
    G = H // H_kv
    rows = q.reshape(1, H_kv, G * T, D)  # query heads of a KV group as rows; row g*T + t
    mask = _rows_tail_mask(T, G, S, q.dtype, q.device)  # [G T, S]
    out, _ = _FLASH_LSE(
        rows, k.unsqueeze(0), v.unsqueeze(0), 0.0, False, attn_mask=mask, scale=scale
    )  # [1, H_kv, G T, D]
    return out.view(H, T, D)


def paged_attention_prefill(
    q: torch.Tensor,  # [T, H, D]
    k_pool: torch.Tensor,  # [N, H_kv, D]
    v_pool: torch.Tensor,  # [N, H_kv, D]
    slots: torch.Tensor,  # [S] int64: pool slot of each key of the sequence, in order
    k_pos: torch.Tensor,  # [S] int64
    q_pos: torch.Tensor,  # [T] int64
    scale: float,
) -> torch.Tensor:  # [T, H, D]
    """Queries (new tokens, or CacheBlend's scattered recompute rows) against keys that
    live in the pool, with the exact per-row position mask."""
    k = k_pool.index_select(0, slots).transpose(0, 1)  # [H_kv, S, D]
    v = v_pool.index_select(0, slots).transpose(0, 1)  # [H_kv, S, D]
    out = attention(q.transpose(0, 1), k, v, q_pos, k_pos, scale)  # [H, T, D]
    return out.transpose(0, 1)  # [T, H, D]


def paged_attention_decode(
    q: torch.Tensor,  # [B, H, D]: one query per sequence, at the last position
    k_pool: torch.Tensor,  # [N, H_kv, D]
    v_pool: torch.Tensor,  # [N, H_kv, D]
    slot_table: torch.Tensor,  # [B, S_max] int64, row b valid for its first seq_lens[b] entries
    seq_lens: torch.Tensor,  # [B] int64
    scale: float,
) -> torch.Tensor:  # [B, H, D]
    """One decode step for B sequences of different lengths (each query sees all its keys)."""
    outs = []
    for b in range(q.shape[0]):
        n = int(seq_lens[b])
        slots = slot_table[b, :n]
        k = k_pool.index_select(0, slots).transpose(0, 1)  # [H_kv, n, D]
        v = v_pool.index_select(0, slots).transpose(0, 1)  # [H_kv, n, D]
        outs.append(attention(q[b].unsqueeze(1), k, v, None, None, scale).squeeze(1))  # [H, D]
    return torch.stack(outs)  # [B, H, D]


def rope_cos_sin(
    positions: torch.Tensor,  # [T] int64
    inv_freq: torch.Tensor,  # [D/2] float32
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, D/2], [T, D/2])
    angles = positions.to(torch.float32).unsqueeze(1) * inv_freq.unsqueeze(0)  # [T, D/2]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rope_apply(
    x: torch.Tensor,  # [..., T, D]: heads first ([H, T, D]) or any leading dims
    cos: torch.Tensor,  # [T, D/2]
    sin: torch.Tensor,  # [T, D/2]
    style: RopeStyle = "neox",
) -> torch.Tensor:  # same shape as x
    """Rotate pairs of dimensions by the angles in cos/sin (returns a new tensor)."""
    half = x.shape[-1] // 2
    if style == "neox":
        # Written into one output through `out=` views: 4 kernels and no concatenation
        # (decode calls this once per layer per token, where call count is the cost).
        x1, x2 = x[..., :half], x[..., half:]  # [..., T, D/2]
        out = torch.empty(x.shape, dtype=torch.result_type(x, cos), device=x.device)  # [..., T, D]
        o1, o2 = out[..., :half], out[..., half:]  # [..., T, D/2]
        torch.mul(x1, cos, out=o1).addcmul_(x2, sin, value=-1)
        torch.mul(x2, cos, out=o2).addcmul_(x1, sin)
        return out
    if style == "gptj":
        x1, x2 = x[..., 0::2], x[..., 1::2]  # [..., T, D/2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)  # [..., T, D/2, 2]
        return out.flatten(-2)
    raise ValueError(f"unknown RoPE style {style!r}; expected 'neox' or 'gptj'")


def rope_shift(
    k: torch.Tensor,  # [S, H_kv, D] keys already rotated for old_pos
    old_pos: torch.Tensor,  # [S] int64
    new_pos: torch.Tensor,  # [S] int64
    inv_freq: torch.Tensor,  # [D/2] float32
    style: RopeStyle = "neox",
) -> torch.Tensor:  # [S, H_kv, D]
    """Move cached keys to new positions: one rotation by (new - old) * inv_freq, which is
    exact for RoPE because rotations compose. Computed in float32, returned in k's dtype."""
    cos, sin = rope_cos_sin(new_pos - old_pos, inv_freq, torch.float32)  # [S, D/2]
    rotated = rope_apply(k.float().transpose(0, 1), cos, sin, style)  # [H_kv, S, D]
    return rotated.transpose(0, 1).to(k.dtype)


def kv_store(
    k_pool: torch.Tensor,  # [N, H_kv, D]
    v_pool: torch.Tensor,  # [N, H_kv, D]
    k: torch.Tensor,  # [T, H_kv, D]
    v: torch.Tensor,  # [T, H_kv, D]
    slots: torch.Tensor,  # [T] int64; -1 = do not store this row
) -> None:
    """Scatter new K/V rows into their pool slots, in place."""
    keep = slots >= 0
    if not bool(keep.all()):
        slots, k, v = slots[keep], k[keep], v[keep]
    k_pool.index_copy_(0, slots, k.to(k_pool.dtype))
    v_pool.index_copy_(0, slots, v.to(v_pool.dtype))


def kv_gather(
    pool: torch.Tensor,  # [N, H_kv, D]
    slots: torch.Tensor,  # [S] int64
    out: torch.Tensor,  # [H_kv, >=S, D] destination (e.g. a sequence workspace)
) -> None:
    """Copy the pool rows of `slots` into a heads-first contiguous buffer."""
    out[:, : slots.shape[0]].copy_(pool.index_select(0, slots).transpose(0, 1))


def kv_deviation(
    fresh: torch.Tensor,  # [S, H_kv, D]
    cached: torch.Tensor,  # [S, H_kv, D]
) -> torch.Tensor:  # [S] float32
    """Per-token squared L2 distance, summed over heads and head dim (CacheBlend's HKVD)."""
    diff = fresh.float() - cached.float()  # [S, H_kv, D]
    return diff.square().sum(dim=(1, 2))


def select_top_rows(deviation: torch.Tensor, k: int) -> torch.Tensor:  # [k] int64, ascending
    """Indices of the k rows with the highest deviation, in ascending row order."""
    k = max(0, min(k, deviation.shape[0]))
    if k == 0:
        return torch.empty(0, dtype=torch.int64, device=deviation.device)
    return torch.topk(deviation, k, sorted=False).indices.sort().values


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, returned in x's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)
