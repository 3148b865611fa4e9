"""Input checks run by every Triton wrapper before a launch.

A kernel that reads past a tensor or through a wrong stride does not fail: it returns
garbage or corrupts memory. So each wrapper states its contract here and refuses bad
input with a `KernelInputError` (a `ValueError`, so the CLI reports it as a clear
message) naming the argument and what was expected.

Index checks (slots inside the pool, lengths inside the table) read the index tensors
back to the host: one synchronisation per call on a GPU. That is the price of the
reference's behaviour (`index_select` raises on a bad slot); see docs/kernels.md.
`EFIM_KERNEL_CHECKS=shapes` keeps the shape/dtype/stride checks (no synchronisation)
and skips the index values, for a GPU run whose indices come from a tested engine.
"""

from __future__ import annotations

import os

import torch
import triton

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int64, torch.int32)


class KernelInputError(ValueError):
    """A Triton wrapper refused its arguments (shape, dtype, stride, device or index)."""


def require(condition: bool, message: str) -> None:
    if not condition:
        raise KernelInputError(message)


def interpreted(kernel: object) -> bool:
    """True when `kernel` was decorated under TRITON_INTERPRET=1 (runs on CPU tensors).

    Triton reads the variable when `@triton.jit` runs, i.e. when `kernels.triton` is
    first imported, so setting it later has no effect on already imported kernels."""
    return not isinstance(kernel, triton.runtime.JITFunction)


def tensor(
    name: str,
    t: object,
    *,
    ndim: int | None = None,
    dtypes: tuple[torch.dtype, ...] | None = None,
) -> torch.Tensor:
    require(isinstance(t, torch.Tensor), f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    assert isinstance(t, torch.Tensor)
    if ndim is not None:
        require(t.dim() == ndim, f"{name}: expected {ndim} dims, got shape {tuple(t.shape)}")
    if dtypes is not None:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        require(t.dtype in dtypes, f"{name}: dtype {str(t.dtype).removeprefix('torch.')} not supported (expected {names})")
    return t


def shape(name: str, t: torch.Tensor, expected: tuple[int, ...]) -> None:
    require(tuple(t.shape) == tuple(expected), f"{name}: expected shape {tuple(expected)}, got {tuple(t.shape)}")


def same_dtype(**named: torch.Tensor) -> None:
    dtypes = {name: t.dtype for name, t in named.items()}
    require(
        len(set(dtypes.values())) == 1,
        "dtypes differ: " + ", ".join(f"{n}={str(d).removeprefix('torch.')}" for n, d in dtypes.items()),
    )


def device(kernel: object, **named: torch.Tensor) -> torch.device:
    """All tensors on one device, and one the kernel can run on: CUDA, or CPU when the
    kernels run under the interpreter."""
    devices = {name: t.device for name, t in named.items()}
    distinct = set(devices.values())
    require(len(distinct) == 1, "tensors on different devices: " + ", ".join(f"{n}={d}" for n, d in devices.items()))
    dev = distinct.pop()
    if interpreted(kernel):
        require(dev.type == "cpu", f"Triton interpreter mode (TRITON_INTERPRET=1) runs on CPU tensors, got {dev}")
    else:
        require(
            dev.type == "cuda",
            f"Triton kernels need CUDA tensors, got {dev} (for CPU verification set TRITON_INTERPRET=1 "
            "before kernels.triton is imported, or use the reference ops)",
        )
    return dev


def writable(name: str, t: torch.Tensor) -> None:
    """An output written by a kernel must not alias itself (an expanded view with a zero
    stride would make two program instances race on one element)."""
    require(
        all(st > 0 or sz <= 1 for st, sz in zip(t.stride(), t.shape)),
        f"{name}: output has a zero or negative stride {t.stride()} (expanded view?); pass a real tensor",
    )


def values_checked() -> bool:
    """False when `EFIM_KERNEL_CHECKS=shapes`: index values are trusted (no device sync)."""
    mode = os.environ.get("EFIM_KERNEL_CHECKS", "all").strip().lower()
    if mode not in ("all", "shapes"):
        raise KernelInputError(f"EFIM_KERNEL_CHECKS must be 'all' or 'shapes', not {mode!r}")
    return mode == "all"


def index_range(name: str, idx: torch.Tensor, upper: int, *, allow_minus_one: bool = False) -> None:
    """Every entry in [0, upper) (or -1 if allowed). Synchronises with the device."""
    if idx.numel() == 0 or not values_checked():
        return
    lo, hi = int(idx.min()), int(idx.max())
    floor = -1 if allow_minus_one else 0
    bad = lo if lo < floor else hi if hi >= upper else None
    if bad is not None:
        allowed = f"[0, {upper})" + (" or -1" if allow_minus_one else "")
        raise KernelInputError(f"{name}: index {bad} out of range (allowed {allowed})")


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())
