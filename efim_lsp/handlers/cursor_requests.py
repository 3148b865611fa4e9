"""Requests editors send about the cursor's place, read as cursor signals.

Most LSP clients tell a server where the cursor is without any extension of ours, by asking
about that place as it moves: VS Code, Zed, Sublime Text's LSP and Emacs (lsp-mode, eglot)
ask for the symbol's `textDocument/documentHighlight`s after the cursor settles, and VS Code,
Zed, Sublime and Emacs ask for `textDocument/codeAction`s at the selection (the light bulb).
The server advertises both and answers with nothing to show (`[]`: the user's language
server draws highlights and actions; a client merges ours, which add nothing). The place they
name is what the server needs before the first key after a jump: it warms the window there
as `efim/didMoveCursor` does (`WarmAhead.position_asked`; docs/design.md "After a jump").
A request at the live session's cursor (asked while typing) is not a signal. A bad position
or an unopened document is answered `[]` and warms nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lsprotocol import types

from efim_lsp.handlers.params import cursor_of

if TYPE_CHECKING:
    from efim_lsp.server import EfimServer


def register(server: EfimServer) -> None:
    server.feature(types.TEXT_DOCUMENT_DOCUMENT_HIGHLIGHT)(document_highlight)
    server.feature(types.TEXT_DOCUMENT_CODE_ACTION, types.CodeActionOptions(code_action_kinds=[types.CodeActionKind.QuickFix]))(code_action)


def document_highlight(ls: EfimServer, params: types.DocumentHighlightParams) -> list:
    _signal(ls, params.text_document, params.position)
    return []


def code_action(ls: EfimServer, params: types.CodeActionParams) -> list:
    # The selection's start: where typing lands once a selected text is replaced.
    _signal(ls, params.text_document, params.range.start)
    return []


def _signal(ls: EfimServer, document: types.TextDocumentIdentifier, position: types.Position) -> None:
    cursor = cursor_of(ls.documents, {"textDocument": {"uri": document.uri},
                                      "position": {"line": position.line, "character": position.character}})
    if cursor is not None:
        ls.completer.position_asked(*cursor)
