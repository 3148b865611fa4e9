"""context="blend" through LocalEngine on a tiny model: ratio 1.0 gives the full prefill's
output, a reordered context reuses chunk and local KV, the next keystroke reuses the
blended sequence as a plain prefix, and the pool stays consistent."""

from __future__ import annotations

import pytest

from engine.api import ContextChunk, InfillRequest
from engine.local import load_engine
from tiny_models import stdlib_sources


@pytest.fixture(scope="module")
def texts():
    return stdlib_sources(("textwrap.py", "shlex.py", "bisect.py"))


@pytest.fixture(scope="module")
def engine(tiny_model_factory):
    eng = load_engine(str(tiny_model_factory("llama")), dtype="fp32", kv_budget="32M", check_integrity=True)
    yield eng
    eng.close()


def _chunks(texts):
    shlex, bisect = texts[1], texts[2]
    return (
        ContextChunk("shlex.py", shlex[shlex.index("def split(") :][:500]),
        ContextChunk("bisect.py", bisect[bisect.index("def insort_right(") :][:450]),
        ContextChunk("shlex.py", shlex[shlex.index("def quote(") :][:400]),
    )


def _run(eng, **kw):
    kw.setdefault("max_tokens", 8)
    return eng.submit(InfillRequest(**kw)).result(120)


def _settle(eng):
    eng.wait_idle()
    eng.cache.check_integrity()
    eng.scheduler.blend_store.check_integrity()


def test_blend_ratio_one_matches_full_prefill_and_keystrokes_reuse_it(engine, texts):
    src = texts[0]
    at = src.index("def fill(")
    P, S = src[at - 900 : at], src[at : at + 300]
    chunks = _chunks(texts)
    base = dict(prefix=P, suffix=S, format="efim")
    full = _run(engine, key="full", chunks=chunks, context="prefix", cache=False, **base)

    first = _run(engine, key="doc", chunks=chunks, context="blend", blend_ratio=1.0, **base)
    assert first.text == full.text
    assert first.stats.prompt_tokens == full.stats.prompt_tokens
    assert len(engine.scheduler.blend_store) == 3  # each chunk prefilled alone and stored

    reordered = chunks[::-1]
    full2 = _run(engine, key="full", chunks=reordered, context="prefix", cache=False, **base)
    second = _run(engine, key="doc", chunks=reordered, context="blend", blend_ratio=1.0, **base)
    assert second.text == full2.text
    # Chunks came from the store: nothing was prefilled alone this time; ratio 1.0 recomputes every row.
    assert second.stats.prefilled_tokens == second.stats.prompt_tokens - second.stats.reused_tokens

    # The next keystroke (EFIM increment) reuses the blended sequence as an ordinary prefix.
    typed = _run(engine, key="doc", chunks=reordered, context="blend", blend_ratio=1.0, increment="def", **base)
    assert typed.stats.prefilled_tokens <= 3
    assert typed.stats.reused_tokens >= typed.stats.prompt_tokens - 3
    full3 = _run(engine, key="full", chunks=reordered, context="prefix", cache=False, increment="def", **base)
    assert typed.text == full3.text
    _settle(engine)


def test_partial_blend_reuses_chunks_and_the_previous_local_window(engine, texts):
    src = texts[0]
    at = src.index("def dedent(")
    P, S = src[at - 1200 : at], src[at : at + 200]
    chunks = _chunks(texts)
    base = dict(prefix=P, suffix=S, format="efim", context="blend", blend_ratio=0.15)
    _run(engine, key="doc2", chunks=chunks, **base)
    moved = (chunks[1], chunks[2], chunks[0])
    res = _run(engine, key="doc2", chunks=moved, **base)
    st = res.stats
    # Cached rows (chunks + the local prefix from the previous request) dominate.
    assert st.reused_tokens > 0.6 * st.prompt_tokens
    assert st.prefilled_tokens < 0.4 * st.prompt_tokens
    assert st.reused_tokens + st.prefilled_tokens >= st.prompt_tokens - 1
    _settle(engine)


def test_blend_falls_back_cleanly(engine, texts):
    src = texts[0]
    # No chunks: an ordinary prefill; context="off" drops the chunks entirely.
    plain = _run(engine, key="plain", prefix=src[:600], context="blend")
    assert plain.finish_reason in ("length", "eos", "stop")
    off = _run(engine, key="off", prefix=src[:600], chunks=_chunks(texts), context="off", cache=False)
    again = _run(engine, key="off2", prefix=src[:600], context="prefix", cache=False)
    assert off.text == again.text
    # A bad ratio ends that request with an error; the engine keeps serving.
    bad = _run(engine, key="bad", prefix=src[:300], chunks=_chunks(texts)[:1], context="blend", blend_ratio=2.0)
    assert bad.finish_reason == "error" and "ratio" in (bad.error or "")
    ok = _run(engine, key="bad", prefix=src[:300], chunks=_chunks(texts)[:1], context="blend")
    assert ok.finish_reason != "error"
    _settle(engine)


def test_forget_context_drops_a_files_chunk_kv(engine, texts):
    src = texts[0]
    chunks = _chunks(texts)
    _run(engine, key="forget", prefix=src[:700], chunks=chunks, context="blend")
    store = engine.scheduler.blend_store
    origins = {e.origin for e in store._entries.values()}
    assert {"shlex.py", "bisect.py"} <= origins
    engine.forget_context("shlex.py")
    _run(engine, key="forget-2", prefix=src[:100], max_tokens=1)  # any request: the engine steps
    origins = {e.origin for e in store._entries.values()}
    assert "shlex.py" not in origins and "bisect.py" in origins
    _settle(engine)


def test_a_cancel_during_a_blend_stops_it_and_keeps_the_chunks_done(tiny_model_factory, texts, monkeypatch):
    import engine.cacheblend.blend as blend

    eng = load_engine(str(tiny_model_factory("llama")), dtype="fp32", kv_budget="32M", check_integrity=True)
    try:
        src = texts[0]
        at = src.index("def wrap(")
        base = dict(key="doc", prefix=src[at - 600 : at], suffix=src[at : at + 200], format="efim",
                    chunks=_chunks(texts), context="blend", max_tokens=8)
        request = InfillRequest(**base)
        real_prefill, handles, calls = blend.prefill_span, [], []

        def prefill_then_cancel(*args, **kwargs):
            out = real_prefill(*args, **kwargs)
            calls.append(1)
            handles[0].cancel()  # the user typed on while the first chunk was prefilled alone
            return out

        monkeypatch.setattr(blend, "prefill_span", prefill_then_cancel)
        handles.append(eng.submit(request))
        done = handles[0].result(120)
        assert done.finish_reason == "cancelled" and done.text == ""
        assert len(calls) == 1  # stopped before the second chunk, not after the whole blend
        assert len(eng.scheduler.blend_store) == 1  # the chunk it did prefill is kept
        _settle(eng)

        monkeypatch.setattr(blend, "prefill_span", real_prefill)
        again = _run(eng, **base)
        full = _run(eng, **{**base, "key": "full", "context": "prefix", "cache": False})
        assert again.finish_reason != "cancelled" and again.text
        assert len(eng.scheduler.blend_store) == 3
        assert again.stats.prompt_tokens == full.stats.prompt_tokens
        _settle(eng)
    finally:
        eng.close()


def test_check_integrity_runs_on_the_engine_thread_over_every_store(engine, texts, monkeypatch):
    """The server's efim/debug/checkIntegrity used to check the radix cache from an executor
    thread (against the cache's one-thread rule) and skipped the blend store."""
    import threading

    src = texts[0]
    at = src.index("def dedent(")
    _run(engine, key="check", prefix=src[at - 600 : at], suffix=src[at : at + 200], chunks=_chunks(texts), context="blend")
    sch = engine.scheduler
    threads: dict[str, str] = {}
    for name, store in (("cache", sch.cache), ("blend", sch.blend_store), ("retained", sch.retained)):
        real = store.check_integrity

        def spy(real=real, name=name):
            threads[name] = threading.current_thread().name
            real()

        monkeypatch.setattr(store, "check_integrity", spy)
    assert engine.check_integrity().result(60) is None
    assert threads == {"cache": "efim-engine", "blend": "efim-engine", "retained": "efim-engine"}
    assert len(sch.blend_store) > 0 and len(sch.retained) > 0  # the checks had something to check


def test_check_integrity_fails_on_a_corrupted_blend_store(tiny_model_factory, texts):
    eng = load_engine(str(tiny_model_factory("llama")), dtype="fp32", kv_budget="32M")
    try:
        src = texts[0]
        at = src.index("def fill(")
        _run(eng, key="doc", prefix=src[at - 600 : at], suffix=src[at : at + 200], chunks=_chunks(texts), context="blend")
        assert eng.check_integrity().result(60) is None
        store = eng.scheduler.blend_store
        key, entry = next(iter(store._entries.items()))  # noqa: SLF001 - forging the corruption
        store._entries[key] = entry._replace(ids=entry.ids[:-1])  # noqa: SLF001 - rows disagree with slots
        with pytest.raises(AssertionError, match="entry rows disagree"):
            eng.check_integrity().result(60)
        store._entries[key] = entry  # noqa: SLF001
        assert eng.check_integrity().result(60) is None  # the failure did not stop the engine
    finally:
        eng.close()


def test_check_integrity_after_close_fails_instead_of_hanging(tiny_model_factory):
    eng = load_engine(str(tiny_model_factory("llama")), dtype="fp32", kv_budget="8M")
    eng.close()
    with pytest.raises(RuntimeError, match="closed"):
        eng.check_integrity().result(10)
