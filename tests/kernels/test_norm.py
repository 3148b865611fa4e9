"""Fused RMSNorm against the reference, under TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed; the Triton kernels cannot be verified")

from kernel_tolerance import DTYPES, assert_close  # noqa: E402

from kernels import reference  # noqa: E402
from kernels.triton import norm as triton_norm  # noqa: E402


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", (64, 96, 576))  # 96: not a power of two; 576: SmolLM2-135M
def test_rms_norm_matches_reference(hidden, dtype):
    gen = torch.Generator().manual_seed(hidden)
    x = (3 * torch.randn(2, 5, hidden, generator=gen)).to(dtype)  # [B, T, hidden]
    weight = torch.randn(hidden, generator=gen).to(dtype)
    assert_close(triton_norm.rms_norm(x, weight, 1e-5), reference.rms_norm(x, weight, 1e-5))


def test_rms_norm_strided_rows_and_bad_weight():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 6, generator=gen).t()  # [6, 64] view with column stride 6
    weight = torch.rand(64, generator=gen)
    assert_close(triton_norm.rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6))
    with pytest.raises(ValueError, match=r"weight: expected shape \(64,\)"):
        triton_norm.rms_norm(x, weight[:32], 1e-6)
