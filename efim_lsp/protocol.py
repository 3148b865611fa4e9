"""Wire-level adjustments to pygls' LanguageServerProtocol.

- Every message in and out can be seen by a `message_observer`
  (`observer(direction, message, monotonic_time)`, direction "in" or "out",
  `message` the JSON object as a dict). This is the seam for
  `efim serve --record` (`efim_lsp.recording`). An observer that
  raises is logged and never breaks the server.
- Completion requests are stamped on arrival (time and document version)
  before pygls schedules their handler: the server measures latency from the
  moment a request was read, and answers only for the version it arrived with.
- A request whose params do not fit the LSP types gets an InvalidParams error
  response (pygls alone would log it and leave the client waiting forever).
- Lifecycle by the LSP spec (`_refused_by_lifecycle`): before `initialize` a
  request gets ServerNotInitialized (-32002) and a notification is dropped; a
  second `initialize` gets InvalidRequest; after `shutdown` every request gets
  InvalidRequest and notifications are dropped; `exit` is always accepted and
  records the process's exit code (0 after `shutdown`, 1 without) in
  `exit_code`, which ends the stdio loop (`efim_lsp.stdio`).
- A completion request whose handler raised unexpectedly (a bug in building or
  post-processing the answer) is answered with an empty list, not an error: the
  editor shows nothing rather than an error popup per keystroke. The exception is
  logged with its traceback and reported once per kind through `on_fault`
  (the server shows it with `window/showMessage`); the next request is served as usual.
- pygls keeps its own copy of every document and re-splits it into lines on
  each change; this server keeps exactly one copy (`documents.DocumentStore`),
  so the built-in open/change/close handlers only forward to ours.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Any, Callable, NamedTuple

import attrs
from cattrs import transform_error
from lsprotocol import types
from pygls.exceptions import JsonRpcException, JsonRpcInvalidParams, JsonRpcInvalidRequest, JsonRpcMethodNotFound, JsonRpcParseError
from pygls.protocol import LanguageServerProtocol, lsp_method
from pygls.protocol.json_rpc import RPCRequest

from efim_lsp.redact import excerpt

log = logging.getLogger(__name__)

MessageObserver = Callable[[str, dict, float], None]

SERVER_NOT_INITIALIZED = -32002

COMPLETION_METHODS = frozenset({types.TEXT_DOCUMENT_INLINE_COMPLETION, types.TEXT_DOCUMENT_COMPLETION})
_MAX_PENDING_ARRIVALS = 1024


class Arrival(NamedTuple):
    at: float  # time.monotonic() when the message was read
    version: int | None  # the document's version at that moment (None: not open)


class _Malformed(NamedTuple):
    id: Any
    method: str | None
    reason: str
    code: int = JsonRpcInvalidParams.CODE  # the error a request gets


def _valid_id(msg_id: Any) -> bool:
    return isinstance(msg_id, (str, int)) and not isinstance(msg_id, bool)


try:  # Python >= 3.11; on 3.10 cattrs raises the `exceptiongroup` backport's groups
    _ExceptionGroup = BaseExceptionGroup
except NameError:  # pragma: no cover - Python 3.10
    from exceptiongroup import BaseExceptionGroup as _ExceptionGroup  # noqa: PLC0415


def _explain(exc: BaseException) -> str:
    """A cattrs structuring error as "what @ where" lines (its own str() says only "1 sub-exception")."""
    if isinstance(exc, _ExceptionGroup):
        try:
            return "; ".join(transform_error(exc, path="$"))[:500]
        except Exception:
            pass
    return str(exc)[:500]


class _QuietDeserializeErrors(logging.Filter):
    """pygls logs a full traceback for every message it cannot structure; this module
    logs one line for each instead (a hostile client must not flood the log)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Unable to deserialize message")


logging.getLogger("pygls.protocol.json_rpc").addFilter(_QuietDeserializeErrors())


def _is_request(method: Any) -> bool:
    """An LSP method whose message type has an `id` (a request by the spec)."""
    if not isinstance(method, str):
        return False
    message_type = types.METHOD_TO_TYPES.get(method, (None,))[0]
    return message_type is not None and attrs.has(message_type) and "id" in attrs.fields_dict(message_type)


def _is_notification(method: Any) -> bool:
    """An LSP method whose message type has no `id` (a notification by the spec)."""
    if not isinstance(method, str):
        return False
    message_type = types.METHOD_TO_TYPES.get(method, (None,))[0]
    return message_type is not None and attrs.has(message_type) and "id" not in attrs.fields_dict(message_type)


class EfimProtocol(LanguageServerProtocol):
    def __init__(self, server, converter):
        super().__init__(server, converter)
        self.message_observer: MessageObserver | None = None
        self.arrivals: OrderedDict[Any, Arrival] = OrderedDict()
        # Set by the server: uri -> current version (None when not open).
        self.version_of: Callable[[str], int | None] = lambda uri: None
        self.initialize_received = False
        self.shutdown_received = False
        self.exit_code: int | None = None  # set by `exit`; ends the stdio loop
        self.on_fault: Callable[[str], None] | None = None  # a request failed unexpectedly
        self._completions: dict[Any, str] = {}  # request id -> method, while in flight
        self._faults_reported: set[str] = set()

    # -- incoming ------------------------------------------------------------
    def structure_message(self, data: dict[str, Any]):
        if not isinstance(data, dict) or "jsonrpc" not in data:
            return data
        self._observe("in", data)
        method = data.get("method")
        if data["jsonrpc"] != "2.0":  # JSON-RPC: an Invalid Request, answered with id null
            reason = f"not a JSON-RPC 2.0 message (jsonrpc is {data['jsonrpc']!r})"
            return _Malformed(None, method if isinstance(method, str) else None, reason, JsonRpcInvalidRequest.CODE)
        if "method" in data and not isinstance(method, str):
            return _Malformed(None, None, f"the method must be a string, not {method!r:.80}", JsonRpcInvalidRequest.CODE)
        if "method" in data and "id" in data and not _valid_id(data["id"]):
            # JSON-RPC: an id is a string or a number; the answer to an invalid request has id null.
            return _Malformed(None, data["method"], f"invalid request id {data['id']!r} (must be a string or an integer)", JsonRpcInvalidRequest.CODE)
        if "method" in data and "id" in data and not self._serves(data["method"]):
            # Checked before the params: a method this server does not have is MethodNotFound,
            # whatever its params (pygls would first refuse params that do not fit its LSP type).
            return _Malformed(data["id"], data["method"], f"unknown method {data['method']!r}", JsonRpcMethodNotFound.CODE)
        if "method" in data and "id" in data and _is_notification(data["method"]):
            # pygls would structure it as the notification and never answer the id.
            reason = f"{data['method']} is a notification; it cannot be called as a request"
            return _Malformed(data["id"], data["method"], reason, JsonRpcMethodNotFound.CODE)
        if "method" in data and "id" not in data and _is_request(data["method"]):
            return _Malformed(None, data["method"], f"{data['method']} is a request; sent without an id it is ignored")
        if "method" in data and "params" not in data:
            # JSON-RPC 2.0 lets a request or notification omit params; pygls' message
            # classes require the member, so `efim/stats` without params was refused.
            data = {**data, "params": None}
        try:
            return super().structure_message(data)
        except Exception as exc:  # pygls raises JsonRpcInvalidParams / InternalError here
            cause = exc.__cause__ or exc
            reason = f"malformed {data.get('method') or 'message'}: {_explain(cause)}"
            return _Malformed(data.get("id"), data.get("method"), reason)

    def _serves(self, method: Any) -> bool:
        """Whether a request to `method` has a handler here (or is a notification, answered below)."""
        if not isinstance(method, str):
            return True  # left to the structuring, which refuses it
        return method in self.fm.features or method in self.fm.builtin_features or _is_notification(method)

    def handle_message(self, message) -> None:
        if isinstance(message, dict):  # no "jsonrpc" member: not a JSON-RPC 2.0 message
            log.warning("ignored a message that is not JSON-RPC 2.0: %s", excerpt(log, message, 200))
            if message.get("id") is not None:
                error = JsonRpcInvalidRequest("not a JSON-RPC 2.0 message").to_response_error()
                self._send_response(message["id"], error=error)
            return
        if isinstance(message, _Malformed):
            invalid_id = message.id is None and message.code == JsonRpcInvalidRequest.CODE
            if not invalid_id and self._refused_by_lifecycle(message.method, message.id, malformed=True):
                return
            log.warning("%s", message.reason)
            if message.method is not None and message.id is not None:
                self._send_response(message.id, error=types.ResponseError(code=message.code, message=message.reason))
            elif invalid_id:  # answered with id null, whatever the lifecycle state
                self._answer_without_id(message.code, message.reason)
            return
        if not hasattr(message, "jsonrpc"):  # a JSON array (LSP has no batches), number, string or null
            log.warning("a message that is not a JSON object: %s", excerpt(log, message, 200))
            self._answer_without_id(JsonRpcInvalidRequest.CODE, f"not a JSON-RPC request object: {type(message).__name__}")
            return
        method = getattr(message, "method", None)
        if method is not None and self._refused_by_lifecycle(method, message.id if isinstance(message, RPCRequest) else None):
            return
        if isinstance(message, RPCRequest) and message.method in COMPLETION_METHODS:
            self._stamp(message)
            self._completions[message.id] = message.method
            while len(self._completions) > _MAX_PENDING_ARRIVALS:
                self._completions.pop(next(iter(self._completions)))
        super().handle_message(message)

    def answer_parse_error(self, reason: str) -> None:
        """A message body that is not JSON: ParseError with id null (JSON-RPC 2.0, 5.1)."""
        self._answer_without_id(JsonRpcParseError.CODE, reason)

    def _answer_without_id(self, code: int, reason: str) -> None:
        self._send_data({"jsonrpc": "2.0", "id": None, "error": {"code": code, "message": reason}})

    def _refused_by_lifecycle(self, method: str | None, msg_id: Any, *, malformed: bool = False) -> bool:
        """Apply the lifecycle rules to an incoming request (`msg_id` set) or notification;
        True when the message was answered with an error or dropped here. A malformed
        `initialize` is answered InvalidParams and does not count as the initialize."""
        if method is None or method == types.EXIT:
            return False
        if self.shutdown_received:
            if msg_id is not None:
                self._refuse(msg_id, JsonRpcInvalidRequest.CODE, f"{method}: the server is shutting down (shutdown was received); only exit is accepted")
            else:
                log.info("dropped %s: the server is shutting down", method)
            return True
        if not self.initialize_received:
            if method == types.INITIALIZE and msg_id is not None:
                self.initialize_received = not malformed
                return False
            if msg_id is not None:
                self._refuse(msg_id, SERVER_NOT_INITIALIZED, f"{method}: the server is not initialized (send initialize first)")
            else:
                log.info("dropped %s: received before initialize", method)
            return True
        if method == types.INITIALIZE:
            if msg_id is not None:
                self._refuse(msg_id, JsonRpcInvalidRequest.CODE, "initialize: the server is already initialized")
            return True
        if method == types.SHUTDOWN and msg_id is not None:
            self.shutdown_received = True
        return False

    def _refuse(self, msg_id: Any, code: int, message: str) -> None:
        log.warning("%s", message)
        self._send_response(msg_id, error=types.ResponseError(code=code, message=message))

    @lsp_method(types.EXIT)
    def lsp_exit(self, *args) -> None:
        """Record the exit code; the stdio loop stops after this message (no sys.exit here:
        the server closes its engine and files on the way out)."""
        self.exit_code = 0 if self.shutdown_received else 1
        log.info("exit received (%s shutdown): exit code %d", "after" if self.shutdown_received else "without", self.exit_code)

    def _stamp(self, message) -> None:
        try:
            uri = message.params.text_document.uri
        except AttributeError:
            return
        self.arrivals[message.id] = Arrival(time.monotonic(), self.version_of(uri))
        while len(self.arrivals) > _MAX_PENDING_ARRIVALS:
            self.arrivals.popitem(last=False)  # requests cancelled before their handler ran

    def take_arrival(self, uri: str) -> Arrival:
        """The arrival stamp of the request being handled (call from its handler)."""
        stamp = self.arrivals.pop(self.msg_id, None)
        return stamp if stamp is not None else Arrival(time.monotonic(), self.version_of(uri))

    def _send_handler_result(self, future, *, msg_id):
        method = self._completions.pop(msg_id, None)
        if not future.cancelled():
            exc = future.exception()
            if isinstance(exc, JsonRpcException):  # the client's mistake (unknown document...): one log line
                self._request_futures.pop(msg_id, None)
                log.warning("request %r answered with error %s: %s", msg_id, exc.code, exc)
                self._send_response(msg_id, error=exc.to_response_error())
                return
            if exc is not None and method is not None:
                self._request_futures.pop(msg_id, None)
                self._completion_fault(msg_id, method, exc)
                return
        super()._send_handler_result(future, msg_id=msg_id)

    def _check_handler_result(self, future) -> None:
        """A notification's handler ended. pygls 2.1 files the future of every notification
        whose handler is a coroutine, a thread or a generator (its own didOpen/didChange/
        didClose are generators) under a fresh uuid in `_request_futures` and never takes it
        out: ~2 KB kept per notification, a front typing for 30 minutes grew 54 -> 121 MB
        (docs/reliability.md). Take it out here; only requests still running are left to scan."""
        try:
            super()._check_handler_result(future)
        finally:
            for msg_id, running in list(self._request_futures.items()):
                if running is future:
                    del self._request_futures[msg_id]
                    break

    def _completion_fault(self, msg_id: Any, method: str, exc: BaseException) -> None:
        log.error("%s %r failed; answering an empty list", method, msg_id, exc_info=(type(exc), exc, exc.__traceback__))
        empty = types.InlineCompletionList(items=[]) if method == types.TEXT_DOCUMENT_INLINE_COMPLETION else types.CompletionList(is_incomplete=True, items=[])
        self._send_response(msg_id, result=empty)
        kind = f"{type(exc).__name__}: {exc}"[:200]
        if self.on_fault is not None and kind not in self._faults_reported:
            self._faults_reported.add(kind)
            try:
                self.on_fault(f"completion failed ({kind}); see the server log. Later requests are served as usual.")
            except Exception:
                log.exception("reporting a fault failed")

    # -- outgoing ------------------------------------------------------------
    def _send_data(self, data: Any):
        if self.message_observer is not None and data:
            try:
                body = self._converter.unstructure(data) if hasattr(data, "__attrs_attrs__") else data
            except Exception:
                body = None
            if isinstance(body, dict):
                self._observe("out", body)
        return super()._send_data(data)

    def _observe(self, direction: str, message: dict) -> None:
        observer = self.message_observer
        if observer is None:
            return
        try:
            observer(direction, message, time.monotonic())
        except Exception:
            log.exception("message observer failed; the message is handled regardless")

    # -- documents: one copy, ours -------------------------------------------
    @lsp_method(types.TEXT_DOCUMENT_DID_OPEN)
    def lsp_text_document__did_open(self, params: types.DidOpenTextDocumentParams):
        if (handler := self.fm.features.get(types.TEXT_DOCUMENT_DID_OPEN)) is not None:
            yield handler, (params,), None

    @lsp_method(types.TEXT_DOCUMENT_DID_CHANGE)
    def lsp_text_document__did_change(self, params: types.DidChangeTextDocumentParams):
        if (handler := self.fm.features.get(types.TEXT_DOCUMENT_DID_CHANGE)) is not None:
            yield handler, (params,), None

    @lsp_method(types.TEXT_DOCUMENT_DID_CLOSE)
    def lsp_text_document__did_close(self, params: types.DidCloseTextDocumentParams):
        if (handler := self.fm.features.get(types.TEXT_DOCUMENT_DID_CLOSE)) is not None:
            yield handler, (params,), None
