"""The adapter's low-rank term in C (kernels/cpu/low_rank.py) against the torch path it
replaces, and the build's refusals (no compiler, off, an untrusted cache folder)."""

from __future__ import annotations

import logging
import os
import stat

import pytest
import torch

from kernels.cpu import build
from kernels.cpu.low_rank import MAX_ROWS, LowRankAdd, segments

needs_cc = pytest.mark.skipif(build.compiler() is None, reason="no C compiler on this machine")


def block_diagonal(parts: list[tuple[int, int]], k: int, *, bf16: bool, seed: int = 0):
    """a [R, K] and a block-diagonal b [N, R]: part i maps its r_i ranks onto its n_i rows only
    (the shape of q, k and v's terms fused into one projection)."""
    g = torch.Generator().manual_seed(seed)
    r_all, n_all = sum(r for r, _ in parts), sum(n for _, n in parts)
    a = torch.randn(r_all, k, generator=g) * 0.05
    b = torch.zeros(n_all, r_all)
    r0 = n0 = 0
    for r, n in parts:
        b[n0 : n0 + n, r0 : r0 + r] = torch.randn(n, r, generator=g) * 0.05
        r0, n0 = r0 + r, n0 + n
    if bf16:
        a, b = a.bfloat16().float(), b.bfloat16().float()
    return a, b


def torch_term(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """What Int4Linear does without the kernel."""
    return y.clone().add_(torch.mm(torch.mm(x.float(), a.t()), b.t()))


def test_segments_are_the_nonzero_blocks_and_cover_every_nonzero():
    a, b = block_diagonal([(4, 6), (4, 3), (2, 5)], 8, bf16=False)
    assert segments(b) == [(0, 4, 0, 6), (4, 8, 6, 9), (8, 10, 9, 14)]
    b[:, 5] = 0.0  # a rank with no output at all is left out
    b[2, 4] = 0.0  # ... and one whose span shrinks gets its own segment
    segs = segments(b)
    covered = torch.zeros_like(b, dtype=torch.bool)
    for r0, r1, n0, n1 in segs:
        covered[n0:n1, r0:r1] = True
    assert not (b != 0)[~covered].any()
    assert all(r != 5 for r0, r1, *_ in segs for r in range(r0, r1))
    assert segments(torch.randn(7, 3)) == [(0, 3, 0, 7)]  # a dense B is one segment


@needs_cc
@pytest.mark.parametrize("bf16_weights", [True, False])
@pytest.mark.parametrize("rows", [1, 3, MAX_ROWS])
def test_the_c_term_equals_the_torch_term(kernel_cache, bf16_weights, rows):
    a, b = block_diagonal([(16, 96), (16, 32), (16, 32)], 64, bf16=bf16_weights, seed=rows)
    if not bf16_weights:
        a = a + 1e-4  # values bf16 cannot hold: the float32 copy is used
    term = LowRankAdd.pack(a, b, kernel_cache)
    assert term is not None
    assert term.b.dtype == (torch.bfloat16 if bf16_weights else torch.float32)
    assert term.b.numel() == 16 * (96 + 32 + 32)  # the blocks only, not the zero padding
    g = torch.Generator().manual_seed(7)
    wide = torch.randn(rows, 128, generator=g).bfloat16()
    x = wide[:, :64]  # a column slice with a row stride of 128, as the fused small-row norm returns
    y = torch.randn(rows, 160, generator=g).bfloat16()
    want = torch_term(x, y, a, b)
    got = y.clone()
    assert term(x, got)
    exact = x.double() @ a.double().t() @ b.double().t() + y.double()
    # Both round one float32 sum to bf16; summation order may move the last bit.
    torch.testing.assert_close(got.double(), exact, atol=1e-2, rtol=8e-3)
    assert (got != want).float().mean().item() < 0.05
    assert (got.double() - want.double()).abs().max().item() <= 2 * want.double().abs().max().item() * 2**-8


@needs_cc
@pytest.mark.parametrize("seed", range(6))
def test_odd_shapes_and_overlapping_segments_equal_the_exact_term(kernel_cache, seed):
    """Ranks and widths that are not multiples of the vector width (the vector loop's masked
    tails: 1-70 ranks, 1-200 columns, any K), and a B whose segments share columns (the
    portable loop), for 1-16 rows."""
    g = torch.Generator().manual_seed(seed)
    pick = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=g))  # noqa: E731
    k, rows = pick(1, 700), pick(1, MAX_ROWS + 1)
    parts = [(pick(1, 40), pick(1, 200)) for _ in range(pick(1, 4))]
    a, b = block_diagonal(parts, k, bf16=seed % 2 == 0, seed=seed)
    if seed % 3 == 2:  # every rank also feeds the first columns: segments over shared columns
        b[: min(8, b.shape[0]), :] = torch.randn(min(8, b.shape[0]), b.shape[1], generator=g).bfloat16().float() * 0.05
        assert len({(n0, n1) for *_, n0, n1 in segments(b)}) > 1 or len(parts) == 1
    if seed % 2:
        a = a + 1e-4
    term = LowRankAdd.pack(a, b, kernel_cache)
    assert term is not None
    x = torch.randn(rows, k + 3, generator=g).bfloat16()[:, :k]
    y = torch.randn(rows, b.shape[0], generator=g).bfloat16()
    got = y.clone()
    assert term(x, got)
    exact = x.double() @ a.double().t() @ b.double().t() + y.double()
    # One bf16 rounding of a float32 sum: within a bf16 step of the exact value (plus float32 noise).
    assert ((got.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-3).all()


@needs_cc
def test_calls_it_does_not_run_leave_the_output_alone(kernel_cache):
    a, b = block_diagonal([(4, 16)], 32, bf16=True)
    term = LowRankAdd.pack(a, b, kernel_cache)
    y = torch.ones(MAX_ROWS + 1, 16, dtype=torch.bfloat16)
    for x, out in (
        (torch.randn(MAX_ROWS + 1, 32).bfloat16(), y),  # a GEMM's rows: torch's work
        (torch.randn(2, 32), torch.ones(2, 16)),  # float32 activations
        (torch.randn(32, 2).bfloat16().t(), torch.ones(2, 16, dtype=torch.bfloat16)),  # strided columns
        (torch.randn(2, 31).bfloat16(), torch.ones(2, 16, dtype=torch.bfloat16)),  # wrong K
    ):
        before = out.clone()
        assert not term(x, out)
        assert torch.equal(out, before)


def test_no_kernel_when_c_kernels_are_off_or_no_compiler(kernel_cache, monkeypatch, caplog):
    a, b = block_diagonal([(4, 16)], 32, bf16=True)
    monkeypatch.setenv("EFIM_C_KERNELS", "0")
    assert LowRankAdd.pack(a, b, kernel_cache) is None
    build.library.cache_clear()
    monkeypatch.setenv("EFIM_C_KERNELS", "1")
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with caplog.at_level(logging.WARNING, logger="kernels.cpu.build"):
        assert LowRankAdd.pack(a, b, kernel_cache) is None
    assert any("no C compiler" in r.getMessage() for r in caplog.records)


@needs_cc
def test_a_failed_build_is_one_warning_and_no_kernel(kernel_cache, monkeypatch, tmp_path, caplog):
    broken = tmp_path / "cc"
    broken.write_text("#!/bin/sh\necho 'cc: internal error' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("CC", str(broken))
    a, b = block_diagonal([(4, 16)], 32, bf16=True)
    with caplog.at_level(logging.WARNING, logger="kernels.cpu.build"):
        assert LowRankAdd.pack(a, b, kernel_cache) is None
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "internal error" in warnings[0]
    assert not list(kernel_cache.glob("*.so")) and not list(kernel_cache.glob(".*tmp"))


@needs_cc
def test_the_library_is_built_once_and_reused_from_the_cache(kernel_cache):
    assert build.library("low_rank", kernel_cache) is not None
    built = list(kernel_cache.glob("low_rank-*.so"))
    assert len(built) == 1
    assert stat.S_IMODE(kernel_cache.stat().st_mode) == 0o700
    mtime = built[0].stat().st_mtime_ns
    build.library.cache_clear()
    assert build.library("low_rank", kernel_cache) is not None
    assert built[0].stat().st_mtime_ns == mtime


@needs_cc
def test_a_cache_folder_others_may_write_is_not_used(kernel_cache, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    planted = shared / "low_rank-0000000000000000.so"
    planted.write_text("not a library")
    assert build.library("low_rank", shared) is not None
    assert sorted(p.name for p in shared.iterdir()) == [planted.name]  # built elsewhere, nothing read or written here
    os.chmod(shared, 0o700)


@needs_cc
def test_a_build_outside_a_cache_folder_leaves_no_temporary_folder(kernel_cache, tmp_path, monkeypatch):
    """No private cache folder: the library is built in a temporary folder, loaded, and the
    folder removed (the mapping outlives the file), for a build that works and one that fails."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    lib = build.library("low_rank")
    assert lib is not None and lib.efim_low_rank_add_bf16 is not None  # loaded, its symbols resolved
    assert not list(tmp_path.glob("efim-kernels-*"))
    build.library.cache_clear()
    broken = tmp_path / "cc"
    broken.write_text("#!/bin/sh\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("CC", str(broken))
    assert build.library("low_rank") is None
    assert not list(tmp_path.glob("efim-kernels-*"))
