"""The passes around an int8 GEMM of many rows, one C call each.

An int8 GEMM (`torch._int_mm`, VNNI on x86) multiplies a prefill's rows about twice as fast
as oneDNN's bf16 GEMM on a 2-core AVX512-BF16 CPU (114 x 576 x 3072: 0.50 ms against 1.0),
but only if the rows get to int8 and the int32 sums back to bf16 cheaply: in torch ops that
is 5-6 passes over the rows (abs, amax, divide, round, cast; cast, two multiplies, cast),
which ate the whole gain. Here each direction is one pass: `quantize` takes bf16 rows to int8
with one scale per row (each channel first multiplied by a factor, the smoothing that moves
activation outliers into the weights), `dequantize` takes the int32 sums back to bf16 with
the row's and the output channel's scales (docs/model.md "int8 prefill").

Kernels know no engine: these take tensors and return new ones, or None where they do not
apply.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kernels.cpu.build import library


class Int8Rows:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self._quantize = lib.efim_quantize_rows
        self._quantize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p,
                                   ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p]
        self._quantize.restype = ctypes.c_int
        self._dequantize = lib.efim_dequantize_rows
        self._dequantize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p,
                                     ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long]
        self._dequantize.restype = ctypes.c_int

    @classmethod
    def load(cls, cache_dir: Path | None = None, *, native: bool = True) -> "Int8Rows | None":
        lib = library("int8_rows", cache_dir, native=native, openmp=True)
        return None if lib is None else cls(lib)

    def quantize(self, x: torch.Tensor, mul: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """bf16 rows x [M, K] (times `mul` [K] float32, per channel) -> (int8 [M, K], float32
        scales [M, 1]) with x * mul ≈ q * scales, round to nearest even, |q| <= 127. None where
        not taken."""
        if x.dtype != torch.bfloat16 or x.is_cuda or x.dim() != 2 or x.stride(1) != 1 or x.shape[1] == 0:
            return None
        m, k = x.shape
        if mul is not None and (mul.dtype != torch.float32 or mul.shape != (k,) or not mul.is_contiguous()):
            return None
        q = torch.empty(m, k, dtype=torch.int8)
        scales = torch.empty(m, 1, dtype=torch.float32)
        self._quantize(m, k, x.data_ptr(), x.stride(0), None if mul is None else mul.data_ptr(), q.data_ptr(), k,
                       scales.data_ptr())
        return q, scales

    def dequantize(self, acc: torch.Tensor, row_scales: torch.Tensor, col_scales: torch.Tensor) -> torch.Tensor | None:
        """int32 sums [M, N] -> bf16 acc * row_scales [M, 1] * col_scales [N]; None where not taken."""
        if acc.dtype != torch.int32 or acc.is_cuda or acc.dim() != 2 or acc.stride(1) != 1 or acc.shape[1] == 0:
            return None
        m, n = acc.shape
        if (
            row_scales.dtype != torch.float32 or row_scales.numel() != m or not row_scales.is_contiguous()
            or col_scales.dtype != torch.float32 or col_scales.shape != (n,) or not col_scales.is_contiguous()
        ):
            return None
        out = torch.empty(m, n, dtype=torch.bfloat16)
        self._dequantize(m, n, acc.data_ptr(), acc.stride(0), row_scales.data_ptr(), col_scales.data_ptr(),
                         out.data_ptr(), n)
        return out


__all__ = ["Int8Rows"]
