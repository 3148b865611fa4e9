"""A step's row operations in one C call each: RMSNorm (after adding a residual in place, where
there is one) and the gated MLP's SiLU(gate) * up.

For the one row of a decode step, torch's RMSNorm is 3-5 calls (the small-row LayerNorm trick
in `engine.model.transformer._Norm`: cat, neg, layer_norm, a slice; one more for the residual
add) and SiLU * up is 4 (two slices, silu, mul_): ~9 calls of 2-6 µs each per layer, 30
layers, where the arithmetic is a few hundred nanoseconds. The roundings follow torch's (the
residual sum and SiLU's result rounded to bf16 before the next use), so the numbers stay
those of the torch path up to float32 summation order (docs/model.md "Decode in C").

A prefill step's rows (tens to hundreds) take the same calls, shared over torch's OpenMP
threads from `PARALLEL_ROWS` rows: torch's RMSNorm there is ~9 passes over the rows (float
copies, pow, mean, rsqrt, two multiplies, the cast back) and SiLU * up 2, each its own
parallel region (docs/model.md "Prefill attention in C", the row operations).

Kernels know no engine: these take rows and return new ones, or None where they do not apply.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kernels.cpu.build import library

PARALLEL_ROWS = 32
"""Rows from which a call is shared over torch's threads; fewer (a decode step's) run on the
calling thread."""


def _rows_ok(*xs: torch.Tensor) -> bool:
    return all(x.dtype == torch.bfloat16 and not x.is_cuda and x.dim() == 2 and x.stride(1) == 1 for x in xs)


def _threads(rows: int) -> int:
    return torch.get_num_threads() if rows >= PARALLEL_ROWS else 1


class RowOps:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self._norm = lib.efim_add_rms_norm
        self._norm.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p,
                               ctypes.c_long, ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p, ctypes.c_long, ctypes.c_int]
        self._norm.restype = ctypes.c_int
        self._silu = lib.efim_silu_mul
        self._silu.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_long,
                               ctypes.c_int]
        self._silu.restype = ctypes.c_int

    @classmethod
    def load(cls, cache_dir: Path | None = None, *, native: bool = True) -> "RowOps | None":
        lib = library("row_ops", cache_dir, native=native, openmp=True)
        return None if lib is None else cls(lib)

    def rms_norm(
        self, x: torch.Tensor, w: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """x / rms(x) * w for rows x [M, K] -> a new [M, K]; with `residual` [M, K], first
        x += residual in place (x is then the residual stream after the add). None (x
        untouched) where the call is not one this takes."""
        m, k = x.shape if x.dim() == 2 else (0, 0)
        if (
            not _rows_ok(x) or w.dtype != torch.bfloat16 or w.shape != (k,) or not w.is_contiguous()
            or (residual is not None and (not _rows_ok(residual) or residual.shape != x.shape))
        ):
            return None
        out = torch.empty(m, k, dtype=torch.bfloat16)
        r_ptr, r_ld = (None, 0) if residual is None else (residual.data_ptr(), residual.stride(0))
        self._norm(m, k, x.data_ptr(), x.stride(0), r_ptr, r_ld, w.data_ptr(), eps, out.data_ptr(), k, _threads(m))
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up of fused rows [M, 2I] (gate first) -> [M, I]; None where not taken."""
        if not _rows_ok(gate_up) or gate_up.shape[1] % 2:
            return None
        m, i = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(m, i, dtype=torch.bfloat16)
        self._silu(m, i, gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), i, _threads(m))
        return out


__all__ = ["RowOps", "PARALLEL_ROWS"]
