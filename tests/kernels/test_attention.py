"""Prefill and decode attention kernels against the reference, under TRITON_INTERPRET=1."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed; the Triton kernels cannot be verified")

from kernel_tolerance import DTYPES, assert_close  # noqa: E402

from kernels import reference  # noqa: E402
from kernels.triton import KernelInputError  # noqa: E402
from kernels.triton import decode as triton_decode  # noqa: E402
from kernels.triton import prefill as triton_prefill  # noqa: E402

H_KV = 2
GQA_RATIOS = (1, 3, 8)
HEAD_DIMS = (64, 128)


def _pool(n: int, d: int, dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    k_pool = torch.randn(n, H_KV, d, generator=gen).to(dtype)  # [N, H_kv, D]
    v_pool = torch.randn(n, H_KV, d, generator=gen).to(dtype)  # [N, H_kv, D]
    return k_pool, v_pool


# Split-K runs in float32 and bfloat16 only: the interpreter is slow, and the merge pass
# is float32 whatever the input dtype.
SPLIT_CASES = [(None, dt) for dt in DTYPES] + [(3, torch.float32), (3, torch.bfloat16)]
SPLIT_IDS = [f"{'auto' if n is None else 'split3'}-{str(dt).removeprefix('torch.')}" for n, dt in SPLIT_CASES]


@pytest.mark.parametrize("num_splits,dtype", SPLIT_CASES, ids=SPLIT_IDS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("ratio", GQA_RATIOS)
def test_prefill_matches_reference(ratio, head_dim, num_splits, dtype):
    """Scattered query rows over a 130-key sequence (not a multiple of the 64-key block),
    keys scattered over the pool; with 3 key splits, the splits after the first are
    partly or wholly invisible to the earliest query rows."""
    gen = torch.Generator().manual_seed(ratio * 1000 + head_dim)
    S, T, N = 130, 5, 160
    k_pool, v_pool = _pool(N, head_dim, dtype, gen)
    q = torch.randn(T, H_KV * ratio, head_dim, generator=gen).to(dtype)  # [T, H, D]
    slots = torch.randperm(N, generator=gen)[:S]  # [S]
    k_pos = torch.arange(S)
    scale = 1 / math.sqrt(head_dim)
    q_pos = torch.tensor([0, 64, 100, 128, 129])  # a scattered recompute set
    out = triton_prefill.paged_prefill(q, k_pool, v_pool, slots, k_pos, q_pos, scale, num_splits=num_splits)
    assert_close(out, reference.paged_attention_prefill(q, k_pool, v_pool, slots, k_pos, q_pos, scale))


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_prefill_scattered_rows_are_rows_of_the_full_prefill(dtype):
    """CacheBlend recomputes a scattered subset of rows: each must equal the same row of a
    full prefill (a bottom-right causal mask would let the early rows see later keys)."""
    gen = torch.Generator().manual_seed(7)
    S, H, D = 67, 6, 64
    k_pool, v_pool = _pool(80, D, dtype, gen)
    slots = torch.randperm(80, generator=gen)[:S]
    q_all = torch.randn(S, H, D, generator=gen).to(dtype)  # [S, H, D]
    pos = torch.arange(S)
    full = triton_prefill.paged_attention_prefill(q_all, k_pool, v_pool, slots, pos, pos, 0.125)  # [S, H, D]
    rows = torch.tensor([0, 3, 17, 40, 63, 66])
    part = triton_prefill.paged_attention_prefill(q_all[rows], k_pool, v_pool, slots, pos, pos[rows], 0.125)
    assert_close(part, full[rows])
    assert_close(full, reference.paged_attention_prefill(q_all, k_pool, v_pool, slots, pos, pos, 0.125))
    # The wrong (bottom-right) mask gives a different answer for row 0: pins what is tested.
    wrong = reference.paged_attention_prefill(q_all[rows], k_pool, v_pool, slots, pos, pos[-len(rows) :], 0.125)
    assert not torch.allclose(wrong[0].float(), full[0].float(), atol=1e-2)


def test_prefill_unsorted_positions_and_fully_masked_rows():
    """Keys in arbitrary position order (a blended chunk list), and a query that sees no
    key (position below every key): the reference returns zeros for it."""
    gen = torch.Generator().manual_seed(3)
    S, T, H, D = 150, 4, 6, 64
    k_pool, v_pool = _pool(160, D, torch.float32, gen)
    slots = torch.randperm(160, generator=gen)[:S]
    k_pos = torch.randperm(S, generator=gen) + 10  # positions 10..159, shuffled
    q_pos = torch.tensor([5, 10, 90, 159])  # row 0 sees nothing, row 1 exactly one key
    q = torch.randn(T, H, D, generator=gen)
    expected = reference.paged_attention_prefill(q, k_pool, v_pool, slots, k_pos, q_pos, 0.1)
    for splits in (1, 3):
        out = triton_prefill.paged_prefill(q, k_pool, v_pool, slots, k_pos, q_pos, 0.1, num_splits=splits)
        assert_close(out, expected)
    assert torch.count_nonzero(out[0]) == 0
    assert torch.allclose(out[1], v_pool[slots[k_pos == 10][0]].repeat_interleave(3, dim=0))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "q_pos,k_pos",
    [(None, None), ("explicit", None), (None, "explicit"), ("explicit", "explicit")],
    ids=["tail", "q_pos", "k_pos", "both"],
)
def test_contiguous_attention_matches_reference(q_pos, k_pos, dtype):
    gen = torch.Generator().manual_seed(11)
    H, H_kv, T, S, D = 8, 1, 6, 45, 64
    q = torch.randn(H, T, D, generator=gen).to(dtype)  # [H, T, D]
    k = torch.randn(H_kv, S, D, generator=gen).to(dtype)  # [H_kv, S, D]
    v = torch.randn(H_kv, S, D, generator=gen).to(dtype)
    qp = torch.tensor([0, 4, 20, 21, 30, 44]) if q_pos else None
    kp = torch.arange(S) * 2 if k_pos else None
    assert_close(triton_prefill.attention(q, k, v, qp, kp, 0.125), reference.attention(q, k, v, qp, kp, 0.125))


def test_keystroke_prefill_splits_the_keys():
    """EFIM's keystroke: 2 new tokens against a long context is a decode-shaped launch;
    the automatic choice splits the keys, and the result still equals the reference."""
    from kernels.triton.online_softmax import choose_num_splits

    assert choose_num_splits(programs=1 * 2, keys=1024) == 4
    assert choose_num_splits(programs=64 * 8, keys=4096) == 1  # a long prefill fills the GPU by rows
    gen = torch.Generator().manual_seed(8)
    H, H_kv, S, D = 6, 2, 1024, 64
    q = torch.randn(H, 2, D, generator=gen)  # [H, T=2, D]
    k = torch.randn(H_kv, S, D, generator=gen)
    v = torch.randn(H_kv, S, D, generator=gen)
    assert_close(triton_prefill.attention(q, k, v, None, None, 0.125), reference.attention(q, k, v, None, None, 0.125))


def test_attention_single_query_and_strided_inputs():
    """T == 1 (the reference's unmasked fast path) and q/k/v that are transposed views."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, 6, 64, generator=gen).transpose(0, 1)  # [H=6, T=1, D] view
    k = torch.randn(33, 2, 64, generator=gen).transpose(0, 1)  # [H_kv=2, S=33, D] view
    v = torch.randn(33, 2, 64, generator=gen).transpose(0, 1)
    assert_close(triton_prefill.attention(q, k, v, None, None, 0.125), reference.attention(q, k, v, None, None, 0.125))


@pytest.mark.parametrize("num_splits,dtype", SPLIT_CASES, ids=SPLIT_IDS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("ratio", GQA_RATIOS)
def test_decode_matches_reference(ratio, head_dim, num_splits, dtype):
    """Three sequences of lengths 1, 77 and 130 in one launch; with 3 splits the
    1-token sequence has two empty splits that the reduction must ignore."""
    gen = torch.Generator().manual_seed(ratio * 100 + head_dim)
    B, N, S_max = 3, 200, 130
    k_pool, v_pool = _pool(N, head_dim, dtype, gen)
    q = torch.randn(B, H_KV * ratio, head_dim, generator=gen).to(dtype)  # [B, H, D]
    table = torch.stack([torch.randperm(N, generator=gen)[:S_max] for _ in range(B)])  # [B, S_max]
    seq_lens = torch.tensor([1, 77, 130])
    table[0, 1:] = -1  # unused entries may hold anything
    scale = 1 / math.sqrt(head_dim)
    out = triton_decode.decode(q, k_pool, v_pool, table, seq_lens, scale, num_splits=num_splits)
    assert_close(out, reference.paged_attention_decode(q, k_pool, v_pool, table, seq_lens, scale))


def test_decode_split_choice():
    assert triton_decode.choose_num_splits(programs=1 * 2, keys=100) == 1
    assert triton_decode.choose_num_splits(programs=1 * 2, keys=4096) == 16
    assert triton_decode.choose_num_splits(programs=64 * 8, keys=4096) == 1


def test_bad_inputs_are_refused_with_a_clear_message():
    gen = torch.Generator().manual_seed(0)
    k_pool, v_pool = _pool(10, 64, torch.float32, gen)
    q = torch.randn(3, 4, 64)
    pos = torch.arange(3)
    with pytest.raises(KernelInputError, match="slots: index 10 out of range"):
        triton_prefill.paged_attention_prefill(q, k_pool, v_pool, torch.tensor([0, 1, 10]), pos, pos, 1.0)
    with pytest.raises(KernelInputError, match="not a multiple"):
        triton_prefill.paged_attention_prefill(torch.randn(3, 3, 64), k_pool, v_pool, pos, pos, pos, 1.0)
    with pytest.raises(KernelInputError, match="dtypes differ"):
        triton_prefill.paged_attention_prefill(q.half(), k_pool, v_pool, pos, pos, pos, 1.0)
    with pytest.raises(KernelInputError, match="q_pos: expected shape"):
        triton_prefill.paged_attention_prefill(q, k_pool, v_pool, pos, pos, pos[:2], 1.0)
    with pytest.raises(KernelInputError, match=r"seq_lens: lengths must lie in \[1, 4\]"):
        triton_decode.paged_attention_decode(q, k_pool, v_pool, torch.zeros(3, 4, dtype=torch.long), torch.tensor([1, 0, 2]), 1.0)
    with pytest.raises(KernelInputError, match="slot_table: index -1"):
        table = torch.tensor([[0, 1, -1, -1]] * 3)
        triton_decode.paged_attention_decode(q, k_pool, v_pool, table, torch.tensor([2, 3, 2]), 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_step_after_prefix_equals_explicit_positions(dtype):
    """A prefill step after a prefix (T tail queries, no positions given) uses an additive
    mask kept between calls of one shape; it must equal the explicit-position path exactly,
    also on the second call (the kept mask) and after the shape or dtype changes."""
    gen = torch.Generator().manual_seed(11)
    H, H_kv, D = 6, 2, 32
    for T, S in ((24, 80), (24, 80), (40, 80), (24, 81), (24, 80)):
        q = torch.randn(H, T, D, generator=gen).to(dtype)
        k = torch.randn(H_kv, S, D, generator=gen).to(dtype)
        v = torch.randn(H_kv, S, D, generator=gen).to(dtype)
        got = reference.attention(q, k, v, None, None, 0.125)
        want = reference.attention(q, k, v, torch.arange(S - T, S), torch.arange(S), 0.125)
        assert torch.equal(got, want), (T, S, dtype)
