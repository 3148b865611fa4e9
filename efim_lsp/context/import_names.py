"""Names for a `from <module> import ` list, from the workspace (issue #33).

At a place in a `from X import ...` statement where a name starts (after `import`, a comma or
the opening bracket, possibly with the first letters typed), the names worth offering are
the ones module X binds at its top level that this file uses below the statement and does
not bind otherwise: the names a person adds an import for after writing the code that uses
them. That is a question about two files that an index answers exactly, and a 135 M model
guesses: on the held-out targets of `efim eval crossfile` that sit in import statements the
model named the right one for 1 in 6 with or without context chunks (docs/crossfile.md).

Pure functions over text (no LSP, no engine): `site_at` finds the statement around a
cursor, `missing_names` ranks the module's names. `efim_lsp.context.source.WorkspaceContext`
resolves X through the workspace and knows its names (`definitions.ModuleDefinitions`).
"""

from __future__ import annotations

import ast
import re
from typing import Iterable, NamedTuple

from efim_lsp.context.outline import top_level_statements

# `from X import` at a line start, X relative or absolute, then an optional bracket.
_FROM = re.compile(r"[ \t]*from[ \t]+(\.*)([A-Za-z_][\w.]*|)[ \t]+import[ \t]+(\(?)")
_LISTED = re.compile(r"\s*(?:[A-Za-z_]\w*(?:\s+as\s+[A-Za-z_]\w*)?\s*,\s*)*(?:[A-Za-z_]\w*)?\Z")
_WORD = re.compile(r"[A-Za-z_]\w*")
# Strings (triple-quoted first) and comments, blanked before looking for uses.
_NOT_CODE = re.compile(r'"""[\s\S]*?(?:"""|\Z)|\'\'\'[\s\S]*?(?:\'\'\'|\Z)|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'|#[^\n]*')
# A binding at column 0 of this file: def, class, an assignment.
_BINDS = re.compile(r"^(?:async[ \t]+def|def|class)[ \t]+([A-Za-z_]\w*)|^([A-Za-z_]\w*)[ \t]*(?::[^=\n]*)?=(?!=)", re.M)
MAX_LINES_BACK = 40  # a bracketed import list spans at most this many lines above the cursor
MAX_NAMES = 5  # names offered at once (joined with ", ")
MAX_LINE = 100  # characters: a longer line gets the first name only


class ImportSite(NamedTuple):
    module: str  # dotted, without the leading dots
    level: int  # leading dots
    line: int  # 0-based line where the statement starts
    before: tuple[str, ...]  # names the statement imports before the cursor, in order
    partial: str  # the name's first letters, typed before the cursor
    end: int  # offset where the statement ends (after its bracket, or its line)
    bracketed: bool
    after: tuple[str, ...] = ()  # names it imports after the cursor, in order
    one_per_line: bool = False  # a bracketed list written one name per line, the cursor at a line's start

    @property
    def listed(self) -> frozenset[str]:
        return frozenset(self.before) | frozenset(self.after)


def site_at(text: str, cursor: int) -> ImportSite | None:
    """The `from X import` statement whose name list the cursor is in, where a name starts
    or is being typed; None anywhere else (inside a word, after a name without a comma,
    in an `as` alias, in `import *`)."""
    if cursor < 0 or cursor > len(text) or (cursor < len(text) and (text[cursor].isalnum() or text[cursor] in "_ \t")):
        return None  # inside a word, or before blanks (inside an indentation)
    start = text.rfind("\n", 0, cursor) + 1
    for _ in range(MAX_LINES_BACK):
        m = _FROM.match(text, start)
        if m is not None and m.end() <= cursor:
            between = text[m.end() : cursor]
            bracketed = m.group(3) == "("
            if ("\n" in between and not bracketed) or ")" in between or not _LISTED.match(between):
                return None
            words = _WORD.findall(between)
            partial = words[-1] if words and not between[-1:].isspace() and between[-1:] != "," else ""
            if partial and between.rstrip()[: -len(partial)].rstrip()[-1:] not in ("", ",", "("):
                return None  # after a name with no comma: an `as` alias or a typo, not a new name
            if not partial and words and not between.rstrip().endswith(","):
                return None
            if partial == "as" or (words[-2:-1] == ["as"] if partial else words[-1:] == ["as"]):
                return None
            before = _imported(words[:-1] if partial else words)
            if bracketed:
                close = text.find(")", cursor)
                end = len(text) if close < 0 else close + 1
            else:
                nl = text.find("\n", cursor)
                end = len(text) if nl < 0 else nl
            rest = text[cursor:end]
            after = _imported(_WORD.findall(code_only(rest.split("\n", 1)[0] if not bracketed else rest)))
            line_before = text[text.rfind("\n", 0, cursor) + 1 : cursor - len(partial)]
            one_per_line = bracketed and "\n" in between and not line_before.strip()
            return ImportSite(m.group(2), len(m.group(1)), text.count("\n", 0, start), tuple(before), partial, end, bracketed,
                              tuple(after), one_per_line)
        if start == 0:
            return None
        start = text.rfind("\n", 0, start - 1) + 1
    return None


def _imported(words: list[str]) -> list[str]:
    """The imported names of a name list's words (`A as B, C` -> A, C)."""
    return [w for i, w in enumerate(words) if w != "as" and (i == 0 or words[i - 1] != "as")]


def top_level_names(source: str | ast.Module) -> frozenset[str]:
    """Every name a module binds at its top level (inside top-level `if`/`try`/`with` too):
    functions, classes, assignments, imports — what `from it import name` can ask for."""
    tree = source
    if isinstance(source, str):
        try:
            tree = ast.parse(source)
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return frozenset()
    names: set[str] = set()
    for node in top_level_statements(tree.body):  # type: ignore[union-attr]
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names if a.name != "*")
    return frozenset(names)


def code_only(text: str) -> str:
    """`text` with strings and comments blanked (same length; line breaks kept)."""
    return _NOT_CODE.sub(lambda m: re.sub(r"[^\n]", " ", m.group()), text)


_USE = re.compile(r"(?<![\w.])\w+")
_ALL = re.compile(r"^__all__[ \t]*(?::[^=\n]*)?\+?=[ \t]*[\[(]([^\])]*)[\])]", re.M)
_QUOTED = re.compile(r"""["']([A-Za-z_]\w*)["']""")


def _sort_keys():
    def kind(name: str) -> int:  # isort's and ruff's `order-by-type`: CONSTANTS, Classes, functions
        return 0 if len(name) > 1 and name.isupper() else 1 if name[:1].isupper() else 2

    return (lambda n: (kind(n), n), lambda n: n, lambda n: n.lower())


SORT_KEYS = _sort_keys()


def missing_names(site: ImportSite, text: str, module_names: Iterable[str], imported_elsewhere: Iterable[str] = ()) -> list[str]:
    """The names of the module (`module_names`) that start with what was typed, that the
    code below the statement uses as whole words (or that a package's `__all__` lists), and
    that the file does not bind already (in this statement, by another import, at its top
    level). Where the statement's names are sorted (as isort and ruff keep them), in that
    order, those that belong at the cursor first; else in the order of their first use."""
    below = text[site.end :]
    all_code = code_only(text)  # same length as text: its tail is the code below
    code = all_code[site.end :]
    bound = set(site.listed) | set(imported_elsewhere)
    bound.update(a or b for a, b in _BINDS.findall(all_code))
    exported = {n for m in _ALL.finditer(below) for n in _QUOTED.findall(m.group(1))}
    used: dict[str, int] = {}  # each whole word read as a name (not after a dot), at its first use
    for m in _USE.finditer(code):
        used.setdefault(m.group(), m.start())
    first: dict[str, int] = {}
    for name in module_names:
        if not name.startswith(site.partial) or name == site.partial or name in bound or len(name) < 2:
            continue
        if name in used:
            first[name] = used[name]
        elif name in exported:
            first[name] = len(code)
    found = sorted(first, key=first.__getitem__)
    listed = [*site.before, *site.after]
    keys = [k for k in SORT_KEYS if all(k(a) <= k(b) for a, b in zip(listed, listed[1:]))] if len(listed) >= 2 else [SORT_KEYS[0]]
    if not keys or not found:
        return found
    key = keys[0]
    low = key(site.before[-1]) if site.before else None
    high = key(site.after[0]) if site.after else None
    fits = [n for n in found if (low is None or key(n) > low) and (high is None or key(n) < high)]
    return sorted(fits or found, key=key)


def suggestion(site: ImportSite, names: list[str], line_rest: str, line_before: str) -> str:
    """What to insert at the cursor: the first name's rest after the typed letters, and
    while the line stays short and nothing follows the cursor but a closing bracket, the
    next names after commas."""
    if not names:
        return ""
    text = names[0][len(site.partial) :]
    if site.one_per_line:
        return text + ("," if not line_rest.strip() else "")
    if line_rest.strip() not in ("", ")"):
        return text
    line = line_before + text
    for name in names[1:MAX_NAMES]:
        if len(line) + 2 + len(name) > MAX_LINE:
            break
        text += ", " + name
        line += ", " + name
    return text


__all__ = ["ImportSite", "site_at", "top_level_names", "code_only", "missing_names", "suggestion"]
