"""`EFIM_KERNELS=triton` routes `kernels.<op>` to the Triton kernels on CPU tensors
(interpreter), and every reference op has a Triton counterpart of the same signature."""

from __future__ import annotations

import inspect

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed; the Triton kernels cannot be verified")

import kernels  # noqa: E402
import kernels.triton as triton_ops  # noqa: E402
from kernels import reference  # noqa: E402


@pytest.mark.parametrize("name", kernels.OPS)
def test_every_op_has_a_triton_kernel_with_the_reference_signature(name):
    ours = inspect.signature(getattr(triton_ops, name))
    theirs = inspect.signature(getattr(reference, name))
    assert list(ours.parameters) == list(theirs.parameters)
    assert [p.default for p in ours.parameters.values()] == [p.default for p in theirs.parameters.values()]


def test_forced_triton_runs_the_kernels_through_the_dispatcher(monkeypatch):
    calls: list[str] = []
    real = kernels._triton_ops()
    assert real is not None, "kernels.triton failed to import"
    spied = {name: _spy(name, fn, calls) for name, fn in real.items()}
    monkeypatch.setattr(kernels, "_triton_ops", lambda: spied)
    monkeypatch.setenv("EFIM_KERNELS", "triton")

    gen = torch.Generator().manual_seed(0)
    k_pool = torch.randn(20, 2, 64, generator=gen)
    v_pool = torch.randn(20, 2, 64, generator=gen)
    new_k, new_v = torch.randn(3, 2, 64, generator=gen), torch.randn(3, 2, 64, generator=gen)
    kernels.kv_store(k_pool, v_pool, new_k, new_v, torch.tensor([4, 5, 6]))
    q = torch.randn(3, 4, 64, generator=gen)
    slots, pos = torch.arange(7), torch.arange(7)
    out = kernels.paged_attention_prefill(q, k_pool, v_pool, slots, pos, pos[4:], 0.125)
    assert kernels.backend_for("paged_attention_prefill", q) == "triton"
    assert calls == ["kv_store", "paged_attention_prefill"]
    monkeypatch.setenv("EFIM_KERNELS", "reference")
    torch.testing.assert_close(out, kernels.paged_attention_prefill(q, k_pool, v_pool, slots, pos, pos[4:], 0.125))
    assert calls == ["kv_store", "paged_attention_prefill"]  # the reference path did not call Triton
    assert torch.equal(k_pool[4:7], new_k)


def _spy(name, fn, calls):
    def run(*args, **kwargs):
        calls.append(name)
        return fn(*args, **kwargs)

    return run
