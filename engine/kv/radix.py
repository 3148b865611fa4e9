"""A radix tree over token ids (prefix reuse) whose rows live in a `SlotPool`.

The rows are token slots of `engine.kv.pool.SlotPool` (one slot per token, under the
KV budget); the tree owns the slots of the sequences it stores. It is a `KVStore`
(`engine.kv.store`) keyed by token ids: `match` finds the longest cached prefix.

The radix tree is shared by all documents. A node holds a run of token ids and the
slots of their K/V rows; its children are keyed by their first id. A node is split
when a new sequence diverges inside it and merged back into its only child when
nothing refers to it on its own, so a document typed for an hour is still a short
path. The model computes in a contiguous per-sequence workspace (`SequenceKV`):
`SlotPool.gather` copies a matched prefix from the pool into it (one `index_select` over
all layers), `commit` copies newly computed rows from it into fresh slots.

Ownership: each slot is free, owned by exactly one tree node, or held by a caller
between `alloc` and `insert`/`free` (the pool keeps the marks). `check_integrity()`
verifies this at any time.

Eviction removes (or trims the tail of) unreferenced leaves in LRU order, taking the
leaves that are not on any document's latest sequence first. A request pins its path
(`pin`) so eviction never takes rows it is about to extend.

All methods are called from one thread (the engine thread); nothing here locks.
"""

from __future__ import annotations

import heapq
import itertools
from typing import NamedTuple, Sequence, TYPE_CHECKING

import torch

from engine.kv.pool import SlotPool

if TYPE_CHECKING:
    from engine.model.sequence_kv import KV


class RadixNode:
    """A run of token ids and their slots. `ref` counts pins on this node or below."""

    __slots__ = ("ids", "slots", "children", "parent", "ref", "last_used", "latest_keys")

    def __init__(self, ids: list[int], slots: torch.Tensor, parent: RadixNode | None) -> None:
        self.ids = ids
        self.slots = slots  # [len(ids)] int64
        self.children: dict[int, RadixNode] = {}
        self.parent = parent
        self.ref = 0
        self.last_used = 0
        self.latest_keys: set[str] = set()  # documents whose latest sequence ends here

    def __repr__(self) -> str:
        return f"RadixNode(n={len(self.ids)}, ref={self.ref}, children={len(self.children)})"


class MatchResult(NamedTuple):
    slots: torch.Tensor  # [n_tokens] int64: slots of the matched prefix, in order
    n_tokens: int
    node: RadixNode  # deepest node touched (root when nothing matched)
    in_node: int = 0  # how many of node's tokens matched (< len(node.ids): the match ends inside it)


class InsertResult(NamedTuple):
    node: RadixNode  # the node ending exactly at len(ids)
    n_existing: int  # tokens that were already in the tree


class CommitResult(NamedTuple):
    node: RadixNode | None  # node ending at `upto` (None: nothing fitted in the budget)
    n_stored: int  # rows newly copied into the pool
    n_cached: int  # tokens of ids[:upto] in the tree afterwards


class CacheStats(NamedTuple):
    bytes_total: int
    bytes_used: int
    bytes_free: int
    slots_total: int
    slots_used: int
    nodes: int
    evictions: int  # leaves removed or trimmed
    evicted_tokens: int


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two id sequences."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the common case, compared in C
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 16:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    for i in range(lo, hi):
        if a[i] != b[i]:
            return i
    return hi


class RadixCache:
    """Radix prefix tree over a token-granular KV pool under a hard byte budget."""

    def __init__(
        self,
        *,
        pool: SlotPool | None = None,
        n_layers: int | None = None,
        n_kv_heads: int | None = None,
        head_dim: int | None = None,
        dtype: torch.dtype | None = None,
        budget_bytes: int | None = None,
        min_evict: int = 64,
        kv_dtype: str | None = None,
    ) -> None:
        """A tree over `pool`, or over a new `SlotPool` of the shape, dtype, budget and
        `kv_dtype` given (see `SlotPool`). `min_evict`: slots an `alloc` that must evict
        frees at least, so a keystroke's few rows do not walk the tree each time."""
        shape = (n_layers, n_kv_heads, head_dim, dtype, budget_bytes)
        if pool is None:
            if any(x is None for x in shape):
                raise TypeError("RadixCache: give a pool, or n_layers, n_kv_heads, head_dim, dtype and budget_bytes")
            pool = SlotPool(
                n_layers=n_layers, n_kv_heads=n_kv_heads, head_dim=head_dim, dtype=dtype,
                budget_bytes=budget_bytes, kv_dtype=kv_dtype,
            )
        elif any(x is not None for x in shape) or kv_dtype is not None:
            raise TypeError("RadixCache: a given pool has its own shape and budget")
        self.pool = pool
        self.root = RadixNode([], torch.empty(0, dtype=torch.int64), None)
        self._latest: dict[str, RadixNode] = {}
        self._clock = itertools.count(1)
        self._min_evict = min_evict
        self.evictions = 0
        self.evicted_tokens = 0

    # ------------------------------------------------------------------ lookup
    def match(self, ids: Sequence[int]) -> MatchResult:
        """Longest cached prefix of `ids`. Does not modify the cache except LRU times
        (no split: a match may end inside `node`). Never fails; an empty match returns root."""
        node, i = self.root, 0
        parts: list[torch.Tensor] = []
        now = next(self._clock)
        n = len(ids)
        while i < n:
            child = node.children.get(ids[i])
            if child is None:
                break
            k = common_prefix_len(child.ids, ids[i : i + len(child.ids)])
            child.last_used = now
            parts.append(child.slots[:k] if k < len(child.ids) else child.slots)
            node, i = child, i + k
            if k < len(child.ids):
                break
        slots = torch.cat(parts) if len(parts) > 1 else (parts[0] if parts else self.root.slots)
        return MatchResult(slots, i, node, parts[-1].shape[0] if parts else 0)

    # ------------------------------------------------------------------ pins
    def pin_match(self, m: MatchResult) -> RadixNode:
        """Pin exactly the matched prefix of `m` (splitting the last node when the match
        ends inside it, so the unmatched rest stays evictable). Call it right after
        `match`, before any other cache call. Returns the node to `unpin` later."""
        node = m.node
        if node is not self.root and m.in_node < len(node.ids):
            node = self._split(node, m.in_node)
        self.pin(node)
        return node

    def pin(self, node: RadixNode) -> None:
        """Protect `node` and its ancestors from eviction until `unpin(node)`."""
        while node is not None:
            node.ref += 1
            node = node.parent

    def unpin(self, node: RadixNode) -> None:
        """Undo one `pin(node)`. Unpinning a node that is not pinned raises."""
        end = node
        while node is not None:
            if node.ref <= 0:
                raise RuntimeError(f"unpin of an unpinned node {end!r}")
            node.ref -= 1
            node = node.parent
        self._merge_into_child(end)

    # ------------------------------------------------------------------ the pool
    # What callers outside engine/kv ask of the cache about its pool: the pool's answers.
    def grow(self, budget_bytes: int) -> int:
        """`SlotPool.grow`: a larger pool under `budget_bytes`; every stored row stays where
        it is. Returns the slots added."""
        return self.pool.grow(budget_bytes)

    def shrink(self, budget_bytes: int) -> torch.Tensor | None:
        """`SlotPool.shrink`, after evicting unpinned leaves until the slots in use fit (the
        caller makes its own held slots fit first: the blend store's). The tree's nodes are
        renumbered in place; the map is returned for the other holders of slot numbers.
        None: not smaller, or pinned and held rows do not fit."""
        n_new = int(budget_bytes) // self.pool.bytes_per_slot
        over = (self.pool.n_slots - self.pool.n_free) - n_new
        if over > 0:
            self.evict(over)
        remap = self.pool.shrink(budget_bytes)
        if remap is not None:
            for node in self.nodes():
                node.slots.copy_(remap[node.slots])  # in place: a split node's halves are disjoint views
        return remap

    @property
    def n_slots(self) -> int:
        return self.pool.n_slots

    @property
    def bytes_per_slot(self) -> int:
        return self.pool.bytes_per_slot

    @property
    def int8(self) -> bool:
        return self.pool.int8

    @property
    def dtype(self) -> torch.dtype:
        return self.pool.dtype

    @property
    def n_layers(self) -> int:
        return self.pool.n_layers

    @property
    def n_kv_heads(self) -> int:
        return self.pool.n_kv_heads

    @property
    def head_dim(self) -> int:
        return self.pool.head_dim

    @property
    def n_free(self) -> int:
        return self.pool.n_free

    def alloc(self, n: int) -> torch.Tensor | None:
        """`n` free slots, held by the caller until `insert` (or `free`). Evicts
        unpinned leaves if needed; None when even eviction cannot make room (nothing
        is evicted in vain in that case only if the pinned part is too large)."""
        if n > self.pool.n_free:
            self.evict(max(n - self.pool.n_free, self._min_evict))
        return self.pool.alloc(n)

    def free(self, slots: torch.Tensor) -> None:
        """Return held slots (from `alloc`, not inserted) to the free list."""
        self.pool.free(slots)

    def gather(self, slots: torch.Tensor, kv: KV, start: int = 0) -> None:
        """`SlotPool.gather`: pool rows `slots` into workspace `kv` at rows start.."""
        self.pool.gather(slots, kv, start)

    def read_slots(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`SlotPool.read_slots`: rows `slots` in the compute dtype, [L, n, H_kv, D] each."""
        return self.pool.read_slots(slots)

    def write_slots(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """`SlotPool.write_slots`: k, v [L, n, H_kv, D] into `slots`."""
        self.pool.write_slots(slots, k, v)

    # ------------------------------------------------------------------ insert
    def insert(self, ids: Sequence[int], slots: torch.Tensor, key: str | None = None) -> InsertResult:
        """Add `ids` with their `slots` ([len(ids)] int64). Takes ownership of the held
        slots in `slots`: where a token is already cached, the tree keeps its own slot and
        a different held slot passed for it is freed. With `key`, the sequence becomes that
        document's latest (kept longest under eviction)."""
        if slots.shape[0] != len(ids):
            raise ValueError(f"insert: {len(ids)} ids but {slots.shape[0]} slots")
        node, i, n = self.root, 0, len(ids)
        now = next(self._clock)
        existing = 0
        tail = self.match(ids).n_tokens
        if tail < n and not self.pool.is_held(slots[tail:]):
            raise RuntimeError("insert: slots for new tokens must be held (from alloc)")
        while i < n:
            child = node.children.get(ids[i])
            if child is None:
                new = RadixNode(list(ids[i:]), slots[i:].clone(), node)
                new.last_used = now
                self.pool.adopt(new.slots)
                node.children[ids[i]] = new
                node, i = new, n
                break
            k = common_prefix_len(child.ids, ids[i : i + len(child.ids)])
            if k < len(child.ids):
                child = self._split(child, k)
            dup = slots[i : i + k]
            extra = dup[dup != child.slots]
            if extra.numel():
                self.pool.free(extra)
            child.last_used = now
            node, i, existing = child, i + k, existing + k
        if key is not None:
            self.set_latest(key, node)
        if node.parent is not None and node.parent is not self.root:
            self._merge_into_child(node.parent)
        return InsertResult(node, existing)

    def set_latest(self, key: str, node: RadixNode) -> None:
        """Mark `node` (the end of a sequence) as document `key`'s latest sequence."""
        old = self._latest.get(key)
        if old is node:
            return
        if old is not None:
            old.latest_keys.discard(key)
        if node is self.root:
            self._latest.pop(key, None)
            return
        node.latest_keys.add(key)
        self._latest[key] = node
        if old is not None and old.parent is not None:
            self._merge_into_child(old)

    def _split(self, node: RadixNode, k: int) -> RadixNode:
        """Cut `node` after k tokens; returns the new head (the original object keeps the
        tail, so pins and latest-key marks on it stay valid)."""
        head = RadixNode(node.ids[:k], node.slots[:k], node.parent)
        head.ref = node.ref
        head.last_used = node.last_used
        node.parent.children[node.ids[0]] = head
        node.ids = node.ids[k:]
        node.slots = node.slots[k:]
        node.parent = head
        head.children[node.ids[0]] = node
        return head

    def _merge_into_child(self, node: RadixNode) -> None:
        """Path compression: fold `node` into its only child when nothing refers to it on
        its own (no pin ends at it, no document's latest sequence ends at it)."""
        if node is self.root or node.parent is None or len(node.children) != 1 or node.latest_keys:
            return
        (child,) = node.children.values()
        if child.ref != node.ref:
            return
        parent = node.parent
        child.ids = node.ids + child.ids
        child.slots = torch.cat((node.slots, child.slots))
        child.parent = parent
        child.last_used = max(child.last_used, node.last_used)
        parent.children[child.ids[0]] = child
        node.children = {}
        node.parent = None

    # ------------------------------------------------------------------ KV rows
    def commit(self, ids: Sequence[int], kv: KV, upto: int, key: str | None = None) -> CommitResult:
        """Store workspace rows for `ids[:upto]` that the tree lacks (rows 0..upto-1 of `kv`
        must be valid). Stores what fits: when the budget cannot hold the missing rows,
        nothing new is stored and `node` is None. Never raises for lack of room."""
        upto = min(upto, len(ids))
        m = self.match(ids[:upto])
        need = upto - m.n_tokens
        if need <= 0:
            res = self.insert(ids[:upto], m.slots, key)
            return CommitResult(res.node, 0, upto)
        pinned = self.pin_match(m)  # eviction in alloc must not take the rows we extend
        try:
            new = self.alloc(need)
        finally:
            self.unpin(pinned)
        if new is None:
            return CommitResult(None, 0, m.n_tokens)
        lo = m.n_tokens
        try:
            self.pool.store_rows(new, kv, lo, upto)
            # Re-match: alloc may have evicted or trimmed parts of an unpinned branch.
            m2 = self.match(ids[:lo])
            if m2.n_tokens < lo:  # cannot happen while pinned; keep the tree exact regardless
                self.pool.free(new)
                return CommitResult(None, 0, m2.n_tokens)
            res = self.insert(ids[:upto], torch.cat((m2.slots, new)), key)
        except BaseException:
            self.pool.free(self.pool.held_among(new))  # not yet owned by the tree: give them back
            raise
        return CommitResult(res.node, need, upto)

    # ------------------------------------------------------------------ eviction
    def evict(self, n: int) -> int:
        """Free at least `n` slots if unpinned leaves allow; returns slots freed.
        Evicting 0 is always safe. Leaves off every document's latest sequence go first,
        then the rest, each in LRU order; a leaf longer than needed is trimmed at its tail."""
        if n <= 0:
            return 0
        protected: set[int] = set()
        for node in self._latest.values():
            while node is not None and id(node) not in protected:
                protected.add(id(node))
                node = node.parent
        heap: list[tuple[bool, int, int, RadixNode]] = []
        tie = itertools.count()
        stack = [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node is not self.root and not node.children and node.ref == 0:
                heap.append((id(node) in protected, node.last_used, next(tie), node))
        heapq.heapify(heap)
        freed = 0
        while freed < n and heap:
            _, _, _, node = heapq.heappop(heap)
            take = min(len(node.ids), n - freed)
            self.evictions += 1
            self.evicted_tokens += take
            freed += take
            if take < len(node.ids):  # trim the tail; the head stays a valid prefix
                self.pool.release(node.slots[-take:])
                node.slots = node.slots[:-take]
                node.ids = node.ids[:-take]
                break
            self.pool.release(node.slots)
            parent = node.parent
            del parent.children[node.ids[0]]
            node.parent = None
            for key in node.latest_keys:  # the document's latest falls back to what is left
                if parent is self.root:
                    self._latest.pop(key, None)
                else:
                    parent.latest_keys.add(key)
                    self._latest[key] = parent
            node.latest_keys = set()
            if parent is not self.root and not parent.children and parent.ref == 0:
                heapq.heappush(heap, (id(parent) in protected, parent.last_used, next(tie), parent))
        return freed

    def clear(self) -> int:
        """Evict every unpinned sequence; returns slots freed."""
        return self.evict(self.n_slots)

    # ------------------------------------------------------------------ checks
    def nodes(self) -> list[RadixNode]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def check_integrity(self) -> None:
        """Raise AssertionError unless: free + tree + held == total; every tree slot is
        owned by exactly one node and marked so; no free slot is listed twice; refcounts
        are >= 0 and a parent's >= each child's; ids and slots agree in length; children
        are keyed by their first id; latest marks point at live nodes."""
        nodes = self.nodes()
        tree = torch.cat([n.slots for n in nodes]) if nodes else torch.empty(0, dtype=torch.int64)
        self.pool.check_integrity(tree)
        for node in nodes:
            assert node.ref >= 0, f"negative refcount on {node!r}"
            assert node.ref <= node.parent.ref, f"child pinned more than its parent: {node!r}"
            assert len(node.ids) == node.slots.shape[0] > 0, f"ids/slots mismatch or empty node {node!r}"
            assert node.parent.children.get(node.ids[0]) is node, "child not keyed by its first id"
        assert self.root.ref >= 0
        live = {id(n) for n in nodes}
        for key, node in self._latest.items():
            assert id(node) in live and key in node.latest_keys, f"latest mark of {key!r} points at a dead node"

    def nbytes(self) -> int:
        """Bytes of the rows the tree stores (its slots; not the free or held ones)."""
        return self.pool.n_tree * self.pool.bytes_per_slot

    def usage(self) -> tuple[int, int]:
        """The whole pool's (bytes used, bytes free) without walking the tree (safe to read
        from any thread)."""
        return self.pool.usage()

    def stats(self) -> CacheStats:
        used = self.n_slots - self.pool.n_free
        return CacheStats(
            bytes_total=self.n_slots * self.bytes_per_slot,
            bytes_used=used * self.bytes_per_slot,
            bytes_free=self.pool.n_free * self.bytes_per_slot,
            slots_total=self.n_slots,
            slots_used=used,
            nodes=len(self.nodes()),
            evictions=self.evictions,
            evicted_tokens=self.evicted_tokens,
        )


__all__ = [
    "RadixCache",
    "RadixNode",
    "MatchResult",
    "InsertResult",
    "CommitResult",
    "CacheStats",
    "common_prefix_len",
]
