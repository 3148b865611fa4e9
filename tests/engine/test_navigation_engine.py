"""After a jump, on a tiny model: document pieces computed in the background, a window
assembled from them by CacheBlend (exact at ratio 1.0 in fp32), background warm-ups that
give way to requests within one prefill step (the order of engine steps, not wall time), and a
pool that stays consistent through a random jump/type/cancel script."""

from __future__ import annotations

import random
import time

import pytest

from engine.api import InfillRequest
from engine.local import load_engine
from tiny_models import settle, stdlib_sources


@pytest.fixture(scope="module")
def text():
    return stdlib_sources(("textwrap.py",))[0]


@pytest.fixture()
def engine(tiny_model_factory):
    eng = load_engine(
        str(tiny_model_factory("llama")), dtype="fp32", kv_budget="64M", check_integrity=True,
        idle_grace=0.0, background_step_tokens=32,
    )
    yield eng
    eng.close()


def _window(text, at, before=900, after=300):
    start = text.rfind("\n", 0, max(0, at - before)) + 1
    end = text.find("\n", at + after) + 1 or len(text)
    return text[start:at], text[at:end]


def _run(eng, **kw):
    kw.setdefault("max_tokens", 8)
    return eng.submit(InfillRequest(**kw)).result(120)


def test_document_pieces_are_computed_in_the_background_and_forgotten(engine, text):
    engine.keep_document_pieces("doc", text, len(text) // 2)
    settle(engine)
    entries = engine.scheduler.blend_store.entries_of("doc")
    assert entries and engine.scheduler.document_tokens() == sum(len(e.ids) for e in entries)
    assert engine.stats().document_tokens > 0 and engine.stats().warm_prefilled_tokens > 0
    engine.forget_document("doc")
    settle(engine)
    assert engine.scheduler.blend_store.entries_of("doc") == []


def test_an_empty_text_keeps_the_pieces_and_forget_document_drops_them_even_in_flight(engine, text):
    engine.keep_document_pieces("doc", text, len(text) // 2)
    settle(engine)
    kept = [e.ids for e in engine.scheduler.blend_store.entries_of("doc")]
    assert kept
    engine.keep_document_pieces("doc", "", 0)  # an empty text has no pieces: not a forget
    engine.forget_document("other")  # another document's forget leaves these alone
    settle(engine)
    assert [e.ids for e in engine.scheduler.blend_store.entries_of("doc")] == kept
    engine.forget_document("doc")
    settle(engine)
    assert engine.scheduler.blend_store.entries_of("doc") == [] and engine.scheduler.document_tokens() == 0
    # A forget right after a pass starts ends the pass too: nothing of it is computed later.
    engine.keep_document_pieces("doc", text, len(text) // 2)
    engine.forget_document("doc")
    settle(engine)
    assert engine.scheduler.blend_store.entries_of("doc") == [] and engine.scheduler.document_tokens() == 0


def test_a_window_after_a_jump_is_assembled_from_the_pieces_exactly_at_ratio_one(engine, text):
    engine.keep_document_pieces("doc", text, len(text) // 2)
    settle(engine)
    at = text.index("def _split(")
    prefix, suffix = _window(text, at)
    full = _run(engine, key="full", prefix=prefix, suffix=suffix, cache=False)
    exact = _run(engine, key="doc", prefix=prefix, suffix=suffix, document_kv=True, blend_ratio=1.0)
    assert exact.text == full.text
    # A jump elsewhere with the default ratio keeps most rows from the pieces.
    at2 = text.index("def _wrap_chunks(")
    p2, s2 = _window(text, at2)
    blended = _run(engine, key="doc", prefix=p2, suffix=s2, document_kv=True, blend_ratio=0.15)
    st = blended.stats
    assert st.reused_tokens >= 0.5 * st.prompt_tokens, st
    # Without the document's KV a window nobody computed before reuses next to nothing.
    p3, s3 = _window(text, text.index("def dedent("))
    plain = _run(engine, key="other", prefix=p3, suffix=s3, document_kv=False)
    assert plain.stats.reused_tokens < 0.1 * plain.stats.prompt_tokens
    settle(engine)


def test_a_request_starts_within_one_background_step(engine, text):
    trace: list = []
    engine.scheduler.trace = trace
    at = text.index("def fill(")
    prefix, suffix = _window(text, at, before=2400, after=600)
    warm = engine.submit(InfillRequest(key="warm", prefix=prefix, suffix=suffix, max_tokens=0, background=True))
    end = time.monotonic() + 60
    while sum(1 for t in trace if t == ("prefill", "warm", True)) < 2:
        assert time.monotonic() < end
        time.sleep(0.001)
    fg = engine.submit(InfillRequest(key="fg", prefix="def f(x):\n    return", suffix="\n", max_tokens=4))
    fg.result(60)
    warm.result(120)
    admit = trace.index(("admit", "fg", False))
    first_fg = trace.index(("prefill", "fg", False))
    between = [t for t in trace[admit:first_fg] if t[2]]
    assert between == []  # admitted, then computed before any more background work
    before_admit = [i for i, t in enumerate(trace[:admit]) if t == ("prefill", "warm", True)]
    assert before_admit and trace.index(("prefill", "fg", False)) > before_admit[-1]
    assert warm.result().finish_reason == "length"  # it finished its prefill afterwards
    settle(engine)


def _warm_up_running(eng, text, steps: int = 1, idle_only: bool = False) -> tuple:
    """A warm-up of the `fill` window under key "doc", once `steps` of its prefill steps have
    begun: (its handle, the scheduler's trace, prefix, suffix)."""
    at = text.index("def fill(")
    prefix, suffix = _window(text, at, before=2400, after=600)
    trace: list = []
    eng.scheduler.trace = trace
    warm = eng.submit(InfillRequest(key="doc", prefix=prefix, suffix=suffix, max_tokens=0, background=True, idle_only=idle_only))
    end = time.monotonic() + 60
    while trace.count(("prefill", "doc", True)) < steps:
        assert time.monotonic() < end
        time.sleep(0.0005)
    return warm, trace, prefix, suffix


def test_a_warm_up_step_gives_way_between_layers_and_goes_on_from_there(tiny_model_factory, text):
    """A warm-up whose whole prompt is one background step: a request of another document
    that arrives meanwhile is served before that step ends (the step pauses between layers,
    then resumes from the layer it reached), and the warm-up's rows are the ones a plain
    prefill computes: the same document's request after it reuses them all and answers as
    on a fresh engine."""
    eng = load_engine(
        str(tiny_model_factory("llama")), dtype="fp32", kv_budget="64M", check_integrity=True,
        idle_grace=0.0, background_step_tokens=100_000, background_min_slice=0.0,
    )
    try:
        warm, trace, prefix, suffix = _warm_up_running(eng, text)
        fg = _run(eng, key="other", prefix="def f(x):\n    return", suffix="\n")
        assert warm.result(120).finish_reason == "length"
        warm_steps = [i for i, t in enumerate(trace) if t == ("prefill", "doc", True)]
        fg_first = trace.index(("prefill", "other", False))
        # The request came while the warm-up's one step ran: that step paused, the request
        # prefilled, then the step went on (a second note of the same step).
        assert warm_steps[0] < fg_first < warm_steps[-1]
        prompt = warm.result().stats.prompt_tokens
        assert warm.result().stats.prefilled_tokens == prompt
        after = _run(eng, key="doc", prefix=prefix, suffix=suffix, increment="x")
        assert after.stats.reused_tokens >= prompt - 2
        assert fg.text is not None
    finally:
        eng.close()
    fresh = load_engine(str(tiny_model_factory("llama")), dtype="fp32", kv_budget="64M")
    try:
        assert _run(fresh, key="doc", prefix=prefix, suffix=suffix, increment="x").text == after.text
    finally:
        fresh.close()


@pytest.mark.parametrize("share_after", [0.0, 1e9])
def test_a_waiting_warm_up_gets_a_slice_while_foreground_work_goes_on(tiny_model_factory, text, share_after):
    """`background_share_after`: after that many seconds of foreground work a waiting warm-up
    runs a slice between the request's steps (0: after every step); never (1e9): it waits
    until the request is done."""
    eng = load_engine(
        str(tiny_model_factory("llama")), dtype="fp32", kv_budget="64M", check_integrity=True, idle_grace=0.0,
        background_step_tokens=32, background_min_slice=0.0, background_share_after=share_after,
    )
    try:
        warm, trace, _, _ = _warm_up_running(eng, text)
        _run(eng, key="other", prefix="def f(x):\n    return", suffix="\n", max_tokens=24)
        warm.result(120)
        first = trace.index(("prefill", "other", False))
        last = len(trace) - 1 - trace[::-1].index(("decode", "other", False))
        assert last - first >= 10  # the request decoded for a while
        during = [t for t in trace[first:last] if t == ("prefill", "doc", True)]
        if share_after == 0.0:
            assert during  # the warm-up ran between the request's steps
        else:
            assert not during
    finally:
        eng.close()


def test_idle_only_background_work_gets_no_slice_beside_a_request(tiny_model_factory, text):
    """`InfillRequest.idle_only` (chunk KV computed ahead): even with a slice due after every
    foreground step, it waits until the request is done, then finishes."""
    eng = load_engine(
        str(tiny_model_factory("llama")), dtype="fp32", kv_budget="64M", check_integrity=True, idle_grace=0.0,
        background_step_tokens=32, background_min_slice=0.0, background_share_after=0.0,
    )
    try:
        idle, trace, _, _ = _warm_up_running(eng, text, idle_only=True)
        _run(eng, key="other", prefix="def f(x):\n    return", suffix="\n", max_tokens=24)
        assert idle.result(120).finish_reason == "length"
        first = trace.index(("prefill", "other", False))
        last = len(trace) - 1 - trace[::-1].index(("decode", "other", False))
        assert last - first >= 10
        assert ("prefill", "doc", True) not in trace[first:last]
        assert ("prefill", "doc", True) in trace[last:]  # and it went on afterwards
    finally:
        eng.close()


@pytest.mark.parametrize("warm_owner", ["A", "B"])
def test_while_windows_share_the_engine_only_the_served_windows_warm_up_gets_a_slice(tiny_model_factory, text, warm_owner):
    """Two owners (the daemon's fronts) had work a moment ago: a warm-up waiting behind owner
    A's request gets slices between that request's steps only when it is A's own; owner B's
    warm-up (a burst of jumps leaves one behind each) waits until A's request is done."""
    eng = load_engine(
        str(tiny_model_factory("llama")), dtype="fp32", kv_budget="64M", check_integrity=True, idle_grace=0.0,
        background_step_tokens=32, background_min_slice=0.0, background_share_after=0.0,
    )
    try:
        at = text.index("def fill(")
        prefix, suffix = _window(text, at, before=2400, after=600)
        trace: list = []
        eng.scheduler.trace = trace
        eng.scheduler.turns.active(["A", "B"])  # both windows had foreground work just now
        warm = eng.submit(InfillRequest(key="doc", prefix=prefix, suffix=suffix, max_tokens=0, background=True, owner=warm_owner))
        _run(eng, key="other", prefix="def f(x):\n    return", suffix="\n", max_tokens=24, owner="A")
        warm.result(120)
        first = trace.index(("prefill", "other", False))
        last = len(trace) - 1 - trace[::-1].index(("decode", "other", False))
        assert last - first >= 10  # the request decoded for a while
        during = [t for t in trace[first:last] if t == ("prefill", "doc", True)]
        assert bool(during) == (warm_owner == "A"), (warm_owner, len(during))
    finally:
        eng.close()


def test_a_request_of_the_same_document_takes_over_its_warm_up(engine, text):
    warm, _, prefix, suffix = _warm_up_running(engine, text, steps=3)
    real = engine.submit(InfillRequest(key="doc", prefix=prefix, suffix=suffix, increment="x", max_tokens=4)).result(60)
    assert warm.result(60).finish_reason == "cancelled"
    assert warm.result().stats.prefilled_tokens >= 3 * 32
    assert real.stats.reused_tokens >= warm.result().stats.prefilled_tokens  # started from the warm-up's rows
    settle(engine)


def test_random_jump_type_cancel_script_keeps_the_pool_consistent(engine, text):
    rng = random.Random(7)
    doc = text
    handles = []
    for step in range(40):
        at = rng.randrange(200, len(doc) - 200)
        prefix, suffix = _window(doc, at, before=rng.randrange(100, 1500), after=rng.randrange(50, 400))
        kind = rng.random()
        if kind < 0.3:
            handles.append(engine.submit(InfillRequest(key="d", prefix=prefix, suffix=suffix, max_tokens=0, background=True)))
        elif kind < 0.6:
            h = engine.submit(InfillRequest(key="d", prefix=prefix, suffix=suffix, increment="se", max_tokens=3, document_kv=True))
            handles.append(h)
            if rng.random() < 0.5:
                time.sleep(rng.random() * 0.02)
                h.cancel()
        elif kind < 0.8:
            cut = rng.randrange(len(doc) - 50)
            doc = doc[:cut] + "y = 2\n" + doc[cut:]
            engine.keep_document_pieces("d", doc, at)
        else:
            time.sleep(rng.random() * 0.05)
    for h in handles:
        h.result(120)
    settle(engine)
    stats = engine.stats()
    assert stats.cache_bytes_used <= stats.cache_bytes_total


def test_a_file_larger_than_its_share_keeps_the_pieces_around_the_cursor(tiny_model_factory, text):
    eng = load_engine(str(tiny_model_factory("llama")), dtype="fp32", kv_budget="4M", idle_grace=0.0, background_step_tokens=64)
    try:
        big = text * 6
        cursor = len(big) * 2 // 3
        eng.keep_document_pieces("big", big, cursor)
        settle(eng)
        store = eng.scheduler.blend_store
        kept = store.entries_of("big")
        assert 0 < eng.scheduler.document_tokens() <= eng.document_cap_tokens
        assert eng.scheduler.document_tokens() < eng.count_tokens(big) // 2  # not the whole file
        # The piece under the cursor is among them.
        from engine.cacheblend.document_kv import cut_pieces  # noqa: PLC0415

        here = next(p for p in cut_pieces(big) if p.start <= cursor < p.end)
        assert tuple(eng.tokenizer.encode_uncached(big[here.start : here.end])) in {e.ids for e in kept}
        stats = eng.stats()
        assert stats.cache_bytes_used <= stats.cache_bytes_total
    finally:
        eng.close()
