"""`other-file` samples for `efim eval next-edit`: a module-level function of one module of a
standard-library package renamed at its `def`, and the first place another module of the same
package that imports it must change — the name in its `from <module> import ...` line, else
its first `<module>.name` / `alias.name` use. Found with `ast` (independently of the
proposer's text scan): absolute and relative imports resolved against the package's files.
Importing modules that define the same name at module level are left out (the name is
theirs there)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import NamedTuple


class OtherFileCase(NamedTuple):
    a_path: Path
    a_text: str
    edit: tuple[int, int, str]  # the rename at the def, in offsets of a_text
    b_path: Path
    b_text: str
    expected: tuple[int, int, str]  # in offsets of b_text


def package_cases(root: Path, package: str) -> list[OtherFileCase]:
    """Every (function, importing module) pair of `package` (a dotted stdlib package)."""
    folder = root / package.replace(".", "/")
    if not (folder / "__init__.py").is_file():
        raise FileNotFoundError(f"no standard-library package {package!r} at {folder}")
    files = sorted(p for p in folder.rglob("*.py") if "test" not in p.relative_to(root).parts[0:2])
    parsed: dict[Path, tuple[str, ast.Module]] = {}
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
            parsed[path] = (text, ast.parse(text))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
    dotted = {path: _dotted(root, path) for path in parsed}
    by_name = {name: path for path, name in dotted.items()}
    out: list[OtherFileCase] = []
    for b_path, (b_text, b_tree) in parsed.items():
        b_package = dotted[b_path].split(".") if b_path.name == "__init__.py" else dotted[b_path].split(".")[:-1]
        b_defines = _module_level_names(b_tree)
        # What B refers to: (A's dotted name) -> names imported from it (ast alias nodes), and
        # the prefixes through which B reaches A's attributes.
        from_imports: dict[str, list[ast.alias]] = {}
        prefixes: dict[str, set[str]] = {}
        for node in ast.walk(b_tree):
            if isinstance(node, ast.ImportFrom):
                source = _resolve(node, b_package)
                if source is None:
                    continue
                for alias in node.names:
                    from_imports.setdefault(source, []).append(alias)
                    prefixes.setdefault(f"{source}.{alias.name}", set()).add(alias.asname or alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    prefixes.setdefault(alias.name, set()).add(alias.asname or alias.name)
        for a_name, a_path in by_name.items():
            if a_path == b_path:
                continue
            a_text, a_tree = parsed[a_path]
            for fn in a_tree.body:
                if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or fn.name in b_defines:
                    continue
                places = []
                for alias in from_imports.get(a_name, []):
                    if alias.name == fn.name:
                        places.append(_offset(b_text, alias.lineno, alias.col_offset))
                if not places:
                    via = prefixes.get(a_name, set())
                    for node in ast.walk(b_tree):
                        if isinstance(node, ast.Attribute) and node.attr == fn.name and ast.unparse(node.value) in via:
                            places.append(_offset(b_text, node.end_lineno, node.end_col_offset) - len(fn.name))
                if not places:
                    continue
                at = min(places)
                if b_text[at : at + len(fn.name)] != fn.name:
                    continue
                d = _offset(a_text, fn.lineno, fn.col_offset)
                d = a_text.index(fn.name, d)
                new = fn.name + "_new"
                out.append(OtherFileCase(a_path, a_text, (d, d + len(fn.name), new), b_path, b_text, (at, at + len(fn.name), new)))
    return out


def _dotted(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _resolve(node: ast.ImportFrom, package: list[str]) -> str | None:
    if node.level == 0:
        return node.module
    if node.level - 1 > len(package):
        return None
    base = package[: len(package) - (node.level - 1)]
    return ".".join([*base, *(node.module.split(".") if node.module else [])])


def _module_level_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def _offset(text: str, lineno: int, col: int) -> int:
    """A text offset from an ast position (UTF-8 columns)."""
    start = 0
    for _ in range(lineno - 1):
        start = text.index("\n", start) + 1
    end = text.find("\n", start)
    line = text[start : end if end >= 0 else len(text)]
    return start + len(line.encode("utf-8")[:col].decode("utf-8", "replace"))


__all__ = ["OtherFileCase", "package_cases"]
