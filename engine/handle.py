"""`LocalHandle`: the caller's side of one request to the local engine.

The engine thread pushes events (`_push`, `_complete`); the caller streams them
(`events`), blocks for the completion (`result`), awaits it from an asyncio loop (`wait`)
or cancels. Implements `engine.api.CompletionHandle`.

Threads: `_push` / `_complete` run on the engine thread; the rest on any thread. `wait`
resolves its future on the waiter's own loop (`call_soon_threadsafe`), never on the
engine thread.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from typing import TYPE_CHECKING, Iterator, Protocol

from engine.api import Completion, StreamEvent

if TYPE_CHECKING:
    from engine.scheduling.sequence import Sequence


class Canceller(Protocol):
    def cancel(self, seq: Sequence) -> None: ...


class LocalHandle:
    """A submitted request: stream its events, wait for its completion, cancel it."""

    def __init__(self, request_id: int, scheduler: Canceller) -> None:
        self.request_id = request_id
        self._scheduler = scheduler
        self._events: queue.SimpleQueue[StreamEvent] = queue.SimpleQueue()
        self._done = threading.Event()
        self._completion: Completion | None = None
        self._lock = threading.Lock()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self.sequence: Sequence | None = None

    # --- engine side
    def _push(self, event: StreamEvent) -> None:
        self._events.put(event)

    def _complete(self, event: StreamEvent) -> None:
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
        if self.sequence is not None and not self._done.is_set():
            self._scheduler.cancel(self.sequence)

    @property
    def done(self) -> bool:
        return self._done.is_set()


def _resolve(fut: asyncio.Future, value: Completion | None) -> None:
    if not fut.done():
        fut.set_result(value)


__all__ = ["LocalHandle"]
