"""Each document's last sequence KV, kept between requests (outside the radix pool).

When a request ends, its contiguous KV (the rows the model computed in) is kept under the
request's key — the document. The next request of that document takes it back and starts
from its rows: no gather from the pool, and the generated tokens (which never enter the
radix cache) are reused too, which matters when the user accepts a suggestion.

Documents with the same text keep one KV: the same file open in two editor windows (two
fronts of the engine daemon, whose keys differ) ends with the same rows. An entry whose ids
equal another's, or begin or extend them, keeps the KV of the longer one (rows
`[:len(ids)]` are the same tokens at the same positions), so each window's file costs its
rows once. Taking a shared entry hands its KV to the taker as it is (no copy on a keystroke's
path) and drops the other entries on it: the window typed in keeps the rows, the others
start from the radix cache's rows when they are used again.

Contracts:
- At most `max_entries` documents are kept, and (when `budget_bytes` is set) at most that
  many bytes; the least recently kept go first — of the owner whose entry or work needs the
  room, when it has one, before another owner's: one window's burst of jumps replaces its
  own KV, not the KV of the window someone is typing in (which would then gather its ~1,400
  rows from the pool at each keystroke: 30-40 ms, measured through the daemon). The newest
  entry goes too if it alone exceeds the bytes: its prompt rows are in the radix cache, only
  generated rows are lost.
- `take` removes the entry: a sequence owns its KV exclusively while it runs (the entries
  sharing that KV are dropped with it).
- Bytes are counted once per KV, however many entries share it; dropping an entry frees
  its bytes only when no other entry keeps its KV.
- The scheduler also drops entries (`evict_oldest`) to make room for running sequences'
  working KV, which shares the KV budget with this store (docs/reliability.md).
- A `KVStore` (`engine.kv.store`) keyed by document: `match` is `peek`, `insert` is
  `keep` (the scheduler's words), `evict(n)` frees at least `n` bytes.
- Engine thread only, except `nbytes` (a best-effort read for stats from any thread).
"""

from __future__ import annotations

import collections
from typing import Callable, NamedTuple, TYPE_CHECKING

from engine.kv.store import DocumentKey

if TYPE_CHECKING:
    from engine.model.sequence_kv import KV


class RetainedSequence(NamedTuple):
    kv: KV
    ids: list[int]  # the tokens whose rows kv holds, row i = ids[i]
    owner: str = ""  # the request's owner (`InfillRequest.owner`: one window of a shared engine)


def kv_bytes(kv: KV) -> int:
    """Bytes a sequence KV holds (k and v, and an int8 KV's scales)."""
    return kv.nbytes()


class RetainedKV:
    """The per-document store of finished sequences' KV (least recently kept dropped first)."""

    def __init__(self, max_entries: int = 4, budget_bytes: int | None = None) -> None:
        self.max_entries = max_entries
        self.budget_bytes = budget_bytes  # None: count only
        self._by_key: collections.OrderedDict[str, RetainedSequence] = collections.OrderedDict()

    def take(self, key: DocumentKey) -> RetainedSequence | None:
        """Remove and return `key`'s entry (None when there is none); the entries that share
        its KV go too (the taker will write to it)."""
        seq = self._by_key.pop(key, None)
        if seq is not None:
            for other in [k for k, s in self._by_key.items() if s.kv is seq.kv]:
                del self._by_key[other]
        return seq

    def shared(self, key: DocumentKey) -> bool:
        """Whether `key`'s entry shares its KV with another entry."""
        seq = self._by_key.get(key)
        return seq is not None and sum(s.kv is seq.kv for s in self._by_key.values()) > 1

    def _holds(self, kv: KV) -> bool:
        """Whether an entry keeps `kv`."""
        return any(s.kv is kv for s in self._by_key.values())

    def _share(self, seq: RetainedSequence) -> RetainedSequence:
        """`seq` on the KV of the entry whose ids begin or extend its own (the longer one's
        KV serves both; entries on a shorter KV move to `seq`'s), else `seq` itself."""
        ids = seq.ids
        for other in self._by_key.values():
            if other.kv is seq.kv or not other.ids or not ids or other.ids[0] != ids[0]:
                continue
            n = min(len(other.ids), len(ids))
            if other.ids[n - 1] != ids[n - 1] or other.ids[:n] != ids[:n]:
                continue
            if len(other.ids) >= len(ids):
                return RetainedSequence(other.kv, ids, seq.owner)
            old = other.kv
            for key, s in self._by_key.items():
                if s.kv is old:
                    self._by_key[key] = RetainedSequence(seq.kv, s.ids, s.owner)
            return seq
        return seq

    def match(self, key: DocumentKey) -> RetainedSequence | None:
        """`key`'s entry, left in place (None when there is none)."""
        return self._by_key.get(key)

    def peek(self, key: DocumentKey) -> RetainedSequence | None:
        """`match`, in the scheduler's words."""
        return self.match(key)

    def evict_oldest(self, spare: DocumentKey | None = None, owner: str | None = None) -> bool:
        """Drop the least recently kept entry other than `spare`'s — `owner`'s own first, when
        it has one; False when there is none to drop."""
        key = self._oldest(spare, owner)
        if key is None:
            return False
        self._drop(key)
        return True

    def _oldest(self, spare: DocumentKey | None, owner: str | None) -> DocumentKey | None:
        """The least recently kept key other than `spare`: among `owner`'s entries when it has
        one, else among all."""
        if owner is not None:
            key = next((k for k, s in self._by_key.items() if k != spare and s.owner == owner), None)
            if key is not None:
                return key
        return next((k for k in self._by_key if k != spare), None)

    def evict(self, n: int, spare: DocumentKey | None = None) -> int:
        """Drop the least recently kept entries other than `spare`'s until at least `n`
        bytes are freed or none is left; returns the bytes freed."""
        freed = 0
        for key in [k for k in self._by_key if k != spare]:  # least recently kept first
            if freed >= n:
                break
            freed += self._drop(key)
        return freed

    def _drop(self, key: DocumentKey) -> int:
        """Remove `key`'s entry; the bytes that frees (0 while another entry keeps its KV)."""
        kv = self._by_key.pop(key).kv
        return 0 if self._holds(kv) else kv_bytes(kv)

    def insert(self, key: DocumentKey, seq: RetainedSequence) -> None:
        """Keep `seq` as the document's latest; then drop the least recently kept beyond the
        count and byte limits."""
        self._by_key.pop(key, None)  # its own previous entry is replaced, never shared with
        self._by_key[key] = self._share(seq)
        limit = self.budget_bytes
        while self._by_key and (
            len(self._by_key) > self.max_entries or (limit is not None and self.nbytes() > limit)
        ):
            oldest = self._oldest(key, seq.owner)  # the keeper's own older entries first
            del self._by_key[key if oldest is None else oldest]

    def keep(self, key: DocumentKey, seq: RetainedSequence) -> None:
        """`insert`, in the scheduler's words."""
        self.insert(key, seq)

    def compact(self, resize: "Callable[[KV, int], KV]") -> None:
        """Give every kept KV the capacity `resize(kv, rows)` returns for the rows its entry
        uses (a budget coming down: a window's KV allocated under the larger one may hold far
        more rows than it uses). Entries that shared a KV share the new one; the order stays."""
        new: dict[int, KV] = {}
        for key, seq in list(self._by_key.items()):
            rows = max(len(s.ids) for s in self._by_key.values() if s.kv is seq.kv)
            if id(seq.kv) not in new:
                new[id(seq.kv)] = resize(seq.kv, rows)
            self._by_key[key] = seq._replace(kv=new[id(seq.kv)])

    def clear(self) -> None:
        """Drop every entry (memory pressure)."""
        self._by_key.clear()

    def entries(self) -> list[tuple[str, RetainedSequence]]:
        """(key, sequence) of every kept document, least recently kept first (the disk
        tier's snapshot reads them; the caller must not change the rows)."""
        return list(self._by_key.items())

    def nbytes(self) -> int:
        """Bytes held by the kept KV (outside the pool, inside the engine's KV budget)."""
        return self.nbytes_besides(None)

    def nbytes_besides(self, key: DocumentKey | None) -> int:
        """Bytes that dropping every entry but `key`'s would free (`key`'s KV stays, with
        every entry sharing it)."""
        spared = self._by_key.get(key) if key is not None else None
        unique = {id(s.kv): s.kv for s in list(self._by_key.values()) if spared is None or s.kv is not spared.kv}
        return sum(kv_bytes(kv) for kv in unique.values())

    def check_integrity(self) -> None:
        """Raise AssertionError unless the store keeps within its count and byte limits and
        every entry's ids fit the rows of its KV."""
        assert len(self._by_key) <= self.max_entries, f"{len(self._by_key)} entries kept, limit {self.max_entries}"
        if self.budget_bytes is not None:
            assert self.nbytes() <= self.budget_bytes, f"retained KV {self.nbytes()} B over its budget {self.budget_bytes} B"
        for key, seq in self._by_key.items():
            assert all(t.shape[:2] == seq.kv[0].shape[:2] for t in seq.kv), f"k and v of {key!r} disagree"
            assert 0 < len(seq.ids) <= seq.kv.capacity, f"{key!r}: {len(seq.ids)} ids in {seq.kv.capacity} rows"

    def __len__(self) -> int:
        return len(self._by_key)

    def __contains__(self, key: DocumentKey) -> bool:
        return key in self._by_key


__all__ = ["RetainedKV", "RetainedSequence", "kv_bytes"]
