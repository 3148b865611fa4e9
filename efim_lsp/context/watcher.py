"""File-system watching of workspace folders (watchfiles) on one daemon thread.

The thread only reports: it calls `on_changes(paths)` with the set of absolute paths
that were added, modified or deleted since the last report; deciding what a change
means (re-read, drop, re-scan after a `.gitignore` edit) is the caller's job.

Losing a folder: when a watched root is deleted (or moved away), watchfiles reports it
deleted and then stays silent for it; when the watch itself fails, it ends. Either is a
fault the user should hear about once: one log warning and one `on_problem(message)`
call per lost root (the server turns it into a `window/showMessage`), and `state()`
says "lost" (with the folders) or "stopped" for `efim/stats`. Watching the other roots
goes on; a later `set_roots` that includes the folder again, once it exists, watches it.
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

    def __init__(self, on_changes: Callable[[set[str]], None], *, debounce_ms: int = 300,
                 on_problem: Callable[[str], None] | None = None) -> None:
        self._on_changes = on_changes
        self.on_problem = on_problem  # called on the watcher thread, once per lost folder
        self._lost: set[Path] = set()
        self._stopped: str | None = None
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
            self._lost = {r for r in self._lost if not r.is_dir()}  # a folder back again is watched again
            self._stopped = None
            if roots_t and not self._closed:
                self._stop = threading.Event()
                self._ready = threading.Event()
                self._thread = threading.Thread(
                    target=self._run, args=(roots_t, self._stop, self._ready), name="efim-watch", daemon=True
                )
                self._thread.start()

    def state(self) -> dict[str, object]:
        """For `efim/stats` ("context" → "watch"): "off" (nothing watched), "watching",
        "lost" (`lost`: the folders that disappeared) or "stopped" (`error`: why)."""
        with self._lock:
            lost = sorted(map(str, self._lost))
            if self._stopped is not None:
                return {"state": "stopped", "error": self._stopped, "lost": lost}
            if lost:
                return {"state": "lost", "lost": lost}
            return {"state": "watching" if self._roots else "off"}

    def _problem(self, message: str) -> None:
        log.warning("context: %s", message)
        if self.on_problem is not None:
            try:
                self.on_problem(message)
            except Exception:  # reporting must never end watching
                log.exception("reporting a file watcher problem failed")

    def _check_roots(self, roots: tuple[Path, ...]) -> None:
        """Report (once each) the roots that are gone."""
        for root in roots:
            if root in self._lost or root.is_dir():
                continue
            with self._lock:
                self._lost.add(root)
            self._problem(f"workspace folder {root} disappeared: its files are no longer watched "
                          "(cross-file context keeps what it had read)")

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
                paths = {path for _change, path in changes}
                self._check_roots(roots)
                try:
                    self._on_changes(paths)
                except Exception:  # a bad callback must not end watching
                    log.exception("context: handling file changes failed")
        except Exception as exc:
            log.exception("file watcher for %s stopped", ", ".join(map(str, roots)))
            if not stop.is_set():
                with self._lock:
                    self._stopped = f"{type(exc).__name__}: {exc}"
                self._problem(f"watching {', '.join(map(str, roots))} stopped ({type(exc).__name__}: {exc}); "
                              "files changed on disk are no longer noticed")
        finally:
            ready.set()


__all__ = ["WorkspaceWatcher"]
