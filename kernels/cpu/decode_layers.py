"""A step of a few rows through every decoder layer in one C call.

With the weights, the attention and the row operations of a decode step in C (`int4_gemv`,
`decode_attention`, `row_ops`), what was left of a served decode step beside them was Python:
per layer eight ctypes calls, their output tensors, the views between them and the wrappers'
checks — with every C call made a no-op the embedded model's step still took 1.1 ms over 30
layers (0.3 ms for the embedding and the head), a quarter of a ~4 ms step (2-core Zen 4,
docs/model.md "The decode layers in one call"). Here those same C functions run one after
another inside one call (`decode_layers.c` compiles the three libraries into one), in the same
order and with the same roundings, so a step's numbers are the calls' own, bit for bit.

A `LayerPlan` holds, per layer, the addresses of its norm weights and of its four packed int4
weights (with their low-rank terms where the adapter's factors are inside them); the caller
keeps those tensors alive. It takes only what it can run: gated SiLU MLPs, RMSNorm, neox RoPE,
every linear packed for the int4 kernel (a bf16 bias added after it, as Qwen2's q/k/v have);
`DecodeLayers.plan` returns None otherwise.

Kernels know no engine: this takes tensors and packed weights, and says False where a call is
not one it takes (the caller runs its own path).
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path
from typing import NamedTuple

import torch

from kernels.cpu.build import library
from kernels.cpu.decode_attention import MAX_GROUP, MAX_HEAD_DIM, scratch_floats
from kernels.cpu.int4_gemv import MAX_ROWS, PackedInt4

_RUN_ARGTYPES = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p] + [ctypes.c_int] * 6
_RUN_ARGTYPES += [ctypes.c_float] * 2 + [ctypes.c_void_p] * 5 + [ctypes.c_int] * 3


class Segment(NamedTuple):
    """Rows of one sequence in a step: `rows` rows at positions pos.., its KV caches k and v
    [L, H_kv, capacity, D] bf16 (rows pos..pos+rows-1 of every layer are written)."""

    k: torch.Tensor
    v: torch.Tensor
    pos: int
    rows: int


class LayerWeights(NamedTuple):
    """One decoder layer as the plan takes it: the norms' bf16 weights [hidden] and the packed
    q/k/v (fused, q heads first), output, gate/up (fused, gate first) and down weights, each
    with its bf16 bias [out] or None."""

    norm1: torch.Tensor
    qkv: PackedInt4
    o: PackedInt4
    norm2: torch.Tensor
    up: PackedInt4
    down: PackedInt4
    biases: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None] = (None,) * 4


class DecodeLayers:
    """The loaded library; `plan` makes a model's `LayerPlan`."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._run = lib.efim_decode_layers
        self._run.argtypes, self._run.restype = _RUN_ARGTYPES, ctypes.c_int
        self._work = lib.efim_decode_layers_work
        self._work.argtypes, self._work.restype = [ctypes.c_int] * 6, ctypes.c_long
        self.fields = int(lib.efim_decode_layers_plan_fields())
        self.vector = bool(lib.efim_int4_gemv_vector())
        self.threaded = bool(lib.efim_decode_attention_openmp())
        self.vector_head = lib.efim_attention_vector_head
        self.vector_head.argtypes, self.vector_head.restype = [ctypes.c_int], ctypes.c_int

    @classmethod
    def load(cls, cache_dir: Path | None = None, *, native: bool = True) -> "DecodeLayers | None":
        lib = library("decode_layers", cache_dir, native=native, openmp=True)
        return None if lib is None else cls(lib)

    def plan(
        self, layers: list[LayerWeights], *, n_heads: int, n_kv_heads: int, head_dim: int, eps: float
    ) -> "LayerPlan | None":
        """The plan of these layers, or None where one of them is not what the C loop runs (the
        AVX-512 loops only: a CPU without them keeps the model's own calls, which know when
        their portable loops pay)."""
        if not layers or not self.vector or not self.vector_head(head_dim):
            return None
        hidden = layers[0].o.out_features
        qkv_n = (n_heads + 2 * n_kv_heads) * head_dim
        inter = layers[0].down.in_features
        if n_heads % n_kv_heads or n_heads // n_kv_heads > MAX_GROUP or head_dim > MAX_HEAD_DIM or head_dim % 2:
            return None
        shapes = {"qkv": (qkv_n, hidden), "o": (hidden, n_heads * head_dim), "up": (2 * inter, hidden),
                  "down": (hidden, inter)}
        rows = []
        for layer in layers:
            if any(n.dtype != torch.bfloat16 or n.shape != (hidden,) or not n.is_contiguous() for n in (layer.norm1, layer.norm2)):
                return None
            row = [layer.norm1.data_ptr(), layer.norm2.data_ptr()]
            for (name, (n, k)), bias in zip(shapes.items(), layer.biases):
                w: PackedInt4 = getattr(layer, name)
                if not isinstance(w, PackedInt4) or (w.out_features, w.in_features) != (n, k):
                    return None
                if bias is not None and (bias.dtype != torch.bfloat16 or bias.shape != (n,) or not bias.is_contiguous()):
                    return None
                row += [n, k, w.group, *w.low_rank_args(), 0 if bias is None else bias.data_ptr()]
            if len(row) != self.fields:
                return None
            rows.append(row)
        return LayerPlan(self, layers, torch.tensor(rows, dtype=torch.int64), hidden, n_heads, n_kv_heads, head_dim,
                         inter, eps)


class LayerPlan:
    """`run(h, cos, sin, segments, scale)`: the step's rows h [T, hidden] (T <= `max_rows`), with
    their RoPE rows cos / sin [T, D/2], through every layer, in place; the rows are `segments`
    in order (one sequence's consecutive rows each: a decode step of several sequences has one
    per sequence). True when it ran, False (h and the KV rows undefined: the caller starts the
    step again on its own path) where not."""

    max_rows = MAX_ROWS

    def __init__(self, lib: DecodeLayers, layers: list[LayerWeights], plan: torch.Tensor, hidden: int, n_heads: int,
                 n_kv_heads: int, head_dim: int, inter: int, eps: float) -> None:
        self._lib, self._layers, self._plan = lib, layers, plan  # the layers keep the addresses valid
        self._plan_ptr = plan.data_ptr()
        self.n_layers = plan.shape[0]
        self.hidden, self.n_heads, self.n_kv_heads, self.head_dim, self.inter = hidden, n_heads, n_kv_heads, head_dim, inter
        self.eps = eps
        self._work_values = int(lib._work(MAX_ROWS, hidden, n_heads, n_kv_heads, head_dim, inter))
        self._buffers = threading.local()  # per thread: (work bf16, attention scratch float32)

    def _buffers_for(self, floats: int) -> tuple[torch.Tensor, torch.Tensor]:
        work, scratch = getattr(self._buffers, "pair", (None, None))
        if work is None:
            work = torch.empty(self._work_values, dtype=torch.bfloat16)
        if scratch is None or scratch.numel() < floats:
            scratch = torch.empty(max(floats, 2 * (0 if scratch is None else scratch.numel()), 4096), dtype=torch.float32)
        self._buffers.pair = work, scratch
        return work, scratch

    def run(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: list[Segment], scale: float) -> bool:
        t = h.shape[0]
        d = self.head_dim
        if (
            not 1 <= t <= MAX_ROWS or h.shape != (t, self.hidden) or h.dtype != torch.bfloat16 or not h.is_contiguous()
            or h.is_cuda or cos.shape != (t, d // 2) or sin.shape != (t, d // 2) or cos.dtype != torch.bfloat16
            or sin.dtype != torch.bfloat16 or not cos.is_contiguous() or not sin.is_contiguous()
            or sum(seg.rows for seg in segments) != t
        ):
            return False
        fields, need = [], 0
        for k, v, pos, rows in segments:
            if (
                k.dtype != torch.bfloat16 or v.dtype != torch.bfloat16 or k.is_cuda or not k.is_contiguous()
                or not v.is_contiguous() or k.shape != v.shape or k.dim() != 4 or k.shape[0] != self.n_layers
                or k.shape[1] != self.n_kv_heads or k.shape[3] != d or rows < 1 or not 0 <= pos <= k.shape[2] - rows
            ):
                return False
            fields += [rows, pos, k.data_ptr(), v.data_ptr(), k.shape[2]]
            need = max(need, scratch_floats(self.n_heads, self.n_kv_heads, d, pos + rows, rows))
        work, scratch = self._buffers_for(need)
        segs = torch.tensor(fields, dtype=torch.int64)
        threads = torch.get_num_threads()
        rc = self._lib._run(
            self.n_layers, self._plan_ptr, len(segments), segs.data_ptr(), t, self.hidden, self.n_heads, self.n_kv_heads,
            d, self.inter, self.eps, scale, h.data_ptr(), cos.data_ptr(), sin.data_ptr(), work.data_ptr(),
            scratch.data_ptr(), threads, threads if self._lib.threaded else 1, 1,
        )
        return rc == 0


__all__ = ["DecodeLayers", "LayerPlan", "LayerWeights", "Segment"]
