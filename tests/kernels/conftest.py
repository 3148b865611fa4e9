"""Kernel tests run every Triton kernel on CPU tensors in Triton's interpreter.

Triton decides interpreter-or-compiler when `@triton.jit` runs, i.e. when
`kernels.triton` is first imported, so TRITON_INTERPRET=1 must be in the environment
before that import. Pytest imports this conftest while collecting, before any test
runs; if something in this process already imported `kernels.triton` compiled-mode,
its modules are dropped so the next import re-decorates the kernels as interpreted.
"""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"


def _reimport_interpreted() -> None:
    loaded = [name for name in sys.modules if name == "kernels.triton" or name.startswith("kernels.triton.")]
    if not loaded:
        return
    from kernels.triton import checks
    from kernels.triton.prefill import _prefill_kernel

    if checks.interpreted(_prefill_kernel):
        return
    for name in loaded:
        del sys.modules[name]
    import kernels

    kernels._triton_ops.cache_clear()


try:
    import triton  # noqa: F401
except Exception:  # not installed, or failing to initialise: the test modules skip themselves
    pass
else:
    _reimport_interpreted()


import pytest  # noqa: E402


@pytest.fixture
def kernel_cache(tmp_path, monkeypatch):
    """A fresh cache folder for the C kernels (kernels/cpu), with them on and none loaded yet."""
    from kernels.cpu import build

    monkeypatch.delenv("EFIM_C_KERNELS", raising=False)
    build.library.cache_clear()
    yield tmp_path / "kernels"
    build.library.cache_clear()
