"""The pygls language server: the state its handlers share, and `build_server`.

`EfimServer` holds exactly one of each part — documents, settings, stats, the engine holder,
the completer, the context source — and the services around them: settings updates,
engine loads (with `$/progress`), position conversion at the LSP edge, stdio serving.
The handlers are thin and grouped by concern in `efim_lsp.handlers` (lifecycle,
documents, completion, the custom `efim/*` protocol, described there); logic lives
elsewhere: sessions (`session.py`), windows (`window.py`), suggestions (`suggest.py`),
typing-through, the engine holder, stats.

The context source is told, never asked: the document and folder handlers push what is
open and where, and the engine holder pushes each new engine
(`efim_lsp.context.source.WorkspaceContext`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from lsprotocol import types
from pygls.exceptions import JsonRpcInternalError, JsonRpcInvalidParams
from pygls.lsp.server import LanguageServer

from efim_lsp import handlers
from efim_lsp import settings as settings_mod
from efim_lsp.completer import Answer, Completer
from efim_lsp.context.source import WorkspaceContext
from efim_lsp.documents import DocumentStore
from efim_lsp.engine_holder import EngineFactory, EngineHolder, EngineSpec, Preflight
from efim_lsp.positions import PositionError
from efim_lsp.next_edit.service import NextEdits
from efim_lsp.protocol import EfimProtocol, MessageObserver
from efim_lsp.settings import Settings
from efim_lsp.stats import ServerStats

log = logging.getLogger(__name__)

SERVER_NAME = "efim-lsp"
SERVER_VERSION = "0.1.0"


class EfimServer(LanguageServer):
    protocol: EfimProtocol

    def __init__(
        self,
        engine_factory: EngineFactory,
        *,
        preflight: Preflight | None = None,
        message_observer: MessageObserver | None = None,
        defaults: dict[str, Any] | None = None,
        context_source: WorkspaceContext | None = None,
    ):
        super().__init__(
            SERVER_NAME,
            SERVER_VERSION,
            text_document_sync_kind=types.TextDocumentSyncKind.Incremental,
            protocol_cls=EfimProtocol,
        )
        self.documents = DocumentStore()
        self.stats = ServerStats()
        self.settings = Settings()
        if defaults:  # command-line flags (e.g. --model); initializationOptions override them
            self.settings = settings_mod.apply(self.settings, defaults).settings
        self.holder = EngineHolder(engine_factory, preflight=preflight)
        self.holder.on_engine_fault = self._engine_fault
        self._engine_faults_shown: set[str] = set()
        self.context = context_source  # told what is open and where (handlers.documents)
        if context_source is not None:
            self.holder.on_engine_changed = context_source.set_engine
            context_source.on_watch_problem(self.show_from_thread)  # a lost workspace folder, once
        self.completer = Completer(self.documents, self.holder, self.stats, lambda: self.settings, context_source=context_source)
        self.next_edits = NextEdits(
            self.documents, self.stats, enabled=lambda: self.settings.next_edit != "off", folders=self._folder_uris,
            use_model=lambda: self.settings.next_edit == "model",
        )
        self.protocol.message_observer = message_observer
        self.protocol.version_of = self._version_of
        self.protocol.on_fault = lambda message: self.show(message, types.MessageType.Error)
        self._pending_problems: list[str] = []
        self.client_is_neovim = False  # set by `initialize`; decides the default version policy
        self._background: set[asyncio.Task] = set()
        self._progress_tokens = 0
        self.loop: asyncio.AbstractEventLoop | None = None  # the serving loop, from `initialize` on

    def _folder_uris(self) -> list[str]:
        """The workspace folders' URIs (the root URI when the client sent none)."""
        workspace = self.workspace
        uris = list(workspace.folders or {})
        if not uris and workspace.root_uri:
            uris = [workspace.root_uri]
        return uris

    def _version_of(self, uri: str) -> int | None:
        doc = self.documents.get(uri)
        return doc.version if doc else None

    # -- settings --------------------------------------------------------------
    def apply_settings(self, raw: Any, *, announce: bool = True) -> settings_mod.SettingsUpdate:
        update = settings_mod.apply(self.settings, raw)
        for key in update.unknown:
            log.warning("unknown setting %r ignored", key)
        for problem in update.problems:
            log.warning("%s", problem)
            if announce:
                self.show(problem, types.MessageType.Warning)
            else:
                self._pending_problems.append(problem)
        self.settings = update.settings
        if announce and self.context is not None and update.changed:
            self.context.settings_changed(self.settings)
        if "strict_versions" in update.changed or not announce:
            self._apply_version_policy()
        if announce and update.changed & settings_mod.ENGINE_KEYS:
            log.info("model settings changed (%s): reloading the engine", ", ".join(sorted(update.changed)))
            self.completer.reset_sessions("engine reload")
            self.start_engine_load()
        return update

    def show_pending_problems(self) -> None:
        """The settings problems found before the client could be shown messages (in
        `initialize`), shown now."""
        for problem in self._pending_problems:
            self.show(problem, types.MessageType.Warning)
        self._pending_problems.clear()

    def _apply_version_policy(self) -> None:
        strict = self.settings.strict_versions
        self.documents.strict_versions = (not self.client_is_neovim) if strict is None else strict

    def show(self, message: str, kind: types.MessageType = types.MessageType.Info) -> None:
        self.window_show_message(types.ShowMessageParams(type=kind, message=f"efim: {message}"))

    def show_from_thread(self, message: str, kind: types.MessageType = types.MessageType.Warning) -> None:
        """`show` from another thread (the file watcher's): sent from the event loop."""
        loop = self.loop
        if loop is None or loop.is_closed():
            return  # not serving (yet, or any more); the caller has logged it
        loop.call_soon_threadsafe(self.show, message, kind)

    # -- engine ----------------------------------------------------------------
    def _engine_fault(self, kind: str, message: str) -> None:
        """The engine reports a fault from its thread (it has logged it): one
        `window/showMessage` per kind for the session, sent from the event loop."""
        loop = self.loop
        if loop is None or loop.is_closed():
            return
        loop.call_soon_threadsafe(self._show_engine_fault, kind, message)

    def _show_engine_fault(self, kind: str, message: str) -> None:
        if kind not in self._engine_faults_shown:
            self._engine_faults_shown.add(kind)
            self.show(message, types.MessageType.Error)

    def start_engine_load(self) -> asyncio.Task:
        task = asyncio.ensure_future(self._load_engine())
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def _load_engine(self) -> None:
        s = self.settings
        spec = EngineSpec.from_settings(s)
        progress = await self._progress_sink()
        with self.context.busy() if self.context is not None else contextlib.nullcontext():  # indexing waits for the load
            ok = await self.holder.load(spec, progress)
        if ok:
            self.window_log_message(types.LogMessageParams(type=types.MessageType.Info, message=f"efim: model ready ({spec.model})"))
        elif self.holder.state == "failed" or self.holder.error:  # failed, or a new remote engine failed and the old one serves
            self.show(f"model failed to load: {self.holder.error}", types.MessageType.Error)

    async def _progress_sink(self):
        caps = self.client_capabilities
        if not (caps and caps.window and caps.window.work_done_progress):
            return None
        self._progress_tokens += 1
        token = f"efim-load-{self._progress_tokens}"
        try:
            await asyncio.wait_for(self.work_done_progress.create_async(token), timeout=5)
        except Exception as exc:
            log.info("client did not create a progress token (%s); loading without progress reports", exc)
            return None
        return _LspProgress(self, token)

    # -- positions -------------------------------------------------------------
    def cursor_offset(self, uri: str, position: types.Position) -> int:
        doc = self.documents.get(uri)
        if doc is None:
            raise JsonRpcInvalidParams(f"unknown document {uri!r} (not opened with didOpen)")
        try:
            return doc.offset_at(position.line, position.character, self.documents.encoding)
        except PositionError as exc:
            raise JsonRpcInvalidParams(f"position outside {uri}: {exc}") from exc

    def lsp_range(self, uri: str, answer: Answer) -> types.Range:
        index = self.documents.get(uri).index
        enc = self.documents.encoding
        start, end = index.position(answer.start, enc), index.position(answer.end, enc)
        return types.Range(types.Position(*start), types.Position(*end))

    def start_io(self, stdin=None, stdout=None) -> int:
        """Serve LSP over stdio until `exit`, stdin closing or SIGTERM (see `efim_lsp.stdio`).

        Returns the process exit code: 0 after `shutdown`, 1 when the server stops without one.
        """
        import sys
        import threading

        from pygls.io_ import StdoutWriter

        from efim_lsp import stdio

        self._stop_event = threading.Event()
        self.protocol.set_writer(StdoutWriter(stdout or sys.stdout.buffer))
        try:
            stdio.run(
                stdin or sys.stdin.buffer,
                self.protocol,
                self.thread_pool,
                exit_code=lambda: self.protocol.exit_code,
                on_error=lambda exc: self.report_server_error(exc, JsonRpcInternalError),
                on_stop=self.close,
            )
        except BrokenPipeError:
            log.error("connection to the client lost; shutting down")
        except (KeyboardInterrupt, SystemExit):
            pass
        finally:
            self._stop_event.set()
            if self._thread_pool:
                self._thread_pool.shutdown(wait=False, cancel_futures=True)
        code = self.protocol.exit_code
        if code is None:
            code = 0 if self.protocol.shutdown_received else 1
        return code

    def close(self) -> None:
        self.completer.close()
        self.holder.close()


class _LspProgress:
    """`$/progress` reports for one token."""

    def __init__(self, server: EfimServer, token: str):
        self._server, self._token = server, token

    def begin(self, title: str, message: str) -> None:
        self._server.work_done_progress.begin(self._token, types.WorkDoneProgressBegin(title=title, message=message, percentage=0))

    def report(self, message: str, percentage: int) -> None:
        self._server.work_done_progress.report(self._token, types.WorkDoneProgressReport(message=message, percentage=percentage))

    def end(self, message: str) -> None:
        self._server.work_done_progress.end(self._token, types.WorkDoneProgressEnd(message=message))


def build_server(
    engine_factory: EngineFactory,
    *,
    preflight: Preflight | None = None,
    message_observer: MessageObserver | None = None,
    defaults: dict[str, Any] | None = None,
    context_source: WorkspaceContext | None = None,
) -> EfimServer:
    """A server with every handler registered. `preflight`: the checks a new local model
    passes before the serving engine is given up (`EngineHolder`); `context_source`: the
    cross-file context, fed by this server."""
    server = EfimServer(
        engine_factory, preflight=preflight, message_observer=message_observer, defaults=defaults, context_source=context_source
    )
    handlers.register(server)
    return server
