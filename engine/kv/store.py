"""The one contract every KV store keeps: `match`, `insert`, `evict`, `nbytes`, `check_integrity`.

Four stores hold KV rows, each keyed by what it can be asked for:
- `engine.kv.radix.RadixCache` — token ids (`TokenIds`), matched by longest prefix; its
  rows are slots of the shared `engine.kv.pool.SlotPool`.
- `engine.kv.blend_store.BlendStore` — a span's token ids (`SpanIds`: a context chunk or a
  document piece), matched exactly; its rows are held slots of the same pool.
- `engine.kv.retained.RetainedKV` — a document (`DocumentKey`): its last sequence's KV,
  in tensors of its own.
- `engine.kv.disk_format.KVDiskStore` — a document (`DocumentKey`): its retained rows in a
  file, for the next process.

What each method means for each store:

| method | RadixCache | BlendStore | RetainedKV | KVDiskStore |
| --- | --- | --- | --- | --- |
| `match(key)` | `MatchResult` of the longest cached prefix (0 tokens: a miss) | the `SpanEntry` of exactly these ids, or None | the document's `RetainedSequence`, left in place, or None | the document's newest verified file as `StoredKV`, or None |
| `insert(key, value)` | ids with their held slots; the tree takes the slots | the span's `SpanKV` rows, copied into held slots | the document's `RetainedSequence` | the document's `DocumentRows`, written to a file |
| `evict(n)` | at least `n` slots of unpinned leaves | at least `n` slots of its LRU entries | at least `n` bytes of its least recently kept entries | at least `n` bytes of least recently used files (then within budget) |
| `nbytes()` | bytes of the slots the tree owns | bytes of the slots it holds | bytes of its tensors | bytes of the directory's KV files |

`evict` returns what it freed in the unit it was asked for; evicting 0 is always safe.
`check_integrity` raises AssertionError on a broken invariant (each store's docstring says
which). Threads are each store's own rule (the first three: the engine thread).
"""

from __future__ import annotations

from typing import Protocol, Sequence, TypeAlias, TypeVar, runtime_checkable

TokenIds: TypeAlias = Sequence[int]  # a prompt's token ids (radix key: prefixes of it match)
SpanIds: TypeAlias = Sequence[int]  # one span's token ids (blend-store key: only these ids match)
DocumentKey: TypeAlias = str  # a request's `key`: its document (retained and disk key)

KeyT = TypeVar("KeyT", contravariant=True)
ValueT = TypeVar("ValueT", contravariant=True)
HitT = TypeVar("HitT", covariant=True)


@runtime_checkable
class KVStore(Protocol[KeyT, ValueT, HitT]):
    """A store of KV rows under `KeyT` keys (see the module docstring for each store)."""

    def match(self, key: KeyT, /) -> HitT:
        """What the store holds for `key`; a miss is None, or an empty match (radix)."""
        ...

    def insert(self, key: KeyT, value: ValueT, /) -> object:
        """Store `value`'s rows under `key`; may evict to make room, never raises for lack of it."""
        ...

    def evict(self, n: int, /) -> int:
        """Free at least `n` (slots or bytes, the store's unit) if it can; returns what it freed."""
        ...

    def nbytes(self) -> int:
        """Bytes of KV the store holds now."""
        ...

    def check_integrity(self) -> None:
        """Raise AssertionError unless the store's invariants hold."""
        ...


__all__ = ["KVStore", "TokenIds", "SpanIds", "DocumentKey"]
