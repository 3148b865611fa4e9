"""Compute kernels behind one dispatcher.

Every op has a pure-torch reference (`kernels.reference`, the fast path on a CPU) and,
for the GPU path, a Triton kernel of the same signature (`kernels.triton`). The engine
calls `kernels.<op>(...)`; it never imports Triton.

Choice, per call: Triton for CUDA tensors when Triton is importable, the reference
otherwise. `EFIM_KERNELS=reference|triton` forces one (triton on CPU tensors needs
`TRITON_INTERPRET=1`, which is how the kernels are verified without a GPU).
"""

from __future__ import annotations

import functools
import importlib
import os
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import torch

# torch is imported on first use of an op (module __getattr__ below), not here: the CLI's
# argument parser imports `bench.kernel_bench`, and `efim --help` must not pay for torch.

OPS = (
    "attention",
    "paged_attention_prefill",
    "paged_attention_decode",
    "rope_apply",
    "rope_shift",
    "kv_store",
    "kv_gather",
    "kv_deviation",
    "select_top_rows",
    "rms_norm",
)


@functools.lru_cache(maxsize=1)
def _triton_ops() -> dict[str, Callable] | None:
    try:
        from kernels import triton as triton_ops  # noqa: PLC0415 - optional dependency
    except Exception:  # ImportError, or Triton failing to initialise without a driver
        return None
    return {name: getattr(triton_ops, name) for name in OPS if hasattr(triton_ops, name)}


def backend_for(name: str, tensor: torch.Tensor) -> str:
    """Which implementation `name` runs for `tensor`: "triton" or "reference"."""
    forced = os.environ.get("EFIM_KERNELS", "").strip().lower()
    if forced not in ("", "reference", "triton"):
        raise ValueError(f"EFIM_KERNELS={forced!r}: expected 'reference' or 'triton'")
    if forced == "reference" or (forced == "" and not tensor.is_cuda):
        return "reference"  # without importing Triton: 0.25 s of every CPU model load
    ops = _triton_ops()
    has = ops is not None and name in ops
    if forced == "triton":
        if not has:
            raise RuntimeError(f"EFIM_KERNELS=triton but no Triton kernel for {name!r} (is triton installed?)")
        return "triton"
    return "triton" if has and tensor.is_cuda else "reference"


def resolve(name: str, tensor: torch.Tensor) -> Callable:
    """The implementation of op `name` that `kernels.<name>` would run for `tensor`, for
    callers that make thousands of calls on tensors of one device (the model resolves
    its ops once instead of paying the dispatch on every call)."""
    if backend_for(name, tensor) == "triton":
        return _triton_ops()[name]
    return getattr(_reference(), name)


def _dispatch(name: str) -> Callable:
    ref = getattr(_reference(), name)

    @functools.wraps(ref)
    def op(*args, **kwargs):
        first = args[0] if args else next(iter(kwargs.values()))
        if backend_for(name, first) == "triton":
            return _triton_ops()[name](*args, **kwargs)
        return ref(*args, **kwargs)

    return op


def _reference():
    # import_module, not `from kernels import reference`: the latter probes hasattr(kernels,
    # "reference"), which would re-enter __getattr__ below.
    return importlib.import_module("kernels.reference")


def __getattr__(name: str):
    """Build `kernels.<op>` (and load torch) on first access."""
    if name in OPS:
        value = _dispatch(name)
    elif name in ("reference", "rope_cos_sin"):
        value = _reference() if name == "reference" else _reference().rope_cos_sin
    else:
        raise AttributeError(f"module 'kernels' has no attribute {name!r}")
    globals()[name] = value
    return value


__all__ = [*OPS, "rope_cos_sin", "backend_for", "resolve"]
