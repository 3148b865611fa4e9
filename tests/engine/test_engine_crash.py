"""The engine thread itself dying (an exception escaping `Scheduler.run`, here a
BaseException injected into one step): `LocalEngine` ends the in-flight requests with an
"error" terminal event (none hangs), reports the crash once through `on_fault`, restarts
the thread with a fresh scheduler, and serves later requests; `health()` says so. Also:
an out-of-memory error during prefill fails only that request and is reported."""

from __future__ import annotations

import threading

import pytest

from engine.runtime import faults
from engine.api import EngineError, InfillRequest
from engine.local import load_engine
from engine.runtime.recovery import MAX_RESTARTS

PREFIX = "def add(a, b):\n    return a + b\n\ndef mul(a, b):\n    "


@pytest.fixture()
def engine(tiny_model_factory):
    eng = load_engine(str(tiny_model_factory("llama")), dtype="fp32", kv_budget="16M")
    reports: list[tuple[str, str]] = []
    eng.on_fault = lambda kind, message: reports.append((kind, message))
    eng.reports = reports
    yield eng
    eng.close()


def request(key: str = "doc", **kw) -> InfillRequest:
    kw.setdefault("max_tokens", 6)
    return InfillRequest(key=key, prefix=PREFIX, suffix="\n", **kw)


def crash_next_step(scheduler, error: BaseException) -> threading.Event:
    """Make the next step of `scheduler` raise `error` (once) after the request is queued."""
    step, fired = scheduler.step, threading.Event()

    def crashing() -> None:
        if not fired.is_set() and scheduler._inbox:
            fired.set()
            raise error
        step()

    scheduler.step = crashing
    return fired


def test_a_dead_engine_thread_fails_in_flight_requests_reports_once_and_restarts(engine):
    assert engine.submit(request("warm")).result(60).finish_reason in ("length", "eos", "stop")
    old_scheduler, old_thread = engine.scheduler, engine._thread
    fired = crash_next_step(old_scheduler, faults.InjectedCrash("boom"))
    with old_scheduler._cond:  # queue three requests before the loop wakes: all are in flight at the crash
        handles = [engine.submit(request(f"doc{i}")) for i in range(3)]
    ends = [h.result(30) for h in handles]  # never hangs
    assert fired.is_set()
    assert [c.finish_reason for c in ends] == ["error"] * 3
    assert all("InjectedCrash: boom" in c.error for c in ends), ends
    for h in handles:  # the stream ends with an error event too
        assert [e.kind for e in h.events(timeout=1)][-1] == "error"
    old_thread.join(5)
    assert not old_thread.is_alive()
    assert engine.scheduler is not old_scheduler and engine._thread.is_alive()
    assert [k for k, _ in engine.reports] == ["engine-crash"]
    assert "3 request(s) failed" in engine.reports[0][1]
    health = engine.health()
    assert health["state"] == "running" and health["restarts"] == 1 and "InjectedCrash" in health["lastCrash"]
    after = engine.submit(request("doc0")).result(60)
    assert after.finish_reason in ("length", "eos", "stop") and after.error is None
    engine.check_integrity().result(30)


def test_a_thread_found_dead_on_submit_is_recovered_by_the_watchdog(engine):
    """A thread that dies without its wrapper recovering (simulated: the recovery is
    skipped once) is found by the next submit."""
    recover = engine._recover
    skipped = threading.Event()

    def skip_once(dead, what):
        if not skipped.is_set():
            skipped.set()
            return
        recover(dead, what)

    engine._recover = skip_once
    crash_next_step(engine.scheduler, SystemExit("gone"))
    stranded = engine.submit(request("a"))
    assert skipped.wait(30)
    engine._thread.join(5)
    assert not engine._thread.is_alive()
    fresh = engine.submit(request("b"))  # the watchdog restarts the engine first
    assert stranded.result(30).finish_reason == "error"  # the request queued before the crash ends too
    assert fresh.result(60).finish_reason in ("length", "eos", "stop")
    assert engine.health()["restarts"] == 1 and "found dead" in engine.health()["lastCrash"]


def test_repeated_crashes_stop_the_engine_instead_of_looping(engine):
    for i in range(MAX_RESTARTS + 1):
        scheduler, thread = engine.scheduler, engine._thread
        crash_next_step(scheduler, faults.InjectedCrash(f"crash {i}"))
        assert engine.submit(request(f"k{i}")).result(30).finish_reason == "error"
        thread.join(10)  # its recovery (and report) is done once the dying thread is gone
        if i < MAX_RESTARTS:
            assert engine.scheduler is not scheduler
    assert engine.health()["state"] == "failed"
    with pytest.raises(EngineError, match="repeated crashes"):
        engine.submit(request("after"))
    assert [k for k, _ in engine.reports] == ["engine-crash"] * MAX_RESTARTS + ["engine-failed"]


def test_out_of_memory_in_the_model_forward_fails_that_request_only(engine, monkeypatch):
    faults.install(engine.scheduler, ["prefill-oom"])
    ok = engine.submit(request("fine")).result(60)
    assert ok.finish_reason != "error"
    oom = engine.submit(request("file:///fault.py")).result(60)
    assert oom.finish_reason == "error" and "OutOfMemoryError" in oom.error
    assert [k for k, _ in engine.reports] == ["out-of-memory"]
    assert engine.health()["outOfMemory"] == 1 and engine.health()["restarts"] == 0
    again = engine.submit(request("file:///fault.py")).result(60)  # the same document, next keystroke
    assert again.finish_reason != "error" and again.error is None
    engine.check_integrity().result(30)
