"""A step's RMSNorm (with and without the residual add) and SiLU * up in C
(kernels/cpu/row_ops.py) against torch's ops, on the AVX-512 build and the portable one, a
decode step's few rows and a prefill's many (over the threads: the same bits as on one)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.cpu import build
from kernels.cpu.row_ops import PARALLEL_ROWS, RowOps
from tests.kernels.threads import torch_threads

pytestmark = pytest.mark.skipif(build.compiler() is None, reason="no C compiler on this machine")


def torch_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).bfloat16()


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize(("rows", "k"), [(1, 576), (3, 100), (16, 64), (PARALLEL_ROWS + 5, 576), (300, 100)])
def test_rms_norm_and_the_residual_add(kernel_cache, native, rows, k):
    ops = RowOps.load(kernel_cache, native=native)
    g = torch.Generator().manual_seed(rows * k)
    wide = (torch.randn(rows, k + 8, generator=g) * 3).bfloat16()
    x = wide[:, :k]  # rows at a stride, as the model's slices hand them over
    w = torch.randn(k, generator=g).bfloat16()
    got = ops.rms_norm(x, w, 1e-5)
    want = torch_rms_norm(x, w, 1e-5)
    assert (got.float() - want.float()).abs().max() <= want.float().abs().max() * 2**-7
    h = (torch.randn(rows, k, generator=g) * 3).bfloat16()
    residual = torch.randn(rows, k, generator=g).bfloat16()
    h_torch = h.clone().add_(residual)  # bf16 add: one rounding, as the C loop rounds it
    normed = ops.rms_norm(h, w, 1e-5, residual)
    assert torch.equal(h, h_torch)
    want = torch_rms_norm(h_torch, w, 1e-5)
    assert (normed.float() - want.float()).abs().max() <= want.float().abs().max() * 2**-7


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize(("rows", "i"), [(1, 1536), (2, 40), (16, 17), (PARALLEL_ROWS + 5, 1536), (300, 40)])
def test_silu_mul_matches_torch(kernel_cache, native, rows, i):
    ops = RowOps.load(kernel_cache, native=native)
    g = torch.Generator().manual_seed(i)
    gate_up = (torch.randn(rows, 2 * i, generator=g) * 4).bfloat16()
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0]).bfloat16()  # past exp's range both ways
    got = ops.silu_mul(gate_up)
    want = F.silu(gate_up[:, :i]).mul_(gate_up[:, i:])
    assert torch.isfinite(got.float()).all()
    # torch's two roundings are reproduced; e^x's polynomial may move one bf16 step.
    diff = (got.float() - want.float()).abs()
    assert (diff <= want.float().abs() * 2**-7 + 1e-30).all()
    assert (got != want).float().mean() < 0.02


def test_calls_it_does_not_take_are_declined(kernel_cache):
    ops = RowOps.load(kernel_cache)
    w = torch.ones(64).bfloat16()
    x = torch.randn(17, 64).bfloat16()
    assert ops.rms_norm(x[:2].float(), w, 1e-5) is None
    assert ops.rms_norm(x[:2], torch.ones(63).bfloat16(), 1e-5) is None
    h = x[:2].clone()
    assert ops.rms_norm(h, w, 1e-5, torch.ones(3, 64).bfloat16()) is None
    assert torch.equal(h, x[:2])  # declined: the residual was not added
    assert ops.silu_mul(torch.randn(2, 7).bfloat16()) is None  # odd width: no gate/up halves
    assert ops.silu_mul(torch.randn(2, 8)) is None


def test_a_prefills_rows_give_the_same_bits_on_one_thread_and_two(kernel_cache):
    ops = RowOps.load(kernel_cache)
    g = torch.Generator().manual_seed(11)
    h = (torch.randn(200, 576, generator=g) * 3).bfloat16()
    residual = torch.randn(200, 576, generator=g).bfloat16()
    w = torch.randn(576, generator=g).bfloat16()
    gate_up = (torch.randn(200, 2 * 1536, generator=g) * 4).bfloat16()
    results = []
    for threads in (1, 2):
        with torch_threads(threads):
            hh = h.clone()
            results.append((ops.rms_norm(hh, w, 1e-5, residual), hh, ops.silu_mul(gate_up)))
    for one, two in zip(*results):
        assert torch.equal(one, two)
