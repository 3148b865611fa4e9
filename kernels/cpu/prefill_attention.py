"""Causal attention of a prefill step's many query rows in one C call (AVX512-BF16).

torch's CPU flash kernel (`scaled_dot_product_attention`) is slow where a jump's first window
lives: a few dozen to a few hundred rows over as many keys. Profiled on a 2-core AVX512-BF16
EPYC, 150 rows of the embedded model: ~700 µs a layer, 18 % of the forward, where the
arithmetic is ~26 MFLOP (docs/model.md "Prefill attention in C"). Here a unit of work is a KV
head and a block of 16 query rows, with the rows of every query head that shares that KV
head; scores are AVX512-BF16 dot products of one query pair against 16 keys (the keys laid
out in pairs once per call), the softmax and the weighted sum of values float32, one rounding
to bf16 per output. Units are shared over torch's OpenMP threads.

The sums run in another order than torch's kernel (float32 either way): outputs agree to
bf16 rounding, not bit for bit.

Kernels know no engine: `attend` takes tensors and returns a new one, or None where the call
is not one it takes.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import torch

from kernels.cpu.build import library

MAX_HEAD_DIM = 128
MAX_GROUP = 16  # query heads per KV head
MIN_ROWS = 17
"""Fewer rows are a decode or verify step's (`kernels.cpu.decode_attention` has those)."""

_ARGTYPES = [ctypes.c_int] * 5 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_long, ctypes.c_long]
_ARGTYPES += [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_long, ctypes.c_long]
_ARGTYPES += [ctypes.c_void_p, ctypes.c_int]


class PrefillAttention:
    """`attend(q, k, v, scale)`: q [H, T, D] (rows of D contiguous), k and v [H_kv, S, D] (the
    step's T keys last, rows of D contiguous, one head stride for both: the cache's narrowed
    views), bf16 on the CPU -> [H, T, D] bf16 (a view of a [T, H, D] tensor: the layer's output
    projection reads it as rows without a copy). Row t attends keys 0..S - T + t."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._call = lib.efim_prefill_attention
        self._call.argtypes, self._call.restype = _ARGTYPES, ctypes.c_int
        self._scratch_floats = lib.efim_prefill_attention_scratch
        self._scratch_floats.argtypes = [ctypes.c_int] * 5
        self._scratch_floats.restype = ctypes.c_long
        self._local = threading.local()

    @classmethod
    def load(cls, cache_dir: Path | None = None, *, native: bool = True) -> "PrefillAttention | None":
        """The library where this CPU has AVX512-BF16 and a compiler builds it; else None."""
        lib = library("prefill_attention", cache_dir, native=native, openmp=True)
        if lib is None:
            return None
        check = lib.efim_prefill_attention_bf16
        check.argtypes, check.restype = [], ctypes.c_int
        return cls(lib) if check() else None

    def _scratch(self, floats: int) -> torch.Tensor:
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.numel() < floats:
            buf = self._local.buf = torch.empty(max(floats, 1 << 16), dtype=torch.float32)
        return buf

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor | None:
        h, t, d = q.shape
        if k.dim() != 3 or v.dim() != 3:
            return None
        h_kv, s = k.shape[0], k.shape[1]
        if (
            not MIN_ROWS <= t <= s or h_kv < 1 or h % h_kv or h // h_kv > MAX_GROUP
            or d % 32 or d > MAX_HEAD_DIM or k.shape[2] != d or v.shape != k.shape
            or q.dtype != torch.bfloat16 or k.dtype != torch.bfloat16 or v.dtype != torch.bfloat16
            or q.is_cuda or k.is_cuda or v.is_cuda
            or q.stride(2) != 1 or k.stride(2) != 1 or k.stride(1) != d or v.stride() != k.stride()
        ):
            return None
        threads = torch.get_num_threads()
        scratch = self._scratch(self._scratch_floats(h, h_kv, d, s, threads))
        out = torch.empty(t, h, d, dtype=torch.bfloat16)
        rc = self._call(h, h_kv, d, s - t, t, float(scale), q.data_ptr(), q.stride(0), q.stride(1),
                        k.data_ptr(), v.data_ptr(), k.stride(0), out.data_ptr(), d, h * d, scratch.data_ptr(), threads)
        return out.transpose(0, 1) if rc == 0 else None


__all__ = ["PrefillAttention", "MIN_ROWS"]
