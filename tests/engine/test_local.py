"""LocalEngine end to end on a tiny random model: reuse, healing, eviction, cancel,
supersede, over-long prompts, stop strings, error isolation."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.api import Completion, Engine, InfillRequest
from engine.scheduling.scheduler import SOLO_STEP_FACTOR
from engine.local import load_engine
from tiny_models import stdlib_sources


@pytest.fixture(scope="module")
def source() -> str:
    return stdlib_sources(("textwrap.py",))[0]


@pytest.fixture(scope="module")
def engine(tiny_model_factory):
    eng = load_engine(str(tiny_model_factory("llama")), dtype="fp32", kv_budget="32M", check_integrity=True)
    yield eng
    eng.close()


def run(eng, **kw) -> Completion:
    kw.setdefault("key", "doc")
    kw.setdefault("max_tokens", 8)
    return eng.submit(InfillRequest(**kw)).result(60)


def settle(eng):
    eng.wait_idle()
    eng.cache.check_integrity()


def window(source: str, at: int, pre: int = 1200, suf: int = 600) -> tuple[str, str]:
    return source[at - pre : at], source[at : at + suf]


@pytest.mark.parametrize("fmt", ["efim", "fim"])
def test_greedy_output_with_reuse_equals_without(engine, source, fmt):
    at = source.index("def wrap(")
    P, S = window(source, at)
    typed = "def wrap(text, width=70, **kwargs):"
    reused_total = 0
    for n in range(3, 16, 3):  # successive keystrokes of one edit session
        req = dict(key=f"reuse-{fmt}", prefix=P, suffix=S, increment=typed[:n], format=fmt)
        cached = run(engine, **req)
        fresh = run(engine, **{**req, "key": "fresh", "cache": False})
        assert cached.text == fresh.text
        assert fresh.stats.reused_tokens == 0 and fresh.stats.prefilled_tokens == fresh.stats.prompt_tokens
        reused_total += cached.stats.reused_tokens
    assert reused_total > 0
    if fmt == "efim":  # later keystrokes prefill a handful of tokens
        assert cached.stats.prefilled_tokens <= 4 < cached.stats.reused_tokens
    settle(engine)


def test_second_document_reuses_shared_prefix(engine, source):
    P, S = window(source, 5000)
    first = run(engine, key="one", prefix=P, suffix=S)
    second = run(engine, key="two", prefix=P, suffix=S[:-40], increment="x")
    fresh = run(engine, key="three", prefix=P, suffix=S[:-40], increment="x", cache=False)
    assert first.finish_reason in ("length", "eos", "stop")
    assert second.stats.reused_tokens >= engine.count_tokens(P)  # the whole prefix came from the radix tree
    assert second.text == fresh.text
    settle(engine)


@pytest.mark.parametrize("inc", ["    retu", "   "])
def test_token_healing_spells_the_dropped_text_then_goes_on(engine, source, inc):
    """A partial word ("retu") or indentation cut short ("   "): the last token(s) are
    dropped and the greedy answer, masked step by step to agree with their text until it is
    spelled out, is what the engine streams after the typed text."""
    P, S = window(source, 8000)
    c = run(engine, key="heal", prefix=P, suffix=S, increment=inc, heal=True, max_tokens=6)
    tok = engine.tokenizer
    segs = engine.template.render(InfillRequest(key="x", prefix=P, suffix=S, increment=inc))
    enc = tok.encode(segs, heal=True)
    assert enc.healing is not None and c.stats.healed_tokens == len(enc.healing.removed_ids) >= 1
    assert not c.stats.prompt_unfinished  # healed tokens are not prompt rows left to compute
    # Independent check: the prompt without the dropped tokens, then the masked argmax per step.
    model = engine.model
    kv = model.new_kv(len(enc.ids) + 8)
    progress = enc.healing.progress(tok.vocab)
    out: list[int] = []
    with torch.inference_mode():
        logits = model.forward(torch.tensor(enc.ids), kv, 0, "last")[0]
        for step in range(6):
            if progress is not None:
                allowed = progress.allowed()
                token = int(allowed[logits.index_select(0, allowed).argmax()])
                progress = progress.after(token)
            else:
                token = int(logits.argmax())
            if token in engine.end_ids:
                break
            out.append(token)
            logits = model.forward(torch.tensor([token]), kv, len(enc.ids) + step, "last")[0]
    spelled = b"".join(tok.vocab.token_bytes[i] for i in out)
    removed = enc.healing.removed_bytes
    assert spelled.startswith(removed) or removed.startswith(spelled)
    assert c.text == spelled[len(removed) :].decode("utf-8", errors="replace")
    unhealed = run(engine, key="heal2", prefix=P, suffix=S, increment=inc, heal=False, max_tokens=4)
    assert unhealed.stats.healed_tokens == 0
    settle(engine)


def test_the_same_text_under_two_keys_keeps_one_kv_and_each_goes_on_alone(engine, source):
    """Two editor windows on one file (two daemon fronts: two keys, one engine): the second
    reuses the first's rows, and both documents then keep one KV between requests. A key
    typed in one takes that KV (the other's entry goes); the other's next key starts from
    the radix cache's rows; both compute what a fresh prefill does."""
    P, S = window(source, 7000)
    a = run(engine, key="twin-a", prefix=P, suffix=S, increment="x")
    b = run(engine, key="twin-b", prefix=P, suffix=S, increment="x")
    assert b.text == a.text and b.stats.reused_tokens >= b.stats.prompt_tokens - 2
    engine.wait_idle()
    retained = engine.scheduler.retained
    assert retained.match("twin-a").kv is retained.match("twin-b").kv and retained.shared("twin-a")
    a2 = run(engine, key="twin-a", prefix=P, suffix=S, increment="x = ")
    assert retained.match("twin-b") is None  # went with the KV a's key took
    b2 = run(engine, key="twin-b", prefix=P, suffix=S, increment="x =")
    for got, inc in ((a2, "x = "), (b2, "x =")):
        fresh = run(engine, key="fresh", prefix=P, suffix=S, increment=inc, cache=False)
        assert got.text == fresh.text and got.stats.prefilled_tokens <= 3
    engine.wait_idle()
    assert retained.match("twin-a").kv is not retained.match("twin-b").kv  # they differ now
    settle(engine)


def test_stop_strings_cut_the_text(engine, source):
    P, S = window(source, 6000)
    base = run(engine, key="stop", prefix=P, suffix=S, max_tokens=24, cache=False)
    assert len(base.text) > 6
    stop = base.text[3:6]
    cut = run(engine, key="stop", prefix=P, suffix=S, max_tokens=24, stop=(stop,))
    assert cut.finish_reason == "stop"
    assert cut.text == base.text[: base.text.index(stop)]
    settle(engine)


def test_events_stream_and_async_wait(engine, source):
    P, S = window(source, 7000)
    h = engine.submit(InfillRequest(key="ev", prefix=P, suffix=S, max_tokens=6))
    events = list(h.events(timeout=60))
    assert events[-1].kind == "done" and all(e.kind == "token" for e in events[:-1])
    assert "".join(e.text for e in events[:-1]) == events[-1].completion.text
    assert len(events) - 1 >= events[-1].completion.stats.generated_tokens

    async def go():
        h2 = engine.submit(InfillRequest(key="ev2", prefix=P, suffix=S, max_tokens=4))
        return await asyncio.wait_for(h2.wait(), 60)

    done = asyncio.run(go())
    assert done.stats.generated_tokens >= 1
    assert isinstance(engine, Engine)
    settle(engine)


def test_over_long_request_is_cut_not_crashed(engine, source):
    c = run(engine, key="long", prefix=source[:20000], suffix=source[20000:26000], increment="x = ", max_tokens=8)
    ctx = engine.info().context_length
    assert c.finish_reason != "error"
    assert c.stats.prompt_tokens + 8 < ctx
    settle(engine)


def test_max_tokens_zero_warms_the_cache(engine, source):
    P, S = window(source, 9000)
    warm = run(engine, key="warm", prefix=P, suffix=S, max_tokens=0)
    assert warm.text == "" and warm.stats.generated_tokens == 0 and warm.finish_reason == "length"
    again = run(engine, key="warm-other", prefix=P, suffix=S, max_tokens=2)
    assert again.stats.reused_tokens == again.stats.prompt_tokens - 1
    settle(engine)


def test_concurrent_requests_decode_batched_with_same_output(engine, source):
    reqs = [dict(key=f"batch{i}", prefix=window(source, 3000 + 700 * i)[0], max_tokens=10) for i in range(3)]
    alone = [run(engine, **{**r, "cache": False}) for r in reqs]
    handles = [engine.submit(InfillRequest(**r)) for r in reqs]
    together = [h.result(60) for h in handles]
    assert [c.text for c in together] == [c.text for c in alone]
    settle(engine)


def test_engine_thread_survives_a_forced_error(engine, source, monkeypatch):
    P, S = window(source, 4000)
    real = engine.model.forward
    calls = {"n": 0}

    def broken(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected failure")
        return real(*a, **kw)

    monkeypatch.setattr(engine.model, "forward", broken)
    h = engine.submit(InfillRequest(key="err", prefix=P, suffix=S, max_tokens=4))
    events = list(h.events(timeout=60))
    assert events[-1].kind == "error" and "injected failure" in events[-1].error
    assert h.result().finish_reason == "error"
    settle(engine)
    ok = run(engine, key="err", prefix=P, suffix=S, max_tokens=4)
    assert ok.finish_reason in ("length", "eos") and ok.error is None
    settle(engine)


def test_bad_request_parameters_fail_at_submit(engine):
    with pytest.raises(ValueError):
        engine.submit(InfillRequest(key="bad", prefix="x", temperature=-1.0))
    with pytest.raises(TypeError):
        engine.submit({"prefix": "x"})  # type: ignore[arg-type]


def test_count_tokens_and_info(engine):
    assert engine.count_tokens("") == 0
    assert engine.count_tokens("def f(x): return x") == len(engine.tokenizer.encode_text("def f(x): return x"))
    info = engine.info()
    assert info.template == "starcoder" and info.supports_fim and info.dtype == "fp32"


# ---------------------------------------------------------------------- control flow


@pytest.fixture()
def small_step_engine(tiny_model_factory):
    eng = load_engine(str(tiny_model_factory("llama")), dtype="fp32", kv_budget="32M", step_tokens=64,
                      check_integrity=True)
    yield eng
    eng.close()


def test_supersede_by_key(small_step_engine, source):
    eng = small_step_engine
    P, S = window(source, 9000)
    old = eng.submit(InfillRequest(key="k", prefix=P, suffix=S, max_tokens=200))
    new = eng.submit(InfillRequest(key="k", prefix=P, suffix=S, increment="x", max_tokens=3))
    assert old.result(60).finish_reason == "cancelled"
    assert new.result(60).finish_reason in ("length", "eos")
    other = eng.submit(InfillRequest(key="other", prefix=P, max_tokens=2))
    assert other.result(60).finish_reason in ("length", "eos")  # other keys are not touched
    assert eng.stats().cancelled >= 1
    settle(eng)


def test_cancel_mid_prefill_keeps_done_steps(small_step_engine, source, monkeypatch):
    eng = small_step_engine
    P, S = window(source, 12000)
    real = eng.model.forward
    state = {"calls": 0, "handle": None}

    def counting(*a, **kw):
        state["calls"] += 1
        if state["calls"] == 3:
            state["handle"].cancel()  # lands while the third prefill step runs
        return real(*a, **kw)

    monkeypatch.setattr(eng.model, "forward", counting)
    req = InfillRequest(key="c1", prefix=P, suffix=S, max_tokens=4)
    h = eng.submit(req)
    state["handle"] = h
    c = h.result(60)
    assert c.finish_reason == "cancelled"
    step = 64 * SOLO_STEP_FACTOR  # the request is alone in the engine: solo-sized steps
    assert c.stats.prefilled_tokens == 3 * step  # stopped at the step boundary after the cancel
    assert c.stats.prompt_unfinished
    monkeypatch.setattr(eng.model, "forward", real)
    again = eng.submit(InfillRequest(key="c2", prefix=P, suffix=S, max_tokens=4)).result(60)
    assert again.stats.reused_tokens >= 3 * step  # from the radix tree (another key)
    assert not again.stats.prompt_unfinished
    settle(eng)


def test_eviction_under_tiny_budget_keeps_outputs_and_integrity(tiny_model_factory, source):
    path = str(tiny_model_factory("llama"))
    probe = load_engine(path, dtype="fp32", kv_budget="1M")
    per_token = probe.cache.bytes_per_slot
    probe.close()
    eng = load_engine(path, dtype="fp32", kv_budget=per_token * 500, check_integrity=True, retain_documents=0)
    try:
        outs = []
        for i in range(4):
            P, S = window(source, 4000 + 1500 * i, 900, 300)
            outs.append((P, S, run(eng, key=f"d{i}", prefix=P, suffix=S, max_tokens=5)))
        st_ = eng.stats()
        assert st_.evictions > 0 and st_.cache_bytes_used <= st_.cache_bytes_total
        for P, S, c in outs:
            assert run(eng, key="check", prefix=P, suffix=S, max_tokens=5, cache=False).text == c.text
        settle(eng)
    finally:
        eng.close()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(["submit", "cancel", "pause"]), st.integers(0, 2), st.integers(0, 30)),
                min_size=1, max_size=10))
def test_random_submit_cancel_keeps_pool_consistent(small_step_engine, source, ops):
    eng = small_step_engine
    handles = []
    rng = random.Random(len(ops))
    for op, key, n in ops:
        if op == "submit":
            at = 3000 + 400 * key
            handles.append(eng.submit(InfillRequest(
                key=f"r{key}", prefix=source[at - 300 - 10 * n : at], suffix=source[at : at + 200],
                increment=source[at : at + n % 7], max_tokens=1 + n % 5, cache=rng.random() > 0.2,
                format=rng.choice(["efim", "fim", "prefix"]))))
        elif op == "cancel" and handles:
            handles[n % len(handles)].cancel()
        else:
            eng.wait_idle()
    for h in handles:
        events = list(h.events(timeout=60))
        assert sum(e.kind in ("done", "error") for e in events) == 1
        assert h.done and h.result().finish_reason != "error"
    settle(eng)
    used, free = eng.cache.usage()
    assert used + free == eng.cache.n_slots * eng.cache.bytes_per_slot


def test_fit_to_context_order():
    from engine.prompting import fit_to_context
    from engine.text.tokenize import Encoded, SegmentSpan

    roles = [("chunk", 10), ("sentinel", 1), ("prefix", 40), ("sentinel", 1), ("suffix", 40), ("sentinel", 1),
             ("increment", 5)]
    ids, spans = [], []
    for role, n in roles:
        spans.append(SegmentSpan(len(ids), len(ids) + n, role))
        ids += [len(ids) + i for i in range(n)]
    enc = Encoded(ids, tuple(spans), None)
    assert fit_to_context(enc, 200) == ids
    out = fit_to_context(enc, 80)  # 98 -> 80: the chunk (10), then 8 from the suffix's far end
    assert len(out) == 80 and out[:1] == [10] and ids[11:51] == out[1:41]
    assert out[-6:] == ids[-6:] and 83 in out and 84 not in out  # suffix 52..91 lost 84..91
    out = fit_to_context(enc, 40)  # suffix down to 10, then the prefix's left goes
    assert len(out) == 40 and out[-6:] == ids[-6:]
    assert sum(1 for t in out if 52 <= t < 92) == 10 and ids[11] not in out
    assert len(fit_to_context(enc, 2)) == 2


def test_retained_kv_is_charged_to_the_kv_budget(tiny_model_factory, source):
    path = str(tiny_model_factory("llama"))
    probe = load_engine(path, dtype="fp32", kv_budget="1M")
    per_token = probe.cache.bytes_per_slot
    probe.close()
    budget = per_token * 4000
    eng = load_engine(path, dtype="fp32", kv_budget=budget, check_integrity=True, retain_documents=4)
    try:
        # The pool gets 3/4 of the budget; retained KV (>= 768 rows each here) may hold 1/4.
        assert eng.cache.n_slots * per_token <= budget - budget // 4
        for i in range(4):
            P, S = window(source, 3000 + 2000 * i, 700, 200)
            run(eng, key=f"doc{i}", prefix=P, suffix=S, max_tokens=3)
            settle(eng)
            assert eng.scheduler.retained.nbytes() <= budget // 4
            st_ = eng.stats()
            assert st_.cache_bytes_total == budget and st_.cache_bytes_used <= budget
        kept = len(eng.scheduler.retained)
        assert 0 < kept < 4  # the byte limit, not the count, dropped some
        # The hot document still reuses: its retained KV or the radix cache has the prompt.
        P, S = window(source, 3000 + 2000 * 3, 700, 200)
        again = eng.submit(InfillRequest(key="doc3", prefix=P, suffix=S, max_tokens=3)).result(60)
        assert again.stats.reused_tokens >= again.stats.prompt_tokens - 2
    finally:
        eng.close()
