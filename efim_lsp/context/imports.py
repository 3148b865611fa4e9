"""What a Python file imports, read from text that may not parse as a whole (no torch).

`imports_of(text)` finds every import statement — at any indentation, so imports inside
functions count — by its first word, joins its continuation lines (an open parenthesis,
a trailing backslash) and parses that statement alone with `ast`. A statement that does not
parse (the line being typed: `from .errors import `) still names its module when its
start does (`from .errors`, `from pkg.mod import Na`): then its names are unknown and the
whole module is meant.
"""

from __future__ import annotations

import ast
import re
from typing import NamedTuple

_START = re.compile(r"^[ \t]*(?:from|import)\b")
_FROM_HEAD = re.compile(r"^\s*from\s+(\.*)\s*((?!import\b)[A-Za-z_][\w.]*)?\s*(?:import\b(.*))?$", re.S)
_IMPORT_HEAD = re.compile(r"^\s*import\s+([A-Za-z_][\w.]*)(?:\s+as\s+([A-Za-z_]\w*))?")
MAX_STATEMENT_LINES = 64


class ImportRef(NamedTuple):
    """One imported module, or names from one module."""

    module: str  # dotted name without the leading dots ("" for `from . import x`)
    level: int  # leading dots (0: absolute)
    names: tuple[str, ...] | None  # names imported from the module; None: the module itself (import, *, unknown)
    alias: str | None  # the name the module is bound to (`import a.b as m` -> "m", `import a.b` -> "a")
    line: int  # 0-based line where the statement starts


def _statement(lines: list[str], start: int) -> tuple[str, int]:
    """The statement starting at `lines[start]` with its continuation lines, and the index after it."""
    depth, end, parts = 0, start, []
    while end < len(lines) and end - start < MAX_STATEMENT_LINES:
        line = lines[end]
        parts.append(line)
        end += 1
        code = line.split("#", 1)[0]
        depth += code.count("(") - code.count(")")
        if depth <= 0 and not code.rstrip().endswith("\\"):
            break
    return "\n".join(parts), end


def _from_parsed(node: ast.stmt, line: int) -> list[ImportRef]:
    if isinstance(node, ast.ImportFrom):
        names = tuple(a.name for a in node.names)
        return [ImportRef(node.module or "", node.level, None if "*" in names else names, None, line)]
    if isinstance(node, ast.Import):
        return [ImportRef(a.name, 0, None, a.asname or a.name.split(".")[0], line) for a in node.names]
    return []


def _from_broken(statement: str, line: int) -> list[ImportRef]:
    """An import statement that does not parse: its module, when its head names one."""
    head = statement.replace("\\\n", " ")
    match = _FROM_HEAD.match(head)
    if match is not None:
        dots, module, rest = match.group(1), match.group(2) or "", match.group(3)
        if not dots and not module:
            return []
        names = None
        if rest is not None and dots and not module:
            # `from . import a, b` cut short: the names typed so far are modules of the package
            typed = tuple(re.findall(r"[A-Za-z_]\w*", rest.split(" as ")[0]))
            return [ImportRef("", len(dots), typed, None, line)] if typed else [ImportRef("", len(dots), None, None, line)]
        return [ImportRef(module.rstrip("."), len(dots), names, None, line)]
    match = _IMPORT_HEAD.match(head)
    if match is not None:
        module = match.group(1).rstrip(".")
        return [ImportRef(module, 0, None, match.group(2) or module.split(".")[0], line)] if module else []
    return []


def imports_of(text: str) -> list[ImportRef]:
    """Every import in `text`, in text order (see the module docstring)."""
    lines = text.splitlines()
    refs: list[ImportRef] = []
    i = 0
    while i < len(lines):
        if not _START.match(lines[i]):
            i += 1
            continue
        statement, end = _statement(lines, i)
        try:
            body = ast.parse(statement.strip()).body
        except (SyntaxError, ValueError):
            body = None
        if body is not None and len(body) >= 1:
            found = _from_parsed(body[0], i)
        else:
            found = _from_broken(statement, i)
        refs.extend(found)
        i = max(end, i + 1)
    return refs


__all__ = ["ImportRef", "imports_of"]
