"""Next edits in other open documents after a module-level name was renamed in one (#34).

A rename recognised by the rename proposer (`proposer.rename_of`: the change widened to the
identifier) counts here when it is at a module-level definition: `def old`/`async def old`/
`class old` at column 0, or `old = ...` / `old: T = ...` at column 0. The server remembers the
few most recent ones (`RecentRename`: the document's URI, old, new, when).

Another open document B is then offered the same rename at its first remaining use of the old
name, when B refers to the renamed document's module:

- `from <mod> import old` (also in a parenthesised list): the name in the import line first;
  once the line imports `new` (or still `old`), B's own bare uses of `old`;
- `import <mod>` / `import <pkg>.<mod> [as m]` / `from <pkg> import <mod> [as m]` (also
  `from . import <mod>`): the
  attribute uses `<mod>.old`, `<pkg>.<mod>.old`, `m.old`.

The module's names come from its URI (`module_names`): every dotted tail of its path relative
to a workspace folder that holds it (`pkg/sub/a.py` → `a`, `sub.a`, `pkg.sub.a`; a package's
`__init__.py` names the package), or of its whole path where no folder holds it.

Never in strings or comments, never part of a longer identifier, never an attribute of
something else, a keyword argument or a nested `def old`. Where B binds `old` itself at module
level (a def, class or assignment) only the attribute uses `m.old` are offered (its own `old`
shadows the import); where B imports an `old` from another module, nothing; silent too where
nothing matches.
Relative imports count with `relative_names` (`from .a import old`, `from . import a`,
`from ..pkg import a`). Not covered: `from <mod> import *`, a parameter or
local named like the function inside B's functions (offered as a use), renames of a
name at a use site rather than its definition, more than the first use per request.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Sequence
from pathlib import PurePosixPath
from typing import NamedTuple
from urllib.parse import unquote, urlparse

from efim_lsp.next_edit.history import Change
from efim_lsp.next_edit.proposer import NextEdit, Rename, rename_of
from efim_lsp.next_edit.source import Literals, matching_close

# Recent module-level renames the server remembers.
RENAMES_KEPT = 8

_FROM = re.compile(r"^[ \t]*from[ \t]+([\w.]+)[ \t]+import[ \t]+", re.MULTILINE)
_IMPORT = re.compile(r"^[ \t]*import[ \t]+([^\n#;]*)", re.MULTILINE)
_ALIAS = re.compile(r"\s*([\w.]+)(?:\s+as\s+(\w+))?\s*$")


class RecentRename(NamedTuple):
    uri: str
    old: str
    new: str
    when: float  # time.monotonic()
    start: int  # where the definition's name is in that document (to follow retyping)


def top_level_rename(text: str, change: Change | None) -> Rename | None:
    """`change` as a rename of a module-level def/class/assignment name, or None."""
    if change is None:
        return None
    rename = rename_of(text, change)
    if rename is None:
        return None
    line_start = text.rfind("\n", 0, rename.start) + 1
    head = text[line_start : rename.start]
    if re.fullmatch(r"(?:async[ \t]+)?def[ \t]+|class[ \t]+", head):
        return rename
    if head == "" and re.match(r"[ \t]*(?::[^=\n]*)?=(?!=)", text[rename.end :]):
        return rename
    return None


def module_names(uri: str, folders: Iterable[str] = ()) -> set[str]:
    """The dotted names `uri`'s module may be imported under (see the module docstring)."""
    path = _path_of(uri)
    if path is None or not path.name.endswith((".py", ".pyi")):
        return set()
    parts = list(path.parts)
    base = None
    for folder in folders:
        root = _path_of(folder)
        holds = root is not None and len(root.parts) < len(parts) and tuple(parts[: len(root.parts)]) == root.parts
        if holds and (base is None or len(root.parts) > base):
            base = len(root.parts)  # the innermost folder that holds it
    parts = parts[base:] if base is not None else [p for p in parts if p not in ("/", "")]
    parts[-1] = parts[-1].rsplit(".", 1)[0]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    names = set()
    for i in range(len(parts) - 1, -1, -1):
        if not all(p.isidentifier() for p in parts[i:]):
            break
        names.add(".".join(parts[i:]))
    return names


def relative_names(uri: str, importer: str, levels: int = 3) -> set[str]:
    """The relative names (`.a`, `..pkg.a`) under which the document `importer` may import the
    module `uri` (up to `levels` dots)."""
    path, here = _path_of(uri), _path_of(importer)
    if path is None or here is None or not path.name.endswith((".py", ".pyi")):
        return set()
    names = set()
    base = here.parent
    for dots in range(1, levels + 1):
        try:
            rel = list(path.relative_to(base).parts)
        except ValueError:
            rel = None
        if rel:
            rel[-1] = rel[-1].rsplit(".", 1)[0]
            if rel[-1] == "__init__":
                rel = rel[:-1]
            if all(p.isidentifier() for p in rel):
                names.add("." * dots + ".".join(rel))
        if base.parent == base:
            break
        base = base.parent
    return names


def propose(text: str, renames: Sequence[tuple[Rename | RecentRename, set[str] | None]]) -> NextEdit | None:
    """The next edit in `text` after `renames` (most recent first), each with its module's
    names — None where `text` is the renamed module itself (its own module-level uses of the
    old name: the rename proposer stays inside the def or class renamed) — or None."""
    literals = None
    for rename, modules in renames:
        if modules is not None and not modules or rename.old not in text:
            continue
        if literals is None:
            literals = Literals(text)
        edit = _propose_one(text, literals, rename.old, rename.new, modules)
        if edit is not None:
            return edit
    return None


def _propose_one(text: str, literals: Literals, old: str, new: str, modules: set[str] | None) -> NextEdit | None:
    import_names: list[tuple[int, int]] = []  # `old` in `from <mod> import ...`
    own = modules is None  # `text` is the renamed module itself
    imported = own  # B binds the name from the module (as `old` or already as `new`)
    modules = modules or set()
    prefixes: list[str] = []  # `<mod>.`, `m.` for attribute uses
    statements: list[tuple[int, int]] = []  # the import statements' spans (no bare uses there)
    for m in _FROM.finditer(text):
        if literals.inside(m.start(1)):
            continue
        lo, hi = _import_list(text, m.end())
        statements.append((m.start(), hi))
        source = m.group(1)
        for name, alias, at in _aliases(text, lo, hi):
            if source in modules:
                if name == old:
                    import_names.append((at, at + len(old)))
                    imported |= alias is None
                elif name == new and alias is None:
                    imported = True
            elif (source + name if source.endswith(".") else f"{source}.{name}") in modules:
                prefixes.append(alias or name)
            elif (alias or name) == old:
                return None  # `old` comes from another module in B
    for m in _IMPORT.finditer(text):
        if literals.inside(m.start(1)):
            continue
        statements.append((m.start(), m.end()))
        for item in m.group(1).split(","):
            a = _ALIAS.match(item)
            if a is None:
                continue
            name, alias = a.group(1), a.group(2)
            if name in modules:
                prefixes.append(alias or name)
            elif alias == old:
                return None
    if _defines(text, literals, old):
        import_names, imported = [], False  # B's own `old` shadows the import (not `m.old`)
    if import_names:
        start, end = import_names[0]
        return NextEdit(start, end, new, f"rename {old} -> {new} (import from another file)")
    uses: list[tuple[int, int]] = []
    prefixes_ = set(prefixes)
    # The name searched for alone, its neighbours checked by hand: a leading look-behind in the
    # pattern makes the scan of a large file many times slower.
    for m in re.finditer(rf"{re.escape(old)}(?!\w)", text):
        s, e = m.span()
        if s > 0 and _is_word(text[s - 1]) or literals.inside(s):
            continue
        qualifier = _qualifier(text, s)
        if qualifier is not None:
            if qualifier in prefixes_:
                uses.append((s, e))
            continue
        if not imported or any(a <= s < b for a, b in statements):
            continue
        if re.match(r"\s*=(?!=)", text[e : e + 80]) or re.search(r"(?:def|class)\s+\Z", text[max(0, s - 12) : s]):
            continue  # a keyword argument, or a nested definition of its own
        uses.append((s, e))
    if not uses:
        return None
    start, end = min(uses)
    where = "in its module" if own else "from another file"
    return NextEdit(start, end, new, f"rename {old} -> {new} (use {where})")


def _qualifier(text: str, at: int) -> str | None:
    """The dotted name before `.` ahead of `at` (`pkg.a` for `pkg.a.foo`), "" for another
    expression's attribute (`f().foo`), None where `at` is not after a dot."""
    i = at - 1
    while i >= 0 and text[i] in " \t":
        i -= 1
    if i < 0 or text[i] != ".":
        return None
    j = i
    while j > 0 and (_is_word(text[j - 1]) or text[j - 1] == "."):
        j -= 1
    name = text[j:i]
    if j > 0 and text[j - 1] in ")]}\"'":
        return ""
    return name


def _is_word(ch: str) -> bool:
    return ch.isalnum() or ch == "_"


def _import_list(text: str, at: int) -> tuple[int, int]:
    """The span of the names after `import` at `at`: a parenthesised list or the line."""
    if text.startswith("(", at):
        close = matching_close(text, at)
        if close is not None:
            return at + 1, close
    end = text.find("\n", at)
    end = len(text) if end < 0 else end
    hash_ = text.find("#", at, end)
    semi = text.find(";", at, end)
    for cut in (hash_, semi):
        if cut >= 0:
            end = min(end, cut)
    return at, end


def _aliases(text: str, lo: int, hi: int) -> list[tuple[str, str | None, int]]:
    """(name, alias or None, offset of the name) for each `name [as alias]` in text[lo:hi]."""
    out = []
    for m in re.finditer(r"([^\W\d]\w*)(?:\s+as\s+([^\W\d]\w*))?", text[lo:hi]):
        if m.group(1) in ("as",):
            continue
        out.append((m.group(1), m.group(2), lo + m.start(1)))
    return out


def _defines(text: str, literals: Literals, name: str) -> bool:
    """Whether `text` binds `name` at module level by a def, class or assignment."""
    pattern = re.compile(
        rf"^(?:(?:async[ \t]+)?def[ \t]+|class[ \t]+){re.escape(name)}(?!\w)|^{re.escape(name)}[ \t]*(?::[^=\n]*)?=(?!=)",
        re.MULTILINE,
    )
    return any(not literals.inside(m.start()) for m in pattern.finditer(text))


def _path_of(uri: str) -> PurePosixPath | None:
    try:
        parsed = urlparse(uri)
    except ValueError:
        return None
    path = unquote(parsed.path if parsed.scheme else uri)
    return PurePosixPath(path.replace("\\", "/")) if path else None


def remember(renames: list[RecentRename], uri: str, text: str, change: Change | None, kept: int = RENAMES_KEPT) -> None:
    """Update `renames` (most recent last) after `uri`'s latest change `change`: a module-level
    rename is recorded (replacing the same definition's earlier state while it is retyped); a
    definition retyped back to its name is forgotten."""
    if change is None:
        return
    rename = top_level_rename(text, change)
    left = change.start
    while left > 0 and (text[left - 1].isalnum() or text[left - 1] == "_"):
        left -= 1
    for i in range(len(renames) - 1, -1, -1):
        r = renames[i]
        if r.uri == uri and left <= r.start <= change.end:
            del renames[i]  # the same definition, being retyped
    if rename is not None:
        renames.append(RecentRename(uri, rename.old, rename.new, time.monotonic(), rename.start))
        del renames[:-kept]


__all__ = ["RENAMES_KEPT", "RecentRename", "module_names", "propose", "relative_names", "remember", "top_level_rename"]
