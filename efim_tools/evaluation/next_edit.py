"""`efim eval next-edit`: next-edit suggestions on real code, by category.

Samples are synthesised at run time from Python modules of the running interpreter's
standard library (`--files`; never copied into the repository). Each sample is the file, one
edit as an editor sends it (a selection retyped key by key), and the next edit a person would
make — or none:

    rename-below   a function's local or parameter renamed at one occurrence; next: the
                   nearest occurrence below (within 40 lines)
    far            the same, the nearest occurrence below more than 40 lines away
    rename-above   the last occurrence renamed; next: the nearest above
    call-site      a parameter appended to or dropped from a function with call sites in
                   the module; next: the nearest call that does not fit the new signature
    parallel       one line of a run of >= 3 lines of the same shape changed; next: the
                   same change on the next line of the run
    noise          an edit after which nothing is due: a number changed, a new statement
                   typed on a new line, a word inside a string changed
    other-file     (from `--packages`) a module-level function renamed at its `def`; next:
                   in another module of the package that imports it, the name in its
                   import line, else its first `module.name` use (`next_edit_other`)

Scores per category: exact (the proposal leaves the text the expected edit leaves), location
(the proposal is on the expected line), edit similarity of the line after the proposal
against the line after the expected edit, and for noise the share answered with no edit.
The proposer is the language server's (`efim_lsp.next_edit.dispatch`: rename, call sites,
parallel lines) fed the edit through the same history the server keeps (`--proposer
baseline`); `textual` is the issue's non-model baseline, `model` and `rules+model` ask the
model (`next_edit_model`). How the call-site and parallel samples are
made: `efim_tools.evaluation.next_edit_synth`.
"""

from __future__ import annotations

import ast
import difflib
import random
import time
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple

from efim_lsp.next_edit import other_files
from efim_lsp.next_edit.dispatch import propose
from efim_lsp.next_edit.history import EditHistory
from efim_tools.evaluation.next_edit_model import textual
from efim_tools.evaluation.next_edit_other import package_cases
from efim_tools.evaluation.next_edit_synth import call_site_samples, parallel_samples
from efim_tools.source_text import AstText
from efim_tools.training.data import stdlib_root

CATEGORIES = ("rename-below", "far", "rename-above", "call-site", "parallel", "noise", "other-file")
FAR_LINES = 40
DEFAULT_FILES = ("difflib", "textwrap", "shlex", "statistics", "fractions", "calendar")
# Packages looked at while building the other-file proposer (held out: multiprocessing,
# asyncio, unittest, xml.dom, concurrent.futures, http).
DEFAULT_PACKAGES = ("email", "logging", "json", "urllib", "importlib")


class Expected(NamedTuple):
    start: int
    end: int
    text: str


class Sample(NamedTuple):
    module: str
    category: str
    before: str  # the text before the edit
    edit: tuple[int, int, str]  # (start, end, new text) in offsets of `before`
    expected: Expected | None  # in offsets of the text after the edit (other-file: of `other`)
    other: str | None = None  # other-file: the importing module's text
    uris: tuple[str, str, str] | None = None  # other-file: the renamed module's, the importer's, the root's


class CategoryScore(NamedTuple):
    n: int
    exact: float
    location: float
    similarity: float
    silent: float


def module_path(name: str) -> Path:
    rel = name if name.endswith(".py") else name.replace(".", "/") + ".py"
    path = stdlib_root() / rel
    if not path.is_file():
        raise FileNotFoundError(f"no standard-library module {name!r} at {path}")
    return path


def samples(files: list[str], *, seed: int, per_category: int, packages: list[str] = ()) -> list[Sample]:
    rng = random.Random(seed)
    pool: dict[str, list[Sample]] = defaultdict(list)
    for name in files:
        text = module_path(name).read_text(encoding="utf-8")
        for sample in _file_samples(name, text, random.Random(f"{seed}:{name}")):
            pool[sample.category].append(sample)
    root = stdlib_root()
    for package in packages:
        for c in package_cases(root, package):
            uris = (c.a_path.as_uri(), c.b_path.as_uri(), root.as_uri())
            pool["other-file"].append(
                Sample(package, "other-file", c.a_text, c.edit, Expected(*c.expected), other=c.b_text, uris=uris)
            )
    out: list[Sample] = []
    for category in CATEGORIES:
        found = pool[category]
        rng.shuffle(found)
        out.extend(found[:per_category])
    return out


def _file_samples(name: str, text: str, rng: random.Random) -> list[Sample]:
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    synthesised = [*call_site_samples(text, tree), *parallel_samples(text, rng)]
    src = AstText(text)
    lines, starts, offset = src.lines, src.starts, src.offset

    out: list[Sample] = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        occurrences: dict[str, list[int]] = defaultdict(list)
        for node in ast.walk(fn):
            if isinstance(node, ast.arg) and node is not None:
                occurrences[node.arg].append(offset(node.lineno, node.col_offset))
            elif isinstance(node, ast.Name):
                occurrences[node.id].append(offset(node.lineno, node.col_offset))
        local = {a.arg for a in ast.walk(fn.args) if isinstance(a, ast.arg)}
        local |= {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        for var in sorted(local):
            spots = sorted(set(occurrences.get(var, ())))
            spots = [s for s in spots if text[s : s + len(var)] == var]
            if len(spots) < 2:
                continue
            new = var + "_new"
            k = len(spots) // 3
            out.append(_rename(name, text, spots[k], spots[k + 1], var, new))
            out.append(_rename(name, text, spots[-1], spots[-2], var, new))
        for node in ast.walk(fn):
            if isinstance(node, ast.Constant) and type(node.value) is int and node.end_col_offset is not None and node.lineno == node.end_lineno:
                s, e = offset(node.lineno, node.col_offset), offset(node.end_lineno, node.end_col_offset)
                out.append(Sample(name, "noise", text, (s, e, str(node.value + 7)), None))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.lineno == node.end_lineno:
                s = offset(node.lineno, node.col_offset)
                e = offset(node.end_lineno, node.end_col_offset)
                literal = text[s:e]
                words = [w for w in literal.strip("'\"rbuf").split() if w.isalpha() and len(w) > 2]
                if words:
                    w = words[0]
                    at = s + literal.index(w)
                    out.append(Sample(name, "noise", text, (at, at + len(w), w[::-1]), None))
        body = fn.body[-1]
        if body.end_lineno is not None and body.lineno == body.end_lineno:
            line = lines[body.lineno - 1]
            indent = line[: len(line) - len(line.lstrip())]
            at = starts[body.lineno - 1]
            out.append(Sample(name, "noise", text, (at, at, f"{indent}log.debug('step done')\n"), None))
    out.extend(Sample(name, x.category, x.before, x.edit, Expected(*x.expected)) for x in synthesised)
    return out


def _rename(module: str, text: str, at: int, nxt: int, old: str, new: str) -> Sample:
    line_of = text.count("\n", 0, at)
    next_line = text.count("\n", 0, nxt)
    if nxt > at:
        category = "far" if next_line - line_of > FAR_LINES else "rename-below"
        shift = len(new) - len(old)
    else:
        category = "rename-above"
        shift = 0
    start = nxt + shift
    return Sample(module, category, text, (at, at + len(old), new), Expected(start, start + len(old), new))


def _apply_as_keys(before: str, edit: tuple[int, int, str]) -> tuple[str, EditHistory]:
    """The edit as an editor sends it: the selection replaced by the first key, the rest typed."""
    start, end, new = edit
    history = EditHistory()
    text = before
    first = new[:1]
    history.observe(start, end, text[start:end], first)
    text = text[:start] + first + text[end:]
    for i, ch in enumerate(new[1:], start + 1):
        history.observe(i, i, "", ch)
        text = text[:i] + ch + text[i:]
    return text, history


def _line_after(text: str, start: int, end: int, new: str, line_start: int) -> str:
    edited = text[:start] + new + text[end:]
    line_end = edited.find("\n", line_start)
    return edited[line_start : line_end if line_end >= 0 else len(edited)]


PROPOSERS = ("baseline", "textual", "model", "rules+model")


def evaluate(cases: list[Sample], proposer: str = "baseline", model=None) -> tuple[dict[str, CategoryScore], float]:
    """Scores per category and the seconds taken. `proposer`: `baseline` (the server's
    proposers, no model), `textual` (the issue's non-model baseline: the last edit again at the
    next textual occurrence), `model` (the model over the probe candidates; `model` is a
    `next_edit_model.ModelProposer`), `rules+model` (the model where the server's proposers are
    silent). Only `baseline` looks at other files (the others leave other-file silent)."""
    if proposer not in PROPOSERS:
        raise ValueError(f"unknown proposer {proposer!r} (one of {', '.join(PROPOSERS)})")
    if proposer in ("model", "rules+model") and model is None:
        raise ValueError(f"proposer {proposer!r} needs a model (next_edit_model.ModelProposer)")
    hits: dict[str, list[tuple[bool, bool, float, bool]]] = defaultdict(list)
    t0 = time.perf_counter()
    for case in cases:
        text, history = _apply_as_keys(case.before, case.edit)
        if case.other is not None:  # other-file: the renamed module's change, the importer asked
            got = None
            if proposer == "baseline":
                rename = other_files.top_level_rename(text, history.last)
                a_uri, b_uri, root_uri = case.uris
                names = other_files.module_names(a_uri, [root_uri]) | other_files.relative_names(a_uri, b_uri)
                got = other_files.propose(case.other, [(rename, names)]) if rename is not None else None
            text = case.other
        elif proposer == "textual":
            got = textual(text, history.last)
        elif proposer == "model":
            got = model.propose(text, history.last)
        else:
            got = propose(text, history.last)
            if got is None and proposer == "rules+model":
                got = model.propose(text, history.last)
        if case.expected is None:
            hits[case.category].append((got is None, got is None, 1.0 if got is None else 0.0, got is None))
            continue
        exp = case.expected
        if got is None:
            hits[case.category].append((False, False, 0.0, True))
            continue
        # The same text afterwards: `source` -> `str(source)` and `ource` -> `tr(source)` agree.
        exact = text[: got.start] + got.new_text + text[got.end :] == text[: exp.start] + exp.text + text[exp.end :]
        same_line = text.count("\n", 0, got.start) == text.count("\n", 0, exp.start)
        line_start = text.rfind("\n", 0, exp.start) + 1
        want = _line_after(text, exp.start, exp.end, exp.text, line_start)
        if same_line:
            have = _line_after(text, got.start, got.end, got.new_text, line_start)
        else:
            have = text[line_start : (text.find("\n", line_start) + 1 or len(text) + 1) - 1]
        sim = difflib.SequenceMatcher(None, have, want).ratio()
        hits[case.category].append((exact, same_line, sim, False))
    seconds = time.perf_counter() - t0
    scores = {}
    for category in CATEGORIES:
        rows = hits.get(category, [])
        n = len(rows)
        if not n:
            continue
        scores[category] = CategoryScore(
            n, sum(r[0] for r in rows) / n, sum(r[1] for r in rows) / n, sum(r[2] for r in rows) / n, sum(r[3] for r in rows) / n
        )
    return scores, seconds


__all__ = ["CATEGORIES", "DEFAULT_FILES", "DEFAULT_PACKAGES", "PROPOSERS", "Sample", "evaluate", "samples"]
