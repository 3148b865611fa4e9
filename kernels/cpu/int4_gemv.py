"""A decode step's few rows times a 4-bit weight, in one C call: y = x Wᵀ.

torch's int4 kernel (`_weight_int4pack_mm_for_cpu`) turns each 4-bit weight into a float and
multiplies in float32: ~15-30 G weights/s on 2 cores, where a decode step's weights stream
from memory at ~45 GB/s (90 G weights/s). Here the weights are repacked so that a 16-bit
widening of 32 bytes gives the (output row, input pair) lanes of AVX512-BF16's dot product
(`vdpbf16ps`: 32 multiply-adds an instruction), and a nibble becomes the bf16 number 128 + q
by one OR; the group's scale, and its zero folded with the 128, are applied once per group
(kernels/cpu/int4_gemv.c). The products are exact (bf16 x a 4-bit code), the sums float32, the
output rounded to bf16 once: what torch's kernel computes, up to the order of float additions.
On a CPU without AVX512-BF16 a portable loop runs instead, and a model does not pack for it
(`Int4Gemv.vector`: the engine keeps torch's kernel there).

Kernels know no engine: this takes tensors and returns new ones, or None where it does not
apply.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kernels.cpu.build import library

MAX_ROWS = 8  # EFIM_GEMV_MAX_ROWS
ROW_BLOCK = 16
"""Output rows are packed in blocks of this many; N must be a multiple."""
MAX_GROUPS = 1024  # EFIM_GEMV_MAX_GROUPS
MAX_RANK = 256  # EFIM_GEMV_MAX_RANK

_CHECKED: dict[ctypes.CDLL, str | None] = {}


class Int4Gemv:
    """The loaded library: `pack` (once per weight) gives a `PackedInt4`, whose calls run the
    product (with or without a low-rank term) and the dequantised copy."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._pack = lib.efim_int4_pack
        self._pack.argtypes = [ctypes.c_int] * 3 + [ctypes.c_void_p] * 5
        self._pack.restype = ctypes.c_int
        self._gemv = lib.efim_int4_gemv
        self._gemv.argtypes = [ctypes.c_int] * 4 + [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p,
                                                    ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_int]
        self._gemv.restype = ctypes.c_int
        self._gemv_lr = lib.efim_int4_gemv_low_rank
        self._gemv_lr.argtypes = self._gemv.argtypes + [ctypes.c_int] + [ctypes.c_void_p] * 3
        self._gemv_lr.restype = ctypes.c_int
        self._dequantize_t = lib.efim_int4_dequantize_t
        self._dequantize_t.argtypes = [ctypes.c_int] * 3 + [ctypes.c_void_p] * 3 + [ctypes.c_long, ctypes.c_int]
        self._dequantize_t.restype = ctypes.c_int
        self.vector = bool(lib.efim_int4_gemv_vector())
        self._lib = lib

    @classmethod
    def load(cls, cache_dir: Path | None = None, *, native: bool = True) -> "Int4Gemv | None":
        lib = library("int4_gemv", cache_dir, native=native, openmp=True)
        return None if lib is None else cls(lib)

    def problem(self) -> str | None:
        """None when this build computes a small product right here (both loops, 1 and 8 rows,
        against float32), else what went wrong. Checked once per loaded library."""
        if self._lib not in _CHECKED:
            _CHECKED[self._lib] = self._check()
        return _CHECKED[self._lib]

    def _check(self) -> str | None:
        gen = torch.Generator().manual_seed(0)
        n, k, group = 32, 64, 32
        codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
        scale = (torch.rand(n, k // group, generator=gen) * 0.01 + 0.001).to(torch.bfloat16)
        zero = (torch.randn(n, k // group, generator=gen) * 0.01).to(torch.bfloat16)
        w = ((codes.float() - 8).view(n, -1, group) * scale.float().unsqueeze(2) + zero.float().unsqueeze(2)).view(n, k)
        packed = self.pack(codes, scale, zero)
        if packed is None:
            return "it refused a shape it takes"
        for m in (1, MAX_ROWS):
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
            exact = x.float() @ w.t()
            for vector in (0, 1) if self.vector else (0,):
                err = (packed.rows(x, vector).float() - exact).abs().max().item()
                if not err <= 1e-2 * max(1.0, exact.abs().max().item()):
                    return f"wrong results ({m} rows, {'vector' if vector else 'portable'} loop, max error {err:.3g})"
        return None

    @staticmethod
    def takes(n: int, k: int, group: int) -> bool:
        """Whether a weight [N, K] in groups of `group` inputs can be packed."""
        return n > 0 and k > 0 and n % ROW_BLOCK == 0 and group % 8 == 0 and k % group == 0 and k // group <= MAX_GROUPS

    def pack(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> "PackedInt4 | None":
        """Codes [N, K] (0..15, w = (q - 8) * scale + zero) and scale / zero [N, K/G] bf16 -> the
        packed weight, or None for a shape or dtype it does not take."""
        n, k = codes.shape
        groups = scale.shape[1] if scale.dim() == 2 else 0
        if (
            groups == 0 or k % groups or not self.takes(n, k, k // groups) or scale.shape != (n, groups)
            or zero.shape != (n, groups) or scale.dtype != torch.bfloat16 or zero.dtype != torch.bfloat16
        ):
            return None
        codes = codes.to(torch.uint8).contiguous()
        scale, zero = scale.contiguous(), zero.contiguous()
        packed = torch.empty(n * k // 2, dtype=torch.uint8)
        sz = torch.empty(n * groups * 2, dtype=torch.bfloat16)
        if self._pack(n, k, k // groups, codes.data_ptr(), scale.data_ptr(), zero.data_ptr(), packed.data_ptr(),
                      sz.data_ptr()) != 0:
            return None
        return PackedInt4(self, packed, sz, n, k, k // groups)


class PackedInt4:
    """One weight in the kernel's layout. Call with bf16 rows x [M, K] (M <= `MAX_ROWS`, unit
    column stride) for y [M, N] bf16; None where the call is not one it takes."""

    __slots__ = (
        "packed", "sz", "out_features", "in_features", "group", "_fn", "_fn_lr", "_dq", "_packed_ptr", "_sz_ptr", "vector",
        "low_rank", "_lr_args",
    )
    max_rows = MAX_ROWS

    def __init__(self, kernel: Int4Gemv, packed: torch.Tensor, sz: torch.Tensor, n: int, k: int, group: int) -> None:
        self.packed, self.sz = packed, sz  # [N K / 2] uint8, [N K / G * 2] bf16
        self.out_features, self.in_features, self.group = n, k, group
        self._fn, self._fn_lr, self._dq = kernel._gemv, kernel._gemv_lr, kernel._dequantize_t
        self.low_rank: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (a [K, R], blk, bv)
        self._lr_args: tuple | None = None
        self._packed_ptr, self._sz_ptr = packed.data_ptr(), sz.data_ptr()
        self.vector = 1 if kernel.vector else 0

    def __call__(self, x: torch.Tensor, *, vector: bool | None = None) -> torch.Tensor | None:
        m = x.shape[0] if x.dim() == 2 else 0
        if (
            m == 0 or m > MAX_ROWS or x.is_cuda or x.dtype != torch.bfloat16 or x.shape[1] != self.in_features
            or x.stride(1) != 1
        ):
            return None
        return self.rows(x, self.vector if vector is None else int(vector))

    def rows(self, x: torch.Tensor, vector: int | None = None) -> torch.Tensor:
        """`__call__` without its checks, for a caller that vouches for them (a decode step's
        own bf16 rows on the CPU, 1..`MAX_ROWS` of them, unit column stride)."""
        m, n = x.shape[0], self.out_features
        y = torch.empty(m, n, dtype=torch.bfloat16)
        args = (m, n, self.in_features, self.group, x.data_ptr(), x.stride(0), self._packed_ptr, self._sz_ptr,
                y.data_ptr(), n, torch.get_num_threads(), self.vector if vector is None else vector)
        if self._lr_args is None:
            self._fn(*args)
        else:
            self._fn_lr(*args, *self._lr_args)
        return y

    def with_low_rank(self, a: torch.Tensor, b: torch.Tensor) -> "PackedInt4 | None":
        """This weight with an adapter's term y += (x aᵀ) bᵀ added inside the product, before
        the output's one rounding: `a` [R, K], `b` [N, R] (scale folded in), both values bf16
        holds exactly (the shipped adapter's). None where it does not take them (the caller
        keeps its separate term). Shares the packed weight."""
        r, k = a.shape
        n = self.out_features
        if k != self.in_features or b.shape != (n, r) or not 0 < r <= MAX_RANK:
            return None
        if not all(torch.equal(t.float(), t.to(torch.bfloat16).float()) for t in (a, b)):
            return None
        nz = (b != 0).view(n // ROW_BLOCK, ROW_BLOCK, r).any(1)  # [blocks, R]: ranks a block takes part in
        blk, values, offset = [], [], 0
        for block in range(n // ROW_BLOCK):
            ranks = nz[block].nonzero().flatten()
            r0, count = (int(ranks[0]), int(ranks[-1]) - int(ranks[0]) + 1) if ranks.numel() else (0, 0)
            blk += [r0, count, offset]
            values.append(b[block * ROW_BLOCK : (block + 1) * ROW_BLOCK, r0 : r0 + count].t().reshape(-1))  # [count * 16]
            offset += count * ROW_BLOCK
        out = PackedInt4.__new__(PackedInt4)
        for name in self.__slots__:
            setattr(out, name, getattr(self, name))
        a_t = a.t().to(torch.bfloat16).contiguous()  # [K, R]
        blk_t = torch.tensor(blk, dtype=torch.int32)
        bv = (torch.cat(values) if offset else b.new_zeros(1)).to(torch.bfloat16).contiguous()
        out.low_rank = (a_t, blk_t, bv)
        out._lr_args = (r, a_t.data_ptr(), blk_t.data_ptr(), bv.data_ptr())
        return out

    def low_rank_args(self) -> tuple[int, int, int, int, int, int]:
        """What the C side's calls take for this weight beyond its shape: the packed weight's and
        scales' addresses and the low-rank term's rank, A, block and value addresses (rank 0
        and null addresses without one); valid while this object lives."""
        r, a, blk, bv = (0, 0, 0, 0) if self._lr_args is None else self._lr_args
        return r, self._packed_ptr, self._sz_ptr, a, blk, bv

    def dequantize_t(self) -> torch.Tensor:  # [K, N] bf16
        """Wᵀ in bf16 with torch's roundings of `Int4Linear`'s dequantise ((q - 8) * scale + zero,
        the offset rounded first), for a prefill's GEMM: one pass over the packed bytes."""
        n, k = self.out_features, self.in_features
        out = torch.empty(k, n, dtype=torch.bfloat16)
        self._dq(n, k, self.group, self._packed_ptr, self._sz_ptr, out.data_ptr(), n, torch.get_num_threads())
        return out

    def codes(self) -> torch.Tensor:  # [N, K] uint8, 0..15
        """The 4-bit codes back out of the layout (for a dequantised copy; not a step's path)."""
        n, k = self.out_features, self.in_features
        v = self.packed.view(n // ROW_BLOCK, k // 4, ROW_BLOCK, 2)  # [block, chunk, row i, e]
        q = torch.cat((v & 15, v >> 4), 3)  # [block, chunk, row, 4]: inputs 4c + 0, 1 (low), 2, 3 (high)
        return q.permute(0, 2, 1, 3).reshape(n, k)

    def scale_zero(self) -> tuple[torch.Tensor, torch.Tensor]:  # ([N, K/G], [N, K/G]) bf16
        """Each (row, group)'s scale and zero back out of the layout."""
        n, groups = self.out_features, self.in_features // self.group
        v = self.sz.view(n // ROW_BLOCK, groups, 2, ROW_BLOCK).permute(2, 0, 3, 1).reshape(2, n, groups)
        return v[0], v[1]

    def nbytes(self) -> int:
        """The packed weight's bytes (a low-rank term's are `low_rank_nbytes`)."""
        return self.packed.numel() + 2 * self.sz.numel()

    def low_rank_nbytes(self) -> int:
        return 0 if self.low_rank is None else sum(t.numel() * t.element_size() for t in self.low_rank)


__all__ = ["Int4Gemv", "PackedInt4", "MAX_ROWS", "MAX_RANK", "ROW_BLOCK"]
