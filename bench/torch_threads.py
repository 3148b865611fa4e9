"""Running a benchmark on a given number of torch threads, and leaving the setting as found."""

from __future__ import annotations

import contextlib
from typing import Iterator


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Within the block torch uses `n` threads (None or 0: leave it alone); afterwards the
    process-wide setting is what it was."""
    import torch  # noqa: PLC0415 - the CLI imports bench modules without loading torch

    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
