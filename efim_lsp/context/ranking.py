"""BM25 over identifiers: which chunks of other files share the vocabulary around the cursor.

An inverted index (identifier -> chunks) keeps a query cheap on large workspaces: only
chunks that mention at least one query identifier are scored.
"""

from __future__ import annotations

import heapq
import math
import threading
from collections import Counter, defaultdict  # noqa: F401 - Counter in annotations
from typing import Iterable, NamedTuple

from efim_lsp.context.chunking import Chunk

# Okapi BM25 constants (the usual values).
K1 = 1.2
B = 0.75
MAX_QUERY_TERMS = 48


class Scored(NamedTuple):
    score: float
    chunk: Chunk


class ChunkIndex:
    """Chunks of many files, replaceable per file. Thread-safe.

    Contracts: `replace(path, chunks)` makes `chunks` the only chunks of `path`;
    `remove(path)` forgets them; `search` never modifies the index.
    """

    def __init__(self) -> None:
        self._by_path: dict[str, list[Chunk]] = {}
        self._by_digest: dict[str, Chunk] = {}
        self._postings: dict[str, set[str]] = defaultdict(set)  # term -> chunk digests
        self._total_length = 0
        self._lock = threading.RLock()
        self.version = 0  # bumped by every change: selections made at another version may be stale

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_digest)

    def paths(self) -> list[str]:
        with self._lock:
            return list(self._by_path)

    def chunks_of(self, path: str) -> list[Chunk]:
        with self._lock:
            return list(self._by_path.get(path, ()))

    def __contains__(self, digest: str) -> bool:
        with self._lock:
            return digest in self._by_digest

    def replace(self, path: str, chunks: Iterable[Chunk]) -> bool:
        """Make `chunks` the chunks of `path`; True if anything changed."""
        chunks = list(chunks)
        with self._lock:
            old = self._by_path.get(path, [])
            if [c.digest for c in old] == [c.digest for c in chunks]:
                return False
            self._drop(path)
            self.version += 1
            if chunks:
                self._by_path[path] = chunks
                for chunk in chunks:
                    self._by_digest[chunk.digest] = chunk
                    self._total_length += chunk.length
                    for term in chunk.terms:
                        self._postings[term].add(chunk.digest)
            return True

    def remove(self, path: str) -> bool:
        with self._lock:
            if path not in self._by_path:
                return False
            self._drop(path)
            self.version += 1
            return True

    def _drop(self, path: str) -> None:
        for chunk in self._by_path.pop(path, []):
            if self._by_digest.pop(chunk.digest, None) is None:
                continue  # the same (path, text) twice in one file: already dropped
            self._total_length -= chunk.length
            for term in chunk.terms:
                posting = self._postings.get(term)
                if posting is not None:
                    posting.discard(chunk.digest)
                    if not posting:
                        del self._postings[term]

    def search(self, query: Counter[str] | Iterable[str], exclude_paths: Iterable[str] = (), limit: int = 16) -> list[Scored]:
        """The `limit` best chunks for `query` (identifiers), best first; ties broken by
        (path, line) so the same index and query always give the same order."""
        terms = set(query)
        excluded = set(exclude_paths)
        with self._lock:
            n = len(self._by_digest)
            if n == 0 or not terms:
                return []
            avg_len = max(self._total_length / n, 1.0)
            scores: dict[str, float] = {}
            by_digest = self._by_digest
            base, slope = K1 * (1.0 - B), K1 * B / avg_len
            # The rarest query identifiers carry the score; common ones cost long posting
            # walks for little: keep the MAX_QUERY_TERMS rarest.
            present = sorted((len(self._postings[t]), t) for t in terms if t in self._postings)
            for _df, term in present[:MAX_QUERY_TERMS]:
                posting = self._postings[term]
                idf = math.log(1.0 + (n - len(posting) + 0.5) / (len(posting) + 0.5))
                gain = idf * (K1 + 1.0)
                for digest in posting:
                    chunk = by_digest[digest]
                    tf = chunk.terms[term]
                    scores[digest] = scores.get(digest, 0.0) + gain * tf / (tf + base + slope * chunk.length)
            for path in excluded:
                for chunk in self._by_path.get(path, ()):
                    scores.pop(chunk.digest, None)
            # A margin past `limit`, then a total order, so equal scores never make the
            # answer depend on set iteration order.
            top = heapq.nlargest(limit + 16, scores.items(), key=lambda item: item[1])
            ranked = [Scored(score, by_digest[d]) for d, score in top]
        ranked.sort(key=lambda s: (-s.score, s.chunk.path, s.chunk.start_line))
        return ranked[:limit]


def jaccard(a: Iterable[str], b: Iterable[str]) -> float:
    sa, sb = set(a), set(b)
    if not sa and not sb:
        return 1.0
    return len(sa & sb) / len(sa | sb)


__all__ = ["ChunkIndex", "Scored", "jaccard", "K1", "B"]
