"""`WorkspaceContext`: the completer's `ContextSource`, fed by a running server.

The server pushes what the context depends on, as it happens: the workspace folders
(`set_folders`, at `initialize` and on folder changes), the open documents
(`document_changed` on open and change, `document_closed`, with their exact text; a
document that was closed keeps its chunks) and the serving engine (`set_engine`, its
tokenizer and the chunk KV to drop). Nothing here calls back into the server.

Folders and documents are only noted when they arrive; a `ContextGatherer` is brought up
to date with them when the settings turn context on (`settings_changed`: the server calls
it at `initialized` and at every settings change) and at each request that wants context,
so while `context` is "off" nothing is indexed or chunked. Nothing here runs on a timer.

File changes reach the engine too: whenever a file's chunks change (editor or disk), the
engine is told to drop that file's chunk KV (`Engine.forget_context`). With `context:
"blend"` the likely chunks' KV is computed in the background (`prefetch.ChunkPrefetch`:
the open documents' imports first), again after a change.

Threads: the pushes and `chunks` run on the event loop; `set_engine` may also come from
the thread that closes the server; invalidations arrive on the event loop (editor changes)
or the context worker (disk changes) and call `forget_context`, which any thread may call
(`engine.api` thread map).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from typing import Any, Callable, ContextManager, Iterable, Protocol, Sequence

from engine.api import ContextChunk

from efim_lsp.context.gatherer import ContextGatherer
from efim_lsp.context.import_names import missing_names, site_at, suggestion
from efim_lsp.context.imports import ImportRef, imports_of
from efim_lsp.context.module_names import ModuleNames
from efim_lsp.context.modules import ModuleResolver
from efim_lsp.context.prefetch import MAX_PLANNED, ChunkPrefetch

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
    """The engine calls the context source makes (a subset of `engine.api.Engine`)."""

    def count_tokens(self, text: str) -> int: ...

    def forget_context(self, path: str) -> None: ...

    def computing(self) -> bool: ...


class WorkspaceContext:
    """ContextSource over a ContextGatherer, told by the server what is open and where."""

    def __init__(self, gatherer: ContextGatherer | None = None, *, watch: bool = True) -> None:
        self.gatherer = gatherer if gatherer is not None else ContextGatherer(watch=watch)
        self.gatherer.add_listener(self._invalidated)
        self._folders: tuple[str, ...] = ()  # workspace folder URIs, as pushed
        self._open: dict[str, tuple[int, str]] = {}  # uri -> (version, text) of the open documents, as pushed
        self._seen: dict[str, tuple[int, int]] = {}  # uri -> (version, length) handed to the gatherer
        self._roots: tuple[str, ...] | None = None  # folder paths handed to the gatherer
        self._engine: ContextEngine | None = None
        self._settings: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the server's, seen at a push
        self._lock = threading.Lock()
        self.prefetch = ChunkPrefetch(self._plan, self._wait_indexed)
        self._module_names = ModuleNames()

    # -- what the server pushes ---------------------------------------------------------
    def set_folders(self, uris: Iterable[str]) -> None:
        """The workspace folders' URIs (the root URI when the client sent no folders)."""
        self._folders = tuple(uris)

    def document_changed(self, uri: str, version: int, text: str) -> None:
        """The server's text of a document just opened or changed (exact while it is in sync)."""
        opened = uri not in self._open
        self._note_loop()
        self._open[uri] = (version, text)
        if opened and self._wants_context():
            self.prefetch.kick()  # its imports' chunks first

    def settings_changed(self, settings: Any) -> None:
        """The server's settings (at `initialized` and after each change): with context on,
        index the workspace now, not at the first request; with blend, compute chunk KV."""
        self._settings = settings
        self._note_loop()
        if self._wants_context():
            try:
                self._sync()
            except Exception:
                log.exception("context: syncing with the server's state failed")
        self.prefetch.configure(self._engine, settings)

    def _note_loop(self) -> None:
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:
            pass

    def _wants_context(self) -> bool:
        s = self._settings
        return s is not None and s.context != "off" and s.context_chunks > 0 and s.context_tokens > 0

    def document_closed(self, uri: str) -> None:
        self._open.pop(uri, None)

    def set_engine(self, engine: ContextEngine | None) -> None:
        """The serving engine (None while none is loaded): its tokenizer counts chunk tokens
        and it is told which files' chunk KV to drop."""
        with self._lock:
            if engine is self._engine:
                return
            self._engine = engine
        self.gatherer.set_token_counter(engine.count_tokens if engine is not None else None)
        self.gatherer.gate.watch_engine(engine.computing if engine is not None else None)  # indexing waits while it computes
        self.prefetch.configure(engine, self._settings)  # type: ignore[arg-type]

    def on_watch_problem(self, report: Callable[[str], None] | None) -> None:
        """`report(message)`, from the watcher thread, once per workspace folder the watch
        loses (the server shows it to the user)."""
        self.gatherer.on_watch_problem(report)

    # -- ContextSource ----------------------------------------------------------------
    def import_completion(self, uri: str, text: str, cursor: int, settings: Any) -> str:
        """At a name's place in a `from X import` list, X a module of a workspace folder or an
        open document: the names of X the code below uses and the file does not bind yet, as
        text to insert (`import_names`); "" anywhere else or with `importNames` off. Needs no
        index: X is looked up where it would be imported from, its names read when asked."""
        if not settings.import_names:
            return ""
        try:
            return self._import_completion(uri, text, cursor)
        except Exception:  # an extra: a problem here must not fail the completion
            log.exception("context: import names failed")
            return ""

    def _import_completion(self, uri: str, text: str, cursor: int) -> str:
        site = site_at(text, cursor)
        if site is None:
            return ""
        roots = [p for p in (uri_to_path(u) for u in self._folders) if "://" not in p]
        opened = {uri_to_path(u): t for u, (_v, t) in list(self._open.items())}
        inside = tuple(os.path.join(r, "") for r in roots)

        def exists(path: str) -> bool:  # never a file outside the workspace folders and the open documents
            return path in opened or (path.startswith(inside) and os.path.isfile(path))

        importer = uri_to_path(uri)
        found = ModuleResolver((), roots, exists).resolve(ImportRef(site.module, site.level, None, None, site.line), importer)
        if not found:
            return ""
        names = self._module_names.of(found[0].path, opened.get(found[0].path))
        if not names:
            return ""
        refs = [r for r in imports_of(text) if r.line != site.line]
        elsewhere = {n for r in refs if r.names for n in r.names} | {r.alias for r in refs if r.alias}
        wanted = missing_names(site, text, names, elsewhere)
        line_start = text.rfind("\n", 0, cursor) + 1
        line_end = text.find("\n", cursor)
        return suggestion(site, wanted, text[cursor : len(text) if line_end < 0 else line_end], text[line_start:cursor])

    def chunks(self, uri: str, text: str, cursor: int, settings: Any, anchor: object = None) -> Sequence[ContextChunk]:
        if settings.context == "off" or settings.context_chunks <= 0 or settings.context_tokens <= 0:
            return ()
        try:
            self._sync()
        except Exception:  # context is an extra: a sync problem must not fail the completion
            log.exception("context: syncing with the server's state failed")
        return self.gatherer.select(
            uri_to_path(uri), text, cursor, max_chunks=settings.context_chunks, max_tokens=settings.context_tokens,
            anchor=anchor, strategy=getattr(settings, "context_selection", "bm25"),
        )

    def busy(self) -> ContextManager[None]:
        """A request or a model load runs inside this block: indexing and chunk planning wait
        meanwhile (`foreground.ForegroundGate`)."""
        return self.gatherer.gate.busy()

    def status(self) -> dict[str, object]:
        """Index counters for `efim/stats` ("context"): folders, files, chunks, indexing, and
        the chunk KV computed ahead ("kv": queued, computed, failed, running)."""
        return {**self.gatherer.status(), "kv": self.prefetch.status()}

    def close(self) -> None:
        self.prefetch.close()
        self.gatherer.close()

    # -- chunk KV ahead (prefetch.ChunkPrefetch; these two run off the event loop) ------
    def _wait_indexed(self, timeout: float) -> bool:
        return self.gatherer.wait_idle(timeout)

    def _plan(self, settings: Any) -> list[ContextChunk]:
        """The likely chunks, most likely first: the open documents' imports (last opened
        first), then the workspace's most imported modules."""
        if settings is None or getattr(settings, "context_selection", "imports") != "imports":
            return []  # BM25 chunks depend on the cursor: nothing to compute ahead
        budget = {"max_chunks": settings.context_chunks, "max_tokens": settings.context_tokens,
                  "pause": self.gatherer.gate.pause_point}  # a request or the engine at work: wait
        planned: dict[tuple[str, str], ContextChunk] = {}
        for uri, (_version, text) in reversed(list(self._open.items())):
            for chunk in self.gatherer.import_chunks(uri_to_path(uri), text, **budget):
                planned.setdefault((chunk.path, chunk.text), chunk)
        for chunk in self.gatherer.popular_chunks(limit=MAX_PLANNED, **budget):
            planned.setdefault((chunk.path, chunk.text), chunk)
        return list(planned.values())

    # -- syncing the gatherer with what was pushed --------------------------------------
    def _sync(self) -> None:
        with self._lock:
            self._sync_documents()  # first: a scan must not read an open document from disk
            self._sync_roots()

    def _sync_roots(self) -> None:
        roots = tuple(sorted(p for p in (uri_to_path(u) for u in self._folders) if "://" not in p))
        if roots != self._roots:
            self._roots = roots
            log.info("context: indexing %s", ", ".join(roots) or "no workspace folder")
            self.gatherer.set_workspaces(list(roots))

    def _sync_documents(self) -> None:
        for uri, (version, text) in self._open.items():
            mark = (version, len(text))
            if self._seen.get(uri) != mark:
                self._seen[uri] = mark
                self.gatherer.change_document(uri_to_path(uri), text)
        for uri in [u for u in self._seen if u not in self._open]:
            del self._seen[uri]
            self.gatherer.close_document(uri_to_path(uri))

    def _invalidated(self, key: str) -> None:
        engine = self._engine
        path = self.gatherer.display_path(key)
        if engine is not None:
            try:
                engine.forget_context(path)
            except Exception:
                log.exception("context: engine could not drop the chunk KV of %s", key)
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self.prefetch.forget, path)  # recomputed in the background


__all__ = ["WorkspaceContext", "ContextEngine", "uri_to_path"]
