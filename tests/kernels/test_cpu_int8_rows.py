"""The passes around an int8 GEMM (kernels/cpu/int8_rows.py) against torch's ops, on the
AVX-512 build and the portable one."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu import build
from kernels.cpu.int8_rows import Int8Rows

pytestmark = pytest.mark.skipif(build.compiler() is None, reason="no C compiler on this machine")


def torch_quantize(x: torch.Tensor, mul: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.float() * (1 if mul is None else mul)
    amax = xf.abs().amax(1, keepdim=True)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    return torch.round(xf * (1 / scale)).clamp(-127, 127).to(torch.int8), scale


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize(("rows", "k"), [(1, 576), (9, 100), (37, 1536), (3, 7)])
@pytest.mark.parametrize("smoothed", [True, False])
def test_rows_to_int8_with_one_scale_each(kernel_cache, native, rows, k, smoothed):
    ops = Int8Rows.load(kernel_cache, native=native)
    g = torch.Generator().manual_seed(rows * k)
    wide = (torch.randn(rows, k + 5, generator=g) * 3).bfloat16()
    x = wide[:, :k]  # rows at a stride
    x[0, k // 2] = 40.0  # an outlier channel sets the first row's scale
    if rows > 1:
        x[-1] = 0  # a row of zeros: scale 1, codes 0
    mul = torch.rand(k, generator=g) + 0.25 if smoothed else None
    q, scales = ops.quantize(x, mul)
    want_q, want_scales = torch_quantize(x, mul)
    assert q.dtype == torch.int8 and q.shape == (rows, k) and scales.shape == (rows, 1)
    torch.testing.assert_close(scales, want_scales, rtol=1e-6, atol=0)
    assert (q.int() - want_q.int()).abs().max() <= 1  # x * (1/s) vs torch's order of the same two roundings
    assert (q.int() != want_q.int()).float().mean() < 0.01
    assert q.abs().max() <= 127 and q[0, k // 2].abs() == 127
    if rows > 1:
        assert scales[-1].item() == 1.0 and not q[-1].any()


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize(("rows", "n"), [(1, 64), (9, 70), (114, 960)])
def test_int32_sums_back_to_bf16(kernel_cache, native, rows, n):
    ops = Int8Rows.load(kernel_cache, native=native)
    g = torch.Generator().manual_seed(rows + n)
    acc = torch.randint(-(2**20), 2**20, (rows, n), dtype=torch.int32, generator=g)
    row_scales = torch.rand(rows, 1, generator=g) * 0.01
    col_scales = torch.rand(n, generator=g) * 0.01
    got = ops.dequantize(acc, row_scales, col_scales)
    assert torch.equal(got, (acc.float() * row_scales * col_scales).bfloat16())


def test_calls_it_does_not_take_get_none(kernel_cache):
    ops = Int8Rows.load(kernel_cache)
    assert ops.quantize(torch.randn(2, 8)) is None  # float32, not bf16
    assert ops.quantize(torch.randn(8, 2).bfloat16().t()) is None  # columns at a stride
    assert ops.quantize(torch.randn(2, 8).bfloat16(), torch.ones(7)) is None  # factors of another width
    acc = torch.zeros(2, 8, dtype=torch.int32)
    assert ops.dequantize(acc.float(), torch.ones(2, 1), torch.ones(8)) is None
    assert ops.dequantize(acc, torch.ones(3, 1), torch.ones(8)) is None
    assert ops.dequantize(acc, torch.ones(2, 1), torch.ones(8, dtype=torch.float64)) is None
