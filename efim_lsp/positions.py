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
from typing import Literal, NamedTuple, Sequence

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


def _is_start(text: str, offset: int) -> bool:
    """Whether a line begins at `offset`: after a `\n`, or after a `\r` not followed by `\n`."""
    if offset == 0:
        return True
    before = text[offset - 1]
    return before == "\n" or (before == "\r" and text[offset : offset + 1] != "\n")


class LineStarts(Sequence[int]):
    """The line starts of a text that changes by edits, kept up to date per edit.

    A gap structure: starts before the last edit are stored as offsets (`_head`), starts
    after it as distances from the end of the text (`_tail`, nearest to the gap last),
    which an edit does not change. An edit costs its own length plus the lines between it
    and the previous edit, not the document's size: typing in a 50 MB file stays cheap.
    Indexing and `bisect` work as on the plain list (`line_starts(text)` equals `list(self)`).
    """

    __slots__ = ("_head", "_tail", "_length")

    def __init__(self, text: str):
        self._head = line_starts(text)
        self._tail: list[int] = []
        self._length = len(text)

    def __len__(self) -> int:
        return len(self._head) + len(self._tail)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        head = self._head
        if i < 0:
            i += len(self)
        if 0 <= i < len(head):
            return head[i]
        j = i - len(head)
        if not 0 <= j < len(self._tail):
            raise IndexError("line index out of range")
        return self._length - self._tail[-1 - j]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (LineStarts, list, tuple)):
            return len(self) == len(other) and list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"LineStarts({list(self)!r})" if len(self) <= 16 else f"LineStarts(<{len(self)} lines>)"

    def edit(self, start: int, end: int, inserted: int, new_text: str) -> None:
        """`old[start:end]` was replaced by `inserted` characters; `new_text` is the whole new text.

        Only starts at old offsets in [start, end] can change (whether an offset is a line
        start depends on the characters just before and at it); they are recomputed from
        the new text at [start, start + inserted].
        """
        head, tail, length = self._head, self._tail, self._length
        # Move the gap: head holds the starts below `start`, tail those above `end`.
        cut = bisect.bisect_left(head, start)
        if cut < len(head):
            moved = head[cut:]
            del head[cut:]
            tail.extend(length - o for o in reversed(moved))
        while tail and length - tail[-1] <= end:
            o = length - tail.pop()
            if o < start:
                head.append(o)
        # Starts at [start, start + inserted] of the new text.
        lo, hi = max(start - 1, 0), min(start + inserted + 1, len(new_text))
        for m in _LINE_BREAK.finditer(new_text, lo, hi):
            o = m.end()
            if start <= o <= start + inserted and _is_start(new_text, o) and (not head or head[-1] < o):
                head.append(o)
        if start == 0 and (not head or head[0] != 0):
            head.insert(0, 0)
        self._length = len(new_text)


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

    def __init__(self, text: str, starts: Sequence[int] | None = None):
        """`starts`: the text's line starts when the caller keeps them (a `LineStarts`
        the document updates per edit; this index is then valid until the next edit)."""
        self.text = text
        self.starts = line_starts(text) if starts is None else starts

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
