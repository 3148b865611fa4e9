"""Scheduler rules, driven synchronously with `step()` (no engine thread)."""

from __future__ import annotations

import pytest

from engine.scheduling.scheduler import SOLO_STEP_FACTOR
from engine.scheduling.sequence import Prompt
from scheduler_doubles import Sink, make, job, drain, prompt


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    from engine.model.loader import load_model

    return load_model(str(tiny_model_factory("llama")), dtype="fp32").model


def test_prefill_steps_and_cancel_within_one_step(model):
    s = make(model, step=32)
    sink = Sink(prompt(200))
    j = job(sink)
    s.submit(j)
    s.step()  # admission + first prefill step
    s.step()  # second prefill step
    s.cancel(j)
    s.step()
    reason, stats, _ = sink.finished
    done = 2 * 32 * SOLO_STEP_FACTOR  # two steps, solo-sized (the request is the only work)
    assert reason == "cancelled" and stats.prefilled_tokens == done and sink.tokens == []
    assert s.cache.match(sink.ids).n_tokens == done  # both steps stayed cached
    s.cache.check_integrity()


def test_fully_cached_prompt_still_recomputes_one_token(model):
    s = make(model)
    ids = prompt(100, 1)
    a, b = Sink(ids), Sink(ids)
    s.submit(job(a, "a"))
    drain(s)
    s.submit(job(b, "b"))
    drain(s)
    assert b.finished[1].reused_tokens == 99 and b.finished[1].prefilled_tokens == 1
    assert a.tokens == b.tokens


def test_retained_kv_reuses_generated_tokens(model):
    """An accepted suggestion: the next prompt extends the old one by the generated tokens,
    which never entered the radix tree but are still in the document's retained KV."""
    s = make(model)
    ids = prompt(80, 2)
    first = Sink(ids, max_tokens=6)
    s.submit(job(first, "doc"))
    drain(s)
    accepted = ids + first.tokens[:5]  # the 6th token was sampled but never fed
    assert s.cache.match(accepted).n_tokens == 80  # the tree holds the prompt only ...
    second = Sink(accepted, max_tokens=3)
    s.submit(job(second, "doc"))
    drain(s)
    assert second.finished[1].reused_tokens == len(accepted) - 1  # ... the retained KV the rest
    fresh = Sink(accepted, max_tokens=3)
    s.submit(job(fresh, "other", cache=False))
    drain(s)
    assert fresh.tokens == second.tokens


def test_batched_decode_matches_sequential(model):
    s = make(model)
    sinks = [Sink(prompt(40 + 9 * i, 10 + i), max_tokens=4) for i in range(3)]
    for i, sk in enumerate(sinks):
        s.submit(job(sk, f"b{i}", cache=False))
    drain(s)
    for i, sk in enumerate(sinks):
        alone = Sink(sk.ids, max_tokens=4)
        s.submit(job(alone, f"solo{i}", cache=False))
        drain(s)
        assert alone.tokens == sk.tokens


def test_sequence_kv_grows_and_stops_at_context(model):
    s = make(model)
    s.runner.context_length = ctx = 300  # a short context keeps the decode loop short
    sink = Sink(prompt(200, 3), max_tokens=10_000)
    j = job(sink, "long", cache=False)
    j.max_tokens = 1  # plan a small KV: it must grow while decoding
    s.submit(j)
    drain(s, limit=5000)
    reason, stats, _ = sink.finished
    assert reason == "length" and stats.prompt_tokens + stats.generated_tokens == ctx + 1


def test_prompt_errors_end_the_job_not_the_scheduler(model):
    s = make(model)
    bad = Sink([])
    s.submit(job(bad))
    too_long = Sink(prompt(s.context_length + 5))
    s.submit(job(too_long))
    good = Sink(prompt(20))
    s.submit(job(good))
    drain(s)
    assert bad.finished[0] == "error" and "empty prompt" in bad.finished[2]
    assert too_long.finished[0] == "error" and "context" in too_long.finished[2]
    assert good.finished[0] == "length" and len(good.tokens) == 4
    assert s.counters.errors == 2


def test_a_flood_of_superseding_requests_holds_one_kv_at_a_time(model):
    """Each admission makes the client send a newer request of the same document (a flood:
    keys arrive faster than windows are admitted). One step admits what had arrived when it
    began, and a superseded sequence gives its KV back before the next one is allocated —
    a step that admitted until the inbox ran dry never ended, holding a window's KV per
    request (the soak's 7.8 GB)."""
    s = make(model)
    seqs = []
    live_kv = []

    class FloodSink(Sink):
        def prepare(self, context_length):
            live_kv.append(sum(1 for q in seqs if q.kv is not None))
            if len(seqs) < 50:  # the client types again: this request is superseded
                seqs[-1].cancelled = True
                seqs.append(job(FloodSink(range(1, 40))))
                s.submit(seqs[-1])
            return Prompt(self.ids)

    seqs.append(job(FloodSink(range(1, 40))))
    s.submit(seqs[0])
    s.step()
    assert len(live_kv) == 1, "one step admitted requests that arrived during it"
    drain(s)
    assert len(seqs) == 50
    assert max(live_kv) <= 1, f"superseded sequences still held their KV: {max(live_kv)}"
    assert all(q.sink.finished is not None for q in seqs)
    assert seqs[-1].sink.finished[0] == "length" and all(q.sink.finished[0] == "cancelled" for q in seqs[:-1])


def test_background_step_follows_the_measured_prefill_rate():
    """A background prefill step is sized to take about `background_step_seconds` at the rate
    measured so far: a first guess before any measurement, multiples of 32, bounded by the
    request's step; a keystroke's few rows do not move the rate."""
    from engine.scheduling.steps import PrefillRate

    rate = PrefillRate()
    assert rate.rows_for(0.1, 256) == PrefillRate.FIRST_GUESS
    rate.observe(2, 0.001)  # a keystroke: ignored
    assert rate.rows_per_s is None
    rate.observe(256, 0.1)  # 2,560 rows/s
    assert rate.rows_for(0.1, 256) == 256
    assert rate.rows_for(0.05, 256) == 128
    rate.observe(256, 0.4)  # slower now: 640 rows/s, averaged in
    assert PrefillRate.SMALLEST <= rate.rows_for(0.1, 256) < 256 and rate.rows_for(0.1, 256) % 32 == 0
    slow = PrefillRate()
    slow.observe(64, 1.0)
    assert slow.rows_for(0.1, 256) == PrefillRate.SMALLEST


def test_a_request_alone_prefills_in_larger_steps_and_back_when_another_arrives(model):
    """Solo-sized steps while a request is the only work; the usual step as soon as
    another request is admitted."""
    s = make(model, step=32)
    a = job(Sink(prompt(400), max_tokens=1), "a")
    s.submit(a)
    s.step()
    assert a.n_valid == 32 * SOLO_STEP_FACTOR
    b = job(Sink(prompt(300, 2), max_tokens=1), "b")
    s.submit(b)
    s.step()  # admits b, then a's next step: two sequences prefilling
    assert a.n_valid == 32 * SOLO_STEP_FACTOR + 32
    drain(s)
    assert a.sink.finished[0] == "length" and b.sink.finished[0] == "length"


def test_a_request_past_its_deadline_ends_while_it_waits_behind_another(model):
    """A deadline ends a prefilling request even when it is not its turn (it waited behind
    another request's prefill), and one that expired in the inbox gets no KV at all."""
    import time

    s = make(model, step=32)
    a = job(Sink(prompt(400), max_tokens=1), "a")
    b = job(Sink(prompt(300, 2), max_tokens=1), "b")
    b.deadline = time.monotonic() + 0.05
    s.submit(a)
    s.submit(b)
    s.step()  # admits both; a (the older) prefills first
    assert b.sink.finished is None and b.n_valid == 0
    time.sleep(0.06)
    s.step()
    assert b.sink.finished[0] == "deadline" and b.kv is None
    c = job(Sink(prompt(200, 3), max_tokens=1), "c")
    c.deadline = time.monotonic() - 1
    s.submit(c)
    s.step()
    assert c.sink.finished[0] == "deadline" and c.sink.finished[1].prefilled_tokens == 0
    drain(s)
    assert a.sink.finished[0] == "length"
    s.cache.check_integrity()

