"""CacheBlend on tiny random models (fp32): RoPE-shift exactness, ratio 1.0 == full
prefill, ratio 0 == full reuse, and the exact per-row position mask."""

from __future__ import annotations

import math

import pytest
import torch

import kernels
from engine.cacheblend.blend import BlendCancelled, ReusedSpan, blend_prefill, place_spans
from engine.kv.blend_store import prefill_span

torch.manual_seed(0)


@pytest.fixture(scope="module")
def models(tiny_model_factory):
    from engine.model.loader import load_model

    out = {}
    for arch in ("llama", "qwen2", "starcoder2"):
        out[arch] = load_model(tiny_model_factory(arch), dtype="fp32").model
    return out


def _ids(model, n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (n,), generator=g, dtype=torch.int64)


def _layout(model, seed=0, header=(0,), chunk_lens=(13, 9, 17), local=11):
    """header + chunks + local ids; spans of cached rows taken from each chunk prefilled alone."""
    parts = [torch.tensor(header, dtype=torch.int64)]
    spans = []
    row = len(header)
    for j, n in enumerate(chunk_lens):
        chunk = _ids(model, n, seed * 100 + j)
        c = prefill_span(model, chunk.tolist(), header)
        spans.append(ReusedSpan(row, c.k, c.v, c.positions))
        parts.append(chunk)
        row += n
    parts.append(_ids(model, local, seed * 100 + 99))
    return torch.cat(parts), spans


def _full(model, ids):
    kv = model.new_kv(ids.shape[0])
    logits = model.forward(ids, kv, 0, "last")
    return logits, kv


@pytest.mark.parametrize("arch", ["llama", "qwen2", "starcoder2"])
def test_rope_shift_of_a_chunk_equals_prefilling_it_at_its_offset(models, arch):
    """K of a chunk prefilled alone at positions 0..n-1 and shifted to o..o+n-1 equals K
    of the same chunk prefilled alone (no preceding context) at o..o+n-1, in every layer."""
    model = models[arch]
    n, offset = 21, 437
    ids = _ids(model, n, 7)
    at_zero = prefill_span(model, ids.tolist())  # positions 0..n-1
    assert torch.equal(at_zero.positions, torch.arange(n))

    # Direct: the same chunk alone at positions offset.., rows 0..n-1 of its own workspace.
    direct = model.new_kv(n)
    pos = torch.arange(offset, offset + n)
    h = model.embed(ids)
    for i in range(model.config.n_layers):
        h = model.layer(i, h, pos, direct, rows=torch.arange(n), key_positions=pos)

    placed = model.new_kv(offset + n)
    place_spans(model, placed, [ReusedSpan(offset, at_zero.k, at_zero.v, at_zero.positions)])
    got_k = placed.k[:, :, offset:]  # [L, H_kv, n, D]
    torch.testing.assert_close(got_k, direct.k, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(placed.v[:, :, offset:], direct.v, rtol=2e-5, atol=2e-5)
    assert not torch.allclose(at_zero.k[1:].transpose(1, 2), direct.k[1:], atol=1e-3)  # the shift did something


@pytest.mark.parametrize("arch", ["llama", "qwen2", "starcoder2"])
def test_ratio_one_reproduces_full_prefill(models, arch):
    model = models[arch]
    ids, spans = _layout(model, seed=1)
    want_logits, want_kv = _full(model, ids)
    kv = model.new_kv(ids.shape[0])
    res = blend_prefill(model, ids, kv, spans, ratio=1.0)
    assert res.reused == 0
    assert torch.equal(res.recomputed, torch.arange(ids.shape[0]))
    torch.testing.assert_close(res.logits, want_logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(kv.k, want_kv.k, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(kv.v, want_kv.v, rtol=1e-4, atol=1e-4)


def test_ratio_one_after_an_exact_prefix_and_decode_continues(models):
    """Rows < start come from a prefix cache and are kept; the result is an ordinary
    sequence KV that decoding continues from."""
    model = models["llama"]
    ids, spans = _layout(model, seed=2)
    start = spans[0].end  # header + first chunk are an exact prefix
    want_logits, want_kv = _full(model, ids)
    kv = model.new_kv(ids.shape[0] + 1)
    kv.k[:, :, :start].copy_(want_kv.k[:, :, :start])
    kv.v[:, :, :start].copy_(want_kv.v[:, :, :start])
    res = blend_prefill(model, ids[start:], kv, spans[1:], ratio=1.0, start=start)
    torch.testing.assert_close(res.logits, want_logits, rtol=1e-4, atol=1e-4)
    nxt = torch.tensor([int(res.logits.argmax())])
    got = model.forward(nxt, kv, ids.shape[0], "last")
    full_kv = model.new_kv(ids.shape[0] + 1)
    want = model.forward(torch.cat((ids, nxt)), full_kv, 0, "last")
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_ratio_zero_is_full_reuse(models):
    model = models["qwen2"]
    ids, spans = _layout(model, seed=3)
    kv = model.new_kv(ids.shape[0])
    res = blend_prefill(model, ids, kv, spans, ratio=0.0)
    cached_rows = torch.cat([torch.arange(s.start, s.end) for s in spans])
    assert res.selected == 0 and res.reused == cached_rows.numel()
    assert not bool(torch.isin(res.recomputed, cached_rows).any())
    assert res.uncached == ids.shape[0] - cached_rows.numel()
    placed = model.new_kv(ids.shape[0])
    place_spans(model, placed, spans)
    # Every layer of every cached row is the rotated cache, untouched.
    assert torch.equal(kv.k[:, :, cached_rows], placed.k[:, :, cached_rows])
    assert torch.equal(kv.v[:, :, cached_rows], placed.v[:, :, cached_rows])


def test_selection_takes_the_rows_with_the_highest_layer1_deviation(models):
    model = models["llama"]
    ids, spans = _layout(model, seed=4)
    n_cached = sum(s.k.shape[1] for s in spans)
    kv = model.new_kv(ids.shape[0])
    res = blend_prefill(model, ids, kv, spans, ratio=0.15)
    assert res.selected == math.ceil(0.15 * n_cached)
    assert res.reused == n_cached - res.selected

    # Recompute the deviation independently from a full layer-0 pass.
    placed = model.new_kv(ids.shape[0])
    place_spans(model, placed, spans)
    pos = torch.arange(ids.shape[0])
    h = model.layer(0, model.embed(ids), pos, placed)
    _, v1 = model.project_kv(1, h, pos)
    cached_rows = torch.cat([torch.arange(s.start, s.end) for s in spans])
    dev = kernels.kv_deviation(v1[cached_rows], placed.v[1][:, cached_rows].transpose(0, 1))
    chosen = torch.isin(cached_rows, res.recomputed)
    assert int(chosen.sum()) == res.selected
    assert float(dev[chosen].min()) >= float(dev[~chosen].max())


def test_recomputed_rows_never_see_later_keys(models):
    """Regression guard for the bottom-right causal mask bug of public CacheBlend code:
    garbage in the cached K/V of a later chunk must not change any earlier row."""
    model = models["llama"]
    ids, spans = _layout(model, seed=5, chunk_lens=(15, 15, 15), local=6)
    ids = ids[: spans[2].start]  # header + two chunks; the second one is the "later" one
    good = spans[:2]
    bad = [good[0], good[1]._replace(k=torch.randn_like(good[1].k) * 50, v=torch.randn_like(good[1].v) * 50)]
    kv_good, kv_bad = model.new_kv(ids.shape[0]), model.new_kv(ids.shape[0])
    early = spans[1].start  # rows before the garbage chunk
    for ratio in (0.5, 0.0):
        r_good = blend_prefill(model, ids, kv_good, good, ratio=ratio)
        r_bad = blend_prefill(model, ids, kv_bad, bad, ratio=ratio)
        torch.testing.assert_close(kv_bad.k[:, :, :early], kv_good.k[:, :, :early], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(kv_bad.v[:, :, :early], kv_good.v[:, :, :early], rtol=1e-5, atol=1e-5)
        # One call recomputed scattered rows on both sides of the garbage.
        assert bool((r_good.recomputed < early).any()) and bool((r_good.recomputed >= early).any())
    # With full reuse the garbage does reach the rows after it (so the check above can fail).
    assert not torch.allclose(r_bad.logits, r_good.logits, atol=1e-3)


def test_bad_spans_are_rejected(models):
    model = models["llama"]
    ids, spans = _layout(model, seed=6)
    kv = model.new_kv(ids.shape[0])
    with pytest.raises(ValueError, match="ratio"):
        blend_prefill(model, ids, kv, spans, ratio=1.5)
    with pytest.raises(ValueError, match="overlap"):
        blend_prefill(model, ids, kv, [spans[0], spans[0]], ratio=0.5)
    with pytest.raises(ValueError, match="outside"):
        blend_prefill(model, ids[:5], kv, spans, ratio=0.5)
    with pytest.raises(ValueError, match="capacity"):
        blend_prefill(model, ids, model.new_kv(4), spans, ratio=0.5)


@pytest.mark.parametrize("ratio", [0.0, 0.15])
def test_cancel_is_polled_between_layers(models, ratio):
    model = models["llama"]
    ids, spans = _layout(model, seed=7)
    polls = []

    def cancelled() -> bool:
        polls.append(1)
        return len(polls) >= 2  # a cancel arrives while the first polled layer runs

    with pytest.raises(BlendCancelled):
        blend_prefill(model, ids, model.new_kv(ids.shape[0]), spans, ratio=ratio, cancelled=cancelled)
    assert len(polls) == 2 < model.config.n_layers
    res = blend_prefill(model, ids, model.new_kv(ids.shape[0]), spans, ratio=ratio, cancelled=lambda: False)
    assert res.logits.shape[0] == 1
