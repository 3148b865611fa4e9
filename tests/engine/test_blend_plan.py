"""Planning a blend from a rendered prompt: chunk rows, the blend store, and local
segments reused from the document's previous sequence."""

from __future__ import annotations

import pytest
import torch

from engine.api import ContextChunk, InfillRequest
from engine.cacheblend.blend import (
    BlendRequest,
    blend_prefill,
    blend_request,
    blend_sequence,
    chunk_units,
    find_run,
    plan_spans,
    previous_spans,
)
from engine.kv.blend_store import BlendStore
from engine.kv.radix import RadixCache
from engine.text.templates import detect_template
from tiny_models import stdlib_sources
from engine.text.tokenize import SegmentTokenizer

CHUNKS = (
    ContextChunk("pkg/a.py", "def alpha(x):\n    return x + 1\n"),
    ContextChunk("pkg/b.py", "class Beta:\n    def run(self):\n        return alpha(2)\n"),
)


@pytest.fixture(scope="module")
def tiny(tiny_model_factory):
    from engine.model.loader import load_model

    loaded = load_model(tiny_model_factory("llama"), dtype="fp32")
    return loaded.model, detect_template(loaded.tokenizer), SegmentTokenizer(loaded.tokenizer)


def _store(model, slots=4096):
    c = model.config
    cache = RadixCache(n_layers=c.n_layers, n_kv_heads=c.n_kv_heads, head_dim=c.head_dim, dtype=torch.float32,
                       budget_bytes=slots * 2 * c.n_layers * c.n_kv_heads * c.head_dim * 4)
    return cache, BlendStore(cache, blend_store_share=0.5)


def _encode(tpl, tok, chunks, prefix, suffix="", increment=""):
    req = InfillRequest(key="k", prefix=prefix, suffix=suffix, increment=increment, chunks=chunks, format="efim")
    return tok.encode(tpl.render(req))


def test_find_run():
    assert find_run([1, 2, 3, 4, 5], [3, 4]) == 2
    assert find_run([1, 2, 3], [3, 4]) == -1
    assert find_run([256, 1], [1]) == 1  # byte-level false match at an unaligned offset is skipped
    assert find_run([], [1]) == -1 and find_run([1], []) == -1


def test_chunk_units_cover_separator_and_text(tiny):
    model, tpl, tok = tiny
    assert tpl.file_sep_id is not None  # the tiny tokenizer has <file_sep>
    enc = _encode(tpl, tok, CHUNKS, "x = alpha(1)\n")
    units = chunk_units(enc.spans)
    assert len(units) == 2
    for (s, e), chunk in zip(units, CHUNKS):
        assert enc.ids[s] == tpl.file_sep_id
        text = b"".join(tok.vocab.token_bytes[i] for i in enc.ids[s + 1 : e]).decode()
        assert text == f"{chunk.path}\n{chunk.text}"
    assert units[0][1] == units[1][0]


def test_plan_uses_the_store_and_the_previous_sequence(tiny):
    model, tpl, tok = tiny
    source = stdlib_sources(("textwrap.py",))[0]
    prefix = source[:1500]
    first = _encode(tpl, tok, CHUNKS, prefix, suffix="\n")
    second = _encode(tpl, tok, CHUNKS[::-1], prefix, suffix="\n")  # chunk order changed
    cache, store = _store(model)
    units1 = chunk_units(first.spans)
    plan1 = plan_spans(model, store, first.ids, units1, origins=["pkg/a.py", "pkg/b.py"])
    assert (plan1.chunk_hits, plan1.chunk_misses) == (0, 2)
    assert plan1.prefilled == sum(e - s for s, e in units1)
    # Request 1 runs; its sequence is what the document keeps.
    kv1 = model.new_kv(len(first.ids))
    blend_prefill(model, torch.tensor(first.ids), kv1, plan1.spans, ratio=1.0)

    units2 = chunk_units(second.spans)
    local2 = [(s.start, s.end) for s in second.spans if s.role in ("prefix", "suffix")]
    extra = previous_spans(first.ids, kv1, second.ids, local2)
    plan2 = plan_spans(model, store, second.ids, units2, extra=extra)
    assert (plan2.chunk_hits, plan2.chunk_misses, plan2.prefilled) == (2, 0, 0)
    (p_start, p_end) = next((s.start, s.end) for s in second.spans if s.role == "prefix")
    assert plan2.from_previous == p_end - p_start  # the suffix "\n" is shorter than MIN_REUSED_RUN
    span = next(sp for sp in plan2.spans if sp.start == p_start)
    old = find_run(first.ids, second.ids[p_start:p_end])
    assert torch.equal(span.positions, torch.arange(old, old + p_end - p_start))
    assert torch.equal(span.v, kv1.v[:, :, old : old + p_end - p_start].transpose(1, 2))
    assert store.forget_origin("pkg/b.py") == 1
    cache.check_integrity()
    store.check_integrity()


def test_blend_sequence_at_ratio_one_after_a_reorder_equals_full_prefill(tiny):
    assert blend_request(InfillRequest(key="k", prefix="x"), _encode(*tiny[1:], (), "x"), tiny[1]) is None
    model, tpl, tok = tiny
    source = stdlib_sources(("shlex.py",))[0]
    first = _encode(tpl, tok, CHUNKS, source[:800], suffix=source[800:900])
    second = _encode(tpl, tok, CHUNKS[::-1], source[:800], suffix=source[800:900])
    cache, store = _store(model)
    kv1 = model.new_kv(len(first.ids))
    model.forward(torch.tensor(first.ids), kv1, 0, "none")
    request = InfillRequest(key="k", prefix=source[:800], suffix=source[800:900], chunks=CHUNKS[::-1], blend_ratio=1.0)
    req = blend_request(request, second, tpl)
    assert req.units == tuple(chunk_units(second.spans)) and req.origins == ("pkg/b.py", "pkg/a.py")
    assert [second.spans[i].role for i in range(len(second.spans)) if (second.spans[i].start, second.spans[i].end) in req.segments] == ["prefix", "suffix"]
    assert req.wanted(0) and not req.wanted(len(second.ids))
    # Writing into the very workspace that holds the previous sequence (the scheduler reuses it).
    extra = previous_spans(first.ids, kv1, second.ids, req.segments)
    out = blend_sequence(model, store, second.ids, kv1, 0, req, extra)
    assert out.reused == 0 and out.recomputed == len(second.ids)
    ref = model.new_kv(len(second.ids))
    want = model.forward(torch.tensor(second.ids), ref, 0, "last")
    torch.testing.assert_close(out.logits, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(kv1.k[:, :, : len(second.ids)], ref.k, rtol=1e-4, atol=1e-4)
    # At 0.15 most cached rows are kept, and the result is still close to the full prefill.
    kv2 = model.new_kv(len(first.ids))
    model.forward(torch.tensor(first.ids), kv2, 0, "none")
    extra = previous_spans(first.ids, kv2, second.ids, req.segments)
    part = blend_sequence(model, store, second.ids, kv2, 0, req._replace(ratio=0.15), extra)
    assert part.reused > part.recomputed


def test_previous_spans_reuse_runs_of_moved_windows(tiny):
    """After a cursor move the prefix window grew and the suffix lost its first lines:
    runs of both are still found in the previous sequence, at their old rows."""
    model, tpl, tok = tiny
    src = stdlib_sources(("textwrap.py",))[0]
    a, b = 3000, 3400  # cursor before and after the move
    old = _encode(tpl, tok, CHUNKS, src[1000:a], suffix=src[a:a + 1200])
    new = _encode(tpl, tok, CHUNKS[::-1], src[1000:b], suffix=src[b:a + 1500])
    kv = model.new_kv(len(old.ids))
    model.forward(torch.tensor(old.ids), kv, 0, "none")
    segs = [(s.start, s.end) for s in new.spans if s.role in ("prefix", "suffix")]
    spans = previous_spans(old.ids, kv, new.ids, segs)
    covered = sum(sp.k.shape[1] for sp in spans)
    old_text_tokens = sum(e - s for s, e in segs) - tok.count(src[a + 1200 : a + 1500])  # text the old prompt had
    assert covered >= 0.8 * old_text_tokens
    for sp in spans:
        n = sp.k.shape[1]
        old_rows = sp.positions
        assert [old.ids[int(r)] for r in old_rows] == new.ids[sp.start : sp.start + n]
        assert torch.equal(sp.k, kv.k[:, :, int(old_rows[0]) : int(old_rows[0]) + n].transpose(1, 2))
    assert previous_spans(old.ids, kv, new.ids, segs, start=len(new.ids)) == []


def test_a_chunk_cut_by_the_exact_prefix_keeps_its_cached_tail(tiny):
    """Regression: a radix match ending inside the first chunk (e.g. its shared `# path`
    header tokens) made the whole chunk count as uncached, recomputing it in every layer."""
    model, tpl, tok = tiny
    enc = _encode(tpl, tok, CHUNKS, "x = 1\n")
    units = chunk_units(enc.spans)
    cache, store = _store(model)
    s, e = units[0]
    plan = plan_spans(model, store, enc.ids, units, start=s + 3)
    first = plan.spans[0]
    assert first.start == s + 3 and first.end == e
    whole = store.load(store.match(enc.ids[s:e]))
    assert torch.equal(first.k, whole.k[:, 3:]) and torch.equal(first.positions, whole.positions[3:])
    assert len(plan.spans) == len(units)
