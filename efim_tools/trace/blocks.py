"""Finding the blocks a synthetic session blanks and retypes: function bodies in real files.

A `Block` is a code-point span `[start, end)` of whole lines: `start` is the start of the
body's first line, `end` the end of its last line *before* that line's terminator. The
blank file is `text[:start] + text[end:]` — the body's lines gone, one empty line left
where the cursor sits — and typing `text[start:end]` at `start` gives the original back.

Python files are parsed with `ast` (function and method bodies, after their docstring).
Other languages fall back on layout: brace blocks (`{` ending a line, closed by the
matching `}` line) or indentation blocks (a line ending in `:` followed by deeper lines).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import NamedTuple

_LINE_BREAK = re.compile(r"\r\n|\r|\n")
BRACE_SUFFIXES = {
    ".c", ".h", ".cc", ".cpp", ".hpp", ".cxx", ".java", ".js", ".jsx", ".ts", ".tsx", ".go",
    ".rs", ".cs", ".kt", ".swift", ".scala", ".php", ".dart", ".lua", ".m", ".css",
}


class Block(NamedTuple):
    start: int
    end: int
    name: str  # function name, or "line N" for layout-found blocks
    lines: int


class Lines(NamedTuple):
    starts: list[int]  # code-point offset where each line starts
    ends: list[int]  # offset where each line's content ends (before its terminator)


def split_lines(text: str) -> Lines:
    starts, ends = [0], []
    for m in _LINE_BREAK.finditer(text):
        ends.append(m.start())
        starts.append(m.end())
    ends.append(len(text))
    if starts[-1] == len(text) and len(starts) > 1:
        # a trailing terminator does not open a line of its own
        starts.pop()
        ends.pop()
    return Lines(starts, ends)


def _span(lines: Lines, first: int, last: int) -> tuple[int, int]:
    """Span of 0-based lines `first..last` inclusive, excluding the last terminator."""
    return lines.starts[first], lines.ends[last]


def python_blocks(text: str) -> list[Block]:
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    # ast counts \r, \n and \r\n as line terminators, exactly as LSP does.
    lines = split_lines(text)
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        body = list(node.body)
        if (
            len(body) > 1
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            body = body[1:]  # keep the docstring; the code after it is what gets typed
        first = body[0].lineno - 1
        last = (node.end_lineno or body[-1].lineno) - 1
        if first <= node.lineno - 1 or last >= len(lines.starts):
            continue  # one-line `def f(): return x`
        # the body must own its first line (ast columns count UTF-8 bytes)
        lead = text[lines.starts[first] : lines.ends[first]].encode("utf-8")[: body[0].col_offset]
        if lead.strip(b" \t\x0c"):
            continue
        start, end = _span(lines, first, last)
        out.append(Block(start, end, node.name, last - first + 1))
    return out


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" \t"))


def indentation_blocks(text: str) -> list[Block]:
    lines = split_lines(text)
    content = [text[s:e] for s, e in zip(lines.starts, lines.ends)]
    out = []
    for i, line in enumerate(content):
        if not line.rstrip().endswith(":"):
            continue
        base = _indent(line)
        last = None
        j = i + 1
        while j < len(content):
            if content[j].strip():
                if _indent(content[j]) <= base:
                    break
                last = j
            j += 1
        if last is not None and last > i:
            start, end = _span(lines, i + 1, last)
            out.append(Block(start, end, f"line {i + 2}", last - i))
    return out


def brace_blocks(text: str) -> list[Block]:
    """Blocks whose `{` ends a line and whose matching `}` starts its own line.

    Brace matching ignores braces inside simple string literals and line comments; it is a
    layout heuristic, not a parser, and skips anything it cannot pair."""
    lines = split_lines(text)
    content = [text[s:e] for s, e in zip(lines.starts, lines.ends)]
    stack: list[int] = []
    out = []
    strip = re.compile(r"\"(?:\\.|[^\"\\])*\"|'(?:\\.|[^'\\])*'|//.*$")
    for i, line in enumerate(content):
        code = strip.sub("", line)
        for ch in code:
            if ch == "{":
                stack.append(i)
            elif ch == "}" and stack:
                opener = stack.pop()
                if (
                    content[opener].rstrip().endswith("{")
                    and code.lstrip().startswith("}")
                    and i - opener >= 2
                ):
                    start, end = _span(lines, opener + 1, i - 1)
                    out.append(Block(start, end, f"line {opener + 2}", i - opener - 1))
    return out


def find_blocks(text: str, path: str | Path = "") -> list[Block]:
    suffix = Path(path).suffix.lower()
    if suffix in (".py", ".pyi", ".pyw"):
        found = python_blocks(text)
        return found if found else indentation_blocks(text)
    if suffix in BRACE_SUFFIXES or text.count("{") > text.count(":"):
        return brace_blocks(text)
    return indentation_blocks(text)


def typeable(blocks: list[Block], text: str, *, min_chars: int, max_chars: int, min_lines: int = 2) -> list[Block]:
    """Blocks worth retyping: a few lines of real code, not a wall of text or a one-liner."""
    out = []
    for b in blocks:
        body = text[b.start : b.end]
        if b.lines >= min_lines and min_chars <= len(body) <= max_chars and body.strip():
            out.append(b)
    return out
