"""Each document's last sequence KV, kept between requests (outside the radix pool).

When a request ends, its contiguous KV (the rows the model computed in) is kept under the
request's key — the document. The next request of that document takes it back and starts
from its rows: no gather from the pool, and the generated tokens (which never enter the
radix cache) are reused too, which matters when the user accepts a suggestion.

Contracts:
- At most `max_entries` documents are kept, and (when `budget_bytes` is set) at most that
  many bytes; the least recently kept go first. The newest entry goes too if it alone
  exceeds the bytes: its prompt rows are in the radix cache, only generated rows are lost.
- `take` removes the entry: a sequence owns its KV exclusively while it runs.
- The scheduler also drops entries (`evict_oldest`) to make room for running sequences'
  working KV, which shares the KV budget with this store (docs/reliability.md).
- A `KVStore` (`engine.kv.store`) keyed by document: `match` is `peek`, `insert` is
  `keep` (the scheduler's words), `evict(n)` frees at least `n` bytes.
- Engine thread only, except `nbytes` (a best-effort read for stats from any thread).
"""

from __future__ import annotations

import collections
from typing import NamedTuple, TYPE_CHECKING

from engine.kv.store import DocumentKey

if TYPE_CHECKING:
    from engine.model.sequence_kv import KV


class RetainedSequence(NamedTuple):
    kv: KV
    ids: list[int]  # the tokens whose rows kv holds, row i = ids[i]


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
        """Remove and return `key`'s entry (None when there is none)."""
        return self._by_key.pop(key, None)

    def match(self, key: DocumentKey) -> RetainedSequence | None:
        """`key`'s entry, left in place (None when there is none)."""
        return self._by_key.get(key)

    def peek(self, key: DocumentKey) -> RetainedSequence | None:
        """`match`, in the scheduler's words."""
        return self.match(key)

    def evict_oldest(self, spare: DocumentKey | None = None) -> int:
        """Drop the least recently kept entry other than `spare`'s; returns its bytes (0 when
        there is none to drop)."""
        for key in self._by_key:
            if key != spare:
                return kv_bytes(self._by_key.pop(key).kv)
        return 0

    def evict(self, n: int, spare: DocumentKey | None = None) -> int:
        """Drop the least recently kept entries other than `spare`'s until at least `n`
        bytes are freed or none is left; returns the bytes freed."""
        freed = 0
        for key in [k for k in self._by_key if k != spare]:  # least recently kept first
            if freed >= n:
                break
            freed += kv_bytes(self._by_key.pop(key).kv)
        return freed

    def insert(self, key: DocumentKey, seq: RetainedSequence) -> None:
        """Keep `seq` as the document's latest; then drop the least recently kept beyond the
        count and byte limits."""
        self._by_key[key] = seq
        self._by_key.move_to_end(key)
        limit = self.budget_bytes
        while self._by_key and (
            len(self._by_key) > self.max_entries or (limit is not None and self.nbytes() > limit)
        ):
            self._by_key.popitem(last=False)

    def keep(self, key: DocumentKey, seq: RetainedSequence) -> None:
        """`insert`, in the scheduler's words."""
        self.insert(key, seq)

    def entries(self) -> list[tuple[str, RetainedSequence]]:
        """(key, sequence) of every kept document, least recently kept first (the disk
        tier's snapshot reads them; the caller must not change the rows)."""
        return list(self._by_key.items())

    def nbytes(self) -> int:
        """Bytes held by the kept KV (outside the pool, inside the engine's KV budget)."""
        return sum(kv_bytes(s.kv) for s in list(self._by_key.values()))

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
