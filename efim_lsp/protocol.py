"""Wire-level adjustments to pygls' LanguageServerProtocol.

- Every message in and out can be seen by a `message_observer`
  (`observer(direction, message, monotonic_time)`, direction "in" or "out",
  `message` the JSON object as a dict). This is the seam for
  `efim serve --record` (issue 4, `efim_lsp.recording`). An observer that
  raises is logged and never breaks the server.
- Completion requests are stamped on arrival (time and document version)
  before pygls schedules their handler: the server measures latency from the
  moment a request was read, and answers only for the version it arrived with.
- A request whose params do not fit the LSP types gets an InvalidParams error
  response (pygls alone would log it and leave the client waiting forever).
- pygls keeps its own copy of every document and re-splits it into lines on
  each change; this server keeps exactly one copy (`documents.DocumentStore`),
  so the built-in open/change/close handlers only forward to ours.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Any, Callable, NamedTuple

from lsprotocol import types
from pygls.exceptions import JsonRpcInvalidParams, JsonRpcInvalidRequest
from pygls.protocol import LanguageServerProtocol, lsp_method
from pygls.protocol.json_rpc import RPCRequest

log = logging.getLogger(__name__)

MessageObserver = Callable[[str, dict, float], None]

COMPLETION_METHODS = frozenset({types.TEXT_DOCUMENT_INLINE_COMPLETION, types.TEXT_DOCUMENT_COMPLETION})
_MAX_PENDING_ARRIVALS = 1024


class Arrival(NamedTuple):
    at: float  # time.monotonic() when the message was read
    version: int | None  # the document's version at that moment (None: not open)


class _Malformed(NamedTuple):
    id: Any
    method: str | None
    reason: str


class EfimProtocol(LanguageServerProtocol):
    def __init__(self, server, converter):
        super().__init__(server, converter)
        self.message_observer: MessageObserver | None = None
        self.arrivals: OrderedDict[Any, Arrival] = OrderedDict()
        # Set by the server: uri -> current version (None when not open).
        self.version_of: Callable[[str], int | None] = lambda uri: None

    # -- incoming ------------------------------------------------------------
    def structure_message(self, data: dict[str, Any]):
        if not isinstance(data, dict) or "jsonrpc" not in data:
            return data
        self._observe("in", data)
        if "method" in data and "params" not in data:
            # JSON-RPC 2.0 lets a request or notification omit params; pygls' message
            # classes require the member, so `efim/stats` without params was refused.
            data = {**data, "params": None}
        try:
            return super().structure_message(data)
        except Exception as exc:  # pygls raises JsonRpcInvalidParams / InternalError here
            cause = exc.__cause__ or exc
            reason = f"malformed {data.get('method') or 'message'}: {cause}"
            return _Malformed(data.get("id"), data.get("method"), reason)

    def handle_message(self, message) -> None:
        if isinstance(message, dict):  # no "jsonrpc" member: not a JSON-RPC 2.0 message
            log.warning("ignored a message that is not JSON-RPC 2.0: %.200r", message)
            if message.get("id") is not None:
                error = JsonRpcInvalidRequest("not a JSON-RPC 2.0 message").to_response_error()
                self._send_response(message["id"], error=error)
            return
        if isinstance(message, _Malformed):
            log.warning("%s", message.reason)
            if message.id is not None and message.method:
                self._send_response(message.id, error=JsonRpcInvalidParams(message.reason).to_response_error())
            return
        if isinstance(message, RPCRequest) and message.method in COMPLETION_METHODS:
            self._stamp(message)
        super().handle_message(message)

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
