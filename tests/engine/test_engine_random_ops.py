"""Random submit / cancel / preempt sequences on the engine alone (tiny model, small KV
budget so that eviction happens), with every KV store's integrity checked after each
sequence (`Engine.check_integrity`, on the engine thread once it is idle).

A sequence is 3-10 random operations on three documents: foreground requests, background
warm-ups (`background=True`) that later foreground requests preempt (another document)
or take over (the same document), cancels right away or after a random pause, pauses,
and `keep_document_pieces` / `forget_document` calls. After the sequence every handle must end
with exactly one terminal event, none with an error, and the contracts of `engine.api`
must hold:
- a background request ends "length" (its prefill done) or "cancelled" — it samples nothing;
- a foreground request nobody cancelled or superseded (a newer foreground request of the
  same key) is never "cancelled": background work never supersedes it.

`make test` runs 200 sequences; EFIM_ENGINE_OPS=1000 runs the long version
(docs/reliability.md has its result)."""

from __future__ import annotations

import os
import random
import time

import pytest

from engine.api import InfillRequest
from engine.local import load_engine
from tiny_models import stdlib_sources

SEQUENCES = int(os.environ.get("EFIM_ENGINE_OPS", "200"))
KEYS = ("a", "b", "c")


@pytest.fixture(scope="module")
def source() -> str:
    return stdlib_sources(("textwrap.py",))[0]


@pytest.fixture(scope="module")
def engine(tiny_model_factory):
    eng = load_engine(str(tiny_model_factory("llama")), dtype="fp32", kv_budget="2M", step_tokens=32,
                      background_step_tokens=16, idle_grace=0.0)
    yield eng
    eng.close()


class _Tracked:
    __slots__ = ("handle", "key", "background", "cancelled_by_us", "superseded")

    def __init__(self, handle, key: str, background: bool) -> None:
        self.handle, self.key, self.background = handle, key, background
        self.cancelled_by_us = False
        self.superseded = False


def _request(rng: random.Random, text: str, key: str, background: bool) -> InfillRequest:
    at = rng.randrange(1500, len(text) - 800)
    return InfillRequest(
        key=key, prefix=text[at - rng.randrange(50, 1500) : at], suffix=text[at : at + rng.randrange(0, 600)],
        increment=text[at : at + rng.randrange(0, 6)] if not background else "",
        max_tokens=rng.randrange(0, 7), format=rng.choice(["efim", "efim", "fim", "prefix"]),
        cache=rng.random() > 0.1, background=background,
    )


def _run_sequence(engine, text: str, rng: random.Random) -> list[_Tracked]:
    tracked: list[_Tracked] = []
    latest_foreground: dict[str, _Tracked] = {}
    for _ in range(rng.randrange(3, 11)):
        roll = rng.random()
        key = rng.choice(KEYS)
        if roll < 0.35:  # foreground: supersedes this key's previous foreground, ends its warm-up
            t = _Tracked(engine.submit(_request(rng, text, key, background=False)), key, False)
            if key in latest_foreground:
                latest_foreground[key].superseded = True
            latest_foreground[key] = t
            tracked.append(t)
        elif roll < 0.65:  # background warm-up
            tracked.append(_Tracked(engine.submit(_request(rng, text, key, background=True)), key, True))
        elif roll < 0.8 and tracked:  # cancel, right away or after a pause
            if rng.random() < 0.5:
                time.sleep(rng.random() * 0.02)
            victim = rng.choice(tracked)
            victim.cancelled_by_us = True
            victim.handle.cancel()
        elif roll < 0.9:
            time.sleep(rng.random() * 0.03)
        else:
            at = rng.randrange(len(text))
            if rng.random() < 0.8:
                engine.keep_document_pieces(key, text, at)
            else:
                engine.forget_document(key)
    return tracked


def test_random_submit_cancel_preempt_sequences_keep_integrity(engine, source):
    rng = random.Random(20261122)
    reasons: dict[str, int] = {}
    started = time.monotonic()
    handles = 0
    for n in range(SEQUENCES):
        tracked = _run_sequence(engine, source, rng)
        for t in tracked:
            events = list(t.handle.events(timeout=120))
            assert sum(e.kind in ("done", "error") for e in events) == 1, (n, events[-3:])
            assert t.handle.done
            reason = t.handle.result(0).finish_reason
            reasons[("bg " if t.background else "fg ") + reason] = reasons.get(("bg " if t.background else "fg ") + reason, 0) + 1
            assert reason != "error", (n, t.handle.result(0))
            if t.background:
                assert reason in ("length", "cancelled"), (n, reason)
            elif not t.cancelled_by_us and not t.superseded:
                assert reason != "cancelled", (n, t.key)
        handles += len(tracked)
        engine.check_integrity().result(120)  # AssertionError from a store names the invariant
    engine.wait_idle(120)
    engine.check_integrity().result(120)
    used, free = engine.cache.usage()
    assert used + free == engine.cache.n_slots * engine.cache.bytes_per_slot
    stats = engine.stats()
    print(f"\n{SEQUENCES} sequences, {handles} requests in {time.monotonic() - started:.1f} s; finish reasons {dict(sorted(reasons.items()))}; "
          f"evictions {stats.evictions}, warm-ups {stats.warm_requests} ({stats.warm_cancelled} cancelled); integrity ok after each sequence")
    assert reasons.get("bg cancelled", 0) > 0 and reasons.get("fg cancelled", 0) > 0  # the run did preempt and cancel
