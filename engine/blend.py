"""CacheBlend (Yao et al., EuroSys 2025): prefill a prompt whose context chunks have
cached KV computed elsewhere, recomputing only the rows that matter.

Given the prompt's token ids and, for some spans of it, K/V rows cached from another
context (`ReusedSpan`: typically a chunk prefilled alone, see `engine.chunks`):

1. cached keys are rotated to their new positions (`kernels.rope_shift`, exact for
   RoPE) and placed, with their values, in every layer of the sequence's KV;
2. layer 0 runs on every new row (its K/V are exact afterwards);
3. layer 1's K/V are projected for every new row; the rows of cached spans whose fresh
   V deviates most from the cached V (`kernels.kv_deviation`, the paper's HKVD) are
   selected — `ceil(ratio · cached rows)` of them (`kernels.select_top_rows`) — and
   together with every uncached row (the local FIM prompt) form the recompute set R;
   layer 1's fresh K/V is kept for all rows (it was computed anyway);
4. layers 1..L-1 run only on the rows of R, each attending to every key whose
   position is <= its own (explicit query and key positions: the rows of R are
   scattered, so a bottom-right causal mask would be wrong); the other rows keep their
   cached (rotated) K/V.

`ratio=1.0` recomputes everything (equal to a full prefill up to rounding); `ratio=0`
is full reuse with no recompute at all (llama.cpp's `--cache-reuse`): layer 0 also runs
on the uncached rows only. The result is an ordinary sequence KV: the scheduler commits
it to the radix cache, and the next keystroke reuses it as a plain prefix.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Sequence

import torch

import kernels


class ReusedSpan(NamedTuple):
    """Cached K/V for the prompt rows start..start+n-1 (absolute rows of the sequence)."""

    start: int
    k: torch.Tensor  # [L, n, H_kv, D] keys after RoPE at `positions`
    v: torch.Tensor  # [L, n, H_kv, D]
    positions: torch.Tensor  # [n] int64

    @property
    def end(self) -> int:
        return self.start + self.k.shape[1]


class BlendResult(NamedTuple):
    logits: torch.Tensor  # [1, V] float32: the last prompt row
    recomputed: torch.Tensor  # [R] int64 absolute rows recomputed in layers >= 1, ascending
    selected: int  # cached rows chosen by deviation (part of `recomputed`)
    reused: int  # cached rows that kept their cached K/V in layers >= 2
    uncached: int  # rows without a cache entry (always recomputed)


def place_spans(model: Any, kv: Any, spans: Sequence[ReusedSpan]) -> None:
    """Write each span's K (rotated from its cached positions to its rows) and V into
    every layer of `kv` (`SequenceKV`: k, v [L, H_kv, cap, D]); row r has position r."""
    style = model.config.rope_style
    for span in spans:
        n = span.k.shape[1]
        if n == 0:
            continue
        L, _, H, D = span.k.shape
        rows = torch.arange(span.start, span.start + n, dtype=torch.int64)  # [n]
        k = span.k.to(kv.k.dtype)
        if not torch.equal(span.positions, rows):
            flat = k.transpose(0, 1).reshape(n, L * H, D)  # [n, L*H_kv, D]: one rotation for all layers
            k = kernels.rope_shift(flat, span.positions, rows, model.inv_freq, style).view(n, L, H, D).transpose(0, 1)
        kv.k[:, :, span.start : span.start + n].copy_(k.transpose(1, 2))  # [L, H_kv, n, D]
        kv.v[:, :, span.start : span.start + n].copy_(span.v.transpose(1, 2))  # [L, H_kv, n, D]


def blend_prefill(
    model: Any,
    ids: torch.Tensor,
    kv: Any,
    spans: Sequence[ReusedSpan],
    ratio: float,
    start: int = 0,
) -> BlendResult:
    """Prefill the tokens `ids` [T] at rows/positions start..start+T-1 of `kv`, reusing
    the cached rows of `spans` (which must lie inside that range and not overlap).
    Rows < start must already hold this sequence's exact prefix (e.g. a radix-cache
    match); they are never recomputed. Afterwards every row < start+T of every layer of
    `kv` holds the blended K/V. Returns the last row's logits and what was recomputed."""
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"blend ratio must be in [0, 1], got {ratio}")
    T = ids.shape[0]
    end = start + T
    if T == 0:
        raise ValueError("blend_prefill: no tokens")
    if end > kv.capacity:
        raise ValueError(f"sequence of {end} tokens exceeds its KV capacity of {kv.capacity}")
    device = kv.k.device
    cached = torch.zeros(T, dtype=torch.bool)  # [T] relative rows covered by a span
    for span in sorted(spans, key=lambda s: s.start):
        if span.start < start or span.end > end:
            raise ValueError(f"span rows {span.start}..{span.end} outside the prefill rows {start}..{end}")
        if bool(cached[span.start - start : span.end - start].any()):
            raise ValueError(f"span rows {span.start}..{span.end} overlap another span")
        cached[span.start - start : span.end - start] = True
    cached[-1] = False  # the last row's logits pick the first token: always computed fresh
    place_spans(model, kv, [s for s in spans])

    positions = torch.arange(start, end, dtype=torch.int64, device=device)  # [T]
    key_positions = torch.arange(end, dtype=torch.int64, device=device)  # [end]
    uncached_rel = (~cached).nonzero().squeeze(1)  # [U]
    cached_rel = cached.nonzero().squeeze(1)  # [C]
    n_cached = cached_rel.numel()
    h = model.embed(ids.to(device))  # [T, hidden]
    n_layers = model.config.n_layers

    if ratio == 0.0 or n_cached == 0 or n_layers < 2:
        # Full reuse (or nothing to reuse): only the uncached rows run, in every layer.
        rows = uncached_rel if n_cached else torch.arange(T)
        h = h.index_select(0, rows.to(device))  # [R, hidden]
        for i in range(n_layers):
            h = model.layer(i, h, positions[rows], kv, key_positions=key_positions)
        selected = 0
    else:
        h = model.layer(0, h, positions, kv, key_positions=key_positions)  # every row: exact layer-0 K/V
        k1, v1 = model.project_kv(1, h, positions)  # [T, H_kv, D] each
        cached_rows = cached_rel + start  # absolute
        old_v = kv.v[1].index_select(1, cached_rows.to(device)).transpose(0, 1)  # [C, H_kv, D]
        deviation = kernels.kv_deviation(v1.index_select(0, cached_rel.to(device)), old_v)  # [C]
        selected = math.ceil(ratio * n_cached - 1e-9)
        top = cached_rel[kernels.select_top_rows(deviation, selected).cpu()]  # [selected] relative
        rows = torch.cat((uncached_rel, top)).sort().values  # [R] relative, ascending
        kv.k[1, :, start:end].copy_(k1.transpose(0, 1))  # [H_kv, T, D]: layer 1 is exact for every row
        kv.v[1, :, start:end].copy_(v1.transpose(0, 1))
        h = h.index_select(0, rows.to(device))  # [R, hidden]
        for i in range(1, n_layers):
            h = model.layer(i, h, positions[rows], kv, key_positions=key_positions)
    logits = model.norm_logits(h[-1:])  # [1, V]: rows are ascending, the last row is in R
    return BlendResult(
        logits=logits,
        recomputed=rows + start,
        selected=int(selected),
        reused=n_cached - int(selected),
        uncached=int(uncached_rel.numel()),
    )


__all__ = ["ReusedSpan", "BlendResult", "blend_prefill", "place_spans"]
