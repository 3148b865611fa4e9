"""The LSP handlers, grouped by concern; `register(server)` installs every group.

- `lifecycle`: initialize, initialized, shutdown and settings changes (`exit` and the
  lifecycle rules are the protocol's: `efim_lsp.protocol`).
- `documents`: didOpen / didChange / didClose and workspace folder changes; they keep the
  document store and the completer current and tell the context source.
- `completion`: textDocument/inlineCompletion and textDocument/completion, and what
  became of a suggestion (`efim.accepted`, shown, partially accepted). Cancellation is
  pygls' `$/cancelRequest`; the completer stops the engine request of a cancelled one.
- `efim`: the custom `efim/*` requests and notifications.
- `cursor_requests`: the document highlights and code actions editors ask for where the
  cursor is, answered empty and read as cursor signals.
- `next_edit`: next-edit suggestions (`textDocument/copilotInlineEdit`, shown, accepted).

Each handler is thin: it reads and checks its params, calls the server's parts
(`efim_lsp.server.EfimServer`: documents, completer, holder, stats, context) and shapes
the reply. A client's mistake in a notification is logged or ignored, in a request it is
an InvalidParams error: the server never stops for one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from efim_lsp.handlers import completion, cursor_requests, documents, efim, lifecycle, next_edit

if TYPE_CHECKING:
    from efim_lsp.server import EfimServer

GROUPS = (lifecycle, documents, completion, cursor_requests, efim, next_edit)


def register(server: EfimServer) -> None:
    for group in GROUPS:
        group.register(server)
