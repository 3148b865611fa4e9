"""The few-row int4 product in C (kernels/cpu/int4_gemv.py) against the exact product of the
dequantised weight and against torch's int4 kernel, its refusals, and `Int4Linear`'s use of it."""

from __future__ import annotations

import pytest
import torch

from engine.model.quant import Int4Linear, _unpack_int4, quantize_groups
from kernels.cpu import build
from kernels.cpu.int4_gemv import MAX_ROWS, Int4Gemv, PackedInt4
from tests.kernels.threads import torch_threads

needs_cc = pytest.mark.skipif(build.compiler() is None, reason="no C compiler on this machine")


def groups(n: int, k: int, group: int, seed: int):
    """(codes [N, K], scale [N, K/G] bf16, zero [N, K/G] bf16) of a random weight, torch's int4
    convention w = (q - 8) * scale + zero."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[:, 3] *= 20  # one wide input channel: groups with very different scales
    got = quantize_groups(w, torch.bfloat16, group)
    zero = (got.minimum + 8.0 * got.scale).to(torch.bfloat16)
    return got.q, got.scale.to(torch.bfloat16), zero


def weight(n: int, k: int, group: int, seed: int) -> Int4Linear:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[:, 3] *= 20
    return Int4Linear.quantize(w, None, torch.bfloat16, group=group)


def parts(lin: Int4Linear):
    """(codes [N, K], scale [N, K/G], zero [N, K/G]) of torch's packed layout."""
    codes = _unpack_int4(lin.packed, lin.in_features).t()
    return codes, lin.scales_zeros[:, :, 0].t(), lin.scales_zeros[:, :, 1].t()


def exact_weight(codes, scale, zero) -> torch.Tensor:  # [N, K] float32
    """w = (q - 8) * scale + zero in float32 (what both kernels compute; `dequantize` rounds to bf16)."""
    n, k = codes.shape
    per = (codes.float() - 8).view(n, scale.shape[1], -1)
    return (per * scale.float().unsqueeze(2) + zero.float().unsqueeze(2)).view(n, k)


def kernel(cache, native: bool = True) -> Int4Gemv:
    got = Int4Gemv.load(cache, native=native)
    assert got is not None
    return got


@needs_cc
@pytest.mark.parametrize("rows", [1, 2, 3, 5, MAX_ROWS])
@pytest.mark.parametrize(("n", "k", "group"), [(64, 64, 32), (960, 576, 32), (16, 256, 64), (80, 1536, 128)])
def test_both_loops_equal_the_exact_product_to_bf16_rounding(kernel_cache, rows, n, k, group):
    codes, scale, zero = groups(n, k, group, seed=rows + n)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
    exact = x.float() @ exact_weight(codes, scale, zero).t()  # [M, N]
    ours = kernel(kernel_cache).pack(codes, scale, zero)
    assert ours is not None
    for vector in (True, False):
        y = ours(x, vector=vector)
        assert y is not None and y.dtype == torch.bfloat16 and y.shape == (rows, n)
        # one bf16 rounding of a float32 sum: within half a bf16 step of the exact value, plus
        # float32 summation error far below it
        assert ((y.float() - exact).abs() <= exact.abs() * 2**-8 + 1e-3).all()


@needs_cc
@pytest.mark.parametrize("rows", [1, 4])
def test_it_computes_what_torchs_int4_kernel_computes(kernel_cache, rows):
    lin = weight(960, 576, 32, seed=rows)
    x = torch.randn(rows, 576).bfloat16()
    ours = kernel(kernel_cache).pack(*parts(lin))
    torch_y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, lin.packed, lin.group, lin.scales_zeros).float()
    assert ((ours(x).float() - torch_y).abs() <= torch_y.abs() * 2**-7 + 1e-3).all()


@needs_cc
def test_the_portable_build_agrees_with_the_vector_build(kernel_cache):
    lin = weight(128, 192, 32, seed=3)
    x = torch.randn(4, 192).bfloat16()
    vec = kernel(kernel_cache).pack(*parts(lin))
    portable = kernel(kernel_cache, native=False).pack(*parts(lin))
    assert vec is not None and portable is not None
    torch.testing.assert_close(vec(x).float(), portable(x).float(), rtol=2**-7, atol=1e-3)


@needs_cc
def test_a_row_is_the_same_bits_on_one_thread_or_two_and_alone_or_with_others(kernel_cache):
    lin = weight(1024, 576, 32, seed=5)
    x = torch.randn(MAX_ROWS, 576).bfloat16()
    ours = kernel(kernel_cache).pack(*parts(lin))
    with torch_threads(1):
        one = ours(x)
    with torch_threads(2):
        two = ours(x)
    assert torch.equal(one, two)
    assert torch.equal(ours(x[2:3]), two[2:3])  # rows do not mix: a verify step's row 2 is a decode step's


@needs_cc
def test_shapes_and_calls_it_does_not_take_are_refused(kernel_cache):
    gemv = kernel(kernel_cache)
    lin = weight(64, 64, 32, seed=0)
    codes, scale, zero = parts(lin)
    assert gemv.pack(codes[:40], scale[:40], zero[:40]) is None  # rows not a multiple of 16
    assert gemv.pack(codes, scale.float(), zero.float()) is None  # scales not bf16
    assert not Int4Gemv.takes(64, 60, 32) and not Int4Gemv.takes(64, 64, 4)
    ours = gemv.pack(codes, scale, zero)
    assert ours(torch.randn(MAX_ROWS + 1, 64).bfloat16()) is None  # too many rows
    assert ours(torch.randn(2, 64)) is None  # float32 rows
    assert ours(torch.randn(2, 32).bfloat16()) is None  # wrong width
    assert ours(torch.randn(64, 2).bfloat16().t()) is None  # strided columns


@needs_cc
def test_int4_linear_keeps_one_copy_and_runs_up_to_95_rows_in_c(kernel_cache, monkeypatch):
    import engine.model.quant as quant

    monkeypatch.setattr(quant, "cache_root", lambda: kernel_cache.parent)
    lin = weight(192, 128, 32, seed=9)
    if not kernel(kernel_cache).vector:
        assert lin.rows_c is None  # no AVX512-BF16: torch's kernel stays
        return
    assert lin.rows_c is not None and lin._packed is None and lin._scales_zeros is None  # one copy resident
    assert lin.nbytes() == 192 * 128 // 2 + (128 // 32) * 192 * 2 * 2
    monkeypatch.setattr(Int4Linear, "_pack_rows_c", lambda self: None)
    torch_only = weight(192, 128, 32, seed=9)
    assert torch.equal(lin.packed, torch_only.packed)  # torch's layout, rebuilt on demand
    assert torch.equal(lin.scales_zeros, torch_only.scales_zeros)
    assert torch.equal(lin.dequantize(), torch_only.dequantize())
    calls = []
    real = PackedInt4.rows
    monkeypatch.setattr(PackedInt4, "rows", lambda self, x, vector=None: calls.append(x.shape[0]) or real(self, x))
    exact = exact_weight(*parts(torch_only)).t()
    for m in (3, MAX_ROWS + 4):
        x = torch.randn(m, 128).bfloat16()
        want = x.float() @ exact
        assert ((lin(x).float() - want).abs() <= want.abs() * 2**-7 + 1e-3).all()
    assert calls == [3, MAX_ROWS, 4]  # 12 rows in two slices
    many = torch.randn(96, 128).bfloat16()
    assert torch.equal(lin(many), torch_only(many))  # a dequantised GEMM from either layout
    assert calls == [3, MAX_ROWS, 4]


@needs_cc
def test_a_kernel_that_fails_its_check_leaves_torchs_kernel_with_one_warning(kernel_cache, monkeypatch, caplog):
    import engine.model.quant as quant

    monkeypatch.setattr(quant, "cache_root", lambda: kernel_cache.parent)
    monkeypatch.setattr(quant, "_WARNED", {})
    monkeypatch.setattr(Int4Gemv, "problem", lambda self: "wrong results (a test)")
    with caplog.at_level("WARNING", logger="engine.model.quant"):
        lins = [weight(64, 64, 32, seed=s) for s in range(3)]
    assert all(lin.rows_c is None for lin in lins)
    x = torch.randn(2, 64).bfloat16()
    torch.testing.assert_close(lins[0](x), torch.ops.aten._weight_int4pack_mm_for_cpu(x, lins[0].packed, 32, lins[0].scales_zeros))
    assert [r.message for r in caplog.records].count(
        "the int4 C kernel fails its check on this machine (wrong results (a test)): torch's int4 kernel runs"
    ) == 1


@needs_cc
def test_the_kernels_own_check_passes_here(kernel_cache):
    assert kernel(kernel_cache).problem() is None


@needs_cc
def test_the_dequantised_weight_is_torchs_bit_for_bit(kernel_cache, monkeypatch):
    import engine.model.quant as quant

    monkeypatch.setattr(quant, "cache_root", lambda: kernel_cache.parent)
    lin = weight(320, 256, 32, seed=11)
    assert lin.rows_c is not None or not kernel(kernel_cache).vector
    monkeypatch.setattr(Int4Linear, "_pack_rows_c", lambda self: None)
    torch_only = weight(320, 256, 32, seed=11)
    assert torch.equal(lin._dequantize_t(), torch_only._dequantize_t())


def adapter(parts: list[tuple[int, int]], k: int, seed: int):
    """a [R, K] and a block-diagonal b [N, R] in bf16-exact values: part i maps r_i ranks onto
    its n_i output rows (q, k and v's terms side by side; boundaries need not fall on 16)."""
    g = torch.Generator().manual_seed(seed)
    r_all, n_all = sum(r for r, _ in parts), sum(n for _, n in parts)
    a = (torch.randn(r_all, k, generator=g) * 0.05).bfloat16().float()
    b = torch.zeros(n_all, r_all)
    r0 = n0 = 0
    for r, n in parts:
        b[n0 : n0 + n, r0 : r0 + r] = (torch.randn(n, r, generator=g) * 0.05).bfloat16().float()
        r0, n0 = r0 + r, n0 + n
    return a, b


@needs_cc
@pytest.mark.parametrize("rows", [1, 3, MAX_ROWS])
def test_the_low_rank_term_inside_the_product_is_the_exact_term(kernel_cache, rows):
    codes, scale, zero = groups(96, 64, 32, seed=rows)
    a, b = adapter([(8, 40), (4, 24), (5, 32)], 64, seed=rows)  # segment ends at 40 and 64: inside blocks
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(7)).bfloat16()
    exact = x.float() @ exact_weight(codes, scale, zero).t() + (x.float() @ a.t()) @ b.t()
    plain = kernel(kernel_cache).pack(codes, scale, zero)
    fused = plain.with_low_rank(a, b)
    assert fused is not None and plain.low_rank is None  # the plain weight is left as it was
    for vector in (True, False):
        y = fused(x, vector=vector)
        assert ((y.float() - exact).abs() <= exact.abs() * 2**-8 + 1e-3).all()
    assert torch.equal(fused(x[1:2] if rows > 1 else x), fused(x)[1:2] if rows > 1 else fused(x))
    assert plain.with_low_rank(a + 1e-4, b) is None  # values bf16 cannot hold: the caller's own term
    assert plain.with_low_rank(a[:, :32], b) is None  # wrong width


@needs_cc
def test_int4_linear_adds_its_adapter_inside_the_c_product(kernel_cache, monkeypatch):
    import engine.model.quant as quant
    from engine.model.quant import LowRank, quantize_groups

    monkeypatch.setattr(quant, "cache_root", lambda: kernel_cache.parent)
    w = torch.randn(192, 128, generator=torch.Generator().manual_seed(2)) * 0.05
    a, b = adapter([(16, 64), (16, 128)], 128, seed=3)
    lin = Int4Linear.from_groups(quantize_groups(w, torch.bfloat16), None, torch.bfloat16, LowRank(a, b))
    if lin.rows_c is None:
        assert not kernel(kernel_cache).vector
        return
    assert lin.rows_c.low_rank is not None and lin.lora_c is None  # one term, inside the product
    exact_w = exact_weight(*parts(lin)) + b @ a  # [N, K]
    for m in (2, MAX_ROWS + 3):
        x = torch.randn(m, 128).bfloat16()
        want = x.float() @ exact_w.t()
        assert ((lin(x).float() - want).abs() <= want.abs() * 2**-7 + 1e-3).all()
    many = torch.randn(100, 128).bfloat16()  # a dequantised GEMM, the adapter added by torch
    want = many.float() @ exact_w.t()
    assert ((lin(many).float() - want).abs() <= want.abs() * 2**-6 + 2e-2).all()
    assert lin.step_nbytes() < lin.nbytes()  # the float32 factors for many rows are not a step's
