"""Whole-document KV: a file's text cut into stable pieces whose KV is computed once
(in the background, nearest the cursor first) and found again wherever a new prompt
window after a jump contains the same text (docs/design.md, "After a jump").

Pieces: the text is cut at line starts, content-defined — a piece ends before a line
that starts a top-level statement (no indentation) or follows a blank line, once it
holds `min_chars`; and before any line once it holds `max_chars`. An edit therefore
changes only the pieces it touches (and at most the next one): every other piece keeps
its text, its token ids, and so its cached KV. Each piece is tokenized on its own and
prefilled alone after the template's header (`engine.kv.blend_store.prefill_span`); its rows
are kept in the `BlendStore` with the document's key as their origin.

Finding them again: a new prompt's local segments (prefix and suffix windows) are
tokenized as whole segments, so a piece's ids match the prompt's ids everywhere except
for a token or two at the piece's edges. `document_spans` finds runs of at least
`MIN_RUN` tokens of the prompt in the document's pieces (an n-gram index per document,
rebuilt when its pieces change) and returns them as `ReusedSpan`s; CacheBlend
(`engine.cacheblend.blend.blend_prefill`) rotates their keys to the new positions and recomputes
the rows that deviate most plus every row no piece covers.

Everything here runs on the engine thread.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, NamedTuple, Sequence

from engine.cacheblend.blend import ReusedSpan
from engine.kv.radix import common_prefix_len

if TYPE_CHECKING:
    from engine.kv.blend_store import BlendStore, SpanEntry

MIN_RUN = 16  # shortest run of a piece reused in a prompt (shorter: cheap to recompute)
MAX_HITS = 8  # places remembered per n-gram (code repeats itself: the longest run wins)
PIECE_MIN_CHARS = 320
PIECE_MAX_CHARS = 1200
# Characters per token are rarely above this in code: the region cut around the cursor is
# this many characters per token of the document's cap on each side.
CHARS_PER_TOKEN_BOUND = 8


class Piece(NamedTuple):
    """Characters start..end of a document's text (end exclusive; line-aligned)."""

    start: int
    end: int


def cut_pieces(text: str, min_chars: int = PIECE_MIN_CHARS, max_chars: int = PIECE_MAX_CHARS) -> list[Piece]:
    """The document's pieces, in order, covering all of `text` (see the module docstring).

    Contract: boundaries depend only on the lines since the previous boundary, so an edit
    inside one piece leaves every boundary before it, and every boundary after the next
    anchor line, where it was."""
    if not 0 < min_chars <= max_chars:
        raise ValueError(f"need 0 < min_chars <= max_chars, got {min_chars}, {max_chars}")
    pieces: list[Piece] = []
    start = 0
    pos = 0
    prev_blank = False
    n = len(text)
    while pos < n:
        nl = text.find("\n", pos)
        end = n if nl < 0 else nl + 1
        line = text[pos:end]
        size = pos - start
        anchor = bool(line) and (prev_blank or not line[0].isspace())
        if size >= max_chars or (size >= min_chars and anchor):
            pieces.append(Piece(start, pos))
            start = pos
        prev_blank = not line.strip()
        pos = end
    if start < n:
        pieces.append(Piece(start, n))
    return pieces


def nearest_first(pieces: Sequence[Piece], cursor: int) -> list[int]:
    """Indices of `pieces` ordered by distance from `cursor` (the piece holding it first)."""

    def distance(i: int) -> int:
        p = pieces[i]
        return -1 if p.start <= cursor < p.end else min(abs(p.start - cursor), abs(p.end - cursor))

    return sorted(range(len(pieces)), key=distance)


class _Hit(NamedTuple):
    entry: SpanEntry
    at: int  # row inside the entry


class DocumentIndex:
    """N-gram index over the `BlendStore` entries of one document (its origin).

    `find(ids)` answers where a run of `MIN_RUN` ids occurs in the document's pieces.
    The index is a snapshot: `stale(store)` tells when the store changed since."""

    def __init__(self, store: BlendStore, origin: str) -> None:
        self.origin = origin
        self.version = store.version_of(origin)
        self._grams: dict[tuple[int, ...], list[_Hit]] = {}
        for entry in store.entries_of(origin):
            ids = entry.ids
            for i in range(len(ids) - MIN_RUN + 1):
                hits = self._grams.setdefault(ids[i : i + MIN_RUN], [])
                if len(hits) < MAX_HITS:
                    hits.append(_Hit(entry, i))

    def stale(self, store: BlendStore) -> bool:
        return store.version_of(self.origin) != self.version

    def __len__(self) -> int:
        return len(self._grams)

    def find(self, gram: Sequence[int]) -> list[_Hit]:
        """Where `gram` (MIN_RUN ids) occurs in the pieces (at most MAX_HITS places)."""
        return self._grams.get(tuple(gram), [])


def document_spans(
    store: BlendStore,
    index: DocumentIndex,
    ids: Sequence[int],
    segments: Sequence[tuple[int, int]],
    start: int = 0,
    taken: Sequence[tuple[int, int]] = (),
) -> list[ReusedSpan]:
    """Spans for the rows >= `start` of `segments` of the prompt `ids` that occur in the
    document's pieces, skipping rows already `taken` by other spans. Each run is anchored
    on `MIN_RUN` ids and extended forwards as far as piece and prompt agree; the K/V are
    copied out of the pool (`store.load_rows`)."""
    blocked = sorted(taken)
    spans: list[ReusedSpan] = []
    for s, e in segments:
        pos = max(s, start)
        while e - pos >= MIN_RUN:
            clash = next(((a, b) for a, b in blocked if a < pos + MIN_RUN and b > pos), None)
            if clash is not None:
                pos = clash[1]
                continue
            hits = index.find(ids[pos : pos + MIN_RUN])
            if not hits:
                pos += 1
                continue
            room = min(e, next((a for a, _b in blocked if a >= pos), e)) - pos
            best, n = hits[0], 0
            want = tuple(ids[pos : pos + room])  # pieces hold tuples: compare like with like
            for hit in hits:  # the occurrence that agrees the longest
                limit = min(room, len(hit.entry.ids) - hit.at)
                m = common_prefix_len(hit.entry.ids[hit.at : hit.at + limit], want[:limit])
                if m > n:
                    best, n = hit, m
            hit = best
            k, v, positions = store.load_rows(hit.entry, hit.at, n)
            spans.append(ReusedSpan(pos, k, v, positions))
            pos += n
    return spans


def covered_rows(spans: Sequence[ReusedSpan]) -> int:
    return sum(int(s.k.shape[1]) for s in spans)


def span_ranges(spans: Sequence[ReusedSpan]) -> list[tuple[int, int]]:
    return [(s.start, s.end) for s in spans]


__all__ = [
    "Piece",
    "cut_pieces",
    "nearest_first",
    "DocumentIndex",
    "document_spans",
    "covered_rows",
    "span_ranges",
    "MIN_RUN",
]


class DocumentPass:
    """The background work of one document: its pieces' token ids, nearest the cursor
    first, made on demand on the engine thread (`tokenize` is the text layer's
    segment tokenizer). `ids_in_order()` is computed once per pass."""

    def __init__(self, key: str, text: str, cursor: int, tokenize: Callable[[str], list[int]], max_tokens: int) -> None:
        self.key = key
        self.text = text
        self.cursor = cursor
        self._tokenize = tokenize
        self.max_tokens = max_tokens  # most tokens of this document's pieces to keep
        self._order: list[tuple[int, ...]] | None = None
        self.done = False
        # Piece text -> ids, handed on from the document's previous pass: after an edit
        # only the pieces it changed are tokenized again.
        self.memo: dict[str, tuple[int, ...]] = {}

    def ids_in_order(self) -> list[tuple[int, ...]]:
        """Token ids of the pieces to keep, nearest the cursor first, within `max_tokens`
        (a file larger than that keeps the pieces around the cursor)."""
        if self._order is None:
            # Only the text that can matter is cut: a region around the cursor a few times
            # the token cap wide (a 50 MB file costs what its neighbourhood costs).
            reach = self.max_tokens * CHARS_PER_TOKEN_BOUND
            lo = self.text.rfind("\n", 0, max(0, self.cursor - reach)) + 1
            hi = self.text.find("\n", min(len(self.text), self.cursor + reach))
            hi = len(self.text) if hi < 0 else hi + 1
            pieces = [Piece(lo + p.start, lo + p.end) for p in cut_pieces(self.text[lo:hi])]
            order: list[tuple[int, ...]] = []
            total = 0
            known, self.memo = self.memo, {}
            for i in nearest_first(pieces, self.cursor):
                p = pieces[i]
                piece = self.text[p.start : p.end]
                ids = known.get(piece)
                if ids is None:
                    ids = tuple(self._tokenize(piece))
                self.memo[piece] = ids
                if not ids:
                    continue
                if total + len(ids) > self.max_tokens:
                    break
                order.append(ids)
                total += len(ids)
            self._order = order
        return self._order
