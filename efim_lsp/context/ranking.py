"""BM25 over identifiers: which chunks of other files share the vocabulary around the cursor.

An inverted index (identifier -> chunks) keeps a query cheap on large workspaces: only
chunks that mention at least one query identifier are scored.
"""

from __future__ import annotations

import heapq
import math
import threading
from array import array
from collections import Counter, OrderedDict  # noqa: F401 - Counter in annotations
from typing import Callable, Iterable, Mapping, NamedTuple

from efim_lsp.context.chunking import Chunk, chunk_digest

# Okapi BM25 constants (the usual values).
K1 = 1.2
B = 0.75
MAX_QUERY_TERMS = 48
# Files whose lines `ChunkIndex` keeps after cutting chunk texts out of them.
TEXTS_KEPT = 32


class Scored(NamedTuple):
    score: float
    chunk: Chunk


class _Posting:
    """The chunks that mention one word: their ids and counts of it, in two flat arrays
    (8 + 2 bytes an entry, where a set of digests took ~60). Ids of dropped chunks stay
    until the arrays are more than half dead, then they are compacted; `df` counts the live."""

    __slots__ = ("ids", "tfs", "df")

    def __init__(self) -> None:
        self.ids = array("q")
        self.tfs = array("H")
        self.df = 0


class ChunkIndex:
    """Chunks of many files, replaceable per file. Thread-safe.

    Contracts: `replace(path, chunks)` makes `chunks` the only chunks of `path`;
    `remove(path)` forgets them; `search` never modifies the index. The chunks it hands
    back carry their words alone (`Chunk.terms` a tuple): the counts live in its postings.

    Text: with `read_text` (path -> the file's current text, or None), `replace(...,
    keep_text=False)` keeps a file's chunks without their text — a 10,000-file workspace's
    chunk texts were 174 MB of its index's 363 — and `search` / `chunks_of` cut each one back
    out of `read_text(path)` when asked, dropping a chunk whose lines no longer hash to its
    digest (the file changed since: its new chunks come when it is indexed again). The last
    `TEXTS_KEPT` files read are kept for the next ask.
    """

    def __init__(self, read_text: Callable[[str], str | None] | None = None) -> None:
        self._read_text = read_text
        self._texts: OrderedDict[str, list[str] | None] = OrderedDict()  # path -> its lines as last read
        self._by_path: dict[str, list[Chunk]] = {}
        self._by_digest: dict[str, Chunk] = {}
        self._id_of: dict[str, int] = {}  # digest -> id in the postings
        self._by_id: dict[int, Chunk] = {}
        self._next_id = 0
        self._postings: dict[str, _Posting] = {}  # term -> the chunks that mention it
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
        """`path`'s chunks with their text (those whose text cannot be cut back out are left out)."""
        with self._lock:
            chunks = list(self._by_path.get(path, ()))
        return [c for c in map(self._with_text, chunks) if c is not None]

    def digests_of(self, path: str) -> tuple[str, ...]:
        """`path`'s chunks' digests, in order (no text read)."""
        with self._lock:
            return tuple(c.digest for c in self._by_path.get(path, ()))

    def _with_text(self, chunk: Chunk) -> Chunk | None:
        """`chunk` with its text: as kept, or cut out of its file's current text (None when
        those lines no longer hash to its digest, or the file cannot be read)."""
        if chunk.text or self._read_text is None:
            return chunk
        with self._lock:
            lines = self._texts.get(chunk.path)
            known = chunk.path in self._texts
            if known:
                self._texts.move_to_end(chunk.path)
        if not known:
            text = self._read_text(chunk.path)
            lines = text.splitlines(keepends=True) if text is not None else None
            with self._lock:
                self._texts[chunk.path] = lines
                while len(self._texts) > TEXTS_KEPT:
                    self._texts.popitem(last=False)
        if lines is None:
            return None
        body = "".join(lines[chunk.start_line : chunk.end_line])
        if chunk_digest(chunk.path, body) != chunk.digest:
            return None
        return chunk._replace(text=body)

    def __contains__(self, digest: str) -> bool:
        with self._lock:
            return digest in self._by_digest

    def replace(self, path: str, chunks: Iterable[Chunk], *, keep_text: bool = True) -> bool:
        """Make `chunks` the chunks of `path`; True if anything changed. `keep_text=False`
        (with `read_text`): their text is not kept but read back when asked."""
        chunks = list(chunks)
        with self._lock:
            self._texts.pop(path, None)
            old = self._by_path.get(path, [])
            if [c.digest for c in old] == [c.digest for c in chunks]:
                if old and not keep_text and self._read_text is not None and old[0].text:
                    self._drop_texts(path)  # the same chunks, from disk now: their text goes
                return False
            self._drop(path)
            self.version += 1
            if chunks:
                drop_text = not keep_text and self._read_text is not None
                self._by_path[path] = [self._add(chunk, drop_text) for chunk in chunks]
            return True

    def _drop_texts(self, path: str) -> None:
        """`path`'s chunks, kept with their text so far, keep it no longer (in every map)."""
        slim = [c._replace(text="") for c in self._by_path[path]]
        self._by_path[path] = slim
        for chunk in slim:
            cid = self._id_of.get(chunk.digest)
            if cid is not None:
                self._by_id[cid] = self._by_digest[chunk.digest] = chunk

    def _add(self, chunk: Chunk, drop_text: bool = False) -> Chunk:
        counts = chunk.terms if isinstance(chunk.terms, Mapping) else dict.fromkeys(chunk.terms, 1)
        slim = chunk._replace(terms=tuple(counts), text="" if drop_text else chunk.text)
        if chunk.digest in self._id_of:
            return slim  # the same (path, text) twice in one file: indexed once
        cid = self._next_id
        self._next_id += 1
        self._id_of[chunk.digest] = cid
        self._by_id[cid] = self._by_digest[chunk.digest] = slim
        self._total_length += chunk.length
        for term, tf in counts.items():
            posting = self._postings.get(term)
            if posting is None:
                posting = self._postings[term] = _Posting()
            posting.ids.append(cid)
            posting.tfs.append(min(tf, 0xFFFF))
            posting.df += 1
        return slim

    def remove(self, path: str) -> bool:
        with self._lock:
            self._texts.pop(path, None)
            if path not in self._by_path:
                return False
            self._drop(path)
            self.version += 1
            return True

    def _drop(self, path: str) -> None:
        for chunk in self._by_path.pop(path, []):
            cid = self._id_of.pop(chunk.digest, None)
            if cid is None:
                continue  # the same (path, text) twice in one file: already dropped
            del self._by_id[cid]
            del self._by_digest[chunk.digest]
            self._total_length -= chunk.length
            for term in chunk.terms:
                posting = self._postings.get(term)
                if posting is None:
                    continue
                posting.df -= 1
                if posting.df <= 0:
                    del self._postings[term]
                elif len(posting.ids) > 2 * posting.df + 8:
                    self._compact(posting)

    def _compact(self, posting: _Posting) -> None:
        live = self._by_id
        kept = [(i, tf) for i, tf in zip(posting.ids, posting.tfs) if i in live]
        posting.ids = array("q", [i for i, _tf in kept])
        posting.tfs = array("H", [tf for _i, tf in kept])

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
            scores: dict[int, float] = {}
            by_id = self._by_id
            base, slope = K1 * (1.0 - B), K1 * B / avg_len
            # The rarest query identifiers carry the score; common ones cost long posting
            # walks for little: keep the MAX_QUERY_TERMS rarest.
            present = sorted((self._postings[t].df, t) for t in terms if t in self._postings)
            for df, term in present[:MAX_QUERY_TERMS]:
                posting = self._postings[term]
                idf = math.log(1.0 + (n - df + 0.5) / (df + 0.5))
                gain = idf * (K1 + 1.0)
                for cid, tf in zip(posting.ids, posting.tfs):
                    chunk = by_id.get(cid)
                    if chunk is None:
                        continue  # dropped; compacted later
                    scores[cid] = scores.get(cid, 0.0) + gain * tf / (tf + base + slope * chunk.length)
            for path in excluded:
                for chunk in self._by_path.get(path, ()):
                    scores.pop(self._id_of.get(chunk.digest, -1), None)
            # A margin past `limit`, then a total order, so equal scores never make the
            # answer depend on dict order.
            top = heapq.nlargest(limit + 16, scores.items(), key=lambda item: item[1])
            ranked = [Scored(score, by_id[cid]) for cid, score in top]
        ranked.sort(key=lambda s: (-s.score, s.chunk.path, s.chunk.start_line))
        out = []
        for scored in ranked:  # texts read outside the lock, for the chunks handed back only
            chunk = self._with_text(scored.chunk)
            if chunk is not None:
                out.append(Scored(scored.score, chunk))
                if len(out) == limit:
                    break
        return out


def jaccard(a: Iterable[str], b: Iterable[str]) -> float:
    sa, sb = set(a), set(b)
    if not sa and not sb:
        return 1.0
    return len(sa & sb) / len(sa | sb)


__all__ = ["ChunkIndex", "Scored", "jaccard", "K1", "B"]
