"""Next-edit suggestions in the protocol Copilot's language server speaks, which clients
already consume (the copilot-lsp Neovim plugin's NES module, VS Code's inline edits):

- `textDocument/copilotInlineEdit` (request) `{textDocument: {uri, version}, position}` →
  `{edits: [{text, textDocument: {uri, version}, range, command: {title, command, arguments:
  [id]}}]}` with one edit or none: an unopened document, another `version` than the
  server's, `nextEdit: "off"` or nothing to propose all get `{edits: []}`, never an error.
  The range is in the negotiated position encoding and the request's version is copied in.
- `textDocument/didShowInlineEdit` (notification) `{item}`: counted as shown.
- `workspace/executeCommand` `efim.acceptInlineEdit` `[id]`: counted as accepted (a stale or
  unknown id as a stale accept; it changes nothing either way — the client applies the edit).

The proposals come from `efim_lsp.next_edit` (the server's `next_edits`); with `nextEdit:
"model" the model is asked too (`NextEdits.propose_with_model`, its probes run by the
completer), and a newer request or a change to the document ends that asking with no edit.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from efim_lsp.handlers.params import cursor_of, mapping

if TYPE_CHECKING:
    from efim_lsp.server import EfimServer

log = logging.getLogger(__name__)

INLINE_EDIT = "textDocument/copilotInlineEdit"
DID_SHOW_INLINE_EDIT = "textDocument/didShowInlineEdit"
ACCEPT_INLINE_EDIT = "efim.acceptInlineEdit"


def register(server: EfimServer) -> None:
    server.feature(INLINE_EDIT)(inline_edit)
    server.feature(DID_SHOW_INLINE_EDIT)(did_show_inline_edit)
    server.command(ACCEPT_INLINE_EDIT)(accept_inline_edit)


async def inline_edit(ls: EfimServer, params: Any) -> dict[str, Any]:
    info = mapping(params)
    document = mapping(info.get("textDocument"))
    uri, version = document.get("uri"), document.get("version")
    if not isinstance(uri, str) or (version is not None and (not isinstance(version, int) or isinstance(version, bool))):
        ls.next_edits.refused()
        return {"edits": []}
    at = cursor_of(ls.documents, params)  # None for a position past the end: no cursor to keep clear of
    cursor = at[1] if at is not None else None
    if ls.settings.next_edit == "model":  # the model asked where the proposers without one are silent
        offer = await ls.next_edits.propose_with_model(uri, version, cursor, ls.completer)
    else:
        offer = ls.next_edits.propose(uri, version, cursor)
    doc = ls.documents.get(uri)
    if offer is None or doc is None or doc.version != offer.version:
        return {"edits": []}
    encoding = ls.documents.encoding
    start, end = doc.index.position(offer.edit.start, encoding), doc.index.position(offer.edit.end, encoding)
    return {
        "edits": [
            {
                "text": offer.edit.new_text,
                "textDocument": {"uri": uri, "version": version if version is not None else offer.version},
                "range": {
                    "start": {"line": start.line, "character": start.character},
                    "end": {"line": end.line, "character": end.character},
                },
                "command": {"title": "efim: next edit accepted", "command": ACCEPT_INLINE_EDIT, "arguments": [offer.id]},
            }
        ]
    }


def did_show_inline_edit(ls: EfimServer, params: Any) -> None:
    ls.next_edits.shown()


def accept_inline_edit(ls, *args: Any) -> None:  # `ls` unannotated: pygls resolves a command's annotations at run time
    offer_id = args[0] if args else None
    if isinstance(offer_id, list):  # some clients pass the arguments array as one value
        offer_id = offer_id[0] if offer_id else None
    ls.next_edits.accepted(offer_id)
