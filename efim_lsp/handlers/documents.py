"""Document and workspace-folder handlers: didOpen, didChange, didClose,
workspace/didChangeWorkspaceFolders.

The server keeps one copy of each open document (`efim_lsp.documents.DocumentStore`;
pygls' own copy is bypassed, `efim_lsp.protocol`). Each handler updates it, tells the
context source what is open (and which folders make the workspace), so the source never
has to ask the server, and tells the completer (sessions, requests in flight).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from lsprotocol import types

from efim_lsp.documents import FullChange, RangeChange

if TYPE_CHECKING:
    from efim_lsp.server import EfimServer

log = logging.getLogger(__name__)


def register(server: EfimServer) -> None:
    server.feature(types.TEXT_DOCUMENT_DID_OPEN)(did_open)
    server.feature(types.TEXT_DOCUMENT_DID_CHANGE)(did_change)
    server.feature(types.TEXT_DOCUMENT_DID_CLOSE)(did_close)
    # pygls has updated `workspace.folders` when this runs.
    server.feature(types.WORKSPACE_DID_CHANGE_WORKSPACE_FOLDERS)(did_change_workspace_folders)


def did_open(ls: EfimServer, params: types.DidOpenTextDocumentParams) -> None:
    doc = params.text_document
    ls.documents.open(doc.uri, doc.language_id, doc.version, doc.text)
    _tell_document(ls, doc.uri)
    ls.completer.opened(doc.uri)
    ls.next_edits.opened(doc.uri)


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
    _tell_document(ls, uri)
    ls.completer.changed(uri, outcome)
    ls.next_edits.changed(uri, outcome)


def did_close(ls: EfimServer, params: types.DidCloseTextDocumentParams) -> None:
    uri = params.text_document.uri
    ls.documents.close(uri)
    if ls.context is not None:
        ls.context.document_closed(uri)
    ls.completer.closed(uri)
    ls.next_edits.closed(uri)


def did_change_workspace_folders(ls: EfimServer, params: types.DidChangeWorkspaceFoldersParams) -> None:
    tell_folders(ls)


def tell_folders(ls: EfimServer) -> None:
    """Hand the workspace folders to the context source: the client's folders, or its root
    URI when it sent none."""
    if ls.context is None:
        return
    workspace = ls.workspace
    uris = list(workspace.folders or {})
    if not uris and workspace.root_uri:
        uris = [workspace.root_uri]
    ls.context.set_folders(uris)


def _tell_document(ls: EfimServer, uri: str) -> None:
    """Hand the server's copy of an open document (its version and text) to the context source."""
    doc = ls.documents.get(uri)
    if ls.context is not None and doc is not None:
        ls.context.document_changed(uri, doc.version, doc.text)
