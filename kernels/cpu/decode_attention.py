"""Attention of a decode step (one query row per head) or a step of a few rows (a speculation
verify, a keystroke's tokens) over a bf16 KV cache in one C call.

torch's CPU flash kernel is built for many query rows: for the one row of a decode step it
opens a parallel region per call and runs its blocked loop over 3 KV heads on 2 threads. On
the embedded model (9 query heads on 3 KV heads of 64 dims) it took 105 µs per layer at 1,024
keys and 19 µs at 64, 2.3-3.3x what this loop took on one thread (AVX-512 where the CPU has
it, portable C otherwise): each key and value row is read once for the G query heads that share
it, scores and softmax in float32, e^x by a polynomial. A decode step of the served model at
~1K tokens of context went 15.0 -> 12.8 ms (docs/model.md "Decode attention in C").
Each KV head's keys are cut into chunks of 256 at fixed places, shared out over torch's own
OpenMP threads (flash-decoding's split, combined by max rescaling), where the build has OpenMP
(kernels/cpu/build.py); `threaded` says which. `attend_rows` takes a step of a few query
rows (a speculation verify, a keystroke's 2-3 tokens), each causal over its own keys: at 1,400
keys torch's flash kernel took ~210 µs a layer for 2 rows.

Kernels know no engine: this takes the query rows and the cache's key and value views.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from pathlib import Path

import torch

from kernels.cpu.build import library

MAX_HEAD_DIM = 256  # EFIM_MAX_HEAD_DIM in decode_attention.c
MAX_GROUP = 64  # EFIM_MAX_GROUP
MAX_CHUNKS = 128  # EFIM_MAX_CHUNKS
PAIRS = 8  # EFIM_PAIRS
MAX_ROWS = 16  # EFIM_MAX_ROWS: query rows `attend_rows` takes


def scratch_floats(h: int, h_kv: int, d: int, n: int, t: int = 1) -> int:
    """Floats of scratch a call of t query rows over n keys needs: the scores of each KV head's
    blocks of (head, row) pairs, and each (KV head, block, chunk) unit's unnormalised share
    (PAIRS x D sums, PAIRS maxima, PAIRS sums): the C side's `efim_attention_rows_scratch`."""
    blocks = -(-(h // h_kv) * t // PAIRS)
    return h_kv * blocks * PAIRS * n + h_kv * blocks * MAX_CHUNKS * (PAIRS * d + 2 * PAIRS)


_STEP_ARGTYPES = [ctypes.c_int] * 5 + [ctypes.c_float] + [ctypes.c_void_p] * 5
_STEP_ARGTYPES += [ctypes.c_long, ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_int]
_ROWS_ARGTYPES = [ctypes.c_int] * 5 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_long, ctypes.c_long]
_ROWS_ARGTYPES += [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_long, ctypes.c_long]
_ROWS_ARGTYPES += [ctypes.c_void_p, ctypes.c_int]


class DecodeAttention:
    """`attend_rows(q, k, v, scale)`: q [H, T, D] (T of 1-16 rows), k and v [H_kv, S, D] (rows of
    D contiguous, one head stride for both: the cache's narrowed views), all bf16 on the CPU ->
    [H, T, D] bf16; `attend` the same for one row; `rope_attend` the whole attention half of a
    step from the fused projection's rows. Each returns None where the call is not one it
    takes (the caller runs its own attention); `faster` says where the model should call them."""

    def __init__(self, step, rows, threaded: bool, vector_head) -> None:
        self._step = step
        self._rows = rows
        self._vector_head = vector_head  # D -> whether the build has AVX-512 loops for it
        self.threaded = threaded  # the build shares long contexts over torch's OpenMP threads
        self._scratch = threading.local()  # float32 scratch (`scratch_floats`), grown as needed (one per thread)

    @classmethod
    def load(cls, cache_dir: Path | None = None, *, native: bool = True, openmp: bool = True) -> "DecodeAttention | None":
        lib = library("decode_attention", cache_dir, native=native, openmp=openmp)
        if lib is None:
            return None
        step = lib.efim_rope_attention_rows
        step.argtypes, step.restype = _STEP_ARGTYPES, ctypes.c_int
        rows = lib.efim_attention_rows
        rows.argtypes, rows.restype = _ROWS_ARGTYPES, ctypes.c_int
        lib.efim_decode_attention_openmp.restype = ctypes.c_int
        vector = lib.efim_attention_vector_head
        vector.argtypes, vector.restype = [ctypes.c_int], ctypes.c_int
        return cls(step, rows, bool(lib.efim_decode_attention_openmp()), functools.lru_cache(maxsize=8)(lambda d: bool(vector(d))))

    def faster(self, rows: int, head_dim: int) -> bool:
        """Whether a step of `rows` query rows with heads of `head_dim` is faster here than in
        torch's kernel (measured, docs/model.md "Long contexts"; the calls themselves take any
        size they can compute, which the tests use): with the AVX-512 loops (64-dim
        heads) every step of up to MAX_ROWS rows; a one-row step with the portable loops on a
        CPU without AVX-512 (as before the rows existed); never the portable loops on an
        AVX-512 CPU (128-dim heads at 1,400 keys: 210 µs against torch's 151) nor the portable
        loops for several rows."""
        if not 1 <= rows <= MAX_ROWS:
            return False
        if self._vector_head(head_dim):
            return True
        return rows == 1 and not self._vector_head(64)

    def _threads(self) -> int:
        return torch.get_num_threads() if self.threaded else 1

    def _scores(self, n: int) -> torch.Tensor:
        buf = getattr(self._scratch, "buf", None)
        if buf is None or buf.numel() < n:
            buf = self._scratch.buf = torch.empty(max(n, 4096), dtype=torch.float32)
        return buf

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor | None:
        """`attend_rows` for a decode step's one query row (None for more)."""
        return self.attend_rows(q, k, v, scale) if q.shape[1] == 1 else None

    def attend_rows(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor | None:
        """A step of a few query rows: q [H, T, D] (rows of D contiguous, any head and row
        stride), k and v [H_kv, S, D] as for `attend`, the step's own T keys last; row t
        attends keys 0..S - T + t (causal) -> [H, T, D] bf16; None where the call is not one
        it takes (more than MAX_ROWS rows among them)."""
        h, t, d = q.shape
        h_kv, s = k.shape[0], k.shape[1]
        if (
            not 1 <= t <= min(MAX_ROWS, s) or q.is_cuda or k.is_cuda
            or q.dtype != torch.bfloat16 or k.dtype != torch.bfloat16 or v.dtype != torch.bfloat16
            or d > MAX_HEAD_DIM or h % h_kv or h // h_kv > MAX_GROUP
            or v.shape != k.shape or k.shape[2] != d
            or q.stride(2) != 1 or k.stride(2) != 1 or k.stride(1) != d
            or v.stride() != k.stride()
        ):
            return None
        out = torch.empty(h, t, d, dtype=torch.bfloat16)
        scratch = self._scores(scratch_floats(h, h_kv, d, s, t))
        rc = self._rows(h, h_kv, d, s, t, scale, q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), v.data_ptr(),
                        k.stride(0), out.data_ptr(), t * d, d, scratch.data_ptr(), self._threads())
        return out if rc == 0 else None

    def rope_attend(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        pos: int,
        scale: float,
        n_heads: int,
    ) -> torch.Tensor | None:
        """The attention half of a step of T rows (a decode step's one token, a verify's few)
        in one call: `qkv` [T, (H + 2 H_kv) D] (the fused projection's rows: q heads, k heads, v
        heads), `cos`/`sin` [T, D/2] (the rows' RoPE rows, neox pairing), `k_cache`/`v_cache`
        [H_kv, capacity, D] (one layer): q and k rotated, k and v written to cache rows
        pos..pos+T-1, then row t attends over rows 0..pos+t -> [H, T, D] bf16. Each row gets the
        arithmetic of a one-row call. None (nothing written) where the call is not one it takes."""
        h_kv, capacity, d = k_cache.shape
        t = qkv.shape[0]
        if (
            qkv.dtype != torch.bfloat16 or k_cache.dtype != torch.bfloat16 or v_cache.dtype != torch.bfloat16
            or cos.dtype != torch.bfloat16 or sin.dtype != torch.bfloat16 or qkv.is_cuda or k_cache.is_cuda
            or not 1 <= t <= MAX_ROWS
            or qkv.shape != (t, (n_heads + 2 * h_kv) * d) or not qkv.is_contiguous()
            or cos.shape != (t, d // 2) or sin.shape != (t, d // 2) or not cos.is_contiguous() or not sin.is_contiguous()
            or not k_cache.is_contiguous() or not v_cache.is_contiguous() or v_cache.shape != k_cache.shape
            or not 0 <= pos <= capacity - t or d % 2 or d > MAX_HEAD_DIM or n_heads % h_kv or n_heads // h_kv > MAX_GROUP
        ):
            return None
        out = torch.empty(n_heads, t, d, dtype=torch.bfloat16)
        scratch = self._scores(scratch_floats(n_heads, h_kv, d, pos + t, t))
        rc = self._step(n_heads, h_kv, d, pos, t, scale, qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                        k_cache.data_ptr(), v_cache.data_ptr(), capacity * d, out.data_ptr(), t * d, d,
                        scratch.data_ptr(), self._threads())
        return out if rc == 0 else None


__all__ = ["DecodeAttention", "MAX_HEAD_DIM", "MAX_GROUP", "MAX_CHUNKS", "MAX_ROWS", "PAIRS", "scratch_floats"]
