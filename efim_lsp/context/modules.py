"""Which files of the index an import names: Python's module resolution, over the workspace.

A relative import (`from .errors import X`, `from .. import util`) is resolved from the
importing file's folder. An absolute one (`from pkg.mod import X`, `import pkg.mod as m`)
is looked up under import roots: each workspace folder, its `src/`, the folder above the
outermost package holding a workspace folder (a folder that is itself a package, such as
`email/` opened alone, is imported as `email.*`), and the same for the importing file. A
module is `name.py`, `name.pyi` or `name/__init__.py`.

Only files in `paths` (the context index: admitted workspace files and open documents)
are ever answered, so an import that points outside the workspace resolves to nothing.
"""

from __future__ import annotations

import os
from typing import Callable, Iterable, NamedTuple

from efim_lsp.context.imports import ImportRef

MAX_PACKAGE_DEPTH = 16


class Resolved(NamedTuple):
    path: str  # the module's file (a key of the index)
    names: tuple[str, ...] | None  # the names imported from it; None: the module itself


def package_root(folder: str) -> str:
    """The folder above the outermost package that `folder` is in (or `folder` itself)."""
    current = folder
    for _ in range(MAX_PACKAGE_DEPTH):
        if not os.path.isfile(os.path.join(current, "__init__.py")):
            return current
        parent = os.path.dirname(current)
        if parent == current:
            return current
        current = parent
    return current


class ModuleResolver:
    """`exists` (optional) replaces membership in `paths`: files looked up where they are
    (import names need no index, `module_names`)."""

    def __init__(self, paths: Iterable[str], roots: Iterable[str], exists: Callable[[str], bool] | None = None) -> None:
        self.paths = paths if isinstance(paths, (set, frozenset)) else set(paths)
        self._exists = exists if exists is not None else self.paths.__contains__
        seen: list[str] = []
        for root in roots:
            for candidate in (root, os.path.join(root, "src"), package_root(root)):
                if candidate not in seen:
                    seen.append(candidate)
        self.roots = tuple(seen)

    def module_file(self, folder: str, dotted: str) -> str | None:
        """`dotted` as a module under `folder`, if the index has it."""
        base = os.path.join(folder, *dotted.split(".")) if dotted else folder
        for candidate in (base + ".py", base + ".pyi", os.path.join(base, "__init__.py"), os.path.join(base, "__init__.pyi")):
            if self._exists(candidate):
                return candidate
        return None

    def _folders(self, ref: ImportRef, importer: str) -> list[str]:
        """Folders to resolve `ref.module` under."""
        if ref.level > 0:
            if "://" in importer:
                return []
            folder = os.path.dirname(importer)
            for _ in range(ref.level - 1):
                folder = os.path.dirname(folder)
            return [folder]
        roots = list(self.roots)
        if "://" not in importer:
            own = package_root(os.path.dirname(importer))
            if own not in roots:
                roots.append(own)
        return roots

    def resolve(self, ref: ImportRef, importer: str) -> list[Resolved]:
        """The indexed modules `ref` names (the importer itself left out)."""
        out: list[Resolved] = []
        for folder in self._folders(ref, importer):
            found = self.module_file(folder, ref.module)
            if ref.names is not None:
                rest: list[str] = []
                for name in ref.names:  # `from pkg import mod`: a submodule, else a name of pkg
                    sub = self.module_file(folder, f"{ref.module}.{name}" if ref.module else name)
                    if sub is not None:
                        out.append(Resolved(sub, None))
                    else:
                        rest.append(name)
                if found is not None and rest:
                    out.append(Resolved(found, tuple(rest)))
            elif found is not None:
                out.append(Resolved(found, None))
            if out:
                break
        return [r for r in out if r.path != importer]


__all__ = ["ModuleResolver", "Resolved", "package_root"]
