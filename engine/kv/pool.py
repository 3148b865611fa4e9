"""The paged KV pool: the tensors every cached row lives in, and who owns each slot.

Layout: `k, v: [L, N_slots, H_kv, D]` — one slot per token (kernels/reference.py).
This deliberately departs from nano-vllm / vLLM's 16-token blocks: EFIM adds 1–3
tokens per keystroke, and with pages the partly filled last page would have to be
copied or re-prefilled on every keystroke. Token slots make "append 2 tokens" cost
exactly 2 rows. With `kv_dtype="int8"` the rows are int8 with one scale per token and kv
head, as the model's `Int8SequenceKV` keeps them.

Ownership: each slot is free, held by a caller (between `alloc` and `adopt` or `free`;
the blend store keeps its rows held for as long as it stores them), or owned by the
radix tree (`adopt`; the tree gives slots back with `release` when it evicts them).
`check_integrity(tree_slots)` verifies the marks against the slots the tree says it owns.
The pool evicts nothing: making room is the tree's job (`RadixCache.alloc`).

All methods are called from one thread (the engine thread), except `usage`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.model.sequence_kv import KV

_FREE, _TREE, _HELD = 0, 1, 2


# Gathers of at least this many rows copy per (layer, head) (`SlotPool.gather`).
_GATHER_PER_HEAD_ROWS = 256


class SlotPool:
    """Token slots of K/V rows under a hard byte budget, with their ownership marks."""

    def __init__(
        self,
        *,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        budget_bytes: int,
        kv_dtype: str | None = None,
    ) -> None:
        """`dtype`: the model's compute dtype. `kv_dtype` "int8": int8 rows with one scale
        (in `dtype`) per token and kv head, so a slot takes (D + scale bytes) / (D x itemsize)
        of the dense bytes — about half at bf16, twice the tokens per budget; gather and
        `store_rows` copy rows and scales as they are. Anything else: rows in `dtype`."""
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

    # ------------------------------------------------------------------ ownership
    @property
    def n_free(self) -> int:
        return self._n_free

    @property
    def n_held(self) -> int:
        """Slots between `alloc` and `adopt`/`free` (the blend store's rows among them)."""
        return self._n_held

    @property
    def n_tree(self) -> int:
        """Slots owned by the radix tree."""
        return self.n_slots - self._n_free - self._n_held

    def alloc(self, n: int) -> torch.Tensor | None:
        """`n` free slots ([n] int64), held by the caller until `adopt` or `free`; None when
        fewer than `n` are free (the pool evicts nothing)."""
        if n <= 0:
            return torch.empty(0, dtype=torch.int64)
        if n > self._n_free:
            return None
        out = self._free[self._n_free - n : self._n_free].clone()  # [n]
        self._n_free -= n
        self._owner[out] = _HELD
        self._n_held += n
        return out

    def free(self, slots: torch.Tensor) -> None:
        """Return held slots (from `alloc`, not adopted) to the free list."""
        if slots.numel() == 0:
            return
        if not self.is_held(slots):
            raise RuntimeError("free() of slots that are not held by the caller")
        self._push_free(slots)
        self._n_held -= slots.numel()

    def adopt(self, slots: torch.Tensor) -> None:
        """Held slots become the radix tree's (it stores their rows from now on)."""
        if slots.numel() == 0:
            return
        if not self.is_held(slots):
            raise RuntimeError("adopt() of slots that are not held by the caller")
        self._owner[slots] = _TREE
        self._n_held -= slots.numel()

    def release(self, slots: torch.Tensor) -> None:
        """The radix tree gives up slots it owned (evicted): they are free again."""
        if slots.numel() == 0:
            return
        if not bool((self._owner[slots] == _TREE).all()):
            raise RuntimeError("release() of slots that the tree does not own")
        self._push_free(slots)

    def is_held(self, slots: torch.Tensor) -> bool:
        """Every slot of `slots` is held by a caller (allocated, not adopted, not freed)."""
        return bool((self._owner[slots] == _HELD).all())

    def held_among(self, slots: torch.Tensor) -> torch.Tensor:
        """The slots of `slots` that are still held ([k] int64, in order)."""
        return slots[self._owner[slots] == _HELD]

    def _push_free(self, slots: torch.Tensor) -> None:
        n = slots.numel()
        self._free[self._n_free : self._n_free + n] = slots
        self._n_free += n
        self._owner[slots] = _FREE

    def grow(self, budget_bytes: int) -> int:
        """Take `budget_bytes` (more than now: else nothing happens) — new tensors of the
        larger slot count, every slot in use (held or the tree's) copied at its own number,
        so every slot number given out stays valid; the new slots are free. Returns the slots
        added. Engine thread only, between steps: the old tensors are dropped here."""
        n_new = int(budget_bytes) // self.bytes_per_slot
        n_old = self.n_slots
        if n_new <= n_old:
            return 0
        used = (self._owner != _FREE).nonzero().flatten()  # [u] int64: rows worth copying
        names = ("k8", "k_scale", "v8", "v_scale") if self.int8 else ("k", "v")
        for name in names:
            old = getattr(self, name)
            new = torch.empty((old.shape[0], n_new, *old.shape[2:]), dtype=old.dtype)  # untouched pages
            if 2 * used.numel() >= n_old:  # mostly in use: one straight copy is several times faster
                new[:, :n_old].copy_(old)
            elif used.numel():  # mostly free: copy the rows in use, leave the rest untouched
                new.index_copy_(1, used, old.index_select(1, used))
            setattr(self, name, new)
        free = torch.empty(n_new, dtype=torch.int64)
        added = n_new - n_old
        free[:added] = torch.arange(n_new - 1, n_old - 1, -1, dtype=torch.int64)  # below the old free ones: used last
        free[added : added + self._n_free] = self._free[: self._n_free]
        self._free = free
        self._owner = torch.cat([self._owner, torch.zeros(added, dtype=torch.int8)])
        self._n_free += added
        self.n_slots = n_new
        return added

    def shrink(self, budget_bytes: int) -> torch.Tensor | None:
        """Take `budget_bytes` (less than now) when the slots in use fit in it: the rows of
        slots in use at or above the new count move to free slots below it, new smaller
        tensors (only the rows in use touched) replace the old, whose memory goes back. Returns
        the map [old n_slots] int64 from each old slot number to its new one — whoever keeps
        slot numbers (the tree's nodes, the blend store) renumbers with it. None: the budget
        is not smaller, or more slots are in use than it holds (evict first). Engine thread
        only, between steps."""
        n_new = int(budget_bytes) // self.bytes_per_slot
        n_old = self.n_slots
        if n_new >= n_old or n_new < 1:
            return None
        used = self._owner != _FREE
        if int(used.sum()) > n_new:
            return None
        stay = used[:n_new].nonzero().flatten()  # [s] rows that keep their number
        high = used[n_new:].nonzero().flatten() + n_new  # [h] rows that move
        dest = (~used[:n_new]).nonzero().flatten()[: high.numel()]  # [h] free slots they move to
        remap = torch.arange(n_old, dtype=torch.int64)
        remap[high] = dest
        src, dst = torch.cat((stay, high)), torch.cat((stay, dest))
        names = ("k8", "k_scale", "v8", "v_scale") if self.int8 else ("k", "v")
        for name in names:
            old = getattr(self, name)
            new = torch.empty((old.shape[0], n_new, *old.shape[2:]), dtype=old.dtype)  # untouched pages
            if src.numel():
                new.index_copy_(1, dst, old.index_select(1, src))
            setattr(self, name, new)
        owner = torch.zeros(n_new, dtype=torch.int8)
        owner[dst] = self._owner[src]
        self._owner = owner
        free = (owner == _FREE).nonzero().flatten()
        self._free = torch.empty(n_new, dtype=torch.int64)  # the stack's room: every slot
        self._free[: free.numel()] = free
        self._n_free = free.numel()
        self.n_slots = n_new
        return remap

    # ------------------------------------------------------------------ rows
    def gather(self, slots: torch.Tensor, kv: KV, start: int = 0) -> None:
        """Copy pool rows `slots` into workspace `kv` (a SequenceKV: k, v [L, H_kv, cap, D],
        or with an int8 pool an Int8SequenceKV: rows and scales as they are) at rows
        start..start+n-1."""
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
        if n < _GATHER_PER_HEAD_ROWS:
            kv.k[:, :, rows].copy_(self.k.index_select(1, slots).transpose(1, 2))  # [L, H_kv, n, D]
            kv.v[:, :, rows].copy_(self.v.index_select(1, slots).transpose(1, 2))
            return
        # Straight into the workspace, one (layer, head) at a time: an index_select over all
        # layers made an [L, n, H_kv, D] temporary and then a transposing copy — 2-3x slower
        # for a window (1,216 rows of the embedded model: ~11-17 ms for k and v, against ~6),
        # while for a few rows the 2 x L x H_kv calls cost more than the copy (4 rows: 0.6 ms
        # against 0.01; 128 rows: 0.7 against 0.13; 512 rows: 2.2 against 3.3).
        for src, dst in ((self.k, kv.k), (self.v, kv.v)):
            for layer in range(src.shape[0]):
                for head in range(src.shape[2]):
                    torch.index_select(src[layer, :, head], 0, slots, out=dst[layer, head, rows])  # [n, D]

    def _check_format(self, kv: KV) -> None:
        if bool(getattr(kv, "quantized", False)) != self.int8:
            raise TypeError(f"a {type(kv).__name__} does not fit a pool of {'int8' if self.int8 else self.dtype} rows")

    def store_rows(self, slots: torch.Tensor, kv: KV, lo: int, hi: int) -> None:
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
            from engine.model.sequence_kv import quantize_rows  # noqa: PLC0415 - the model's own rounding

            k8, ks = quantize_rows(k, self.dtype)
            v8, vs = quantize_rows(v, self.dtype)
            self.k8.index_copy_(1, slots, k8)
            self.k_scale.index_copy_(1, slots, ks)
            self.v8.index_copy_(1, slots, v8)
            self.v_scale.index_copy_(1, slots, vs)
            return
        self.k.index_copy_(1, slots, k.to(self.dtype))
        self.v.index_copy_(1, slots, v.to(self.dtype))

    # ------------------------------------------------------------------ checks
    def usage(self) -> tuple[int, int]:
        """(bytes used, bytes free) without walking anything (safe to read from any thread)."""
        free = self._n_free
        return (self.n_slots - free) * self.bytes_per_slot, free * self.bytes_per_slot

    def check_integrity(self, tree_slots: torch.Tensor) -> None:
        """Raise AssertionError unless free + tree + held == total, given the slots the tree
        owns (`tree_slots`, [n] int64): each of them is owned by it once and marked so; no
        free slot is listed twice or marked used; the held count matches the marks."""
        free = self._free[: self._n_free]
        assert self._n_free + tree_slots.numel() + self._n_held == self.n_slots, (
            f"free {self._n_free} + tree {tree_slots.numel()} + held {self._n_held} != total {self.n_slots}"
        )
        assert tree_slots.unique().numel() == tree_slots.numel(), "a slot is owned by two nodes"
        assert free.unique().numel() == free.numel(), "a slot is on the free list twice"
        assert bool((self._owner[tree_slots] == _TREE).all()), "a tree slot is not marked as owned by the tree"
        assert bool((self._owner[free] == _FREE).all()), "a free slot is marked as used"
        assert int((self._owner == _HELD).sum()) == self._n_held, "held-slot count drifted"


__all__ = ["SlotPool"]
