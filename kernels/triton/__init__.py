"""Triton kernels with the same names and signatures as `kernels.reference`.

The engine never imports this package: `kernels.<op>` dispatches here for CUDA tensors
(or for every tensor when `EFIM_KERNELS=triton`). Importing it raises ImportError when
Triton is missing, which the dispatcher treats as "no Triton path".

Verification without a GPU: with `TRITON_INTERPRET=1` set *before this package is first
imported* (Triton decides at `@triton.jit` time), every kernel runs on CPU tensors in
Triton's interpreter; tests/kernels compares each one with its reference that way.

| op | module |
| --- | --- |
| attention, paged_attention_prefill | prefill.py (per-row positions, GQA, online softmax) |
| paged_attention_decode | decode.py (split-K + reduction pass) |
| rope_apply, rope_shift | rope.py (neox and gptj pair layouts) |
| kv_store, kv_gather, kv_deviation, select_top_rows | kv.py |
| rms_norm | norm.py |
"""

from __future__ import annotations

import triton  # noqa: F401 - fail the import here, not at the first launch

from kernels.triton.checks import KernelInputError
from kernels.triton.decode import paged_attention_decode
from kernels.triton.kv import kv_deviation, kv_gather, kv_store, select_top_rows
from kernels.triton.norm import rms_norm
from kernels.triton.prefill import attention, paged_attention_prefill
from kernels.triton.rope import rope_apply, rope_shift

__all__ = [
    "KernelInputError",
    "attention",
    "kv_deviation",
    "kv_gather",
    "kv_store",
    "paged_attention_decode",
    "paged_attention_prefill",
    "rms_norm",
    "rope_apply",
    "rope_shift",
    "select_top_rows",
]
