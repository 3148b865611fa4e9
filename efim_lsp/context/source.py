"""`WorkspaceContext`: the completer's `ContextSource`, fed from a running server.

At each request it brings a `ContextGatherer` up to date with its `ContextHost` (the
server) — workspace folders, the open documents (their exact text; a document that was
closed keeps its chunks), the engine's tokenizer — and asks it for the chunks around the
cursor. Nothing here runs on a timer and nothing needs an extra LSP handler: the host is
read when a completion needs context.

File changes reach the engine too: whenever a file's chunks change (editor or disk), the
engine is told to drop that file's chunk KV (`Engine.forget_context`).

Threads: `chunks` runs on the event loop; invalidations arrive on the event loop (editor
changes) or the context worker (disk changes) and call `forget_context`, which any thread
may call (`engine.api` thread map).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Iterable, Protocol, Sequence

from engine.api import ContextChunk

from efim_lsp.context.gatherer import ContextGatherer

log = logging.getLogger(__name__)


def uri_to_path(uri: str) -> str:
    """A file URI as a file-system path; any other URI unchanged (the gatherer keys it as is)."""
    if uri.startswith("file:"):
        from pygls.uris import to_fs_path  # noqa: PLC0415

        path = to_fs_path(uri)
        if path:
            return path
    return uri


class ContextEngine(Protocol):
    """The two engine calls the context source makes (a subset of `engine.api.Engine`)."""

    def count_tokens(self, text: str) -> int: ...

    def forget_context(self, path: str) -> None: ...


class ContextHost(Protocol):
    """What the context source reads from the server (on the event loop, per request)."""

    def workspace_folders(self) -> Sequence[str]:
        """URIs of the workspace folders (the root URI when the client sent no folders)."""

    def open_documents(self) -> Iterable[tuple[str, int, str]]:
        """(uri, version, text) of every open document, as the server holds it."""

    def context_engine(self) -> ContextEngine | None:
        """The ready engine, or None while none is loaded."""

    # Optional: `show_from_thread(message)`, a warning for the user from any thread (the
    # file watcher reports a lost folder through it).


class WorkspaceContext:
    """ContextSource over a ContextGatherer. Call `bind(host)` once the server exists."""

    def __init__(self, gatherer: ContextGatherer | None = None, *, watch: bool = True) -> None:
        self.gatherer = gatherer if gatherer is not None else ContextGatherer(watch=watch)
        self.gatherer.add_listener(self._invalidated)
        self._host: ContextHost | None = None
        self._seen: dict[str, tuple[int, int]] = {}  # uri -> (version, length) handed to the gatherer
        self._roots: tuple[str, ...] | None = None
        self._engine: ContextEngine | None = None
        self._lock = threading.Lock()

    def bind(self, host: ContextHost) -> "WorkspaceContext":
        self._host = host
        # A lost workspace folder is shown to the user once (the host hops onto its loop).
        report = getattr(host, "show_from_thread", None)
        if report is not None:
            self.gatherer.on_watch_problem(report)
        return self

    # -- ContextSource ----------------------------------------------------------------
    def chunks(self, uri: str, text: str, cursor: int, settings: Any) -> Sequence[ContextChunk]:
        if settings.context == "off" or settings.context_chunks <= 0 or settings.context_tokens <= 0:
            return ()
        if self._host is not None:
            try:
                self._sync(self._host)
            except Exception:  # context is an extra: a sync problem must not fail the completion
                log.exception("context: syncing with the server failed")
        return self.gatherer.select(
            uri_to_path(uri), text, cursor, max_chunks=settings.context_chunks, max_tokens=settings.context_tokens
        )

    def status(self) -> dict[str, object]:
        """Index counters for `efim/stats` ("context"): folders, files, chunks, indexing."""
        return self.gatherer.status()

    def close(self) -> None:
        self.gatherer.close()

    # -- syncing ----------------------------------------------------------------------
    def _sync(self, host: ContextHost) -> None:
        with self._lock:
            self._sync_documents(host)  # first: a scan must not read an open document from disk
            self._sync_roots(host)
            self._sync_engine(host)

    def _sync_roots(self, host: ContextHost) -> None:
        roots = tuple(sorted(p for p in (uri_to_path(u) for u in host.workspace_folders()) if "://" not in p))
        if roots != self._roots:
            self._roots = roots
            log.info("context: indexing %s", ", ".join(roots) or "no workspace folder")
            self.gatherer.set_workspaces(list(roots))

    def _sync_documents(self, host: ContextHost) -> None:
        open_uris: set[str] = set()
        for uri, version, text in host.open_documents():
            open_uris.add(uri)
            mark = (version, len(text))
            if self._seen.get(uri) != mark:
                self._seen[uri] = mark
                self.gatherer.change_document(uri_to_path(uri), text)
        for uri in [u for u in self._seen if u not in open_uris]:
            del self._seen[uri]
            self.gatherer.close_document(uri_to_path(uri))

    def _sync_engine(self, host: ContextHost) -> None:
        engine = host.context_engine()
        if engine is not self._engine:
            self._engine = engine
            self.gatherer.set_token_counter(engine.count_tokens if engine is not None else None)

    def _invalidated(self, key: str) -> None:
        engine = self._engine
        if engine is not None:
            try:
                engine.forget_context(self.gatherer.display_path(key))
            except Exception:
                log.exception("context: engine could not drop the chunk KV of %s", key)


__all__ = ["WorkspaceContext", "ContextHost", "ContextEngine", "uri_to_path"]
