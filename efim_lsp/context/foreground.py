"""Background context work gives way to foreground work.

Indexing a workspace is Python on a worker thread: while it runs it holds the GIL but for
the interpreter's switch interval, and every thread that wants the GIL back — the event
loop reading a keystroke, the engine thread between two torch calls — waits up to that
interval each time (measured: a model load 3 s → 25 s and keystroke TTFT 3× while 3,000
files were indexed; `efim bench workspace`). So the worker checks in between files: while a
request is being answered or a model is loading (`ForegroundGate.busy`), it waits
(`pause_point`), at most `MAX_PAUSE_S` at a time so a stream of requests slows indexing
down without stopping it. The same while this process's engine thread computes anything
(`Engine.computing`: a warm-up, document pieces, chunk KV), polled every `POLL_S`: a request
arriving then waits for the step in progress, and that step must not crawl.

Threads: `busy` is entered and left on any thread (the event loop's requests, a loader);
`pause_point` is called by background threads only.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable, Iterator

MAX_PAUSE_S = 2.0  # longest wait at one pause point: background work still moves under constant load
POLL_S = 0.005  # how often a paused thread looks at the engine again


class ForegroundGate:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._busy = 0
        self._engine_computing: Callable[[], bool] = lambda: False
        self.paused_s = 0.0  # background time spent waiting, for `efim/stats`

    def watch_engine(self, computing: Callable[[], bool] | None) -> None:
        """`computing()`: True while the engine thread has work (None: no engine to wait for)."""
        self._engine_computing = computing or (lambda: False)

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """Foreground work runs inside this block; background work waits meanwhile."""
        with self._cond:
            self._busy += 1
        try:
            yield
        finally:
            with self._cond:
                self._busy -= 1
                if self._busy == 0:
                    self._cond.notify_all()

    @property
    def is_busy(self) -> bool:
        return self._busy > 0 or self._computing()

    def _computing(self) -> bool:
        try:
            return bool(self._engine_computing())
        except Exception:  # an engine closing under us: nothing to wait for
            return False

    def pause_point(self, max_wait_s: float = MAX_PAUSE_S) -> None:
        """Return at once when nothing foreground runs and the engine is idle; else when
        both are, or after `max_wait_s`."""
        if not self.is_busy:
            return
        started = time.monotonic()
        deadline = started + max_wait_s
        with self._cond:
            while self.is_busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                # Requests notify when they end; the engine is polled.
                self._cond.wait(min(left, POLL_S) if self._busy == 0 else left)
        self.paused_s += time.monotonic() - started


__all__ = ["ForegroundGate", "MAX_PAUSE_S"]
