"""Tolerances for comparing a Triton kernel with its torch reference.

float32: both sides compute in float32, differing only in summation order.
bfloat16/float16: the kernels accumulate in float32 and round once, the reference may
round intermediate results; one or two units in the last place of the output dtype.
"""

from __future__ import annotations

import torch

TOLERANCE = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=4e-3, rtol=4e-3),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
}

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    tol = TOLERANCE[dtype or expected.dtype]
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    torch.testing.assert_close(actual.float(), expected.float(), **tol)
