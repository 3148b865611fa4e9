"""Tolerant scanning of Python-like text for the proposers: strings and comments, brackets,
ast positions back to offsets. Nothing here needs the whole file to parse.
"""

from __future__ import annotations

import ast
import bisect
import re
import warnings

# Strings (quoted once or three times; an unterminated one ends at its line or at the end)
# and `#` comments, found by the regex engine rather than a character loop: the call-site
# proposer scans whole files at every request.
_LITERAL = r"""#[^\r\n]*|\"\"\"(?:\\.|[^\\])*?(?:\"\"\"|\Z)|'''(?:\\.|[^\\])*?(?:'''|\Z)|"(?:\\.|[^\\"\r\n])*(?:"|(?=[\r\n])|\Z)|'(?:\\.|[^\\'\r\n])*(?:'|(?=[\r\n])|\Z)"""
_LITERALS = re.compile(_LITERAL, re.DOTALL)
_BRACKETS = re.compile(r"[()\[\]{}]|" + _LITERAL, re.DOTALL)
_PAIRS = {")": "(", "]": "[", "}": "{"}


def parse(text: str, mode: str = "exec") -> ast.AST | None:
    """`ast.parse`, or None where the text does not parse; its warnings (`1if x`) kept quiet:
    this is text being typed, not code being run."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return ast.parse(text, mode=mode)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


class Literals:
    """Where the strings and comments of a text are, for `inside` questions."""

    def __init__(self, text: str) -> None:
        spans = [m.span() for m in _LITERALS.finditer(text)]
        self.starts = [a for a, _ in spans]
        self.ends = [b for _, b in spans]

    def inside(self, offset: int) -> bool:
        i = bisect.bisect_right(self.starts, offset) - 1
        return i >= 0 and offset < self.ends[i]


def matching_close(text: str, open_at: int, limit: int = 6000) -> int | None:
    """The offset of the bracket closing the one at `open_at` (strings and comments skipped),
    or None: unbalanced, mismatched, or not closed within `limit` characters."""
    stack = [text[open_at]]
    for m in _BRACKETS.finditer(text, open_at + 1, min(len(text), open_at + 1 + limit)):
        ch = m.group()
        if len(ch) != 1 or ch in "#'\"":
            continue  # a string or a comment
        if ch in "([{":
            stack.append(ch)
        elif stack.pop() != _PAIRS[ch]:
            return None
        elif not stack:
            return m.start()
    return None


class Snippet:
    """A piece of text parsed on its own: ast (line, UTF-8 column) back to text offsets."""

    def __init__(self, text: str, base: int) -> None:
        self.text = text
        self.base = base  # where the piece starts in the document
        self.lines = text.splitlines(keepends=True) or [""]
        self.starts = [0]
        for line in self.lines:
            self.starts.append(self.starts[-1] + len(line))

    def offset(self, lineno: int, col: int) -> int:
        line = self.lines[lineno - 1]
        return self.base + self.starts[lineno - 1] + len(line.encode("utf-8")[:col].decode("utf-8", "replace"))

    def span(self, node) -> tuple[int, int]:
        return self.offset(node.lineno, node.col_offset), self.offset(node.end_lineno, node.end_col_offset)


def minimal(text: str, start: int, end: int, new: str, *, words: bool = False) -> tuple[int, int, str]:
    """`text[start:end] -> new` without the characters both sides share at either end; with
    `words`, never cutting into a word (`source` -> `str(source)` stays whole)."""
    old = text[start:end]
    p = 0
    while p < len(old) and p < len(new) and old[p] == new[p]:
        p += 1
    if words:
        while p > 0 and _word(old[p - 1]) and (_word(old[p : p + 1]) or _word(new[p : p + 1])):
            p -= 1
    s = 0
    while s < len(old) - p and s < len(new) - p and old[len(old) - 1 - s] == new[len(new) - 1 - s]:
        s += 1
    if words:
        while s > 0 and _word(old[len(old) - s]) and (_word(old[len(old) - s - 1 : len(old) - s]) or _word(new[len(new) - s - 1 : len(new) - s])):
            s -= 1
    return start + p, end - s, new[p : len(new) - s]


def _word(ch: str) -> bool:
    return bool(ch) and (ch.isalnum() or ch == "_")


__all__ = ["Literals", "Snippet", "matching_close", "minimal", "parse"]
