"""Blend store for CacheBlend: the K/V of spans prefilled alone — context chunks and the
documents' pieces — reusable at any offset of any prompt.

A span (its token ids: for a context chunk the file separator and the `path\\ntext` tokens,
as the template renders them; for a piece its text's tokens) is prefilled alone — after
the template's fixed header (its BOS ids, if any), so its first token is not an attention
sink the real prompt never has — and its K (after RoPE, at positions header..header+n-1),
V and those positions are stored. `engine.cacheblend.blend` rotates the keys to wherever
the span lands (`kernels.rope_shift`).

Storage: rows live in the radix cache's token-granular pool (`engine.kv.pool.SlotPool`,
[L, N, H_kv, D]), in slots taken with `RadixCache.alloc` (which may evict radix leaves to
make room) and kept *held* by this store, so span KV and prefix KV share one byte budget
and the pool's integrity check still balances (held slots are counted). The store keeps
itself within `blend_store_share` of the pool, evicting its own least recently used
entries; the radix tree's eviction does not see these slots (see `docs/cacheblend.md`).

Keys: a span's token ids (`engine.kv.store.SpanIds`; a `KVStore` matched exactly),
stored under a hash of them; a hit compares the ids (no false sharing on collisions).
All methods run on the engine thread; nothing here locks.
"""

from __future__ import annotations

import collections
import hashlib
import logging
from array import array
from typing import Callable, NamedTuple, Sequence, TYPE_CHECKING

import torch

from engine.kv.radix import RadixCache
from engine.kv.store import SpanIds

if TYPE_CHECKING:
    from engine.model.transformer import Transformer

log = logging.getLogger(__name__)


def span_key(ids: Sequence[int]) -> bytes:
    """Content key of a span's token ids."""
    return hashlib.blake2b(array("q", ids).tobytes(), digest_size=16).digest()


class SpanKV(NamedTuple):
    """A span's cached rows, heads-second like the pool (ready for `rope_shift`)."""

    k: torch.Tensor  # [L, n, H_kv, D] keys after RoPE at `positions`
    v: torch.Tensor  # [L, n, H_kv, D]
    positions: torch.Tensor  # [n] int64: the positions the keys were rotated for


class SpanEntry(NamedTuple):
    key: bytes
    ids: tuple[int, ...]
    slots: torch.Tensor  # [n] int64 pool slots, held by the store
    positions: torch.Tensor  # [n] int64
    origin: str | None  # the file (context chunk) or document (piece) it came from, for invalidation


class BlendStoreStats(NamedTuple):
    entries: int
    tokens: int
    bytes_used: int
    hits: int
    misses: int
    evictions: int


def prefill_span(model: Transformer, ids: Sequence[int], header: Sequence[int] = (), stop: Callable[[], bool] | None = None) -> SpanKV | None:
    """Prefill `header + ids` on a fresh sequence; return the K/V rows of `ids`
    (the header's rows are dropped: every prompt has its own header at position 0).
    `stop()` is polled between layers: when it turns true the prefill is abandoned and
    None returned (a background span giving way to a request: a chunk of 256 rows is a
    whole forward, 40-60 ms on 2 cores, that a keystroke would otherwise wait for)."""
    h, n = len(header), len(ids)
    if n == 0:
        raise ValueError("prefill_span: empty span")
    kv = model.new_kv(h + n)
    tokens = torch.tensor([*header, *ids], dtype=torch.int64)
    if stop is None:
        model.forward(tokens, kv, 0, "none")
    elif model.prefill_pausable(tokens, kv, 0, stop=stop) is not None:
        return None
    k, v = kv.read(h, h + n)  # [L, H_kv, n, D], dequantised when the KV is int8
    k, v = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()  # [L, n, H_kv, D]
    return SpanKV(k, v, torch.arange(h, h + n, dtype=torch.int64))


class BlendStore:
    """Span KV in held slots of a `RadixCache`'s pool, LRU within `blend_store_share` of it."""

    def __init__(self, cache: RadixCache, *, blend_store_share: float = 0.25) -> None:
        if not 0.0 < blend_store_share <= 1.0:
            raise ValueError(f"blend_store_share must be in (0, 1], got {blend_store_share}")
        self.cache = cache  # allocates (evicting radix leaves when the pool is full)
        self.pool = cache.pool  # holds, reads, writes and frees the rows
        self.share = blend_store_share  # of the pool's slots, whatever their number (the pool may grow)
        self._entries: collections.OrderedDict[bytes, SpanEntry] = collections.OrderedDict()  # LRU first
        self._n_slots = 0
        self.hits = self.misses = self.evictions = 0
        self.version = 0  # bumped whenever an entry is added or dropped (for indexes built on it)
        self._origin_versions: collections.Counter[str | None] = collections.Counter()

    @property
    def max_slots(self) -> int:
        """Most slots the store holds: its share of the pool (which grows with `SlotPool.grow`)."""
        return max(1, int(self.pool.n_slots * self.share))

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, ids: SpanIds) -> bool:
        entry = self._entries.get(span_key(ids))
        return entry is not None and entry.ids == tuple(ids)

    def match(self, ids: SpanIds) -> SpanEntry | None:
        """The entry for exactly these ids (marks it recently used, counts a hit), or None
        (counts a miss)."""
        key = span_key(ids)
        entry = self._entries.get(key)
        if entry is None or entry.ids != tuple(ids):
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return entry

    def version_of(self, origin: str) -> int:
        """Changes whenever an entry of `origin` is added or dropped."""
        return self._origin_versions[origin]

    def entries_of(self, origin: str) -> list[SpanEntry]:
        """Every entry that came from `origin` (does not change recency)."""
        return [e for e in self._entries.values() if e.origin == origin]

    def touch(self, entry: SpanEntry) -> None:
        """Mark `entry` recently used (it was reused without a lookup)."""
        if entry.key in self._entries:
            self._entries.move_to_end(entry.key)

    def load_rows(self, entry: SpanEntry, at: int, n: int) -> SpanKV:
        """Copy rows at..at+n-1 of an entry out of the pool."""
        k, v = self.pool.read_slots(entry.slots[at : at + n])  # [L, n, H_kv, D]
        self.touch(entry)
        return SpanKV(k, v, entry.positions[at : at + n])

    def tokens_of(self, origin: str) -> int:
        return sum(len(e.ids) for e in self._entries.values() if e.origin == origin)

    def load(self, entry: SpanEntry) -> SpanKV:
        """Copy an entry's rows out of the pool."""
        k, v = self.pool.read_slots(entry.slots)  # [L, n, H_kv, D]
        return SpanKV(k, v, entry.positions)

    def insert(self, ids: SpanIds, kv: SpanKV, origin: str | None = None) -> SpanEntry | None:
        """Store a span's rows (replacing an entry with the same ids). Evicts this store's
        LRU entries to stay within its share, and lets the pool evict radix leaves; returns
        None (storing nothing) when the pool cannot make room."""
        ids = tuple(ids)
        n = len(ids)
        if kv.k.shape[1] != n or kv.v.shape[1] != n or kv.positions.shape[0] != n:
            raise ValueError(f"insert: {n} ids but K/V/positions rows {kv.k.shape[1]}/{kv.v.shape[1]}/{kv.positions.shape[0]}")
        if n == 0 or n > self.max_slots:
            return None
        key = span_key(ids)
        if key in self._entries:
            self._drop(key)
        while self._n_slots + n > self.max_slots and self._entries:
            self._evict_one()
        slots = self.cache.alloc(n)
        while slots is None and self._entries:  # the pool is full of pinned prefixes: give back ours
            self._evict_one()
            slots = self.cache.alloc(n)
        if slots is None:
            return None
        self.pool.write_slots(slots, kv.k, kv.v)  # [L, n, H_kv, D]; quantised in an int8 pool
        entry = SpanEntry(key, ids, slots, kv.positions.clone(), origin)
        self._entries[key] = entry
        self._n_slots += n
        self.version += 1
        self._origin_versions[origin] += 1
        return entry

    def forget_origin(self, origin: str) -> int:
        """Drop every entry that came from `origin` (a file changed); returns entries dropped."""
        keys = [k for k, e in self._entries.items() if e.origin == origin]
        for key in keys:
            self._drop(key)
        return len(keys)

    def fit(self, n_pool_slots: int) -> int:
        """Evict (LRU first) until the store is within its share of a pool of `n_pool_slots`
        (a pool about to shrink); returns slots freed."""
        over = self._n_slots - max(1, int(n_pool_slots * self.share))
        return self.evict(over) if over > 0 else 0

    def renumber(self, remap: torch.Tensor) -> None:
        """The pool renumbered its slots (`SlotPool.shrink`): `remap[old]` is each slot's new
        number. In place, so every holder of an entry (a document's piece index) sees it."""
        for entry in self._entries.values():
            entry.slots.copy_(remap[entry.slots])

    def evict(self, n_slots: int) -> int:
        """Free at least `n_slots` pool slots if the store holds them (LRU first); returns
        slots freed. Evicting 0 is always safe."""
        freed = 0
        while freed < n_slots and self._entries:
            freed += self._evict_one()
        return freed

    def drop(self, entry: SpanEntry) -> None:
        """Remove `entry` (if still stored), freeing its slots."""
        if self._entries.get(entry.key) is entry:
            self._drop(entry.key)

    def clear(self) -> None:
        for key in list(self._entries):
            self._drop(key)

    def _evict_one(self) -> int:
        key = next(iter(self._entries))
        self.evictions += 1
        return self._drop(key)

    def _drop(self, key: bytes) -> int:
        entry = self._entries.pop(key)
        self.version += 1
        self._origin_versions[entry.origin] += 1
        self.pool.free(entry.slots)
        self._n_slots -= entry.slots.numel()
        return entry.slots.numel()

    def nbytes(self) -> int:
        """Bytes of the pool slots this store holds."""
        return self._n_slots * self.pool.bytes_per_slot

    def stats(self) -> BlendStoreStats:
        return BlendStoreStats(
            entries=len(self._entries),
            tokens=self._n_slots,
            bytes_used=self.nbytes(),
            hits=self.hits,
            misses=self.misses,
            evictions=self.evictions,
        )

    def check_integrity(self) -> None:
        """Raise AssertionError unless the slot count matches the entries, no slot is in
        two entries, and every slot is held in the pool (not free, not in the tree)."""
        slots = [e.slots for e in self._entries.values()]
        all_slots = torch.cat(slots) if slots else torch.empty(0, dtype=torch.int64)
        assert all_slots.numel() == self._n_slots, f"slot count {self._n_slots} != {all_slots.numel()} in entries"
        assert all_slots.unique().numel() == all_slots.numel(), "a slot is in two span entries"
        assert self._n_slots <= self.max_slots, "blend store over its share of the pool"
        if all_slots.numel():
            assert self.pool.is_held(all_slots), "a span's slot is not held in the pool"
        for entry in self._entries.values():
            assert len(entry.ids) == entry.slots.numel() == entry.positions.numel(), "entry rows disagree"
            assert span_key(entry.ids) == entry.key, "entry stored under a wrong key"


__all__ = ["BlendStore", "SpanEntry", "SpanKV", "BlendStoreStats", "span_key", "prefill_span"]
