"""A source file's text with its line starts, for turning `ast` positions into text offsets."""

from __future__ import annotations


class AstText:
    """`text` split into lines once; `offset` maps an `ast` (line, column) to a code-point
    offset of `text` (ast columns count UTF-8 bytes)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.lines = text.splitlines(keepends=True)
        self.starts = [0]
        for line in self.lines:
            self.starts.append(self.starts[-1] + len(line))

    def offset(self, lineno: int, col: int) -> int:
        line = self.lines[lineno - 1]
        return self.starts[lineno - 1] + len(line.encode("utf-8")[:col].decode("utf-8", "replace"))

    def span(self, node) -> tuple[int, int]:
        """The offsets of an ast node's start and end."""
        return self.offset(node.lineno, node.col_offset), self.offset(node.end_lineno, node.end_col_offset)


__all__ = ["AstText"]
