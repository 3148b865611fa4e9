"""File-system watching of workspace folders (watchfiles) on one daemon thread.

The thread only reports: it calls `on_changes(paths)` with the set of absolute paths
that were added, modified or deleted since the last report; deciding what a change
means (re-read, drop, re-scan after a `.gitignore` edit) is the caller's job.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Callable

from efim_lsp.context.ignore import VENDOR_DIRS

log = logging.getLogger(__name__)


class WorkspaceWatcher:
    """Watches a set of folders; `set_roots` restarts the watch with a new set.

    Contracts: `on_changes` runs on the watcher thread, never concurrently with itself;
    after `close()` returns, it is never called again.
    """

    def __init__(self, on_changes: Callable[[set[str]], None], *, debounce_ms: int = 300) -> None:
        self._on_changes = on_changes
        self._debounce_ms = debounce_ms
        self._roots: tuple[Path, ...] = ()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._lock = threading.Lock()
        self._closed = False

    @property
    def roots(self) -> tuple[Path, ...]:
        return self._roots

    def set_roots(self, roots: list[Path]) -> None:
        with self._lock:
            roots_t = tuple(sorted({Path(r) for r in roots if Path(r).is_dir()}))
            if roots_t == self._roots and self._thread is not None:
                return
            self._stop_thread()
            self._roots = roots_t
            if roots_t and not self._closed:
                self._stop = threading.Event()
                self._ready = threading.Event()
                self._thread = threading.Thread(
                    target=self._run, args=(roots_t, self._stop, self._ready), name="efim-watch", daemon=True
                )
                self._thread.start()

    def wait_started(self, timeout: float = 5.0) -> bool:
        """Block until the current watch is installed (events before that may be missed)."""
        return self._ready.wait(timeout)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._stop_thread()

    def _stop_thread(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=10)
            if self._thread.is_alive():
                log.warning("file watcher thread did not stop within 10 s")
            self._thread = None

    def _run(self, roots: tuple[Path, ...], stop: threading.Event, ready: threading.Event) -> None:
        import watchfiles  # noqa: PLC0415 - the Rust extension loads only when watching starts

        watch_filter = watchfiles.DefaultFilter(ignore_dirs=tuple(VENDOR_DIRS))
        try:
            for changes in watchfiles.watch(
                *roots,
                watch_filter=watch_filter,
                debounce=self._debounce_ms,
                step=50,
                stop_event=stop,
                rust_timeout=200,
                yield_on_timeout=True,
                raise_interrupt=False,
                ignore_permission_denied=True,
            ):
                ready.set()  # the first timeout tick proves the watch is installed
                if stop.is_set():
                    break
                if not changes:
                    continue
                try:
                    self._on_changes({path for _change, path in changes})
                except Exception:  # a bad callback must not end watching
                    log.exception("context: handling file changes failed")
        except Exception:
            log.exception("file watcher for %s stopped", ", ".join(map(str, roots)))
        finally:
            ready.set()


__all__ = ["WorkspaceWatcher"]
