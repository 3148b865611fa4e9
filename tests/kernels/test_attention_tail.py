"""The keystroke path of `kernels.reference.attention`: a few queries at the tail of a long
key sequence (T <= 16, prefix >= 256) run as GQA rows through one masked flash call with a
kept [G*T, S] mask. It must equal the explicit-position path (the exact `k_pos <= q_pos`
mask), also when the kept mask is reused and after T, G, S or the dtype change."""

from __future__ import annotations

import pytest
import torch

from kernels import reference


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=str)
def test_keystroke_tail_equals_explicit_positions(dtype, tol):
    gen = torch.Generator().manual_seed(3)
    D = 32
    # (H, H_kv, T, S): repeated shapes reuse the kept mask; the others rebuild it
    for H, H_kv, T, S in ((6, 2, 3, 300), (6, 2, 3, 300), (6, 2, 2, 300), (9, 3, 3, 300), (6, 6, 16, 400),
                          (6, 2, 3, 301)):
        q = torch.randn(H, T, D, generator=gen).to(dtype)
        k = torch.randn(H_kv, S, D, generator=gen).to(dtype)
        v = torch.randn(H_kv, S, D, generator=gen).to(dtype)
        assert T <= reference._TAIL_ROWS and S - T >= reference._TAIL_MIN_PREFIX  # the path under test
        got = reference.attention(q, k, v, None, None, 0.125)
        want = reference.attention(q.float(), k.float(), v.float(), torch.arange(S - T, S), torch.arange(S), 0.125)
        torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def test_tail_rows_see_each_other_causally():
    """Row t must see tail keys 0..t and not t+1..: with values that mark the last key,
    only the last token's rows pick it up."""
    H, H_kv, T, S, D = 4, 2, 3, 260, 8
    q = torch.zeros(H, T, D)
    k = torch.zeros(H_kv, S, D)
    v = torch.zeros(H_kv, S, D)
    v[:, -1] = 1000.0  # only the last key carries a value
    out = reference.attention(q, k, v, None, None, 1.0)  # uniform weights over the visible keys
    assert torch.all(out[:, :-1] == 0)
    assert torch.allclose(out[:, -1], torch.full((H, D), 1000.0 / S))
