"""Alternatives (`InfillRequest.n`): one prefill, n forks decoded together, fork 0 the
greedy answer, cancelling the request ends every fork (tiny random model, fp32)."""

from __future__ import annotations

import pytest

from engine.api import Completion, InfillRequest
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
    kw.setdefault("max_tokens", 12)
    return eng.submit(InfillRequest(**kw)).result(60)


def settle(eng) -> None:
    eng.wait_idle()
    eng.check_integrity().result(30)
    assert eng.scheduler._decoding == [] and eng.scheduler._prefilling == []


@pytest.mark.parametrize("at", [2000, 5000, 8000, 11000])
def test_fork_zero_is_the_greedy_answer_and_the_prompt_is_prefilled_once(engine, source, at):
    req = dict(prefix=source[at - 800 : at], suffix=source[at : at + 300], increment="    ", cache=False)
    single = run(engine, key=f"one-{at}", **req)
    before = engine.stats()
    multi = run(engine, key=f"three-{at}", n=3, alternatives_temperature=0.8, alternatives_top_p=0.95, **req)
    after = engine.stats()
    assert multi.text == single.text
    assert multi.finish_reason == single.finish_reason
    assert single.alternatives == () and single.alternatives_finish == ()
    assert len(multi.alternatives) == len(multi.alternatives_finish) == 2
    # One prefill: the request's own figures and the engine's counters both say so.
    assert multi.stats.prefilled_tokens == single.stats.prefilled_tokens == single.stats.prompt_tokens
    assert after.prefilled_tokens - before.prefilled_tokens == single.stats.prefilled_tokens
    assert after.requests - before.requests == 1
    # The forks' tokens are counted as generated work.
    assert after.generated_tokens - before.generated_tokens > multi.stats.generated_tokens
    settle(engine)


def test_alternatives_are_sampled_reproducibly_and_differ(engine, source):
    at = source.index("def wrap(")
    req = dict(prefix=source[at - 1000 : at], suffix=source[at : at + 400], increment="def ", n=4, max_tokens=10)
    first = run(engine, key="rep-a", **req)
    again = run(engine, key="rep-b", **req)
    assert first.alternatives == again.alternatives  # fixed per-request seeds
    assert first.text == again.text
    # Sampled at temperature 0.8 from a random model: the forks do not all repeat the greedy text.
    assert len({first.text, *first.alternatives}) > 1, (first.text, first.alternatives)
    other_seed = run(engine, key="rep-c", seed=1000, **req)
    assert other_seed.text == first.text and other_seed.alternatives != first.alternatives
    settle(engine)


def test_cancel_ends_every_fork(engine, source):
    at = 6000
    handle = engine.submit(
        InfillRequest(key="cancel", prefix=source[at - 1000 : at], suffix=source[at : at + 200], n=3, max_tokens=400)
    )
    events = handle.events(timeout=60)
    first = next(events)
    assert first.kind == "token"  # fork 0 sampled its first token: the forks exist now
    handle.cancel()
    done = handle.result(60)
    assert done.finish_reason == "cancelled"
    assert done.alternatives_finish == ("cancelled", "cancelled")
    assert [e.kind for e in events][-1] == "done"  # exactly one terminal event
    assert done.stats.generated_tokens < 400
    settle(engine)


def test_a_superseding_request_cancels_the_forks_of_the_old_one(engine, source):
    at = 7000
    req = dict(key="super", prefix=source[at - 1000 : at], suffix=source[at : at + 200])
    old = engine.submit(InfillRequest(n=3, max_tokens=400, **req))
    next(old.events(timeout=60))
    new = engine.submit(InfillRequest(n=2, max_tokens=6, increment="x", **req))
    gone = old.result(60)
    assert gone.finish_reason == "cancelled" and set(gone.alternatives_finish) == {"cancelled"}
    assert len(new.result(60).alternatives) == 1
    settle(engine)


def test_background_requests_ignore_n_and_bad_n_is_refused(engine, source):
    at = 4000
    warm = engine.submit(InfillRequest(key="warm", prefix=source[at - 500 : at], n=4, background=True)).result(60)
    assert warm.alternatives == () and warm.stats.generated_tokens == 0
    for bad in (0, 9):
        with pytest.raises(ValueError):
            engine.submit(InfillRequest(key="bad", prefix="x", n=bad))
    settle(engine)
