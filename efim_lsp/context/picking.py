"""Which indexed chunks go into a prompt, and how much of each: BM25's best chunks that the
local prompt window does not already hold, each trimmed to its share of the token budget.

Trimming keeps the grid-aligned run of lines that mentions the most query identifiers, so a
re-trim for a slightly different query tends to land on the same lines — and the prompt
prefix, with its KV, stays the same (docs/design.md, "Prefix stability").
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from efim_lsp.context.chunking import Chunk, identifiers, sub_chunk
from efim_lsp.context.ranking import ChunkIndex

# Lines around the cursor taken as "the local window" when the caller gives none.
WINDOW_LINES_BEFORE = 150
WINDOW_LINES_AFTER = 50
# A chunk with at least this fraction of its lines already in the local window adds nothing.
DUPLICATE_FRACTION = 0.5
# Trimmed chunks start on this line grid, so a re-trim tends to land on the same lines.
TRIM_GRID = 8
# No chunk is cut below this many tokens (a smaller share is not worth its place).
MIN_CHUNK_TOKENS = 32


class Picked(NamedTuple):
    score: float
    chunk: Chunk  # as it goes into the prompt (trimmed to its share)
    source: Chunk  # as it is in the index


def share(max_tokens: int, max_chunks: int) -> int:
    """One chunk's part of a `max_tokens` budget split over `max_chunks` chunks."""
    return max(MIN_CHUNK_TOKENS, max_tokens // max(1, max_chunks))


def pick_chunks(
    index: ChunkIndex,
    terms: frozenset[str],
    local: set[str],
    max_chunks: int,
    max_tokens: int,
    count_tokens: Callable[[str], int],
    *,
    exclude_paths: set[str],
    only_paths: set[str] | None = None,
    per_chunk: int | None = None,
) -> list[Picked]:
    """BM25's best chunks for `terms`, best first: none of `exclude_paths`, none whose lines
    are mostly in `local` (`significant_lines` of the prompt window), no text twice, one per
    file when `only_paths` is given; each trimmed to `per_chunk` tokens (default: its share)
    and all together within `max_tokens`."""
    per_chunk = per_chunk or share(max_tokens, max_chunks)
    picked: list[Picked] = []
    seen: set[str] = set()
    files: set[str] = set()
    total = 0
    limit = max_chunks * 4 if only_paths is None else max(64, max_chunks * 16)
    for scored in index.search(terms, exclude_paths=exclude_paths, limit=limit):
        if len(picked) == max_chunks:
            break
        source = scored.chunk
        if only_paths is not None and (source.path not in only_paths or source.path in files):
            continue
        if source.text in seen or duplicate_fraction(source.text, local) >= DUPLICATE_FRACTION:
            continue
        chunk = source
        n = count_tokens(chunk.text)
        if n > per_chunk:
            chunk = trim_chunk(chunk, terms, per_chunk, n, count_tokens)
            n = count_tokens(chunk.text)
        if total + n > max_tokens or not chunk.text.strip():
            continue
        seen.add(source.text)
        files.add(source.path)
        picked.append(Picked(scored.score, chunk, source))
        total += n
    return picked


def by_relevance(picked: list[Picked]) -> list[Picked]:
    """`picked` least relevant first (ties: path, then line), the order chunks take in a
    prompt so that the most relevant sits next to the local text."""
    return sorted(picked, key=lambda p: (p.score, p.chunk.path, p.chunk.start_line))


def trim_chunk(chunk: Chunk, terms: frozenset[str], limit: int, tokens: int, count_tokens: Callable[[str], int]) -> Chunk:
    """The grid-aligned run of lines of `chunk` (`tokens` long) that fits `limit` tokens and
    mentions the most query identifiers (the first such run on ties)."""
    lines = chunk.text.splitlines(keepends=True)
    span = max(1, int(len(lines) * limit / tokens))
    best, best_hits = 0, -1
    for start in range(0, max(1, len(lines) - span + 1), TRIM_GRID):
        hits = len(terms & set(identifiers("".join(lines[start : start + span]))))
        if hits > best_hits:
            best, best_hits = start, hits
    lo = chunk.start_line + best
    hi = lo + span
    trimmed = sub_chunk(chunk, lo, hi)
    while hi - lo > 1 and count_tokens(trimmed.text) > limit:
        hi -= max(1, (hi - lo) // 8)
        trimmed = sub_chunk(chunk, lo, hi)
    return trimmed


def window_text(text: str, cursor: int, window: tuple[int, int] | None) -> str:
    """The prompt window's text: `window` = (start, end) offsets, or lines around the cursor."""
    if window is not None:
        start, end = window
        return text[max(0, start) : max(0, end)]
    before = text[:cursor].splitlines(keepends=True)[-WINDOW_LINES_BEFORE:]
    after = text[cursor:].splitlines(keepends=True)[:WINDOW_LINES_AFTER]
    return "".join(before + after)


def _significant(text: str) -> list[str]:
    """`text`'s lines that identify content, trimmed (braces and blank lines say nothing)."""
    return [s for s in (line.strip() for line in text.splitlines()) if len(s) > 3]


def significant_lines(text: str) -> set[str]:
    """The distinct lines of `text` that identify content (`duplicate_fraction`'s `local`)."""
    return set(_significant(text))


def duplicate_fraction(text: str, local: set[str]) -> float:
    """The share of `text`'s significant lines that are in `local` (1.0 when it has none)."""
    lines = _significant(text)
    if not lines:
        return 1.0
    return sum(1 for s in lines if s in local) / len(lines)


__all__ = ["Picked", "pick_chunks", "by_relevance", "trim_chunk", "share", "window_text", "significant_lines", "duplicate_fraction"]
