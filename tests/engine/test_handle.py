"""`RequestHandle` on its own: the engine side (`push`, `complete`) and the caller side
(`events`, `result`, `wait`, `cancel`) with a recording canceller, no engine; and the
stats records' one conversion (`EngineStats.from_counters`)."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

import pytest

from engine.api import TOKEN_COUNTS, Completion, CompletionHandle, EngineStats, RequestStats, StreamEvent
from engine.handle import RequestHandle
from engine.remote.ledger import Ledger


class _Recorder:
    def __init__(self) -> None:
        self.cancelled: list[str] = []

    def cancel(self, work: str) -> None:
        self.cancelled.append(work)


def _done(text: str = "x") -> StreamEvent:
    completion = Completion(text=text, finish_reason="stop", stats=RequestStats())
    return StreamEvent(kind="done", completion=completion)


def test_events_stream_in_order_and_end_with_the_one_terminal_event():
    handle: RequestHandle[str] = RequestHandle(7, _Recorder())
    assert isinstance(handle, CompletionHandle) and handle.request_id == 7 and not handle.done
    handle.push(StreamEvent(kind="token", text="a"))
    handle.push(StreamEvent(kind="token", text="b"))
    handle.complete(_done("ab"))
    assert [e.kind for e in handle.events(timeout=1)] == ["token", "token", "done"]
    assert handle.done and handle.result(0).text == "ab"


def test_result_and_events_time_out_while_the_engine_has_not_completed():
    handle: RequestHandle[str] = RequestHandle(1, _Recorder())
    with pytest.raises(TimeoutError):
        handle.result(0.01)
    with pytest.raises(TimeoutError):
        next(handle.events(timeout=0.01))


def test_cancel_reaches_the_canceller_with_the_work_only_while_the_request_runs():
    recorder = _Recorder()
    handle: RequestHandle[str] = RequestHandle(1, recorder)
    handle.cancel()  # no work attached yet: nothing to cancel
    handle.work = "seq-1"
    handle.cancel()
    handle.complete(_done())
    handle.cancel()  # done: nothing to cancel
    assert recorder.cancelled == ["seq-1"]


def test_wait_resolves_on_the_waiters_loop_when_another_thread_completes():
    handle: RequestHandle[str] = RequestHandle(1, _Recorder())

    async def waiting() -> Completion:
        threading.Timer(0.02, handle.complete, args=(_done("late"),)).start()
        return await asyncio.wait_for(handle.wait(), 5)

    assert asyncio.run(waiting()).text == "late"
    assert asyncio.run(handle.wait()).text == "late"  # completed already: returns at once


@dataclass
class _Counters:
    """Shaped like the scheduler's counters: aligned names and counts of its own."""

    requests: int = 3
    completed: int = 2
    errors: int = 1
    prompt_tokens: int = 40
    warm_ms: float = 12.34
    decode_steps: int = 5
    kv_grow_refused: int = 9


def test_engine_stats_take_every_aligned_count_and_round_warm_ms():
    stats = EngineStats.from_counters(_Counters(), cache_bytes_used=4096, kv_disk="on")
    assert (stats.requests, stats.completed, stats.prompt_tokens, stats.decode_steps) == (3, 2, 40, 5)
    assert stats.warm_ms == 12.3 and stats.cache_bytes_used == 4096 and stats.kv_disk == "on"
    assert stats.cancelled == 0 and stats.evictions == 0  # neither counted nor measured: the default


def test_the_remote_ledger_becomes_engine_stats_in_one_call():
    ledger = Ledger()
    ledger.finished(False, "stop", RequestStats(prompt_tokens=10, reused_tokens=6, prefilled_tokens=4, generated_tokens=3))
    ledger.finished(False, "cancelled", RequestStats(prompt_tokens=5, prefilled_tokens=5))
    ledger.finished(True, "length", RequestStats(prefilled_tokens=7))
    stats = EngineStats.from_counters(ledger)
    assert (stats.requests, stats.completed, stats.cancelled) == (2, 1, 1)
    assert [getattr(stats, n) for n in TOKEN_COUNTS] == [15, 6, 9, 3]
    assert (stats.warm_requests, stats.warm_completed, stats.warm_prefilled_tokens, stats.warm_ms) == (1, 1, 7, 0.0)
    assert stats.kv_disk == "off" and stats.decode_steps == 0
