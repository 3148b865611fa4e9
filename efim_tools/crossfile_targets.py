"""Cross-file targets of real packages (issue #33): the places whose completion needs a name
another module of the same package defines. Shared by the eval that asks the server there
(`efim_tools.evaluation.crossfile`, whose docstring describes the rules) and the training
samples built there (`efim_tools.training.crossfile`).
"""

from __future__ import annotations

import ast
import builtins
import importlib.util
import keyword
import os
import random
import re
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple

from efim_lsp.context.workspace import read_text_file

SKIP_DIRS = frozenset({"__pycache__", "test", "tests", "idle_test"})
MIN_NAME = 3
_BUILTIN_NAMES = frozenset(dir(builtins)) | frozenset(keyword.kwlist) | frozenset(keyword.softkwlist)


class PackageError(ValueError):
    """A package that cannot be evaluated (unknown, a single module, too few modules)."""


class Package(NamedTuple):
    name: str  # the import name (or the folder's name)
    root: Path  # its folder, symlinks resolved
    files: tuple[str, ...]  # its modules, posix paths relative to `root`, sorted


class Target(NamedTuple):
    package: str
    file: str  # relative to the package's folder
    line_no: int  # 1-based
    column: int  # code points before the cursor on its line
    name: str  # the name that starts at the cursor
    defined_in: tuple[str, ...]  # the other modules that define it at top level
    before: str  # the line's text before the cursor (kept in the document)
    rest: str  # the rest of the line from the cursor, right-stripped: the expected completion
    text: str  # the document as opened: the module with the line cut at the cursor

    @property
    def character(self) -> int:
        """The cursor's LSP character (UTF-16 code units)."""
        return len(self.before.encode("utf-16-le")) // 2


# -- packages ----------------------------------------------------------------------------
def resolve_package(spec: str) -> Package:
    """The package named `spec` (an import name, or a folder path); PackageError if there
    is none or it has fewer than two modules."""
    if os.sep in spec or spec.startswith(".") or Path(spec).is_dir():
        root = Path(spec).expanduser()
        if not root.is_dir():
            raise PackageError(f"package {spec!r}: no such folder")
        name = root.resolve().name
    else:
        try:
            found = importlib.util.find_spec(spec)
        except (ImportError, ValueError):
            found = None
        if found is None:
            raise PackageError(f"package {spec!r}: not found (importlib.util.find_spec found no module of that name)")
        if not found.submodule_search_locations:
            raise PackageError(f"package {spec!r}: a single module ({found.origin}), not a package of several modules")
        root, name = Path(next(iter(found.submodule_search_locations))), spec
    root = root.resolve()
    files = tuple(
        p.relative_to(root).as_posix() for p in sorted(root.rglob("*.py"))
        if p.is_file() and not SKIP_DIRS.intersection(p.relative_to(root).parts[:-1])
    )
    if len(files) < 2:
        raise PackageError(f"package {spec!r} ({root}): {len(files)} module(s); cross-file targets need at least two")
    return Package(name, root, files)


def _source(package: Package, rel: str) -> tuple[str, ast.Module] | None:
    """A module's text and syntax tree; None if the server would not read it or it does not parse."""
    text = read_text_file(package.root / rel, quiet=True)
    if text is None or "\r" in text:
        return None
    try:
        return text, ast.parse(text)
    except (SyntaxError, ValueError):
        return None


def _eligible(name: str) -> bool:
    return len(name) >= MIN_NAME and name not in _BUILTIN_NAMES and not (name.startswith("__") and name.endswith("__"))


def top_level_names(tree: ast.Module) -> set[str]:
    """Names a module defines at its top level (also inside top-level if/try/with blocks)."""
    names: set[str] = set()
    body = list(tree.body)
    while body:
        node = body.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            body.extend(node.body + getattr(node, "orelse", []) + getattr(node, "finalbody", []))
            body.extend(s for h in getattr(node, "handlers", []) for s in h.body)
    return {n for n in names if _eligible(n)}


def _inside(module: str | None, level: int, package: str) -> bool:
    return level > 0 or (module is not None and (module == package or module.startswith(package + ".")))


def package_aliases(tree: ast.Module, package: str) -> set[str]:
    """Names the module binds to the package or to names imported from it (`import json`,
    `from email import errors`, `from . import scanner`, `... as parser`)."""
    bound: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bound.update(a.asname or a.name.split(".")[0] for a in node.names if _inside(a.name, 0, package))
        elif isinstance(node, ast.ImportFrom) and _inside(node.module, node.level, package):
            bound.update(a.asname or a.name for a in node.names if a.name != "*")
    return bound


def code_uses(tree: ast.Module, lines: list[str], package: str) -> dict[tuple[int, int], str]:
    """(0-based line, code-point column) -> name, for every place a name is used in code:
    read (`x`), read off a name bound to the package or to something imported from it
    (`errors.x`, not `data.x`), or imported from the package (`from .mod import x`)."""

    def column(line: int, byte_col: int) -> int:
        return len(lines[line].encode("utf-8")[:byte_col].decode("utf-8", "ignore"))

    modules = package_aliases(tree, package)
    uses: dict[tuple[int, int], str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            uses[(node.lineno - 1, column(node.lineno - 1, node.col_offset))] = node.id
        elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and isinstance(node.value, ast.Name)
              and node.value.id in modules and node.end_lineno is not None and node.end_col_offset is not None):
            line = node.end_lineno - 1
            uses[(line, column(line, node.end_col_offset - len(node.attr.encode("utf-8"))))] = node.attr
        elif isinstance(node, ast.ImportFrom) and _inside(node.module, node.level, package):
            for alias in node.names:
                if alias.name != "*":
                    uses[(alias.lineno - 1, column(alias.lineno - 1, alias.col_offset))] = alias.name
    return uses


def module_targets(package: Package, rel: str, text: str, tree: ast.Module, defined: dict[str, list[str]]) -> list[Target]:
    """The targets of one module, in text order (`defined`: name -> the modules defining it)."""
    lines = text.split("\n")
    own = top_level_names(tree)
    uses = code_uses(tree, lines, package.name)
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line) + 1)
    seen: set[str] = set()
    chosen: dict[int, Target] = {}
    line = 0
    for match in re.finditer(r"\w+", text):
        word = match.group()
        if word in seen:
            continue
        seen.add(word)
        while starts[line + 1] <= match.start():
            line += 1
        col = match.start() - starts[line]
        siblings = [m for m in defined.get(word, ()) if m != rel]
        if not siblings or word in own or uses.get((line, col)) != word or line in chosen:
            continue
        before, rest = lines[line][:col], lines[line][col:].rstrip()
        doc = text[: starts[line]] + before + text[starts[line + 1] - 1 :]
        chosen[line] = Target(package.name, rel, line + 1, col, word, tuple(siblings), before, rest, doc)
    return [chosen[k] for k in sorted(chosen)]


def find_targets(package: Package, limit: int | None = None, seed: int = 0) -> list[Target]:
    """Every target of the package, or a seeded sample of `limit` of them (the same seed,
    package and files give the same sample)."""
    sources = {rel: src for rel in package.files if (src := _source(package, rel)) is not None}
    defined: dict[str, list[str]] = defaultdict(list)
    for rel, (_, tree) in sources.items():
        for name in top_level_names(tree):
            defined[name].append(rel)
    found = [t for rel, (text, tree) in sources.items() for t in module_targets(package, rel, text, tree, defined)]
    if limit is not None and len(found) > limit:
        found = random.Random(f"crossfile:{seed}:{package.name}").sample(found, limit)
    return found


__all__ = ["SKIP_DIRS", "PackageError", "Package", "Target", "resolve_package", "top_level_names",
           "package_aliases", "code_uses", "module_targets", "find_targets"]
