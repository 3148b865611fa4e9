"""The server's exact copy of every open document.

`DocumentStore` applies `didOpen` / `didChange` / `didClose` in code-point
offsets (positions are converted with the document's own `LineIndex`, in the
negotiated encoding) and reports every applied change as an `Edit`, so edit
sessions and typing-through can follow what happened around the cursor.

Sync rules (docs/design.md, "Failure behaviour": the copy never drifts silently):
- Versions must increase. A version that goes backwards, repeats, or (with
  `strict_versions`, the default) skips a number means a change was lost or
  reordered: the document is marked out of sync, incremental changes are
  ignored, and completion declines until the client re-sends the whole text
  (a `didOpen`, or a `didChange` whose change has no range).
  Neovim batches several buffer ticks into one didChange, so its versions jump
  by design; the server turns `strict_versions` off for it.
- A change whose range lies outside the text also marks it out of sync.
- Documents with NUL bytes (binary) or above `MAX_DOCUMENT_CHARS` are kept but
  marked unsupported: completion declines with that reason. Documents above the
  limit are not edited incrementally (they stay unsupported until a full-text change).

Big documents: an edit costs the edit, not the document. The line table
(`positions.LineStarts`) is updated in place rather than rebuilt, the binary check
looks at the inserted text only, and the checksum is computed when asked for. The
one whole-text operation per edit left is the new `str` (a memcpy: ~1 ms for 5 MB),
because completion reads the document as one string.
"""

from __future__ import annotations

import hashlib
import logging
from typing import NamedTuple, Sequence

from efim_lsp.positions import Encoding, LineIndex, LineStarts, PositionError

log = logging.getLogger(__name__)

MAX_DOCUMENT_CHARS = 64_000_000


class Edit(NamedTuple):
    """`text[start:end]` replaced by `new_text`, in offsets of the text *before* this edit."""

    start: int
    end: int
    new_text: str

    @property
    def delta(self) -> int:
        return len(self.new_text) - (self.end - self.start)


class RangeChange(NamedTuple):
    """One incremental change as the client sent it (positions in client units)."""

    start_line: int
    start_character: int
    end_line: int
    end_character: int
    text: str


class FullChange(NamedTuple):
    text: str


Change = RangeChange | FullChange


class ChangeOutcome(NamedTuple):
    edits: list[Edit]  # applied edits, in order (empty when none or when resynced)
    resynced: bool  # a full-text change replaced the document (sessions must restart)
    in_sync: bool
    removed: tuple[str, ...] = ()  # the text each edit replaced (edit history, next edits)


class Document:
    """One open document. `text` is exact while `in_sync` is true."""

    def __init__(self, uri: str, language_id: str, version: int, text: str):
        self.uri = uri
        self.language_id = language_id
        self.version = version
        self.in_sync = True
        self.sync_problem: str | None = None
        self.unsupported: str | None = None
        self._text = ""
        self._index: LineIndex | None = None
        self._starts: LineStarts | None = None  # built on first use, then kept up to date per edit
        self._checksum: str | None = None
        self.replace_text(text)

    @property
    def text(self) -> str:
        return self._text

    @property
    def index(self) -> LineIndex:
        if self._index is None:
            if self._starts is None:
                self._starts = LineStarts(self._text)
            self._index = LineIndex(self._text, self._starts)
        return self._index

    @property
    def checksum(self) -> str:
        """`text_checksum(text)`, computed once per text version."""
        if self._checksum is None:
            self._checksum = text_checksum(self._text)
        return self._checksum

    @property
    def eol(self) -> str:
        """The document's dominant line ending (what inserted text should use)."""
        head = self._text[:65536]
        crlf = head.count("\r\n")
        lf = head.count("\n") - crlf
        cr = head.count("\r") - crlf
        if crlf > lf and crlf >= cr:
            return "\r\n"
        if cr > lf:
            return "\r"
        return "\n"

    def replace_text(self, text: str) -> None:
        self._text = text
        self._index = None
        self._starts = None
        self._checksum = None
        self.in_sync = True
        self.sync_problem = None
        self.unsupported = unsupported_reason(text)

    def apply(self, edit: Edit) -> None:
        text = self._text
        self._text = new = text[: edit.start] + edit.new_text + text[edit.end :]
        if self._starts is not None:
            self._starts.edit(edit.start, edit.end, len(edit.new_text), new)
        self._index = None
        self._checksum = None
        if self.unsupported is None:
            if "\0" in edit.new_text or len(new) > MAX_DOCUMENT_CHARS:
                self.unsupported = unsupported_reason(new)
        else:
            self.unsupported = unsupported_reason(new)  # it may have become supported

    def mark_out_of_sync(self, problem: str) -> None:
        if self.in_sync:
            log.warning("%s is out of sync: %s; completion declines until the client re-sends it", self.uri, problem)
        self.in_sync = False
        self.sync_problem = problem

    def offset_at(self, line: int, character: int, encoding: Encoding) -> int:
        return self.index.offset(line, character, encoding)


def text_checksum(text: str) -> str:
    """sha256 of the text's UTF-8 bytes (lone surrogates encoded as Python's `surrogatepass`
    does), hex, first 16 digits: what `efim/documentText` and `efim/stats` report, so a
    client can check the server's copy against its own."""
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def unsupported_reason(text: str) -> str | None:
    if "\0" in text:
        return "binary content (NUL bytes)"
    if len(text) > MAX_DOCUMENT_CHARS:
        return f"document larger than {MAX_DOCUMENT_CHARS} characters"
    return None


class DocumentStore:
    def __init__(self, encoding: Encoding = "utf-16", *, strict_versions: bool = True):
        self.encoding: Encoding = encoding
        self.strict_versions = strict_versions
        self._docs: dict[str, Document] = {}

    def __contains__(self, uri: str) -> bool:
        return uri in self._docs

    def __len__(self) -> int:
        return len(self._docs)

    def get(self, uri: str) -> Document | None:
        return self._docs.get(uri)

    def uris(self) -> list[str]:
        """The open documents. (pygls' `workspace.text_documents` is empty in this server:
        the store is the one copy of each document.)"""
        return list(self._docs)

    def open(self, uri: str, language_id: str, version: int, text: str) -> Document:
        doc = Document(uri, language_id, version, text)
        self._docs[uri] = doc
        if doc.unsupported:
            log.info("%s opened but completion is off for it: %s", uri, doc.unsupported)
        return doc

    def close(self, uri: str) -> Document | None:
        return self._docs.pop(uri, None)

    def change(self, uri: str, version: int | None, changes: Sequence[Change]) -> ChangeOutcome:
        """Apply one didChange. Raises KeyError for a document that is not open."""
        doc = self._docs[uri]
        previous = doc.version
        if version is not None:
            doc.version = version
        if version is None or version <= previous:
            doc.mark_out_of_sync(f"version went from {previous} to {version}")
        elif self.strict_versions and version != previous + 1:
            doc.mark_out_of_sync(f"version skipped from {previous} to {version}")

        edits: list[Edit] = []
        removed: list[str] = []
        resynced = False
        for change in changes:
            if isinstance(change, FullChange):
                doc.replace_text(change.text)
                edits.clear()
                removed.clear()
                resynced = True
                continue
            if not doc.in_sync:
                continue  # cannot apply a delta to a text we no longer trust
            if doc.unsupported and len(doc.text) > MAX_DOCUMENT_CHARS:
                continue  # huge documents are not tracked incrementally
            try:
                edit = self._edit_from(doc, change)
            except PositionError as exc:
                doc.mark_out_of_sync(f"change outside the text: {exc}")
                continue
            removed.append(doc.text[edit.start : edit.end])
            doc.apply(edit)
            edits.append(edit)
        if resynced and version is not None and doc.in_sync:
            log.info("%s re-synced at version %s", uri, version)
        return ChangeOutcome(edits, resynced, doc.in_sync, tuple(removed))

    def _edit_from(self, doc: Document, change: RangeChange) -> Edit:
        index = doc.index
        start = index.offset(change.start_line, change.start_character, self.encoding)
        end = index.offset(change.end_line, change.end_character, self.encoding)
        if end < start:
            raise PositionError(f"range end before its start ({change})")
        return Edit(start, end, change.text)
