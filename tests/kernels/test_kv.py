"""KV store / gather / deviation kernels against the reference, under TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed; the Triton kernels cannot be verified")

from kernel_tolerance import DTYPES, assert_close  # noqa: E402

from kernels import reference  # noqa: E402
from kernels.triton import KernelInputError  # noqa: E402
from kernels.triton import kv as triton_kv  # noqa: E402


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("h_kv,head_dim", [(1, 64), (3, 64), (8, 128)])
def test_kv_store_scatters_rows_and_skips_minus_one(h_kv, head_dim, dtype):
    """Rows of the pool's own dtype are copied bit for bit; slot -1 rows are not stored.
    The pools are one layer of a [L, N, H_kv, D] tensor (strided views)."""
    gen = torch.Generator().manual_seed(h_kv)
    N, T = 40, 9
    pools = torch.randn(2, 3, N, h_kv, head_dim, generator=gen).to(dtype)  # [K/V, L, N, H_kv, D]
    k_pool, v_pool = pools[0, 1], pools[1, 1]  # [N, H_kv, D] views
    k = torch.randn(T, h_kv, head_dim, generator=gen).to(dtype)  # [T, H_kv, D]
    v = torch.randn(T, h_kv, head_dim, generator=gen).to(dtype)
    slots = torch.tensor([5, -1, 39, 0, 17, -1, 8, 22, 1])
    expected = pools.clone()
    reference.kv_store(expected[0, 1], expected[1, 1], k, v, slots)
    triton_kv.kv_store(k_pool, v_pool, k, v, slots)
    assert torch.equal(pools, expected)  # the other layers are untouched too


def test_kv_store_converts_to_the_pool_dtype():
    """float32 rows into a float16 pool (round to nearest, like the reference's `.to`).
    bfloat16 is not asserted bit-exact here: the interpreter rounds float32 -> bfloat16
    toward zero, a GPU to nearest (see docs/kernels.md)."""
    gen = torch.Generator().manual_seed(0)
    k_pool = torch.zeros(6, 2, 64, dtype=torch.float16)
    v_pool = torch.zeros(6, 2, 64, dtype=torch.float16)
    k, v = torch.randn(3, 2, 64, generator=gen), torch.randn(3, 2, 64, generator=gen)
    slots = torch.tensor([4, 0, -1])
    ek, ev = k_pool.clone(), v_pool.clone()
    reference.kv_store(ek, ev, k, v, slots)
    triton_kv.kv_store(k_pool, v_pool, k, v, slots)
    assert torch.equal(k_pool, ek) and torch.equal(v_pool, ev)


def test_kv_store_refuses_out_of_range_slots_and_loses_nothing():
    k_pool = torch.zeros(6, 2, 64)
    v_pool = torch.zeros(6, 2, 64)
    rows = torch.ones(2, 2, 64)
    with pytest.raises(KernelInputError, match=r"slots: index 6 out of range \(allowed \[0, 6\) or -1\)"):
        triton_kv.kv_store(k_pool, v_pool, rows, rows, torch.tensor([0, 6]))
    with pytest.raises(KernelInputError, match="index -2"):
        triton_kv.kv_store(k_pool, v_pool, rows, rows, torch.tensor([-2, 1]))
    assert torch.count_nonzero(k_pool) == 0 and torch.count_nonzero(v_pool) == 0
    with pytest.raises(KernelInputError, match="zero or negative stride"):
        triton_kv.kv_store(torch.zeros(1, 2, 64).expand(6, 2, 64), v_pool, rows, rows, torch.tensor([0, 1]))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kv_gather_matches_reference(dtype):
    gen = torch.Generator().manual_seed(4)
    pool = torch.randn(30, 3, 64, generator=gen).to(dtype)  # [N, H_kv, D]
    slots = torch.randperm(30, generator=gen)[:11]
    out = torch.full((3, 16, 64), 7.0, dtype=dtype)  # [H_kv, >=S, D]: the tail must stay 7
    expected = out.clone()
    reference.kv_gather(pool, slots, expected)
    triton_kv.kv_gather(pool, slots, out)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("h_kv,head_dim", [(1, 64), (3, 128), (8, 64)])
def test_kv_deviation_matches_reference(h_kv, head_dim, dtype):
    gen = torch.Generator().manual_seed(h_kv * head_dim)
    S = 37  # not a multiple of the 16-row block
    cached = torch.randn(S, h_kv, head_dim, generator=gen).to(dtype)  # [S, H_kv, D]
    fresh = (cached.float() + 0.1 * torch.randn(S, h_kv, head_dim, generator=gen)).to(dtype)
    dev = triton_kv.kv_deviation(fresh, cached)  # [S]
    assert dev.dtype == torch.float32
    assert_close(dev, reference.kv_deviation(fresh, cached), dtype=torch.float32)


def test_top_rows_find_the_perturbed_tokens():
    """Deviation + selection end to end: the rows whose V was changed are the ones chosen."""
    gen = torch.Generator().manual_seed(9)
    cached = torch.randn(50, 2, 64, generator=gen)
    fresh = cached + 1e-3 * torch.randn(50, 2, 64, generator=gen)
    changed = torch.tensor([2, 11, 30, 49])
    fresh[changed] += torch.randn(4, 2, 64, generator=gen)
    dev = triton_kv.kv_deviation(fresh, cached)
    assert torch.equal(triton_kv.select_top_rows(dev, 4), changed)
    assert torch.equal(triton_kv.select_top_rows(dev, 7), reference.select_top_rows(reference.kv_deviation(fresh, cached), 7))
    assert triton_kv.select_top_rows(dev, 0).numel() == 0
    assert triton_kv.select_top_rows(dev, 500).numel() == 50


def test_shapes_only_mode_skips_the_index_values_but_not_the_shapes(monkeypatch):
    from kernels.triton import checks

    k_pool, v_pool, rows = torch.zeros(6, 2, 64), torch.zeros(6, 2, 64), torch.ones(2, 2, 64)
    monkeypatch.setenv("EFIM_KERNEL_CHECKS", "shapes")
    assert not checks.values_checked()
    checks.index_range("slots", torch.tensor([0, 6]), 6)  # trusted: no device sync, no error
    with pytest.raises(KernelInputError, match="zero or negative stride"):  # layout is still checked
        triton_kv.kv_store(torch.zeros(1, 2, 64).expand(6, 2, 64), v_pool, rows, rows, torch.tensor([0, 1]))
    monkeypatch.setenv("EFIM_KERNEL_CHECKS", "all")
    with pytest.raises(KernelInputError, match="index 6"):
        triton_kv.kv_store(k_pool, v_pool, rows, rows, torch.tensor([0, 6]))
    monkeypatch.setenv("EFIM_KERNEL_CHECKS", "some")
    with pytest.raises(KernelInputError, match="EFIM_KERNEL_CHECKS"):
        checks.values_checked()
