"""The next edit after a signature change, without a model: the call sites.

When the latest change lies inside a `def`'s parameter list and, compared with the text
before it, the function has gained or lost exactly one parameter (the others the same, in
the same order), the nearest call site in the file that does not fit the new signature yet
gets the matching edit — below the `def` first, then above:

- a parameter added: an argument appended — positionally when the call passes every earlier
  parameter by position and no keywords (`f(a, b)` → `f(a, b, new)`), else as a keyword; the
  parameter's default when it has one (`new=None`), else its name as a placeholder;
- a parameter dropped: the argument that passed it removed, with its comma (by keyword, or
  by position when the call passes more positions than the new signature takes).

Only the `def` header and each candidate call are parsed (`ast`, each on its own), so a file
being typed in elsewhere still works; a header or a call that does not parse, a call with
`*args`/`**kwargs`, or a signature with `*args` gets no edit. Calls are found by name: a
module-level or nested function by its bare name, a method through its first parameter
(`self.name(`, `cls.name(`), `__init__` by its class (`Name(`); never in strings or comments.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Sequence
from typing import NamedTuple

from efim_lsp.next_edit.history import Change
from efim_lsp.next_edit.proposer import NextEdit
from efim_lsp.next_edit.source import Literals, Snippet, matching_close, minimal, parse

# How far above the change a `def` line is looked for, and how many calls are examined.
HEADER_LINES = 30
CANDIDATES = 64
# Older changes looked through for the signature change that call fixes followed.
FOLLOWED = 12

_DEF = re.compile(r"[ \t]*(?:async[ \t]+)?def[ \t]+([^\W\d]\w*)[ \t]*\(")
_HEAD_END = re.compile(r"[ \t]*(?:->[^:\r\n]*)?:")
_CLASS = re.compile(r"[ \t]*class[ \t]+([^\W\d]\w*)")


class Param(NamedTuple):
    name: str
    kind: str  # "posonly", "normal", "vararg", "kwonly", "kwarg"
    default: str | None  # its source text


class Signature(NamedTuple):
    name: str
    def_at: int  # offset of the `def` line's start
    open_at: int  # the parameter list's brackets
    close_at: int
    params: tuple[Param, ...]


class Callee(NamedTuple):
    name: re.Pattern[str]  # the called name and its `(`; what is parsed starts there
    receiver: re.Pattern[str] | None  # what must end right before the name (`self.`), or None: a bare name
    bound: int  # leading parameters the call does not pass (self, cls)

    def calls(self, text: str, lo: int = 0, hi: int | None = None):
        """The name matches of calls in `text[lo:hi]`. The name is searched for alone (a
        leading look-behind would cost the regex engine its literal scan: 30x slower)."""
        for m in self.name.finditer(text, lo, len(text) if hi is None else hi):
            at = m.start()
            if self.receiver is None:
                if at == 0 or not (text[at - 1].isalnum() or text[at - 1] in "_."):
                    yield m
            elif self.receiver.search(text, max(0, at - 80), at):
                yield m


class Plan(NamedTuple):
    sig: Signature  # the new signature
    kind: str  # "add" or "drop"
    param: Param
    index: int  # its position among the call's arguments (bound ones not counted)
    callee: Callee


def propose(text: str, change: Change | None, earlier: Sequence[Change] = ()) -> NextEdit | None:
    """The next call to fix after `change`, or after the signature change among `earlier`
    (the document's older changes, oldest first) when every change since fixed a call of
    that function (an offered edit accepted, or the same argument typed)."""
    if change is None:
        return None
    plan = plan_of(text, change) or _resumed(text, change, earlier)
    if plan is None:
        return None
    sig, kind, param, index, callee = plan
    positions = sum(p.kind in ("posonly", "normal") for p in sig.params) - callee.bound
    literals = Literals(text)
    calls = [m for m in callee.calls(text) if not literals.inside(m.start()) and not _is_def(text, m.start())]
    below = [m for m in calls if m.start() > sig.close_at]
    above = [m for m in reversed(calls) if m.start() < sig.def_at]
    for where, found in (("below", below), ("above", above)):
        for m in found[:CANDIDATES]:
            edit = _edit(text, m.start(), m.end() - 1, kind, param, index, positions)
            if edit is not None:
                start, end, new_text = edit
                return NextEdit(start, end, new_text, f"call site of {sig.name}: {kind} {param.name} ({where})")
    return None


def plan_of(text: str, change: Change) -> Plan | None:
    """What `change` did to a signature: one parameter added or dropped, or None."""
    s, e = change.start, change.end
    if not (0 <= s <= e <= len(text)) or text[s:e] != change.new:
        return None
    new = signature_at(text, s, e)
    if new is None:
        return None
    before = text[:s] + change.old + text[e:]
    old = signature_at(before, s, s + len(change.old))
    if old is None or (old.name, old.def_at) != (new.name, new.def_at):
        return None
    delta = _one_param(old.params, new.params)
    if delta is None:
        return None
    kind, param, index = delta
    callee = _callee(text, new)
    if callee is None or index < callee.bound:
        return None
    return Plan(new, kind, param, index - callee.bound, callee)


def _resumed(text: str, change: Change, earlier: Sequence[Change]) -> Plan | None:
    """The plan of the latest signature change in `earlier` that only call fixes followed."""
    since = [change]
    for older in reversed(earlier[-FOLLOWED:]):
        plan = plan_of(text, older)
        if plan is not None:
            return plan if all(_fixes_call(text, plan, c) for c in since) else None
        since.append(older)
    return None


def _fixes_call(text: str, plan: Plan, change: Change) -> bool:
    """Whether `change` is the plan's argument added to or removed from one of its calls."""
    if plan.kind == "add":
        default = plan.param.default
        forms = {plan.param.name, f"{plan.param.name}={default if default is not None else plan.param.name}"}
        if change.old or change.new.lstrip(", ").strip() not in forms | ({default} if default else set()):
            return False
    elif change.new or not change.old.strip(", \t\r\n"):
        return False
    line_start = text.rfind("\n", 0, change.start) + 1
    for m in plan.callee.calls(text, max(0, line_start - 2000), change.start):
        close = matching_close(text, m.end() - 1)
        if close is not None and m.end() <= change.start and change.end <= close:
            return True
    return False


def signature_at(text: str, start: int, end: int) -> Signature | None:
    """The `def` whose parameter list holds `text[start:end]`, parsed from its header alone."""
    line_start = text.rfind("\n", 0, start) + 1
    for _ in range(HEADER_LINES):
        m = _DEF.match(text, line_start)
        if m is not None:
            open_at = m.end() - 1
            close_at = matching_close(text, open_at)
            if close_at is None or not (open_at < start and end <= close_at):
                return None
            tail = _HEAD_END.match(text, close_at + 1)
            if tail is None:
                return None
            header = text[m.start() : tail.end()].lstrip(" \t")
            tree = parse(header + " pass")
            fn = tree.body[0] if isinstance(tree, ast.Module) and tree.body else None
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                return None
            return Signature(fn.name, line_start, open_at, close_at, _params(fn.args, Snippet(header, 0)))
        if line_start == 0:
            return None
        line_start = text.rfind("\n", 0, line_start - 1) + 1
    return None


def _params(args: ast.arguments, header: Snippet) -> tuple[Param, ...]:
    out: list[Param] = []
    positional = [*args.posonlyargs, *args.args]
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    for i, (arg, default) in enumerate(zip(positional, defaults)):
        out.append(Param(arg.arg, "posonly" if i < len(args.posonlyargs) else "normal", _source(header, default)))
    if args.vararg is not None:
        out.append(Param(args.vararg.arg, "vararg", None))
    for arg, default in zip(args.kwonlyargs, args.kw_defaults):
        out.append(Param(arg.arg, "kwonly", _source(header, default)))
    if args.kwarg is not None:
        out.append(Param(args.kwarg.arg, "kwarg", None))
    return tuple(out)


def _source(header: Snippet, node: ast.expr | None) -> str | None:
    if node is None:
        return None
    a, b = header.span(node)
    return header.text[a:b]


def _one_param(old: tuple[Param, ...], new: tuple[Param, ...]) -> tuple[str, Param, int] | None:
    """("add"|"drop", the parameter, its index among the longer list's) when exactly one
    parameter is new or gone and the others kept their names and kinds; no `*args`."""
    if any(p.kind == "vararg" for p in (*old, *new)):
        return None
    if len(new) == len(old) + 1:
        kind, longer, shorter = "add", new, old
    elif len(old) == len(new) + 1:
        kind, longer, shorter = "drop", old, new
    else:
        return None
    key = lambda p: (p.name, p.kind)
    for i, param in enumerate(longer):
        if [key(p) for p in longer[:i] + longer[i + 1 :]] == [key(p) for p in shorter]:
            if param.kind == "kwarg" or param.name in {p.name for p in shorter}:
                return None
            return kind, param, i
    return None


def _callee(text: str, sig: Signature) -> Callee | None:
    """How calls of the function read: its bare name, or `self.`/`cls.` + name for a method."""
    indent = _indent_at(text, sig.def_at)
    owner = _owner(text, sig.def_at, indent) if indent else None
    name = re.escape(sig.name)
    if owner is None or owner[0] == "def":
        return _callee_of(name, None, 0)
    decorators = _decorators(text, sig.def_at)
    if "staticmethod" in decorators:
        return _callee_of(name, rf"self|cls|{re.escape(owner[1])}", 0)
    first = next((p for p in sig.params if p.kind in ("posonly", "normal")), None)
    if first is None:
        return None
    if "classmethod" in decorators:
        receivers = "|".join(sorted({"self", re.escape(first.name), re.escape(owner[1])}))
        return _callee_of(name, receivers, 1)
    if sig.name == "__init__":
        return _callee_of(re.escape(owner[1]), None, 1)
    return _callee_of(name, re.escape(first.name), 1)


def _callee_of(name: str, receivers: str | None, bound: int) -> Callee:
    receiver = re.compile(rf"(?<![\w.])(?:{receivers})[ \t]*\.[ \t]*\Z") if receivers is not None else None
    return Callee(re.compile(rf"{name}[ \t]*\("), receiver, bound)


def _owner(text: str, def_at: int, indent: int) -> tuple[str, str] | None:
    """("class", name) or ("def", "") for the block the `def` at `def_at` is nested in."""
    end = def_at
    while end > 0:
        start = text.rfind("\n", 0, end - 1) + 1
        line = text[start:end]
        if line.strip() and not line.lstrip().startswith(("#", "@")) and _indent(line) < indent:
            c = _CLASS.match(line)
            if c is not None:
                return "class", c.group(1)
            if _DEF.match(line):
                return "def", ""
            return None  # an `if`/`try` around the def: too unusual to guess
        end = start
    return None


def _decorators(text: str, def_at: int) -> set[str]:
    names: set[str] = set()
    end = def_at
    while end > 0:
        start = text.rfind("\n", 0, end - 1) + 1
        line = text[start:end].strip()
        if not line.startswith("@"):
            break
        names.add(line[1:].split("(")[0].strip().split(".")[-1])
        end = start
    return names


def _indent_at(text: str, line_start: int) -> int:
    end = text.find("\n", line_start)
    return _indent(text[line_start : end if end >= 0 else len(text)])


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" \t"))


def _is_def(text: str, at: int) -> bool:
    line_start = text.rfind("\n", 0, at) + 1
    return re.search(r"\b(?:def|class)[ \t]+$", text[line_start:at]) is not None


def _edit(text: str, name_at: int, open_at: int, kind: str, param: Param, index: int, positions: int) -> tuple[int, int, str] | None:
    """The edit that makes the call at `name_at` fit a signature taking `positions`
    positional arguments, or None: it fits already, or that cannot be told (it does not
    parse, `*args`/`**kwargs`, an argument where it is ambiguous)."""
    close_at = matching_close(text, open_at)
    if close_at is None:
        return None
    snippet = Snippet(text[name_at : close_at + 1], name_at)
    tree = parse(snippet.text, "eval")
    call = tree.body if isinstance(tree, ast.Expression) else None
    if not isinstance(call, ast.Call):
        return None
    if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
        return None
    n = len(call.args)
    positional = param.kind in ("posonly", "normal")
    spans = sorted(snippet.span(a) for a in [*call.args, *call.keywords])
    if kind == "add":
        if any(k.arg == param.name for k in call.keywords):
            return None  # passed already
        if positional and n > index:
            return None  # passed already (the last position), or ambiguous (a position before others)
        if positional and n == index and not call.keywords and param.default is None:
            arg = param.name
        elif param.kind == "posonly":
            if n != index or call.keywords:
                return None  # a positional-only parameter cannot be passed by keyword
            arg = param.default if param.default is not None else param.name
        else:
            arg = f"{param.name}={param.default if param.default is not None else param.name}"
        if not spans:
            return open_at + 1, open_at + 1, arg
        return spans[-1][1], spans[-1][1], ", " + arg
    # drop: the argument that passed it
    target = next((snippet.span(k) for k in call.keywords if k.arg == param.name), None)
    if target is None and positional and n > index and n > positions:
        target = snippet.span(call.args[index])  # more positions than the new signature takes
    if target is None:
        return None
    i = spans.index(target)
    if len(spans) == 1:
        return minimal(text, open_at + 1, close_at, "")
    if i > 0:
        return spans[i - 1][1], target[1], ""
    return target[0], spans[1][0], ""


__all__ = ["Param", "Plan", "Signature", "plan_of", "propose", "signature_at"]
