"""The pygls language server: thin handlers over the plain modules.

Handlers convert LSP positions to code-point offsets (and back) at this edge,
call `documents`, `completer`, `settings`, and return lsprotocol types. Logic
lives elsewhere: sessions (`session.py`), windows (`window.py`), suggestions
(`suggest.py`), typing-through, the engine slot, stats.

Custom protocol:
- `efim/stats` (request) → camelCase counters (see `stats.ServerStats.to_wire`), `model`
  (state, info) and `context` (index status, when a context source is attached);
  params `{"reset": true}` zero them after answering (benchmarks measure phases).
- `efim/debug/checkIntegrity` (request) → `{ok, engine, problems}`: the engine's KV
  integrity check (radix cache, chunk store, retained KV; run on the engine thread when it
  is idle) and every edit session's consistency with its document.
- `efim/didMoveCursor` (notification, client → server): `{textDocument: {uri}, position}`
  where the cursor is now, sent by our clients (debounced) when it moves without an edit
  and when a document becomes the active one; the server warms the window there in the
  background (docs/design.md, "After a jump"). Unknown documents and bad positions are
  ignored.
- `efim/documentText` (request, read-only) `{"textDocument": {"uri"}}` → `{uri, version,
  text, checksum, inSync}`: the server's copy of an open document, so a client (and the
  tests) can check it never drifts; `checksum` is `documents.text_checksum`. `efim/stats`
  carries `documents: {uri: {version, checksum, length, inSync}}` for the same check
  without the text.
- `efim.accepted` (command, attached to every item): a full accept.
- `textDocument/didShowCompletion`, `textDocument/didPartiallyAcceptCompletion`
  (Copilot-compatible notifications): shown / partially accepted counters.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from lsprotocol import types
from pygls.exceptions import JsonRpcInternalError, JsonRpcInvalidParams
from pygls.lsp.server import LanguageServer

from engine.api import Engine

from efim_lsp import settings as settings_mod
from efim_lsp.completer import Answer, Completer, ContextSource
from efim_lsp.documents import DocumentStore, FullChange, RangeChange
from efim_lsp.engine_slot import EngineFactory, EngineSlot, EngineSpec
from efim_lsp.positions import ENCODINGS, PositionError
from efim_lsp.protocol import EfimProtocol, MessageObserver
from efim_lsp.settings import Settings
from efim_lsp.stats import ServerStats

log = logging.getLogger(__name__)

SERVER_NAME = "efim-lsp"
SERVER_VERSION = "0.1.0"

STATS = "efim/stats"
CHECK_INTEGRITY = "efim/debug/checkIntegrity"
DID_MOVE_CURSOR = "efim/didMoveCursor"
DOCUMENT_TEXT = "efim/documentText"
ACCEPTED_COMMAND = "efim.accepted"
DID_SHOW = "textDocument/didShowCompletion"
DID_PARTIALLY_ACCEPT = "textDocument/didPartiallyAcceptCompletion"
INTEGRITY_TIMEOUT_S = 30.0  # how long efim/debug/checkIntegrity waits for the engine to be idle

_LABEL_CHARS = 60


class EfimServer(LanguageServer):
    protocol: EfimProtocol

    def __init__(
        self,
        engine_factory: EngineFactory,
        *,
        message_observer: MessageObserver | None = None,
        defaults: dict[str, Any] | None = None,
        context_source: ContextSource | None = None,
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
        self.slot = EngineSlot(engine_factory, preflight=getattr(engine_factory, "preflight", None))
        self.slot.on_engine_fault = self._engine_fault
        self._engine_faults_shown: set[str] = set()
        self.completer = Completer(self.documents, self.slot, self.stats, lambda: self.settings, context_source=context_source)
        self.protocol.message_observer = message_observer
        self.protocol.version_of = self._version_of
        self.protocol.on_fault = lambda message: self.show(message, types.MessageType.Error)
        self._pending_problems: list[str] = []
        self._client_is_neovim = False
        self._background: set[asyncio.Task] = set()
        self._progress_tokens = 0
        self._loop: asyncio.AbstractEventLoop | None = None  # the serving loop, from `initialize` on

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
        if "strict_versions" in update.changed or not announce:
            self._apply_version_policy()
        if announce and update.changed & settings_mod.ENGINE_KEYS:
            log.info("model settings changed (%s): reloading the engine", ", ".join(sorted(update.changed)))
            self.completer.reset_sessions("engine reload")
            self.start_engine_load()
        return update

    def _apply_version_policy(self) -> None:
        strict = self.settings.strict_versions
        self.documents.strict_versions = (not self._client_is_neovim) if strict is None else strict

    def show(self, message: str, kind: types.MessageType = types.MessageType.Info) -> None:
        self.window_show_message(types.ShowMessageParams(type=kind, message=f"efim: {message}"))

    def show_from_thread(self, message: str, kind: types.MessageType = types.MessageType.Warning) -> None:
        """`show` from another thread (the file watcher's): sent from the event loop."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return  # not serving (yet, or any more); the caller has logged it
        loop.call_soon_threadsafe(self.show, message, kind)

    # -- engine ----------------------------------------------------------------
    def _engine_fault(self, kind: str, message: str) -> None:
        """The engine reports a fault from its thread (it has logged it): one
        `window/showMessage` per kind for the session, sent from the event loop."""
        loop = self._loop
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
        ok = await self.slot.load(spec, progress)
        if ok:
            self.window_log_message(types.LogMessageParams(type=types.MessageType.Info, message=f"efim: model ready ({spec.model})"))
        elif self.slot.state == "failed" or self.slot.error:  # failed, or a new remote engine failed and the old one serves
            self.show(f"model failed to load: {self.slot.error}", types.MessageType.Error)

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

    # -- what the context source reads (efim_lsp.context.source.ContextHost) ---
    def workspace_folders(self) -> list[str]:
        workspace = self.workspace
        uris = list(workspace.folders or {})
        if not uris and workspace.root_uri:
            uris = [workspace.root_uri]
        return uris

    def open_documents(self) -> list[tuple[str, int, str]]:
        docs = ((uri, self.documents.get(uri)) for uri in self.documents.uris())
        return [(uri, doc.version, doc.text) for uri, doc in docs if doc is not None]

    def context_engine(self) -> Engine | None:
        return self.slot.engine

    # -- positions -------------------------------------------------------------
    def cursor_offset(self, uri: str, position: types.Position) -> int:
        doc = self.documents.get(uri)
        if doc is None:
            raise JsonRpcInvalidParams(f"unknown document {uri!r} (not opened with didOpen)")
        try:
            return doc.offset_at(position.line, position.character, self.documents.encoding)
        except PositionError as exc:
            raise JsonRpcInvalidParams(f"position outside {uri}: {exc}") from exc

    def cursor_of(self, params: Any) -> tuple[str, int] | None:
        """(uri, offset) of a `{textDocument: {uri}, position: {line, character}}` payload
        that names an open document and a position inside it; None otherwise."""
        try:
            info = _mapping(params)
            uri = _mapping(info.get("textDocument")).get("uri")
            pos = _mapping(info.get("position"))
            line, character = pos.get("line"), pos.get("character")
            if not isinstance(uri, str) or not isinstance(line, int) or not isinstance(character, int):
                return None
            doc = self.documents.get(uri)
            if doc is None:
                return None
            return uri, doc.offset_at(line, character, self.documents.encoding)
        except (PositionError, TypeError, ValueError, AttributeError):
            return None

    def lsp_range(self, uri: str, answer: Answer) -> types.Range:
        index = self.documents.get(uri).index
        enc = self.documents.encoding
        start, end = index.position(answer.start, enc), index.position(answer.end, enc)
        return types.Range(types.Position(*start), types.Position(*end))

    def accept_command(self, uri: str, answer: Answer) -> types.Command:
        return types.Command(
            title="efim: suggestion accepted",
            command=ACCEPTED_COMMAND,
            arguments=[{"uri": uri, "id": answer.suggestion_id, "length": len(answer.text)}],
        )

    async def answer_at(self, uri: str, position: types.Position) -> Answer | None:
        cursor = self.cursor_offset(uri, position)
        arrival = self.protocol.take_arrival(uri)
        result = await self.completer.complete(uri, cursor, arrival.version, arrival.at)
        return result if isinstance(result, Answer) else None

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
        self.slot.close()


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


# ---------------------------------------------------------------------------
# Handlers
# ---------------------------------------------------------------------------


def build_server(
    engine_factory: EngineFactory,
    *,
    message_observer: MessageObserver | None = None,
    defaults: dict[str, Any] | None = None,
    context_source: ContextSource | None = None,
) -> EfimServer:
    server = EfimServer(engine_factory, message_observer=message_observer, defaults=defaults, context_source=context_source)

    @server.feature(types.INITIALIZE)
    def initialize(ls: EfimServer, params: types.InitializeParams) -> None:
        ls._loop = asyncio.get_running_loop()
        encoding = str(getattr(ls.workspace.position_encoding, "value", ls.workspace.position_encoding))
        ls.documents.encoding = encoding if encoding in ENCODINGS else "utf-16"
        ls._client_is_neovim = bool(params.client_info and params.client_info.name.lower().startswith("neovim"))
        ls.apply_settings(params.initialization_options, announce=False)
        log.info("initialize: client %s, positions in %s", params.client_info.name if params.client_info else "?", ls.documents.encoding)

    @server.feature(types.INITIALIZED)
    def initialized(ls: EfimServer, params: types.InitializedParams) -> None:
        for problem in ls._pending_problems:
            ls.show(problem, types.MessageType.Warning)
        ls._pending_problems.clear()
        ls.start_engine_load()

    @server.feature(types.SHUTDOWN)
    def shutdown(ls: EfimServer, params: None) -> None:
        ls.close()

    @server.feature(types.TEXT_DOCUMENT_DID_OPEN)
    def did_open(ls: EfimServer, params: types.DidOpenTextDocumentParams) -> None:
        doc = params.text_document
        ls.documents.open(doc.uri, doc.language_id, doc.version, doc.text)
        ls.completer.opened(doc.uri)

    @server.feature(types.TEXT_DOCUMENT_DID_CHANGE)
    def did_change(ls: EfimServer, params: types.DidChangeTextDocumentParams) -> None:
        uri = params.text_document.uri
        if uri not in ls.documents:
            log.warning("didChange for %s, which is not open; ignored", uri)
            return
        changes = [
            RangeChange(c.range.start.line, c.range.start.character, c.range.end.line, c.range.end.character, c.text)
            if isinstance(c, types.TextDocumentContentChangePartial)
            else FullChange(c.text)
            for c in params.content_changes
        ]
        outcome = ls.documents.change(uri, params.text_document.version, changes)
        ls.completer.changed(uri, outcome)

    @server.feature(types.TEXT_DOCUMENT_DID_CLOSE)
    def did_close(ls: EfimServer, params: types.DidCloseTextDocumentParams) -> None:
        ls.documents.close(params.text_document.uri)
        ls.completer.closed(params.text_document.uri)

    @server.feature(DID_MOVE_CURSOR)
    def did_move_cursor(ls: EfimServer, params: Any) -> None:
        """Where the user is before the first key: warm the window there (a notification:
        a bad one is ignored, never answered with an error)."""
        cursor = ls.cursor_of(params)
        if cursor is not None:
            ls.completer.cursor_moved(*cursor)

    @server.feature(types.WORKSPACE_DID_CHANGE_CONFIGURATION)
    async def did_change_configuration(ls: EfimServer, params: types.DidChangeConfigurationParams) -> None:
        raw = params.settings
        if not raw:
            caps = ls.client_capabilities
            if caps and caps.workspace and caps.workspace.configuration:
                # Pull model (VS Code sends `settings: null`): ask for our section.
                result = await ls.workspace_configuration_async(
                    types.ConfigurationParams(items=[types.ConfigurationItem(section="efim")])
                )
                raw = result[0] if result else None
        if raw:
            ls.apply_settings(raw)

    @server.feature(types.TEXT_DOCUMENT_INLINE_COMPLETION, types.InlineCompletionOptions())
    async def inline_completion(ls: EfimServer, params: types.InlineCompletionParams) -> types.InlineCompletionList:
        uri = params.text_document.uri
        answer = await ls.answer_at(uri, params.position)
        if answer is None:
            return types.InlineCompletionList(items=[])
        # The first item is the usual suggestion; the setting `alternatives` adds others for the
        # same range, which editors cycle through.
        rng = ls.lsp_range(uri, answer)
        items = [
            types.InlineCompletionItem(
                insert_text=text, range=rng, command=ls.accept_command(uri, answer._replace(text=text))
            )
            for text in (answer.text, *answer.alternatives)
        ]
        return types.InlineCompletionList(items=items)

    @server.feature(types.TEXT_DOCUMENT_COMPLETION, types.CompletionOptions(trigger_characters=None))
    async def completion(ls: EfimServer, params: types.CompletionParams) -> types.CompletionList:
        """Fallback for clients without inline completion: one item whose edit inserts the suggestion."""
        uri = params.text_document.uri
        answer = await ls.answer_at(uri, params.position)
        if answer is None:
            return types.CompletionList(is_incomplete=True, items=[])
        first_line = answer.text.lstrip("\r\n").splitlines()[0] if answer.text.strip() else answer.text
        item = types.CompletionItem(
            label=first_line[:_LABEL_CHARS] + ("…" if len(first_line) > _LABEL_CHARS or "\n" in answer.text.strip() else ""),
            kind=types.CompletionItemKind.Text,
            detail="efim",
            documentation=types.MarkupContent(kind=types.MarkupKind.PlainText, value=answer.text),
            insert_text_format=types.InsertTextFormat.PlainText,
            text_edit=types.TextEdit(range=ls.lsp_range(uri, answer), new_text=answer.text),
            filter_text=answer.text,
            sort_text="0",
            preselect=True,
            command=ls.accept_command(uri, answer),
        )
        # is_incomplete: the client asks again as the user types (typing-through answers it).
        return types.CompletionList(is_incomplete=True, items=[item])

    @server.command(ACCEPTED_COMMAND)
    def accepted(ls: EfimServer, *args: Any) -> None:
        info = _mapping(args[0]) if args else {}
        ls.stats.accepted += 1
        length = info.get("length")
        if isinstance(length, int) and length >= 0:
            ls.stats.accepted_chars += length

    @server.feature(DID_SHOW)
    def did_show(ls: EfimServer, params: Any) -> None:
        ls.stats.shown += 1

    @server.feature(DID_PARTIALLY_ACCEPT)
    def did_partially_accept(ls: EfimServer, params: Any) -> None:
        ls.stats.partially_accepted += 1
        length = _mapping(params).get("acceptedLength")
        if isinstance(length, int) and length >= 0:
            ls.stats.accepted_chars += length

    @server.feature(STATS)
    def stats(ls: EfimServer, params: Any) -> dict[str, Any]:
        engine = ls.slot.engine
        engine_stats = engine.stats() if engine is not None else None
        extra: dict[str, Any] = {"model": {"state": ls.slot.state, "error": ls.slot.error, "info": _info_dict(ls.slot.info)}}
        extra["engine"] = ls.slot.health()
        context_source = ls.completer.context_source
        if context_source is not None:
            try:
                extra["context"] = context_source.status()
            except Exception:  # counters are informative; never fail the stats request
                log.exception("context status failed")
        extra["documents"] = _documents_summary(ls.documents)
        out = ls.stats.to_wire(engine_stats, ls.completer.sessions_active, ls.completer.rebases, extra)
        if _mapping(params).get("reset"):
            ls.completer.reset_counters()  # benchmarks: measure a phase on its own
        return out

    @server.feature(DOCUMENT_TEXT)
    def document_text(ls: EfimServer, params: Any) -> dict[str, Any]:
        return _document_text(ls.documents, params)

    @server.feature(CHECK_INTEGRITY)
    async def check_integrity(ls: EfimServer, params: Any) -> dict[str, Any]:
        problems: list[str] = []
        for uri in ls.completer.uris:
            session, doc = ls.completer.session(uri), ls.documents.get(uri)
            if session is not None and doc is not None and doc.in_sync and not session.consistent(doc.text):
                problems.append(f"edit session of {uri} does not match the text")
        engine_report = "not loaded"
        engine = ls.slot.engine
        if engine is not None:
            try:  # on the engine thread, between steps, once it is idle (engine.api thread map)
                await asyncio.wait_for(asyncio.wrap_future(engine.check_integrity()), INTEGRITY_TIMEOUT_S)
            except asyncio.TimeoutError:
                engine_report = f"not checked: the engine was not idle within {INTEGRITY_TIMEOUT_S:g} s"
                problems.append(f"engine: {engine_report}")
            except Exception as exc:  # AssertionError from a store's invariants
                engine_report = f"FAILED: {type(exc).__name__}: {exc}"
                problems.append(f"engine: {exc}")
            else:
                engine_report = "ok"
        return {"ok": not problems, "engine": engine_report, "problems": problems}

    return server


def _document_text(documents: DocumentStore, params: Any) -> dict[str, Any]:
    """`efim/documentText`: the server's copy of one open document."""
    ident = _mapping(_mapping(params).get("textDocument"))
    uri = ident.get("uri")
    if not isinstance(uri, str):
        raise JsonRpcInvalidParams("efim/documentText: params must be {\"textDocument\": {\"uri\": string}}")
    doc = documents.get(uri)
    if doc is None:
        raise JsonRpcInvalidParams(f"unknown document {uri!r} (not opened with didOpen)")
    return {"uri": uri, "version": doc.version, "text": doc.text, "checksum": doc.checksum, "inSync": doc.in_sync}


def _documents_summary(documents: DocumentStore) -> dict[str, Any]:
    """`efim/stats` "documents": per open document, what a client needs to detect drift."""
    out = {}
    for uri in documents.uris():
        doc = documents.get(uri)
        out[uri] = {"version": doc.version, "checksum": doc.checksum, "length": len(doc.text), "inSync": doc.in_sync}
    return out


def _mapping(value: Any) -> dict[str, Any]:
    """Params of custom methods arrive as dicts or (pygls) namedtuples."""
    if isinstance(value, dict):
        return value
    if hasattr(value, "_asdict"):
        return value._asdict()
    return {}


def _info_dict(info) -> dict[str, Any] | None:
    if info is None:
        return None
    import msgspec

    return msgspec.to_builtins(info)

