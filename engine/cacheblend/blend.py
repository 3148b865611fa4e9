"""CacheBlend (Yao et al., EuroSys 2025): prefill a prompt whose context chunks have
cached KV computed elsewhere, recomputing only the rows that matter.

Given the prompt's token ids and, for some spans of it, K/V rows cached from another
context (`ReusedSpan`: typically a chunk or a document piece prefilled alone, see
`engine.kv.blend_store`):

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
from array import array
from typing import Any, Callable, NamedTuple, Sequence, TYPE_CHECKING

import torch

import kernels
from engine.kv.radix import common_prefix_len
from engine.kv.blend_store import BlendStore, prefill_span

if TYPE_CHECKING:
    from engine.model.sequence_kv import KV
    from engine.model.transformer import Transformer

# Recomputed rows run through a layer in up to MAX_BLOCKS blocks of consecutive
# positions, each attending only to the keys up to its last position: masked attention
# gets no causal skipping from SDPA, and blocks recover most of it (8 blocks of rows
# spread evenly do ~56 % of the full rectangle's work, one block 100 %).
MAX_BLOCKS = 8
MIN_BLOCK_ROWS = 64
# Runs of the previous sequence are anchored on this many tokens: shorter ones are
# cheap to recompute and likely coincidences.
MIN_REUSED_RUN = 16
# A local-only blend (the document's own KV after a jump) is tried only when at least
# this many rows of the local segments remain to compute: below it a plain prefill is
# about as fast.
MIN_LOCAL_ROWS = 128


class BlendCancelled(Exception):
    """Raised between chunk prefills or between layers when the request was cancelled.
    Chunks already prefilled stay in the store; rows >= `start` of the KV are garbage."""


def _check(cancelled: Callable[[], bool] | None) -> None:
    if cancelled is not None and cancelled():
        raise BlendCancelled()


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


def place_spans(model: Transformer, kv: KV, spans: Sequence[ReusedSpan]) -> None:
    """Write each span's K (rotated from its cached positions to its rows) and V into
    every layer of `kv` (a `SequenceKV` or `Int8SequenceKV`, through its row API: an int8
    KV quantises the rotated rows as it stores them); row r has position r."""
    style = model.config.rope_style
    for span in spans:
        n = span.k.shape[1]
        if n == 0:
            continue
        L, _, H, D = span.k.shape
        rows = torch.arange(span.start, span.start + n, dtype=torch.int64)  # [n]
        k = span.k.to(kv.dtype)
        if not torch.equal(span.positions, rows):
            flat = k.transpose(0, 1).reshape(n, L * H, D)  # [n, L*H_kv, D]: one rotation for all layers
            k = kernels.rope_shift(flat, span.positions, rows, model.inv_freq, style).view(n, L, H, D).transpose(0, 1)
        kv.write(span.start, k.transpose(1, 2), span.v.transpose(1, 2))  # [L, H_kv, n, D]


def run_layer(model: Transformer, i: int, h: torch.Tensor, positions: torch.Tensor, kv: KV) -> torch.Tensor:
    """Layer i for rows at ascending `positions` [R] (row r of `kv` has position r), in
    blocks of consecutive positions (see MAX_BLOCKS). A block's rows see every key up to
    their own position: earlier blocks wrote theirs first, later ones are masked anyway.
    Returns h [R, hidden] (updated in place)."""
    n = h.shape[0]
    n_blocks = max(1, min(MAX_BLOCKS, n // MIN_BLOCK_ROWS))
    bounds = [n * b // n_blocks for b in range(n_blocks + 1)]
    for lo, hi in zip(bounds, bounds[1:]):
        part = h[lo:hi]  # [r, hidden] view
        keys = torch.arange(int(positions[hi - 1]) + 1, dtype=torch.int64, device=h.device)  # [S_b]
        out = model.layer(i, part, positions[lo:hi], kv, key_positions=keys)
        if out.data_ptr() != part.data_ptr():
            part.copy_(out)
    return h


def blend_prefill(
    model: Transformer,
    ids: torch.Tensor,
    kv: KV,
    spans: Sequence[ReusedSpan],
    ratio: float,
    start: int = 0,
    cancelled: Callable[[], bool] | None = None,
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
    device = kv[0].device
    cached = torch.zeros(T, dtype=torch.bool)  # [T] relative rows covered by a span
    for span in sorted(spans, key=lambda s: s.start):
        if span.start < start or span.end > end:
            raise ValueError(f"span rows {span.start}..{span.end} outside the prefill rows {start}..{end}")
        if bool(cached[span.start - start : span.end - start].any()):
            raise ValueError(f"span rows {span.start}..{span.end} overlap another span")
        cached[span.start - start : span.end - start] = True
    cached[-1] = False  # the last row's logits pick the first token: always computed fresh
    place_spans(model, kv, spans)

    positions = torch.arange(start, end, dtype=torch.int64, device=device)  # [T]
    uncached_rel = (~cached).nonzero().squeeze(1)  # [U]
    cached_rel = cached.nonzero().squeeze(1)  # [C]
    n_cached = cached_rel.numel()
    h = model.embed(ids.to(device))  # [T, hidden]
    n_layers = model.config.n_layers

    if ratio == 0.0 or n_cached == 0 or n_layers < 2:
        # Full reuse (or nothing to reuse): only the uncached rows run, in every layer.
        rows = uncached_rel  # every row when nothing is cached
        h = h.index_select(0, rows.to(device))  # [R, hidden]
        for i in range(n_layers):
            _check(cancelled)
            h = run_layer(model, i, h, positions[rows], kv)
        selected = 0
    else:
        h = run_layer(model, 0, h, positions, kv)  # every row: exact layer-0 K/V
        k1, v1 = model.project_kv(1, h, positions)  # [T, H_kv, D] each
        cached_rows = cached_rel + start  # absolute
        old_v = kv.layer_kv(1, end)[1].index_select(1, cached_rows.to(device)).transpose(0, 1)  # [C, H_kv, D]
        deviation = kernels.kv_deviation(v1.index_select(0, cached_rel.to(device)), old_v)  # [C]
        selected = math.ceil(ratio * n_cached - 1e-9)
        top = cached_rel[kernels.select_top_rows(deviation, selected).cpu()]  # [selected] relative
        rows = torch.cat((uncached_rel, top)).sort().values  # [R] relative, ascending
        kv.write_layer(1, start, k1.transpose(0, 1), v1.transpose(0, 1))  # [H_kv, T, D]: layer 1 is exact for every row
        h = h.index_select(0, rows.to(device))  # [R, hidden]
        for i in range(1, n_layers):
            _check(cancelled)
            h = run_layer(model, i, h, positions[rows], kv)
    logits = model.norm_logits(h[-1:])  # [1, V]: rows are ascending, the last row is in R
    return BlendResult(
        logits=logits,
        recomputed=rows + start,
        selected=int(selected),
        reused=n_cached - int(selected),
        uncached=int(uncached_rel.numel()),
    )


class SpanPlan(NamedTuple):
    spans: list[ReusedSpan]
    chunk_hits: int  # chunks found in the store
    chunk_misses: int  # chunks prefilled alone now (and stored)
    prefilled: int  # tokens those misses cost
    from_previous: int  # rows of the `extra` spans (local segments of the previous sequence)


class BlendRequest(NamedTuple):
    """What the scheduler needs to blend one prompt (built by the text layer)."""

    ratio: float
    units: tuple[tuple[int, int], ...]  # rows of each context chunk (file separator included)
    segments: tuple[tuple[int, int], ...]  # rows of the local text segments (prefix, suffix)
    origins: tuple[str | None, ...] = ()  # each unit's file, for invalidation
    header: tuple[int, ...] = ()  # the template's fixed header (BOS ids) chunks are prefilled after
    # Also reuse the document's own stored KV for the local segments (`engine.cacheblend.document_kv`):
    # the scheduler keeps the blend only if those spans cover enough rows.
    local: bool = False

    def has_units_after(self, reused: int) -> bool:
        return any(e > reused for _s, e in self.units)

    def wanted(self, reused: int) -> bool:
        """True when rows >= `reused` (the exact prefix already in hand) include a chunk,
        or local segments worth looking up: otherwise an ordinary prefill of the tail is
        all there is to do."""
        if self.has_units_after(reused):
            return True
        return self.local and sum(max(0, e - max(s, reused)) for s, e in self.segments) >= MIN_LOCAL_ROWS


class BlendOutcome(NamedTuple):
    logits: torch.Tensor  # [1, V] float32
    recomputed: int  # rows recomputed in layers >= 1 (incl. every uncached row)
    reused: int  # cached rows kept (chunks and previous-sequence segments)
    prefilled: int  # tokens of chunks prefilled alone because the store lacked them


def blend_sequence(
    model: Transformer,
    store: BlendStore,
    ids: Sequence[int],
    kv: KV,
    start: int,
    request: BlendRequest,
    extra: Sequence[ReusedSpan] = (),
    cancelled: Callable[[], bool] | None = None,
) -> BlendOutcome:
    """The scheduler's entry point: prefill rows start..len(ids)-1 of `kv` by blending
    (rows < start hold an exact prefix), with the chunks from `store` and `extra` spans
    (see `previous_spans`). Afterwards `kv` is an ordinary sequence KV. `cancelled` is
    polled between chunk prefills and layers; when it turns true, `BlendCancelled`."""
    plan = plan_spans(
        model, store, ids, request.units,
        header=request.header, start=start, origins=request.origins, extra=extra, cancelled=cancelled,
    )
    tail = torch.tensor(list(ids[start:]), dtype=torch.int64)  # [T]
    res = blend_prefill(model, tail, kv, plan.spans, request.ratio, start=start, cancelled=cancelled)
    return BlendOutcome(res.logits, int(res.recomputed.numel()), res.reused, plan.prefilled)


def chunk_units(spans: Sequence[Any]) -> list[tuple[int, int]]:
    """(start, end) of every context chunk of an encoded prompt (`Encoded.spans`: items
    with start, end, role): a "chunk" segment together with the file-separator
    "sentinel" right before it, when the template has one."""
    units: list[tuple[int, int]] = []
    for i, span in enumerate(spans):
        if span.role != "chunk" or span.end <= span.start:
            continue
        start = span.start
        if i > 0 and spans[i - 1].role == "sentinel" and spans[i - 1].end == span.start:
            start = spans[i - 1].start
        units.append((start, span.end))
    return units


def find_run(haystack: Sequence[int], needle: Sequence[int]) -> int:
    """First index where `needle` occurs contiguously in `haystack`, or -1."""
    if not needle or len(needle) > len(haystack):
        return -1
    hay = array("q", haystack).tobytes()
    pat = array("q", needle).tobytes()
    pos = hay.find(pat)
    while pos >= 0 and pos % 8:  # a match must start on an id boundary
        pos = hay.find(pat, pos + 1)
    return -1 if pos < 0 else pos // 8


def previous_spans(
    prev_ids: Sequence[int],
    prev_kv: KV,
    ids: Sequence[int],
    segments: Sequence[tuple[int, int]],
    start: int = 0,
) -> list[ReusedSpan]:
    """Spans for runs of the segments of `ids` (rows >= `start`) that occur verbatim in
    a previous sequence (`prev_ids`, whose rows `prev_kv` holds) — the document's last
    request, computed with other context before them. Each run is anchored on
    `MIN_REUSED_RUN` tokens and extended as far as both sequences agree, so a prefix
    window that grew or a suffix window that lost its first lines is still mostly reused.
    The K/V are copied: the new sequence may be written into the very workspace that
    holds the old one."""
    spans: list[ReusedSpan] = []
    n_prev = min(len(prev_ids), prev_kv.capacity)
    prev = list(prev_ids[:n_prev])
    for s, e in segments:
        pos = max(s, start)
        while e - pos >= MIN_REUSED_RUN:
            at = find_run(prev, ids[pos : pos + MIN_REUSED_RUN])
            if at < 0:
                pos += MIN_REUSED_RUN // 2  # re-anchor a little further on
                continue
            limit = min(e - pos, n_prev - at)
            n = common_prefix_len(prev[at : at + limit], ids[pos : pos + limit])  # >= MIN_REUSED_RUN
            k, v = prev_kv.read(at, at + n)  # [L, H_kv, n, D] (dequantised from an int8 KV)
            k, v = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()  # [L, n, H_kv, D]
            spans.append(ReusedSpan(pos, k, v, torch.arange(at, at + n, dtype=torch.int64)))
            pos += n
    return spans


def plan_spans(
    model: Transformer,
    store: BlendStore,
    ids: Sequence[int],
    units: Sequence[tuple[int, int]],
    *,
    header: Sequence[int] = (),
    start: int = 0,
    origins: Sequence[str | None] | None = None,
    extra: Sequence[ReusedSpan] = (),
    cancelled: Callable[[], bool] | None = None,
) -> SpanPlan:
    """Cached K/V for the rows >= `start` of a prompt: each chunk unit from `store`
    (prefilled alone after `header` and stored on a miss), plus `extra` spans (e.g.
    from `previous_spans`)."""
    spans: list[ReusedSpan] = []
    hits = misses = prefilled = 0
    for j, (s, e) in enumerate(units):
        if e <= start:
            continue  # inside the exact prefix already
        chunk = list(ids[s:e])
        entry = store.match(chunk)
        if entry is not None:
            cached = store.load(entry)
            hits += 1
        else:
            _check(cancelled)  # before each chunk prefilled alone: the expensive part
            cached = prefill_span(model, chunk, header, stop=cancelled)  # and between its layers
            if cached is None:
                raise BlendCancelled("cancelled while a chunk was prefilled alone")
            store.insert(chunk, cached, origins[j] if origins is not None and j < len(origins) else None)
            misses += 1
            prefilled += len(chunk)
        cut = max(0, start - s)  # rows before `start` are an exact prefix: keep only the rest
        spans.append(ReusedSpan(s + cut, cached.k[:, cut:], cached.v[:, cut:], cached.positions[cut:]))
    extra = [x for x in extra if x.start >= start]
    spans.extend(extra)
    return SpanPlan(spans, hits, misses, prefilled, sum(x.k.shape[1] for x in extra))


def blend_request(request: Any, encoded: Any, template: Any, *, chunks: bool = True, local: bool = False) -> BlendRequest | None:
    """The `BlendRequest` of an `InfillRequest` rendered by `template` and tokenized into
    `encoded` (`engine.text.tokenize.Encoded`), or None when it has no chunk to blend (or
    `chunks` is off) and `local` (reuse the document's own stored KV) is off. ValueError
    for a ratio outside [0, 1]."""
    if not 0.0 <= float(request.blend_ratio) <= 1.0:
        raise ValueError(f"blend_ratio must be in [0, 1], got {request.blend_ratio}")
    units = chunk_units(encoded.spans) if chunks else []
    if not units and not local:
        return None
    origins = tuple(c.path for c in request.chunks) if len(request.chunks) == len(units) else ()
    segments = tuple((s.start, s.end) for s in encoded.spans if s.role in ("prefix", "suffix"))
    return BlendRequest(float(request.blend_ratio), tuple(units), segments, origins, tuple(template.bos_ids), local)


__all__ = [
    "BlendCancelled",
    "ReusedSpan",
    "BlendResult",
    "BlendRequest",
    "BlendOutcome",
    "blend_sequence",
    "SpanPlan",
    "blend_prefill",
    "place_spans",
    "plan_spans",
    "previous_spans",
    "blend_request",
    "chunk_units",
    "find_run",
    "MIN_REUSED_RUN",
    "MIN_LOCAL_ROWS",
]
