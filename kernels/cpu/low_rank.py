"""A low-rank term added to a few rows of bf16 output in one C call: y += (x Aᵀ) Bᵀ.

A LoRA adapter kept beside a model's packed int4 weights (they cannot absorb it: its changes
are smaller than one 4-bit step) costs two matmuls per linear layer and step. In torch those
are a float copy of x, two float32 `mm` and an `add_` — ~30 µs of dispatch and ~1 MB of
float32 weights per layer of the embedded model, 4 of its ~14 ms decode step (docs/model.md
"The adapter's low-rank term in C"). Here one ctypes call does it: x read as bf16, sums in
float32 (as the torch path), the weights stored in bf16 when that holds them exactly (the
shipped adapter is bf16) and float32 otherwise, and a block-diagonal B (the q, k and v terms of
one fused projection) kept as its blocks, not as the zero-padded matrix.

Kernels know no engine: this takes tensors and returns whether it ran.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kernels.cpu.build import library

MAX_RANK = 256  # EFIM_MAX_RANK in low_rank.c
MAX_OUT = 16384  # EFIM_MAX_OUT
MAX_ROWS = 16
"""Rows up to which the C loop runs (decode and speculation-verify steps); more rows are a
GEMM's work and stay on torch."""

_ARGTYPES = [ctypes.c_int] * 4 + [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
_ARGTYPES += [ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_void_p]


def _functions(cache_dir: Path | None) -> dict[torch.dtype, object] | None:
    lib = library("low_rank", cache_dir)
    if lib is None:
        return None
    out = {}
    for dtype, symbol in ((torch.float32, "efim_low_rank_add_f32"), (torch.bfloat16, "efim_low_rank_add_bf16")):
        fn = getattr(lib, symbol)
        fn.argtypes, fn.restype = _ARGTYPES, ctypes.c_int
        out[dtype] = fn
    return out


def segments(b: torch.Tensor) -> list[tuple[int, int, int, int]]:
    """B [N, R]'s nonzero blocks as (r0, r1, n0, n1): consecutive ranks whose nonzero outputs
    span the same columns n0..n1-1 (a rank with no nonzero output is left out). Exact for any
    B: every nonzero lies in its rank's segment."""
    nz = b.t() != 0  # [R, N]
    spans = []
    for r in range(nz.shape[0]):
        cols = nz[r].nonzero()
        spans.append(None if cols.numel() == 0 else (int(cols[0]), int(cols[-1]) + 1))
    out: list[tuple[int, int, int, int]] = []
    for r, span in enumerate(spans):
        if span is None:
            continue
        if out and out[-1][1] == r and out[-1][2:] == span:
            out[-1] = (out[-1][0], r + 1, *span)
        else:
            out.append((r, r + 1, *span))
    return out


class LowRankAdd:
    """The packed term for one weight [N, K]: `a` [R, K], `b` [N, R] (scale folded into b).
    Call with x [M, K] and y [M, N], both bf16 with unit column stride: adds (x aᵀ) bᵀ into y
    and returns True, or returns False and leaves y alone when the call is not one it runs
    (another dtype, more than `MAX_ROWS` rows, strided columns)."""

    __slots__ = ("a", "b", "seg", "n_seg", "k", "r", "n", "_fn", "_a_ptr", "_b_ptr")
    max_rows = MAX_ROWS

    def __init__(self, a: torch.Tensor, b: torch.Tensor, fn, seg: list[tuple[int, int, int, int]], dtype: torch.dtype) -> None:
        self.r, self.k = a.shape
        self.n = b.shape[0]
        self.a = a.t().to(dtype).contiguous()  # [K, R]
        bt = b.t()  # [R, N]
        blocks = [bt[r0:r1, n0:n1].reshape(-1) for r0, r1, n0, n1 in seg]
        self.b = (torch.cat(blocks) if blocks else bt.new_zeros(1)).to(dtype).contiguous()
        self.seg = (ctypes.c_int * (4 * len(seg)))(*(v for s in seg for v in s))
        self.n_seg = len(seg)
        self._fn = fn
        self._a_ptr, self._b_ptr = self.a.data_ptr(), self.b.data_ptr()

    @classmethod
    def pack(cls, a: torch.Tensor, b: torch.Tensor, cache_dir: Path | None = None) -> "LowRankAdd | None":
        """The packed term, or None where the C kernel is unavailable or the shape is past its
        buffers (the caller keeps its torch path)."""
        r, k = a.shape
        n = b.shape[0]
        if b.shape[1] != r or r > MAX_RANK or n > MAX_OUT or a.device.type != "cpu":
            return None
        fns = _functions(cache_dir)
        if fns is None:
            return None
        exact_bf16 = all(torch.equal(t.float(), t.to(torch.bfloat16).float()) for t in (a, b))
        dtype = torch.bfloat16 if exact_bf16 else torch.float32
        return cls(a, b, fns[dtype], segments(b), dtype)

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> bool:
        m = x.shape[0]
        if (
            m > MAX_ROWS or x.is_cuda or x.dtype != torch.bfloat16 or y.dtype != torch.bfloat16 or x.stride(1) != 1
            or y.stride(1) != 1 or x.shape[1] != self.k or y.shape != (m, self.n)
        ):
            return False
        self.add_rows(x, y)
        return True

    def add_rows(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """`__call__` without its checks, for a caller that vouches for them: x [M, K] and
        y [M, N] bf16 on the CPU, M <= `MAX_ROWS`, unit column stride (a decode step's own
        rows and the fresh output of its matmul). ~2 us of attribute reads fewer a call, 120
        calls a step of the served model."""
        self._fn(x.shape[0], self.k, self.r, self.n, x.data_ptr(), x.stride(0), self._a_ptr, self._b_ptr, y.data_ptr(),
                 y.stride(0), self.n_seg, self.seg)

    def nbytes(self) -> int:
        return self.a.numel() * self.a.element_size() + self.b.numel() * self.b.element_size()


__all__ = ["LowRankAdd", "segments", "MAX_ROWS", "MAX_RANK", "MAX_OUT"]
