"""KV pool with a hard byte budget and a radix tree over token ids (prefix reuse).

Layout: `k, v: [L, N_slots, H_kv, D]` — one slot per token (kernels/reference.py).
This deliberately departs from nano-vllm / vLLM's 16-token blocks: EFIM adds 1–3
tokens per keystroke, and with pages the partly filled last page would have to be
copied or re-prefilled on every keystroke. Token slots make "append 2 tokens" cost
exactly 2 rows.

The radix tree is shared by all documents. A node holds a run of token ids and the
slots of their K/V rows; its children are keyed by their first id. A node is split
when a new sequence diverges inside it and merged back into its only child when
nothing refers to it on its own, so a document typed for an hour is still a short
path. The model computes in a contiguous per-sequence workspace (`SequenceKV`):
`gather` copies a matched prefix from the pool into it (one `index_select` over all
layers), `commit` copies newly computed rows from it into fresh slots.

Ownership: each slot is free, owned by exactly one tree node, or held by a caller
between `alloc` and `insert`/`free`. `check_integrity()` verifies this at any time.

Eviction removes (or trims the tail of) unreferenced leaves in LRU order, taking the
leaves that are not on any document's latest sequence first. A request pins its path
(`pin`) so eviction never takes rows it is about to extend.

All methods are called from one thread (the engine thread); nothing here locks.
"""

from __future__ import annotations

import heapq
import itertools
import re
from typing import Any, NamedTuple, Sequence

import torch

_FREE, _TREE, _HELD = 0, 1, 2
_GIB = 1 << 30


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


def parse_bytes(text: str | int) -> int:
    """'512M', '2G', '1.5GiB', '300000000' -> bytes (binary units)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]?)(i?[bB])?\s*", str(text))
    if not m:
        raise ValueError(f"cannot read {text!r} as a size; use e.g. '512M', '2G' or a number of bytes")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2).lower()]
    return int(float(m.group(1)) * scale)


def default_budget_bytes() -> int:
    """min(25 % of MemAvailable, 4 GiB); 1 GiB when /proc/meminfo is unreadable."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return min(int(line.split()[1]) * 1024 // 4, 4 * _GIB)
    except OSError:
        pass
    return _GIB


class RadixCache:
    """Token-granular KV pool + radix prefix tree under a hard byte budget."""

    def __init__(
        self,
        *,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        budget_bytes: int,
        min_evict: int = 64,
        kv_dtype: str | None = None,
    ) -> None:
        """`dtype`: the model's compute dtype. `kv_dtype` "int8": the pool stores int8 rows
        with one scale (in `dtype`) per token and kv head, as `Int8SequenceKV` does, so a
        slot takes (D + scale bytes) / (D x itemsize) of the dense bytes — about half at
        bf16, twice the tokens per budget; gather and commit copy rows and scales as they
        are. Anything else: rows in `dtype`."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        self.int8 = kv_dtype == "int8"
        self.dtype = dtype
        self.n_layers, self.n_kv_heads, self.head_dim = n_layers, n_kv_heads, head_dim
        row = head_dim + itemsize if self.int8 else head_dim * itemsize  # bytes per token, layer, head, K or V
        self.bytes_per_slot = 2 * n_layers * n_kv_heads * row
        n_slots = int(budget_bytes) // self.bytes_per_slot
        if n_slots < 1:
            raise ValueError(
                f"KV budget {budget_bytes} bytes holds no token (one token needs {self.bytes_per_slot} bytes)"
            )
        self.n_slots = n_slots
        # torch.empty reserves address space; pages are touched only as slots fill.
        if self.int8:
            self.k8 = torch.empty(n_layers, n_slots, n_kv_heads, head_dim, dtype=torch.int8)  # [L, N, H_kv, D]
            self.k_scale = torch.empty(n_layers, n_slots, n_kv_heads, dtype=dtype)  # [L, N, H_kv]
            self.v8 = torch.empty(n_layers, n_slots, n_kv_heads, head_dim, dtype=torch.int8)  # [L, N, H_kv, D]
            self.v_scale = torch.empty(n_layers, n_slots, n_kv_heads, dtype=dtype)  # [L, N, H_kv]
        else:
            self.k = torch.empty(n_layers, n_slots, n_kv_heads, head_dim, dtype=dtype)  # [L, N, H_kv, D]
            self.v = torch.empty(n_layers, n_slots, n_kv_heads, head_dim, dtype=dtype)  # [L, N, H_kv, D]
        self._free = torch.arange(n_slots, dtype=torch.int64)  # stack; [:_n_free] are free
        self._n_free = n_slots
        self._owner = torch.zeros(n_slots, dtype=torch.int8)  # _FREE / _TREE / _HELD
        self._n_held = 0
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

    # ------------------------------------------------------------------ slots
    @property
    def n_free(self) -> int:
        return self._n_free

    def alloc(self, n: int) -> torch.Tensor | None:
        """`n` free slots, held by the caller until `insert` (or `free`). Evicts
        unpinned leaves if needed; None when even eviction cannot make room (nothing
        is evicted in vain in that case only if the pinned part is too large)."""
        if n <= 0:
            return torch.empty(0, dtype=torch.int64)
        if n > self._n_free:
            self.evict(max(n - self._n_free, self._min_evict))
            if n > self._n_free:
                return None
        out = self._free[self._n_free - n : self._n_free].clone()  # [n]
        self._n_free -= n
        self._owner[out] = _HELD
        self._n_held += n
        return out

    def free(self, slots: torch.Tensor) -> None:
        """Return held slots (from `alloc`, not inserted) to the free list."""
        if slots.numel() == 0:
            return
        if not bool((self._owner[slots] == _HELD).all()):
            raise RuntimeError("free() of slots that are not held by the caller")
        self._release(slots)
        self._n_held -= slots.numel()

    def _release(self, slots: torch.Tensor) -> None:
        n = slots.numel()
        self._free[self._n_free : self._n_free + n] = slots
        self._n_free += n
        self._owner[slots] = _FREE

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
        if tail < n and not bool((self._owner[slots[tail:]] == _HELD).all()):
            raise RuntimeError("insert: slots for new tokens must be held (from alloc)")
        while i < n:
            child = node.children.get(ids[i])
            if child is None:
                new = RadixNode(list(ids[i:]), slots[i:].clone(), node)
                new.last_used = now
                self._owner[new.slots] = _TREE
                self._n_held -= n - i
                node.children[ids[i]] = new
                node, i = new, n
                break
            k = common_prefix_len(child.ids, ids[i : i + len(child.ids)])
            if k < len(child.ids):
                child = self._split(child, k)
            dup = slots[i : i + k]
            extra = dup[dup != child.slots]
            if extra.numel():
                self.free(extra)
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
    def gather(self, slots: torch.Tensor, kv: Any, start: int = 0) -> None:
        """Copy pool rows `slots` into workspace `kv` (a SequenceKV: k, v [L, H_kv, cap, D],
        or with an int8 pool an Int8SequenceKV: rows and scales as they are) at rows
        start..start+n-1. One index_select over all layers per tensor."""
        n = slots.shape[0]
        if n == 0:
            return
        self._check_format(kv)
        rows = slice(start, start + n)
        if self.int8:
            kv.k8[:, :, rows].copy_(self.k8.index_select(1, slots).transpose(1, 2))  # [L, H_kv, n, D]
            kv.k_scale[:, :, rows].copy_(self.k_scale.index_select(1, slots).transpose(1, 2))  # [L, H_kv, n]
            kv.vt8[:, :, :, rows].copy_(self.v8.index_select(1, slots).permute(0, 2, 3, 1))  # [L, H_kv, D, n]
            kv.v_scale[:, :, rows].copy_(self.v_scale.index_select(1, slots).transpose(1, 2))
            return
        kv.k[:, :, rows].copy_(self.k.index_select(1, slots).transpose(1, 2))  # [L, H_kv, n, D]
        kv.v[:, :, rows].copy_(self.v.index_select(1, slots).transpose(1, 2))  # [L, H_kv, n, D]

    def _check_format(self, kv: Any) -> None:
        if bool(getattr(kv, "quantized", False)) != self.int8:
            raise TypeError(f"a {type(kv).__name__} does not fit a pool of {'int8' if self.int8 else self.dtype} rows")

    def _store(self, slots: torch.Tensor, kv: Any, lo: int, hi: int) -> None:
        """Workspace rows lo..hi-1 of `kv` -> pool `slots`: as they are when the formats
        match; dense rows (the disk tier's) are quantised into an int8 pool."""
        if self.int8 and not getattr(kv, "quantized", False):
            k, v = kv.read(lo, hi)  # [L, H_kv, n, D]
            self.write_slots(slots, k.transpose(1, 2), v.transpose(1, 2))
            return
        self._check_format(kv)
        if self.int8:
            self.k8.index_copy_(1, slots, kv.k8[:, :, lo:hi].transpose(1, 2))  # [L, n, H_kv, D]
            self.k_scale.index_copy_(1, slots, kv.k_scale[:, :, lo:hi].transpose(1, 2))  # [L, n, H_kv]
            self.v8.index_copy_(1, slots, kv.vt8[:, :, :, lo:hi].permute(0, 3, 1, 2))  # [L, n, H_kv, D]
            self.v_scale.index_copy_(1, slots, kv.v_scale[:, :, lo:hi].transpose(1, 2))
            return
        self.k.index_copy_(1, slots, kv.k[:, :, lo:hi].transpose(1, 2))  # [L, n, H_kv, D]
        self.v.index_copy_(1, slots, kv.v[:, :, lo:hi].transpose(1, 2))  # [L, n, H_kv, D]

    def read_slots(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # ([L, n, H_kv, D], [L, n, H_kv, D])
        """Rows `slots` in the compute dtype (dequantised from an int8 pool): new tensors."""
        if self.int8:
            k = self.k8.index_select(1, slots).to(self.dtype).mul_(self.k_scale.index_select(1, slots).unsqueeze(-1))
            v = self.v8.index_select(1, slots).to(self.dtype).mul_(self.v_scale.index_select(1, slots).unsqueeze(-1))
            return k, v
        return self.k.index_select(1, slots), self.v.index_select(1, slots)

    def write_slots(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [L, n, H_kv, D] (any float dtype) in `slots` (quantised in an int8 pool)."""
        if self.int8:
            from engine.model.transformer import quantize_rows  # noqa: PLC0415 - the model's own rounding

            k8, ks = quantize_rows(k, self.dtype)
            v8, vs = quantize_rows(v, self.dtype)
            self.k8.index_copy_(1, slots, k8)
            self.k_scale.index_copy_(1, slots, ks)
            self.v8.index_copy_(1, slots, v8)
            self.v_scale.index_copy_(1, slots, vs)
            return
        self.k.index_copy_(1, slots, k.to(self.dtype))
        self.v.index_copy_(1, slots, v.to(self.dtype))

    def commit(self, ids: Sequence[int], kv: Any, upto: int, key: str | None = None) -> CommitResult:
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
            self._store(new, kv, lo, upto)
            # Re-match: alloc may have evicted or trimmed parts of an unpinned branch.
            m2 = self.match(ids[:lo])
            if m2.n_tokens < lo:  # cannot happen while pinned; keep the tree exact regardless
                self.free(new)
                return CommitResult(None, 0, m2.n_tokens)
            res = self.insert(ids[:upto], torch.cat((m2.slots, new)), key)
        except BaseException:
            held = new[self._owner[new] == _HELD]  # not yet owned by the tree: give them back
            self.free(held)
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
                self._release(node.slots[-take:])
                node.slots = node.slots[:-take]
                node.ids = node.ids[:-take]
                break
            self._release(node.slots)
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
        free = self._free[: self._n_free]
        assert self._n_free + tree.numel() + self._n_held == self.n_slots, (
            f"free {self._n_free} + tree {tree.numel()} + held {self._n_held} != total {self.n_slots}"
        )
        assert tree.unique().numel() == tree.numel(), "a slot is owned by two nodes"
        assert free.unique().numel() == free.numel(), "a slot is on the free list twice"
        assert bool((self._owner[tree] == _TREE).all()), "a tree slot is not marked as owned by the tree"
        assert bool((self._owner[free] == _FREE).all()), "a free slot is marked as used"
        assert int((self._owner == _HELD).sum()) == self._n_held, "held-slot count drifted"
        for node in nodes:
            assert node.ref >= 0, f"negative refcount on {node!r}"
            assert node.ref <= node.parent.ref, f"child pinned more than its parent: {node!r}"
            assert len(node.ids) == node.slots.shape[0] > 0, f"ids/slots mismatch or empty node {node!r}"
            assert node.parent.children.get(node.ids[0]) is node, "child not keyed by its first id"
        assert self.root.ref >= 0
        live = {id(n) for n in nodes}
        for key, node in self._latest.items():
            assert id(node) in live and key in node.latest_keys, f"latest mark of {key!r} points at a dead node"

    def usage(self) -> tuple[int, int]:
        """(bytes used, bytes free) without walking the tree (safe to read from any thread)."""
        free = self._n_free
        return (self.n_slots - free) * self.bytes_per_slot, free * self.bytes_per_slot

    def stats(self) -> CacheStats:
        used = self.n_slots - self._n_free
        return CacheStats(
            bytes_total=self.n_slots * self.bytes_per_slot,
            bytes_used=used * self.bytes_per_slot,
            bytes_free=self._n_free * self.bytes_per_slot,
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
    "parse_bytes",
    "default_budget_bytes",
]
