"""`WorkspaceContext`: the completer's `ContextSource`, fed from a running server.

At each request it brings a `ContextGatherer` up to date with the server — workspace
folders (pygls' `workspace.folders`, or the root URI), the open documents (their exact
text from the server's `DocumentStore`; a document that was closed keeps its chunks),
the engine's tokenizer — and asks it for the chunks around the cursor. Nothing here
runs on a timer and nothing needs an extra LSP handler: the server's own state is read
when a completion needs context.

File changes reach the engine too: whenever a file's chunks change (editor or disk), the
engine is told to drop that file's chunk KV (`Engine.forget_context`, when it has one).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Sequence

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


class WorkspaceContext:
    """ContextSource over a ContextGatherer. Call `bind(server)` once the server exists."""

    def __init__(self, gatherer: ContextGatherer | None = None, *, watch: bool = True) -> None:
        self.gatherer = gatherer if gatherer is not None else ContextGatherer(watch=watch)
        self.gatherer.add_listener(self._invalidated)
        self._server: Any = None
        self._seen: dict[str, tuple[int, int]] = {}  # uri -> (version, length) handed to the gatherer
        self._roots: tuple[str, ...] | None = None
        self._engine: Any = None
        self._lock = threading.Lock()

    def bind(self, server: Any) -> "WorkspaceContext":
        self._server = server
        return self

    # -- ContextSource ----------------------------------------------------------------
    def chunks(self, uri: str, text: str, cursor: int, settings: Any) -> Sequence[ContextChunk]:
        if settings.context == "off" or settings.context_chunks <= 0 or settings.context_tokens <= 0:
            return ()
        if self._server is not None:
            try:
                self._sync(self._server)
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
    def _sync(self, server: Any) -> None:
        with self._lock:
            self._sync_documents(server)  # first: a scan must not read an open document from disk
            self._sync_roots(server)
            self._sync_engine(server)

    def _sync_roots(self, server: Any) -> None:
        workspace = server.workspace
        uris = list(getattr(workspace, "folders", {}) or {})
        if not uris and getattr(workspace, "root_uri", None):
            uris = [workspace.root_uri]
        roots = tuple(sorted(p for p in (uri_to_path(u) for u in uris) if "://" not in p))
        if roots != self._roots:
            self._roots = roots
            log.info("context: indexing %s", ", ".join(roots) or "no workspace folder")
            self.gatherer.set_workspaces(list(roots))

    def _sync_documents(self, server: Any) -> None:
        store = getattr(server, "documents", None)
        if store is not None and callable(getattr(store, "uris", None)):
            open_uris = set(store.uris())  # efim's DocumentStore: pygls keeps no copies there
        else:
            open_uris = set(getattr(server.workspace, "text_documents", {}) or {})
        for uri in open_uris:
            doc = store.get(uri) if store is not None else None
            if doc is None:
                pyg = server.workspace.text_documents.get(uri)
                if pyg is None:
                    continue
                version, text = pyg.version or 0, pyg.source
            else:
                version, text = doc.version, doc.text
            mark = (version, len(text))
            if self._seen.get(uri) != mark:
                self._seen[uri] = mark
                self.gatherer.change_document(uri_to_path(uri), text)
        for uri in [u for u in self._seen if u not in open_uris]:
            del self._seen[uri]
            self.gatherer.close_document(uri_to_path(uri))

    def _sync_engine(self, server: Any) -> None:
        engine = getattr(getattr(server, "slot", None), "engine", None)
        if engine is not self._engine:
            self._engine = engine
            counter = getattr(engine, "count_tokens", None)
            self.gatherer.set_token_counter(counter)

    def _invalidated(self, key: str) -> None:
        forget = getattr(self._engine, "forget_context", None)
        if forget is not None:
            try:
                forget(self.gatherer.display_path(key))
            except Exception:
                log.exception("context: engine could not drop the chunk KV of %s", key)


__all__ = ["WorkspaceContext", "uri_to_path"]
