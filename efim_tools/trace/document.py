"""A client-side copy of one document: LSP positions ↔ code-point offsets, incremental edits.

The replayer and the synthesiser both need the text a client holds after each edit and
the LSP position of an offset. Positions follow LSP exactly: lines end at `\\n`, `\\r\\n`
or `\\r` (and nothing else — not `str.splitlines`' form feeds or U+2028), columns count
units of the negotiated position encoding (UTF-16 code units by default, so a character
outside the BMP counts two).
"""

from __future__ import annotations

import bisect
import re
from typing import Any, NamedTuple

_LINE_BREAK = re.compile(r"\r\n|\r|\n")


class Position(NamedTuple):
    line: int
    character: int

    def to_lsp(self) -> dict[str, int]:
        return {"line": self.line, "character": self.character}


def units(text: str, encoding: str = "utf-16") -> int:
    """Length of `text` in position-encoding units."""
    if encoding == "utf-32":
        return len(text)
    if encoding == "utf-16":
        return len(text) + sum(1 for ch in text if ord(ch) > 0xFFFF)
    if encoding == "utf-8":
        return len(text.encode("utf-8", "surrogatepass"))
    raise ValueError(f"unknown position encoding {encoding!r}")


def _column_to_index(line_text: str, column: int, encoding: str) -> int:
    """Code-point index of `column` units into `line_text`, clamped to the line (as LSP asks)."""
    if encoding == "utf-32":
        return min(column, len(line_text))
    count = 0
    for index, ch in enumerate(line_text):
        if count >= column:
            return index
        count += units(ch, encoding)
    return len(line_text)


class TextDocument:
    """Text plus version; `apply_change` takes an LSP TextDocumentContentChangeEvent."""

    def __init__(self, uri: str, text: str, version: int = 0, encoding: str = "utf-16") -> None:
        self.uri = uri
        self._text = text
        self._starts: list[int] | None = None
        self.version = version
        self.encoding = encoding

    @property
    def text(self) -> str:
        return self._text

    @text.setter
    def text(self, value: str) -> None:
        self._text = value
        self._starts = None

    def _line_starts(self) -> list[int]:
        if self._starts is None:
            self._starts = [0, *(m.end() for m in _LINE_BREAK.finditer(self._text))]
        return self._starts

    def _line_content_end(self, starts: list[int], line: int) -> int:
        """Offset of the end of `line` before its terminator."""
        if line + 1 < len(starts):
            end = starts[line + 1]
            if self.text[end - 2 : end] == "\r\n":
                return end - 2
            return end - 1
        return len(self.text)

    def offset_at(self, position: Position | dict[str, int]) -> int:
        if isinstance(position, dict):
            position = Position(position["line"], position["character"])
        starts = self._line_starts()
        if position.line >= len(starts):
            return len(self.text)
        start = starts[position.line]
        end = self._line_content_end(starts, position.line)
        return start + _column_to_index(self.text[start:end], position.character, self.encoding)

    def position_at(self, offset: int) -> Position:
        if not 0 <= offset <= len(self.text):
            raise ValueError(f"offset {offset} outside a document of {len(self.text)} characters")
        starts = self._line_starts()
        lo = bisect.bisect_right(starts, offset) - 1
        return Position(lo, units(self.text[starts[lo] : offset], self.encoding))

    def range_of(self, start: int, end: int) -> dict[str, Any]:
        return {"start": self.position_at(start).to_lsp(), "end": self.position_at(end).to_lsp()}

    def apply_change(self, change: dict[str, Any]) -> tuple[int, int]:
        """Apply one content change; return the code-point span `(start, end)` it replaced."""
        if "range" not in change or change["range"] is None:
            old = len(self.text)
            self.text = change["text"]
            return 0, old
        start = self.offset_at(change["range"]["start"])
        end = self.offset_at(change["range"]["end"])
        if end < start:
            raise ValueError(f"change range ends before it starts: {change['range']}")
        self.replace(start, end, change["text"])
        return start, end

    def edit(self, start: int, end: int, text: str) -> dict[str, Any]:
        """Replace `[start, end)` by `text` and return the LSP content change that says so."""
        change = {"range": self.range_of(start, end), "text": text}
        self.replace(start, end, text)
        return change

    def replace(self, start: int, end: int, text: str) -> None:
        """Replace code points `[start, end)`; line starts are patched, not recomputed.

        Only lines from the one holding `start - 1` (a `\r` there may pair with an
        inserted `\n`) to the one holding `end + 1` can change; starts after them shift."""
        old = self._text
        new = old[:start] + text + old[end:]
        starts = self._starts
        self._text = new
        if starts is None:
            return
        delta = len(text) - (end - start)
        i = bisect.bisect_right(starts, max(0, start - 1)) - 1
        j = bisect.bisect_right(starts, min(end + 1, len(old))) - 1
        stop = starts[j + 1] + delta if j + 1 < len(starts) else len(new)
        middle = [m.end() for m in _LINE_BREAK.finditer(new, starts[i], stop)]
        self._starts = starts[: i + 1] + middle + [s + delta for s in starts[j + 2 :]]
