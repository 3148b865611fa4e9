"""Completion handlers: textDocument/inlineCompletion, textDocument/completion, and what
became of a suggestion.

A request is answered for the document version it arrived with (its arrival stamp,
`efim_lsp.protocol`); positions are converted to code-point offsets here and back for
the reply. A request that names an unknown document or a position outside it is an
InvalidParams error; one whose handler fails unexpectedly is answered with an empty list
(`EfimProtocol`). `$/cancelRequest` cancels the handler, and the completer its engine
request (`efim_lsp.completer`).

Feedback from the client, counted in `efim/stats`:
- `efim.accepted` (command, attached to every item): a full accept.
- `textDocument/didShowCompletion`, `textDocument/didPartiallyAcceptCompletion`
  (Copilot-compatible notifications): shown / partially accepted counters.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lsprotocol import types

from efim_lsp.completer import Answer
from efim_lsp.handlers.params import mapping

if TYPE_CHECKING:
    from efim_lsp.server import EfimServer

ACCEPTED_COMMAND = "efim.accepted"
DID_SHOW = "textDocument/didShowCompletion"
DID_PARTIALLY_ACCEPT = "textDocument/didPartiallyAcceptCompletion"

_LABEL_CHARS = 60


def register(server: EfimServer) -> None:
    server.feature(types.TEXT_DOCUMENT_INLINE_COMPLETION, types.InlineCompletionOptions())(inline_completion)
    server.feature(types.TEXT_DOCUMENT_COMPLETION, types.CompletionOptions(trigger_characters=None))(completion)
    server.command(ACCEPTED_COMMAND)(accepted)
    server.feature(DID_SHOW)(did_show)
    server.feature(DID_PARTIALLY_ACCEPT)(did_partially_accept)


async def inline_completion(ls: EfimServer, params: types.InlineCompletionParams) -> types.InlineCompletionList:
    uri = params.text_document.uri
    answer = await _answer_at(ls, uri, params.position)
    if answer is None:
        return types.InlineCompletionList(items=[])
    # The first item is the usual suggestion; the setting `alternatives` adds others for the
    # same range, which editors cycle through.
    rng = ls.lsp_range(uri, answer)
    items = [
        types.InlineCompletionItem(insert_text=text, range=rng, command=_accept_command(uri, answer._replace(text=text)))
        for text in (answer.text, *answer.alternatives)
    ]
    return types.InlineCompletionList(items=items)


async def completion(ls: EfimServer, params: types.CompletionParams) -> types.CompletionList:
    """Fallback for clients without inline completion: one item whose edit inserts the suggestion."""
    uri = params.text_document.uri
    answer = await _answer_at(ls, uri, params.position)
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
        command=_accept_command(uri, answer),
    )
    # is_incomplete: the client asks again as the user types (typing-through answers it).
    return types.CompletionList(is_incomplete=True, items=[item])


def accepted(ls, *args: Any) -> None:  # `ls` unannotated: pygls resolves a command's annotations at run time
    info = mapping(args[0]) if args else {}
    ls.stats.accepted += 1
    length = info.get("length")
    if isinstance(length, int) and length >= 0:
        ls.stats.accepted_chars += length


def did_show(ls: EfimServer, params: Any) -> None:
    ls.stats.shown += 1


def did_partially_accept(ls: EfimServer, params: Any) -> None:
    ls.stats.partially_accepted += 1
    length = mapping(params).get("acceptedLength")
    if isinstance(length, int) and length >= 0:
        ls.stats.accepted_chars += length


async def _answer_at(ls: EfimServer, uri: str, position: types.Position) -> Answer | None:
    """The completer's answer at `position`, for the version the request arrived with;
    None when it declines."""
    cursor = ls.cursor_offset(uri, position)
    arrival = ls.protocol.take_arrival(uri)
    result = await ls.completer.complete(uri, cursor, arrival.version, arrival.at)
    return result if isinstance(result, Answer) else None


def _accept_command(uri: str, answer: Answer) -> types.Command:
    return types.Command(
        title="efim: suggestion accepted",
        command=ACCEPTED_COMMAND,
        arguments=[{"uri": uri, "id": answer.suggestion_id, "length": len(answer.text)}],
    )
