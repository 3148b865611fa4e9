"""A Python module's definitions in a few lines: what another file needs to use it.

`Outline.of(text)` reads the module's top level with `ast` (also inside top-level `if`,
`try` and `with` blocks): function signatures, class heads with their methods' signatures,
assignments' names (short values kept), and each definition's docstring first line.
`Outline.render(fits)` writes the most detailed form that `fits(text)` accepts, dropping
detail in a fixed order — private definitions, method docstrings, all docstrings, methods
other than `__init__`, then one line per definition, then the last definitions — so the
same module text and budget always give the same chunk (and the same KV).
"""

from __future__ import annotations

import ast
from typing import Callable, NamedTuple

MAX_VALUE_CHARS = 48
MAX_DOC_CHARS = 100
KEPT_DECORATORS = frozenset({"property", "classmethod", "staticmethod", "abstractmethod", "dataclass", "cached_property"})


class Member(NamedTuple):
    signature: str  # `def name(args) -> ret:` (decorators above it, one a line)
    doc: str  # docstring first line ("" if none)
    public: bool


class Definition(NamedTuple):
    name: str
    head: str  # `def f(a, b):`, `class C(Base):`, `NAME = value`
    doc: str
    members: tuple[Member, ...]  # a class's methods
    public: bool
    kind: str  # "def" | "class" | "assign"


def _doc(node: ast.AST) -> str:
    try:
        doc = ast.get_docstring(node, clean=True)  # type: ignore[arg-type]
    except TypeError:
        return ""
    if not doc:
        return ""
    first = doc.strip().split("\n", 1)[0].strip()
    if len(first) > MAX_DOC_CHARS:
        first = first[: MAX_DOC_CHARS - 3].rstrip() + "..."
    return first.replace('"""', "'''").replace("\\", "\\\\")


def _decorators(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> str:
    out = []
    for deco in node.decorator_list:
        target = deco.func if isinstance(deco, ast.Call) else deco
        name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
        if name in KEPT_DECORATORS or name in ("setter", "getter", "deleter"):
            out.append("@" + ast.unparse(target))
    return "".join(d + "\n" for d in out)


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    ret = f" -> {ast.unparse(node.returns)}" if node.returns is not None else ""
    prefix = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
    return f"{_decorators(node)}{prefix} {node.name}({ast.unparse(node.args)}){ret}:"


def _public(name: str, exported: set[str] | None) -> bool:
    return not name.startswith("_") or (exported is not None and name in exported)


def _exported(tree: ast.Module) -> set[str] | None:
    """`__all__` when the module lists its names as literal strings."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            if isinstance(node.value, (ast.List, ast.Tuple)):
                names = {e.value for e in node.value.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
                return names or None
    return None


def top_level_statements(body: list[ast.stmt]) -> list[ast.stmt]:
    """A module's top-level statements, those inside top-level `if`/`try`/`with` included."""
    out: list[ast.stmt] = []
    for node in body:
        if isinstance(node, ast.If):
            out += top_level_statements(node.body) + top_level_statements(node.orelse)
        elif isinstance(node, ast.Try):
            out += top_level_statements(node.body) + [s for h in node.handlers for s in top_level_statements(h.body)]
            out += top_level_statements(node.orelse) + top_level_statements(node.finalbody)
        elif isinstance(node, ast.With):
            out += top_level_statements(node.body)
        else:
            out.append(node)
    return out


def _definitions(tree: ast.Module) -> list[Definition]:
    exported = _exported(tree)
    out: list[Definition] = []
    seen: set[str] = set()
    for node in top_level_statements(tree.body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if node.name in seen:
                continue
            seen.add(node.name)
            out.append(Definition(node.name, _signature(node), _doc(node), (), _public(node.name, exported), "def"))
        elif isinstance(node, ast.ClassDef):
            if node.name in seen:
                continue
            seen.add(node.name)
            bases = [ast.unparse(b) for b in node.bases] + [ast.unparse(k) for k in node.keywords]
            head = f"{_decorators(node)}class {node.name}" + (f"({', '.join(bases)})" if bases else "") + ":"
            members = tuple(
                Member(_signature(m), _doc(m), m.name == "__init__" or not m.name.startswith("_"))
                for m in node.body
                if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))
            )
            out.append(Definition(node.name, head, _doc(node), members, _public(node.name, exported), "class"))
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [t.id for t in targets if isinstance(t, ast.Name)]
            for t in targets:
                if isinstance(t, (ast.Tuple, ast.List)):
                    names += [e.id for e in t.elts if isinstance(e, ast.Name)]
            value = node.value
            shown = ast.unparse(value) if value is not None else ""
            if len(shown) > MAX_VALUE_CHARS or "\n" in shown:
                shown = "..."
            for name in names:
                if name in seen or (name.startswith("__") and name.endswith("__")):
                    continue
                seen.add(name)
                annotation = f": {ast.unparse(node.annotation)}" if isinstance(node, ast.AnnAssign) else ""
                head = f"{name}{annotation} = {shown}" if shown else f"{name}{annotation}"
                out.append(Definition(name, head, "", (), _public(name, exported), "assign"))
    return out


def _indent(text: str, pad: str) -> str:
    return "\n".join(pad + line for line in text.split("\n"))


class Detail(NamedTuple):
    private: bool  # private definitions too
    method_docs: bool
    docs: bool
    methods: bool  # all public methods (else `__init__` alone)
    one_line: bool  # one line per definition (`class C(B): ...`, `def f(a): ...`)


# From the most detailed form to the least; `render` takes the first that fits.
DETAILS = (
    Detail(True, True, True, True, False),
    Detail(False, True, True, True, False),
    Detail(False, False, True, True, False),
    Detail(False, False, False, True, False),
    Detail(False, False, False, False, False),
    Detail(False, False, False, False, True),
)


def _render_definition(d: Definition, detail: Detail) -> str:
    if d.kind == "assign":
        return d.head
    if detail.one_line:
        return d.head.rsplit("\n", 1)[-1] + " ..."
    lines = [d.head]
    if d.doc and detail.docs:
        lines.append(f'    """{d.doc}"""')
    members = [m for m in d.members if m.public and (detail.methods or m.signature.split("(", 1)[0].endswith("__init__"))]
    for m in members:
        if m.doc and detail.method_docs:
            lines.append(_indent(m.signature, "    "))
            lines.append(f'        """{m.doc}"""')
        else:
            lines.append(_indent(m.signature, "    ") + " ...")
    if len(lines) == 1 or (d.kind == "def" and len(lines) == 1):
        lines[0] += " ..."
    return "\n".join(lines)


class Outline(NamedTuple):
    definitions: tuple[Definition, ...]

    @classmethod
    def of(cls, text: str) -> Outline | None:
        """The outline of a module's text; None when it does not parse."""
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return None
        return cls(tuple(_definitions(tree)))

    def names(self) -> set[str]:
        return {d.name for d in self.definitions}

    def render_at(self, detail: Detail, limit: int | None = None) -> str:
        shown = [d for d in self.definitions if d.public or detail.private]
        if limit is not None:
            shown = shown[:limit]
        blocks = [_render_definition(d, detail) for d in shown]
        return "".join(b + "\n" for b in blocks)

    def render(self, fits: Callable[[str], bool]) -> str:
        """The most detailed rendering `fits` accepts ("" when not even one line per
        definition of the first one fits, or there is nothing public)."""
        text = ""
        for detail in DETAILS:
            text = self.render_at(detail)
            if not text or fits(text):
                return text
        names = self.names_only()
        if fits(names):
            return names
        shown = [d for d in self.definitions if d.public]
        lo, hi = 0, len(shown)  # the most leading names that fit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if fits(self.names_only(mid)):
                lo = mid
            else:
                hi = mid - 1
        return self.names_only(lo) if lo else ""

    def names_only(self, limit: int | None = None) -> str:
        """The public names alone, by kind: `# classes: A, B` / `# functions: f` / `# names: X`."""
        shown = [d for d in self.definitions if d.public][:limit]
        lines = []
        for kind, label in (("class", "classes"), ("def", "functions"), ("assign", "names")):
            names = [d.name for d in shown if d.kind == kind]
            if names:
                lines.append(f"# {label}: {', '.join(names)}\n")
        return "".join(lines)


__all__ = ["Outline", "Definition", "Member", "Detail", "DETAILS"]
