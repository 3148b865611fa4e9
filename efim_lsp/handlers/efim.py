"""The custom `efim/*` protocol.

- `efim/stats` (request) → camelCase counters (see `stats.ServerStats.to_wire`), `model`
  (state, info) and `context` (index status, when a context source is attached);
  params `{"reset": true}` zero them after answering (benchmarks measure phases).
- `efim/debug/checkIntegrity` (request) → `{ok, engine, problems}`: the engine's KV
  integrity check (radix cache, blend store, retained KV; run on the engine thread when it
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
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from pygls.exceptions import JsonRpcInvalidParams

from efim_lsp.documents import DocumentStore
from efim_lsp.handlers.params import cursor_of, mapping

if TYPE_CHECKING:
    from efim_lsp.server import EfimServer

log = logging.getLogger(__name__)

STATS = "efim/stats"
CHECK_INTEGRITY = "efim/debug/checkIntegrity"
DID_MOVE_CURSOR = "efim/didMoveCursor"
DOCUMENT_TEXT = "efim/documentText"
INTEGRITY_TIMEOUT_S = 30.0  # how long efim/debug/checkIntegrity waits for the engine to be idle


def register(server: EfimServer) -> None:
    server.feature(DID_MOVE_CURSOR)(did_move_cursor)
    server.feature(STATS)(stats)
    server.feature(DOCUMENT_TEXT)(document_text)
    server.feature(CHECK_INTEGRITY)(check_integrity)


def did_move_cursor(ls: EfimServer, params: Any) -> None:
    """Where the user is before the first key: warm the window there (a notification:
    a bad one is ignored, never answered with an error)."""
    cursor = cursor_of(ls.documents, params)
    if cursor is not None:
        ls.completer.cursor_moved(*cursor)


def stats(ls: EfimServer, params: Any) -> dict[str, Any]:
    engine = ls.holder.engine
    engine_stats = engine.stats() if engine is not None else None
    extra: dict[str, Any] = {"model": {"state": ls.holder.state, "error": ls.holder.error, "info": _info_dict(ls.holder.info)}}
    extra["engine"] = ls.holder.health()
    context_source = ls.completer.context_source
    if context_source is not None:
        try:
            extra["context"] = context_source.status()
        except Exception:  # counters are informative; never fail the stats request
            log.exception("context status failed")
    extra["documents"] = _documents_summary(ls.documents)
    out = ls.stats.to_wire(engine_stats, ls.completer.sessions_active, ls.completer.rebases, extra)
    if mapping(params).get("reset"):
        ls.completer.reset_counters()  # benchmarks: measure a phase on its own
    return out


def document_text(ls: EfimServer, params: Any) -> dict[str, Any]:
    """`efim/documentText`: the server's copy of one open document."""
    uri = mapping(mapping(params).get("textDocument")).get("uri")
    if not isinstance(uri, str):
        raise JsonRpcInvalidParams("efim/documentText: params must be {\"textDocument\": {\"uri\": string}}")
    doc = ls.documents.get(uri)
    if doc is None:
        raise JsonRpcInvalidParams(f"unknown document {uri!r} (not opened with didOpen)")
    return {"uri": uri, "version": doc.version, "text": doc.text, "checksum": doc.checksum, "inSync": doc.in_sync}


async def check_integrity(ls: EfimServer, params: Any) -> dict[str, Any]:
    problems: list[str] = []
    for uri in ls.completer.uris:
        session, doc = ls.completer.session(uri), ls.documents.get(uri)
        if session is not None and doc is not None and doc.in_sync and not session.consistent(doc.text):
            problems.append(f"edit session of {uri} does not match the text")
    engine_report = "not loaded"
    engine = ls.holder.engine
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


def _documents_summary(documents: DocumentStore) -> dict[str, Any]:
    """`efim/stats` "documents": per open document, what a client needs to detect drift."""
    out = {}
    for uri in documents.uris():
        doc = documents.get(uri)
        out[uri] = {"version": doc.version, "checksum": doc.checksum, "length": len(doc.text), "inSync": doc.in_sync}
    return out


def _info_dict(info) -> dict[str, Any] | None:
    if info is None:
        return None
    import msgspec

    return msgspec.to_builtins(info)
