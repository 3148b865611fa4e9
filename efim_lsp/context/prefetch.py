"""Chunk KV computed ahead, off the requests' path (`context: "blend"`).

With CacheBlend a chunk's KV is computed once, alone, and reused wherever the chunk lands
in a prompt (`engine.kv.blend_store`). A chunk first met by a request is computed on that
request's path; `ChunkPrefetch` computes the likely chunks before then, as background work
the engine runs only while no request is queued or running (a background blend gives way
between layers when one arrives; `idle_only`: unlike a warm-up, it gets no slice beside a
stream of keystrokes): one chunk at a time, so a warm-up submitted meanwhile waits for at
most one chunk.

Which chunks (`plan`, called off the event loop): the definition chunks of what the open
documents import (most recently opened first), then those of the workspace modules the
most files import. Planned again when a document is opened, a file's chunks change (its
KV was dropped: `ContextGatherer` listeners), the engine or the settings change. Each
chunk is submitted once per text (its path and text identify it, as its KV is keyed by
its tokens); a changed file's new text is a new chunk.

Threads: everything here runs on the event loop except `plan`, which runs on the loop's
default executor (it resolves every indexed file's imports: seconds of Python in a big
workspace, so it waits at the gate's pause points — `foreground.ForegroundGate` — while a
request is answered or the engine computes).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Protocol

from engine.api import ContextChunk, InfillRequest

log = logging.getLogger(__name__)

PREFETCH_KEY = "efim-context-prefetch"  # the engine key of the background requests (one at a time)
MAX_PLANNED = 256  # chunks of the workspace's most imported modules computed ahead at most


class PrefetchEngine(Protocol):
    def submit(self, request: InfillRequest) -> Any: ...


def chunk_key(chunk: ContextChunk) -> tuple[str, str]:
    return (chunk.path, chunk.text)


class ChunkPrefetch:
    def __init__(self, plan: Callable[[Any], list[ContextChunk]], wait_indexed: Callable[[float], bool]) -> None:
        self._plan = plan  # settings -> chunks, most likely first
        self._wait_indexed = wait_indexed  # blocks until the index is built (timeout s) -> done
        self._engine: PrefetchEngine | None = None
        self._settings: Any = None
        self._done: set[tuple[str, str]] = set()
        self._queue: list[ContextChunk] = []
        self._dirty = True
        self._task: asyncio.Task | None = None
        self.submitted = 0
        self.computed = 0
        self.failed = 0

    def configure(self, engine: PrefetchEngine | None, settings: Any) -> None:
        """The serving engine (None while loading) and the settings; starts the work when
        both allow it (a local engine, `context: "blend"`)."""
        changed = engine is not self._engine
        self._engine, self._settings = engine, settings
        if changed:
            self._done.clear()  # a new engine holds no chunk KV
        self.kick()

    def forget(self, path: str) -> None:
        """The file shown as `path` changed: its chunks' KV was dropped."""
        self._done = {k for k in self._done if k[0] != path}
        self.kick()

    def kick(self) -> None:
        """Plan again, and start working if idle (from the event loop; elsewhere a no-op)."""
        self._dirty = True
        if not self._enabled():
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._run())

    def _enabled(self) -> bool:
        engine, settings = self._engine, self._settings
        if engine is None or settings is None or getattr(settings, "context", "off") != "blend" or not getattr(settings, "cache", True):
            return False
        try:
            info = engine.info()  # type: ignore[attr-defined]
        except Exception:
            return False
        return getattr(info, "kv_dtype", None) is not None  # the local engine's KV (a remote one has no blend store)

    def status(self) -> dict[str, object]:
        return {
            "queued": len([c for c in self._queue if chunk_key(c) not in self._done]),
            "computed": self.computed,
            "failed": self.failed,
            "running": self._task is not None and not self._task.done(),
        }

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._enabled():
                if self._dirty:
                    self._dirty = False
                    settings = self._settings
                    indexed = await loop.run_in_executor(None, self._wait_indexed, 600.0)
                    if not indexed:
                        log.info("context: the index is still building after 600 s; chunk KV is computed after it")
                        self._dirty = True
                        continue
                    self._queue = await loop.run_in_executor(None, self._plan, settings)
                todo = next((c for c in self._queue if chunk_key(c) not in self._done), None)
                if todo is None:
                    if not self._dirty:
                        return
                    continue
                await self._compute(todo)
        except asyncio.CancelledError:
            raise
        except Exception:  # computing ahead is an optimisation: never let it hurt the server
            log.exception("context: computing chunk KV ahead failed")

    async def _compute(self, chunk: ContextChunk) -> None:
        engine, settings = self._engine, self._settings
        self._done.add(chunk_key(chunk))  # once per text, whatever happens
        if engine is None or settings is None:
            return
        request = InfillRequest(
            key=PREFETCH_KEY, prefix="", chunks=(chunk,), format=settings.prompt_format, context="blend",
            max_tokens=1, blend_ratio=settings.blend_ratio, background=True, idle_only=True,
        )
        try:
            handle = engine.submit(request)
        except Exception as exc:
            log.debug("context: chunk KV request refused: %s", exc)
            self.failed += 1
            return
        self.submitted += 1
        completion = await handle.wait()
        if completion is not None and completion.finish_reason in ("length", "stop"):
            self.computed += 1
        else:
            self.failed += 1
            log.debug("context: chunk KV of %s ended %s", chunk.path, getattr(completion, "finish_reason", None))

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()


__all__ = ["ChunkPrefetch", "PREFETCH_KEY", "MAX_PLANNED", "chunk_key"]
