"""`RequestHandle`: one submitted request, between the engine that computes it and its caller.

Both engines hand these out (`engine.local.LocalEngine`, `engine.remote.RemoteEngine`).
The engine writes: `push` a token event, then `complete` once with the terminal event
(the local engine through its `engine.prompting.RequestSink`, the remote one from its
loop). The caller reads: streams the events (`events`), blocks for the completion
(`result`), awaits it from an asyncio loop (`wait`) or cancels. Implements
`engine.api.CompletionHandle`.

A cancel goes to the engine through the handle's `Canceller`, with the handle's `work`:
what the engine computes the request as (the local engine's `Sequence`, the remote
engine's call), attached by the engine right after it built the handle.

Threads: `push` / `complete` run on the engine's thread (the local engine thread, the
remote loop); the rest on any thread. `wait` resolves its future on the waiter's own loop
(`call_soon_threadsafe`), never on the engine's thread.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from typing import Generic, Iterator, Protocol, TypeVar

from engine.api import Completion, StreamEvent

WorkT = TypeVar("WorkT")
WorkT_contra = TypeVar("WorkT_contra", contravariant=True)


class Canceller(Protocol[WorkT_contra]):
    """Where a handle's cancel goes: the engine, handed the request's `work`. Any thread;
    never blocks; called at most while the request runs."""

    def cancel(self, work: WorkT_contra) -> None: ...


class RequestHandle(Generic[WorkT]):
    """A submitted request: stream its events, wait for its completion, cancel it."""

    def __init__(self, request_id: int, canceller: Canceller[WorkT]) -> None:
        self.request_id = request_id
        self._canceller = canceller
        self._events: queue.SimpleQueue[StreamEvent] = queue.SimpleQueue()
        self._done = threading.Event()
        self._completion: Completion | None = None
        self._lock = threading.Lock()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self.work: WorkT | None = None  # set by the engine once it built the request's work

    # --- engine side
    def push(self, event: StreamEvent) -> None:
        """Engine side: queue a "token" event for the reader."""
        self._events.put(event)

    def complete(self, event: StreamEvent) -> None:
        """Engine side: end the request with its terminal event ("done" or "error", carrying
        the completion), once; wakes `result` and every `wait`."""
        with self._lock:
            self._completion = event.completion
            # done before the event is queued: a consumer woken by the terminal event may
            # check `done` at once (it saw False when the put came first)
            self._done.set()
            self._events.put(event)
            waiters, self._waiters = self._waiters, []
        for loop, fut in waiters:
            try:
                loop.call_soon_threadsafe(_resolve, fut, event.completion)
            except RuntimeError:  # the waiter's loop is closed: nobody is listening
                pass

    # --- caller side
    def events(self, timeout: float | None = None) -> Iterator[StreamEvent]:
        """Blocking iterator over stream events, ending with the terminal one. `timeout`
        bounds the wait for each event (TimeoutError). Single consumer: events are handed
        out once."""
        while True:
            try:
                event = self._events.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"no event from request {self.request_id} within {timeout} s") from None
            yield event
            if event.kind in ("done", "error"):
                return

    def result(self, timeout: float | None = None) -> Completion:
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} not finished within {timeout} s")
        assert self._completion is not None
        return self._completion

    async def wait(self) -> Completion:
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._completion is not None:
                return self._completion
            fut = loop.create_future()
            self._waiters.append((loop, fut))
        return await fut

    def cancel(self) -> None:
        if self.work is not None and not self._done.is_set():
            self._canceller.cancel(self.work)

    @property
    def done(self) -> bool:
        return self._done.is_set()


def _resolve(fut: asyncio.Future, value: Completion | None) -> None:
    if not fut.done():
        fut.set_result(value)


__all__ = ["RequestHandle", "Canceller"]
