"""The engine thread's crashes: whether a dead thread gets a successor, and how the
requests of a scheduler whose thread died end.

An exception escaping `Scheduler.run` kills the engine thread (its steps' own exceptions
are caught inside). `LocalEngine` then starts a fresh scheduler on a new thread, at most
`MAX_RESTARTS` times within `RESTART_WINDOW_S`; past that the engine stays "failed" and
`submit` raises EngineError (a crash at every step would otherwise loop forever).
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from engine.api import Completion, RequestStats, StreamEvent

if TYPE_CHECKING:
    from engine.scheduling.scheduler import Scheduler
    from engine.scheduling.sequence import Sequence

MAX_RESTARTS = 3
RESTART_WINDOW_S = 60.0


class CrashRecord:
    """The engine thread's crashes (`health()`: restarts, the last crash). `lock` is held
    while one crash is dealt with (on the dying thread, or a submitter's watchdog)."""

    def __init__(self, max_restarts: int = MAX_RESTARTS, window_s: float = RESTART_WINDOW_S) -> None:
        self.lock = threading.Lock()
        self.max_restarts = max_restarts
        self.window_s = window_s
        self.restarts = 0
        self.last: str | None = None
        self._times: list[float] = []

    def crashed(self, what: str, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._times = [t for t in self._times if now - t < self.window_s] + [now]
        self.last = what

    @property
    def recent(self) -> int:
        """Crashes within the window, the last one included."""
        return len(self._times)

    def may_restart(self) -> bool:
        return self.recent <= self.max_restarts


def is_out_of_memory(error: str | None) -> bool:
    return bool(error) and ("OutOfMemoryError" in error or "out of memory" in error.lower())


def abandon(scheduler: Scheduler, reason: str) -> int:
    """End every request of a scheduler whose thread died with "error" (queued ones
    included) and fail its idle-work futures (`Scheduler.abandon`); returns how many
    foreground requests were ended. A request whose finish failed (the scheduler's state
    may be half-updated) has its handle completed here: a handle never hangs."""

    def complete_handle(seq: Sequence) -> None:
        handle = getattr(seq.sink, "handle", None)
        if handle is not None and not handle.done:
            completion = Completion(text="", finish_reason="error", stats=RequestStats(), error=reason)
            handle.complete(StreamEvent(kind="error", completion=completion, error=reason))

    return scheduler.abandon(reason, complete_handle)


__all__ = ["MAX_RESTARTS", "RESTART_WINDOW_S", "CrashRecord", "abandon", "is_out_of_memory"]
