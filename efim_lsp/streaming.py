"""Reading an engine's completion stream on the asyncio loop.

The handle's blocking `events()` iterator runs on a small thread pool and feeds an asyncio
queue, so the server sees the first token when it happens (server-side TTFT) and can stop
decoding as soon as the suggestion is complete (`suggest.shape` says when: a block whose
indentation ended, a line that ended). A stream that is stopped early is still read to its
terminal event in the background, for the engine's counts.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

from efim_lsp.stats import ServerStats
from efim_lsp.suggest import CursorContext, Mode, shape
from engine.api import Completion, CompletionHandle, StreamEvent

# No stream event for this long means the engine is stuck: cancel and decline rather than
# leave the request (and the client's ghost text) hanging. Generous: a cold prefill of a
# full window on a loaded 2-core machine takes tens of seconds.
STREAM_STALL_SECONDS = 180.0


class Streamed(NamedTuple):
    text: str
    first_token_at: float | None  # time.monotonic() of the first token
    completion: Completion | None  # the terminal event's, when it was read
    error: str | None


class StreamReader:
    """Reads completion streams for a server; `close` stops its threads."""

    def __init__(self, workers: int = 8) -> None:
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="efim-stream")
        self._drains: set[asyncio.Task] = set()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def read(
        self, handle: CompletionHandle, ctx: CursorContext, mode: Mode, stats: ServerStats, *, forks: bool = False
    ) -> Streamed:
        """Stream fork 0's text until the suggestion is complete (then cancel the handle) or
        the terminal event. With `forks` (alternatives), a complete suggestion still waits
        for the terminal event — the cancel ends every fork before its next decode step —
        since only that event carries the forks' texts. The engine's counts go to `stats`."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, StreamEvent | None]] = asyncio.Queue()

        def put(item: tuple[float, StreamEvent | None]) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:
                pass  # the loop is gone (shutdown); nobody is listening

        def pump() -> None:
            try:
                for event in handle.events():
                    put((time.monotonic(), event))
                    if event.kind != "token":
                        return
                put((time.monotonic(), None))
            except Exception as exc:
                put((time.monotonic(), StreamEvent(kind="error", error=f"{type(exc).__name__}: {exc}")))

        self._pool.submit(pump)
        stalled = StreamEvent(kind="error", error=f"no output from the engine for {STREAM_STALL_SECONDS:.0f} s")
        # A timer rather than asyncio.wait_for: on 3.11, wait_for can swallow a cancellation
        # that races with a queue item, and `$/cancelRequest` must always cancel.
        timer = loop.call_later(STREAM_STALL_SECONDS, put, (0.0, stalled))
        text = ""
        first: float | None = None
        complete: str | None = None  # fork 0's complete suggestion, while the forks wind down
        try:
            while True:
                at, event = await queue.get()
                timer.cancel()
                if event is stalled:
                    handle.cancel()
                    self._drain(queue, stats)
                    return Streamed(text, first, None, stalled.error)
                timer = loop.call_later(STREAM_STALL_SECONDS, put, (0.0, stalled))
                if event is None:
                    return Streamed(text, first, None, "the engine's stream ended without a result")
                if event.kind == "token":
                    if complete is not None:
                        continue
                    if first is None:
                        first = at
                    text += event.text
                    if shape(text, ctx, mode, done=False).final:
                        handle.cancel()  # the suggestion is complete: stop decoding
                        if forks:
                            complete = text
                            continue
                        self._drain(queue, stats)
                        return Streamed(text, first, None, None)
                    continue
                completion = event.completion
                if completion is not None:
                    stats.add_engine_request(completion.stats)
                if complete is not None:
                    return Streamed(complete, first, completion, None)
                if completion is not None and completion.finish_reason != "cancelled":
                    text = completion.text  # authoritative (stop strings trimmed, healing applied)
                error = event.error if event.kind == "error" else None
                if completion is not None and completion.finish_reason == "error":
                    error = completion.error or "engine error"
                return Streamed(text, first, completion, error)
        except asyncio.CancelledError:
            handle.cancel()
            self._drain(queue, stats)
            raise
        finally:
            timer.cancel()

    def _drain(self, queue: asyncio.Queue, stats: ServerStats) -> None:
        """Read a stopped stream to its terminal event in the background (for its stats)."""

        async def drain() -> None:
            while True:
                _, event = await queue.get()
                if event is None or event.kind != "token":
                    if event is not None and event.completion is not None:
                        stats.add_engine_request(event.completion.stats)
                    return

        task = asyncio.get_running_loop().create_task(drain())
        self._drains.add(task)
        task.add_done_callback(self._drains.discard)


__all__ = ["StreamReader", "Streamed", "STREAM_STALL_SECONDS"]
