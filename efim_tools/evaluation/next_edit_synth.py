"""`efim eval next-edit` samples for the call-site and parallel categories, synthesised from
a real module's text at run time (its `ast` and `tokenize`, not the proposers' scanners):

    call-site   a parameter appended to a function that has call sites in the module
                (`extra`, or `extra=None`), or its last parameter dropped; next: the nearest
                call below the `def` (then above) that does not fit the new signature —
                `extra` appended positionally when the call passes every earlier parameter
                by position and no keywords, else `extra=extra` / `extra=None`; the dropped
                argument removed with its comma
    parallel    one line of a run of >= 3 consecutive lines of the same shape (tokens with
                names, numbers and strings abstracted, same repeats, same indentation)
                changed (a line drawn at random and the run's last one) — an attribute
                given a `_` prefix, a value wrapped in `str(...)`, a name the run's lines
                share changed, `strict=True` added to a call that ends the line; next: the
                same change on the next line of the run (the one above for the last line).
                A number or string changed into another is left out: that is what the noise
                set is made of, and the proposer stays silent on it
"""

from __future__ import annotations

import ast
import io
import keyword
import random
import tokenize
from collections.abc import Callable
from typing import NamedTuple

from efim_tools.source_text import AstText

PARAM = "extra"


class Synth(NamedTuple):
    category: str
    before: str
    edit: tuple[int, int, str]  # in offsets of `before`
    expected: tuple[int, int, str]  # in offsets of the text after the edit


# -- call sites ----------------------------------------------------------------------------
def call_site_samples(text: str, tree: ast.Module) -> list[Synth]:
    src = AstText(text)
    parents: dict[ast.AST, ast.AST] = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parents[child] = node
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    out: list[Synth] = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        a = fn.args
        if a.vararg or a.kwarg or a.kwonlyargs or a.posonlyargs:
            continue
        owner = parents.get(fn)
        decorators = {d.id for d in fn.decorator_list if isinstance(d, ast.Name)}
        if decorators & {"staticmethod", "classmethod", "property"} or any(not isinstance(d, ast.Name) for d in fn.decorator_list):
            continue
        if isinstance(owner, ast.ClassDef):
            if not a.args:
                continue
            bound, me = 1, a.args[0].arg
            if fn.name == "__init__":
                is_call: Callable[[ast.Call], bool] = lambda c, o=owner.name: isinstance(c.func, ast.Name) and c.func.id == o
            else:
                is_call = lambda c, n=fn.name, m=me: (isinstance(c.func, ast.Attribute) and c.func.attr == n
                                                      and isinstance(c.func.value, ast.Name) and c.func.value.id == m)
        else:
            bound = 0
            is_call = lambda c, n=fn.name: isinstance(c.func, ast.Name) and c.func.id == n
        sites = sorted((c for c in calls if is_call(c)), key=lambda c: (c.lineno, c.col_offset))
        if not sites:
            continue
        names = {x.arg for x in a.args}
        head_open = text.index("(", src.offset(fn.lineno, fn.col_offset))
        params = [(src.span(x)[0], max([src.span(x)[1], *(src.span(d)[1] for d in _default(a, i))])) for i, x in enumerate(a.args)]
        # Added: `extra` (or `extra=None`) after the last parameter.
        if PARAM not in names:
            with_default = bool(a.defaults) or (fn.lineno + fn.col_offset) % 2 == 1
            new_param = f"{PARAM}=None" if with_default else PARAM
            at = params[-1][1] if params else head_open + 1
            inserted = (", " if params else "") + new_param
            index = len(a.args) - bound
            sample = _call_sample(text, src, (at, at, inserted), sites, index, lambda call, i=index, d=with_default: _added(text, src, call, i, d))
            if sample:
                out.append(sample)
        # Dropped: the last parameter (not the bound one).
        if len(a.args) > bound:
            i = len(a.args) - 1
            start = params[i - 1][1] if i > 0 else params[i][0]
            dropped = a.args[i].arg
            index = i - bound
            sample = _call_sample(text, src, (start, params[i][1], ""), sites, index, lambda call, i=index, d=dropped: _removed(text, src, call, i, d))
            if sample:
                out.append(sample)
    return out


def _default(a: ast.arguments, i: int) -> list[ast.expr]:
    k = i - (len(a.args) - len(a.defaults))
    return [a.defaults[k]] if k >= 0 else []


def _call_sample(text: str, src: AstText, edit: tuple[int, int, str], sites: list[ast.Call], index: int,
                 fix: Callable[[ast.Call], tuple[int, int, str] | None]) -> Synth | None:
    start, end, new = edit
    shift = len(new) - (end - start)
    fixes = [(src.span(c)[0], fix(c)) for c in sites if not _unknowable(c)]
    below = [f for at, f in fixes if at >= end and f is not None]
    above = [f for at, f in reversed(fixes) if at < start and f is not None]
    chosen = below[0] if below else above[0] if above else None
    if chosen is None:
        return None
    a, b, t = chosen
    if a >= end:
        a, b = a + shift, b + shift
    return Synth("call-site", text, edit, (a, b, t))


def _unknowable(call: ast.Call) -> bool:
    return any(isinstance(x, ast.Starred) for x in call.args) or any(k.arg is None for k in call.keywords)


def _added(text: str, src: AstText, call: ast.Call, index: int, with_default: bool) -> tuple[int, int, str] | None:
    n = len(call.args)
    if n > index or any(k.arg == PARAM for k in call.keywords):
        return None
    if n == index and not call.keywords and not with_default:
        arg = PARAM
    else:
        arg = f"{PARAM}=None" if with_default else f"{PARAM}={PARAM}"
    ends = [src.span(x)[1] for x in [*call.args, *call.keywords]]
    if not ends:
        at = text.index("(", src.span(call.func)[1]) + 1
        return at, at, arg
    return max(ends), max(ends), ", " + arg


def _removed(text: str, src: AstText, call: ast.Call, index: int, name: str) -> tuple[int, int, str] | None:
    target = next((src.span(k) for k in call.keywords if k.arg == name), None)
    if target is None and len(call.args) > index:
        target = src.span(call.args[index])
    if target is None:
        return None
    spans = sorted(src.span(x) for x in [*call.args, *call.keywords])
    i = spans.index(target)
    if len(spans) == 1:
        open_at = text.index("(", src.span(call.func)[1])
        close_at = src.span(call)[1] - 1
        return open_at + 1, close_at, ""
    if i > 0:
        return spans[i - 1][1], target[1], ""
    return target[0], spans[1][0], ""


# -- parallel lines --------------------------------------------------------------------------
class _Tok(NamedTuple):
    kind: str  # "name", "number", "string", or the text itself (operators, keywords)
    text: str
    start: int  # offsets in the file
    end: int


def parallel_samples(text: str, rng: random.Random) -> list[Synth]:
    src = AstText(text)
    by_line: dict[int, list[_Tok]] = {}
    spanning: set[int] = set()
    try:
        for t in tokenize.generate_tokens(io.StringIO(text).readline):
            if t.type in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER):
                continue
            if t.start[0] != t.end[0]:
                spanning.update(range(t.start[0], t.end[0] + 1))
                continue
            kind = {tokenize.NUMBER: "number", tokenize.STRING: "string"}.get(t.type)
            if t.type == tokenize.NAME:
                kind = t.string if keyword.iskeyword(t.string) else "name"
            if kind is None:
                kind = t.string
            a = src.starts[t.start[0] - 1] + t.start[1]
            by_line.setdefault(t.start[0], []).append(_Tok(kind, t.string, a, a + len(t.string)))
    except (tokenize.TokenError, SyntaxError):
        return []

    def shape(lineno: int):
        toks = by_line.get(lineno)
        if not toks or lineno in spanning or len(toks) < 3 or toks[0].kind in ("import", "from", "def", "class", "@"):
            return None
        line = src.lines[lineno - 1]
        first: dict[str, int] = {}
        return (line[: len(line) - len(line.lstrip())],
                tuple((t.kind, first.setdefault(t.text, i)) if t.kind in ("name", "number", "string") else t.kind for i, t in enumerate(toks)))

    out: list[Synth] = []
    lineno = 1
    total = len(src.lines)
    while lineno <= total:
        sh = shape(lineno)
        end = lineno + 1
        while sh is not None and end <= total and shape(end) == sh:
            end += 1
        run = list(range(lineno, end))
        lineno = end if sh is not None else lineno + 1
        if sh is None or len(run) < 3:
            continue
        for k in sorted({rng.randrange(len(run) - 1), len(run) - 1}):
            nxt = run[k + 1] if k + 1 < len(run) else run[k - 1]
            for make in (_prefix_attribute, _wrap_value, _shared_token, _strict_flag):
                here, there = make(by_line[run[k]], [by_line[r] for r in run]), make(by_line[nxt], [by_line[r] for r in run])
                if here is None or there is None:
                    continue
                a, b, t = here
                shift = len(t) - (b - a)
                ea, eb, et = there
                if ea >= b:
                    ea, eb = ea + shift, eb + shift
                out.append(Synth("parallel", text, here, (ea, eb, et)))
    return out


def _varying(run: list[list[_Tok]], i: int) -> bool:
    return len({toks[i].text for toks in run}) == len(run)


def _prefix_attribute(toks: list[_Tok], run: list[list[_Tok]]) -> tuple[int, int, str] | None:
    for i, t in enumerate(toks):
        if (t.kind == "name" and i > 0 and toks[i - 1].text == "." and _varying(run, i) and not t.text.startswith("_")
                and sum(x.text == t.text for x in toks) == 1):
            return t.start, t.start, "_"
    return None


def _wrap_value(toks: list[_Tok], run: list[list[_Tok]]) -> tuple[int, int, str] | None:
    for i in range(len(toks) - 1, 0, -1):
        t = toks[i]
        after = toks[i + 1].text if i + 1 < len(toks) else ""
        if t.kind == "name" and toks[i - 1].text in ("=", ",", "(", ":") and after in ("", ",", ")") and _varying(run, i):
            return t.start, t.end, f"str({t.text})"
    return None


def _shared_token(toks: list[_Tok], run: list[list[_Tok]]) -> tuple[int, int, str] | None:
    for i, t in enumerate(toks):
        if len({r[i].text for r in run}) != 1:
            continue
        if t.kind == "name" and len(t.text) > 2 and t.text not in ("self", "cls"):
            return t.end, t.end, "2"
    return None


def _strict_flag(toks: list[_Tok], run: list[list[_Tok]]) -> tuple[int, int, str] | None:
    if toks[-1].text != ")" or len(toks) < 3:
        return None
    depth = 0
    for t in reversed(toks):
        depth += {")": 1, "(": -1}.get(t.text, 0)
        if depth == 0:
            break
    if depth != 0:
        return None  # the `)` closes a bracket opened on another line
    opener = next(i for i in range(len(toks) - 1, -1, -1) if toks[i].text == "(" and _closes(toks, i))
    if opener == 0 or toks[opener - 1].kind not in ("name", ")", "]"):
        return None  # a tuple or a bracketed expression, not a call
    before = toks[-2]
    return (before.end, before.end, "strict=True") if before.text == "(" else (before.end, before.end, ", strict=True")


def _closes(toks: list[_Tok], i: int) -> bool:
    """Whether the `(` at `i` is the one the line's last `)` closes."""
    depth = 0
    for t in toks[i:]:
        depth += {"(": 1, ")": -1}.get(t.text, 0)
        if depth == 0:
            return t is toks[-1]
    return False


__all__ = ["PARAM", "Synth", "call_site_samples", "parallel_samples"]
