"""Files cut into line-aligned chunks, each with the identifiers it mentions.

Chunks are fixed windows of `CHUNK_LINES` lines starting at multiples of it, so an edit
changes the chunks from its line on and leaves the earlier ones byte-identical (and their
KV, keyed by token ids, reusable).
"""

from __future__ import annotations

import hashlib
import re
import sys
from collections import Counter
from typing import Mapping, NamedTuple

CHUNK_LINES = 64

# Unicode-aware identifiers of two characters or more (`\w` minus a leading digit).
_IDENT = re.compile(r"[^\W\d]\w+")

# Words every language repeats; they say nothing about which chunk is related.
STOP_WORDS = frozenset(
    """
    and as assert async await break case catch class const continue def default del do elif else
    enum except export extends false final finally for from func function go if impl import in
    interface is lambda let match mod module new nil none not null of or package pass private
    protected pub public raise return self static struct super switch this throw throws true try
    type typeof use var void while with yield int str bool float string char long double
    """.split()
)


def identifiers(text: str, *, shared: bool = False) -> Counter[str]:
    """Identifier counts of `text`, lower-cased, stop words removed. `shared`: each word
    interned (`sys.intern`), for counts an index keeps — a workspace's chunks repeat the same
    words, and one string per word instead of one per chunk is a third of the index's memory."""
    counts = Counter(map(str.lower, _IDENT.findall(text)))
    for word in STOP_WORDS.intersection(counts):
        del counts[word]
    if shared:
        counts = Counter({sys.intern(word): n for word, n in counts.items()})
    return counts


class Chunk(NamedTuple):
    path: str  # the file's display path (relative to its workspace folder when it has one)
    start_line: int  # 0-based first line
    end_line: int  # exclusive
    text: str
    # Identifier counts (see `identifiers`) as cut; a chunk from the index carries the words
    # alone (a tuple: `ranking.ChunkIndex` keeps their counts in its postings).
    terms: Mapping[str, int] | tuple[str, ...]
    digest: str  # hash of (path, text): identity for caches and selections
    length: int  # identifiers in all (BM25's document length)


def chunk_digest(path: str, text: str) -> str:
    return hashlib.blake2b(f"{path}\0{text}".encode("utf-8", "surrogatepass"), digest_size=12).hexdigest()


def split_chunks(path: str, text: str, lines_per_chunk: int = CHUNK_LINES) -> list[Chunk]:
    """Cut `text` into windows of `lines_per_chunk` lines; blank-only windows are dropped."""
    if lines_per_chunk < 1:
        raise ValueError(f"lines_per_chunk must be >= 1, got {lines_per_chunk}")
    lines = text.splitlines(keepends=True)
    chunks: list[Chunk] = []
    for start in range(0, len(lines), lines_per_chunk):
        body = "".join(lines[start : start + lines_per_chunk])
        if not body.strip():
            continue
        end = min(start + lines_per_chunk, len(lines))
        terms = identifiers(body, shared=True)
        chunks.append(Chunk(path, start, end, body, terms, chunk_digest(path, body), sum(terms.values())))
    return chunks


def sub_chunk(chunk: Chunk, start_line: int, end_line: int) -> Chunk:
    """The lines [start_line, end_line) of `chunk` (absolute line numbers) as a chunk."""
    lines = chunk.text.splitlines(keepends=True)
    lo = max(0, start_line - chunk.start_line)
    hi = min(len(lines), end_line - chunk.start_line)
    body = "".join(lines[lo:hi])
    terms = identifiers(body)
    return Chunk(chunk.path, chunk.start_line + lo, chunk.start_line + hi, body, terms, chunk_digest(chunk.path, body), sum(terms.values()))


__all__ = ["Chunk", "CHUNK_LINES", "STOP_WORDS", "identifiers", "split_chunks", "sub_chunk", "chunk_digest"]
