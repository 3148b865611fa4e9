"""LSP positions <-> code-point offsets, converted once at the protocol edge.

The client counts `Position.character` in the negotiated encoding (UTF-16 code
units by default; UTF-8 bytes or UTF-32 code points when both sides agree).
Everything inside the server works on Python `str` offsets (code points), so a
position is turned into an offset as it arrives and an offset back into a
position as it leaves, and nowhere else.

Line breaks are the LSP ones: `\\n`, `\\r\\n` and `\\r`; a `\\r\\n` pair is one break.
"""

from __future__ import annotations

import bisect
import re
from typing import Literal, NamedTuple

Encoding = Literal["utf-8", "utf-16", "utf-32"]
ENCODINGS: tuple[Encoding, ...] = ("utf-8", "utf-16", "utf-32")

_LINE_BREAK = re.compile(r"\r\n|\r|\n")


class PositionError(ValueError):
    """A position that does not exist in the document (line past the end...)."""


class LinePosition(NamedTuple):
    line: int
    character: int  # in the negotiated encoding's units


def line_starts(text: str) -> list[int]:
    """Offsets at which each line begins (the first is always 0)."""
    return [0, *(m.end() for m in _LINE_BREAK.finditer(text))]


def _units(chunk: str, encoding: Encoding) -> int:
    if encoding == "utf-32" or chunk.isascii():
        return len(chunk)
    if encoding == "utf-16":
        # surrogatepass: a lone surrogate sent by a client still counts as one unit.
        return len(chunk.encode("utf-16-le", "surrogatepass")) // 2
    return len(chunk.encode("utf-8", "surrogatepass"))


def _char_width(ch: str, encoding: Encoding) -> int:
    cp = ord(ch)
    if encoding == "utf-32" or cp < 0x80:
        return 1
    if encoding == "utf-16":
        return 2 if cp > 0xFFFF else 1
    if cp < 0x800:
        return 2
    return 3 if cp < 0x10000 else 4


class LineIndex:
    """Line table of one text version; immutable (build a new one per version)."""

    __slots__ = ("text", "starts")

    def __init__(self, text: str):
        self.text = text
        self.starts = line_starts(text)

    @property
    def line_count(self) -> int:
        return len(self.starts)

    def line_end(self, line: int) -> int:
        """Offset of the end of `line`'s content (before its line break)."""
        if line + 1 < len(self.starts):
            end = self.starts[line + 1]
            if self.text.startswith("\r\n", end - 2) and end - 2 >= self.starts[line]:
                return end - 2
            return end - 1
        return len(self.text)

    def offset(self, line: int, character: int, encoding: Encoding = "utf-16") -> int:
        """Code-point offset of an LSP position.

        A character past the end of its line means the end of that line (LSP
        spec). A position inside a multi-unit character (half a surrogate pair,
        the middle of a UTF-8 sequence) snaps to that character's start.
        `line == line_count` with character 0 is the end of the text, as some
        clients send for whole-document ranges. Other lines raise PositionError.
        """
        if line < 0 or character < 0:
            raise PositionError(f"negative position ({line}, {character})")
        if line >= len(self.starts):
            if line == len(self.starts) and character == 0:
                return len(self.text)
            raise PositionError(f"line {line} is past the end of the document ({len(self.starts)} lines)")
        start = self.starts[line]
        end = self.line_end(line)
        if encoding == "utf-32":
            return min(start + character, end)
        content = self.text[start:end]
        if content.isascii():
            return start + min(character, len(content))
        units = 0
        for i, ch in enumerate(content):
            width = _char_width(ch, encoding)
            if units + width > character:
                return start + i
            units += width
        return end

    def position(self, offset: int, encoding: Encoding = "utf-16") -> LinePosition:
        """LSP position of a code-point offset (clamped to the text)."""
        offset = max(0, min(offset, len(self.text)))
        line = bisect.bisect_right(self.starts, offset) - 1
        start = self.starts[line]
        # An offset between '\r' and '\n' is not a real position; report the line end.
        offset = min(offset, self.line_end(line))
        return LinePosition(line, _units(self.text[start:offset], encoding))
