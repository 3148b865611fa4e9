"""The shape of a suggestion once accepted (`efim eval shape`): does the file still parse,
and does the suggestion's last line repeat the line below it?

Cases: statement starts in the held-out stdlib modules (one-line statements and compound
headers, from the module's AST). Each statement's first line is emptied to its indentation,
as an editor holds a fresh line after a jump; the cursor ends the indentation. The language
server's path is followed: `CursorContext`, `choose_mode` (or a forced one-line mode),
`fresh_line`, an EFIM request with the indentation as the increment, `shape` of the
generation (a generation that reached `max_tokens` cut to its finished lines, as the server
cuts it). The suggestion is accepted (inserted at the cursor) and counted:

- unparseable: `ast.parse` fails on the file with the suggestion in place (the original
  parses; the file with the emptied line is not required to);
- duplicate: the suggestion's last line equals (stripped) the next non-blank line below
  the cursor line;
- empty: no suggestion shown (`shape(...).text == ""`).

Each generation is shaped twice, without and with `shape`'s post-processing (the indentation
snap, the closing of an open docstring and the off-side rule), so the two rows of a mode compare it on the same
generations.
"""

from __future__ import annotations

import ast
import random
import time
from typing import NamedTuple

from efim_lsp.suggest import CursorContext, choose_mode, fresh_line, shape
from efim_tools.training.data import SourceFile, held_out_files


class ShapeCase(NamedTuple):
    module: str
    line_no: int  # 1-based: the emptied line
    before: str  # the file up to the emptied line (whole lines)
    indent: str  # the emptied line's indentation (typed: the cursor ends it)
    after: str  # the file after the emptied line's content: its line break and the rest
    original: str  # the emptied line's content (after the indentation)


class ShapeScore(NamedTuple):
    mode: str  # "auto" (the server's choice) or "line" (one line forced)
    post: bool  # shape()'s post-processing on (indentation snap, docstring close, off-side rule)
    n: int
    shown: int
    unparseable: int  # of the shown suggestions
    duplicate: int  # of the shown suggestions
    multi_line: int  # shown suggestions with more than one line
    fresh_line: int  # requests asked under the fresh-line rule
    seconds: float


def shape_cases(files: list[SourceFile] | None = None, n: int = 200, seed: int = 0) -> list[ShapeCase]:
    """`n` statement starts spread over the held-out modules (a seeded shuffle); only
    modules that parse, and statements whose first line holds nothing before them."""
    files = files if files is not None else held_out_files()
    rng = random.Random(seed)
    candidates = []
    for f in files:
        try:
            tree = ast.parse(f.text)
        except SyntaxError:
            continue
        lines = f.text.split("\n")
        starts = [0]
        for line in lines:
            starts.append(starts[-1] + len(line) + 1)
        seen = set()
        for node in ast.walk(tree):
            if not isinstance(node, ast.stmt) or node.lineno in seen:
                continue
            line = lines[node.lineno - 1]
            indent = line[: len(line) - len(line.lstrip())]
            if len(indent) != node.col_offset or not line.strip() or line.strip().startswith(("@", "#")):
                continue  # a statement after `;`, or a decorated definition's line
            if not _whole_first_line(node, line):
                continue  # the first line of a statement that goes on over several lines
            seen.add(node.lineno)
            candidates.append((f, node.lineno, starts[node.lineno - 1], indent, line))
    rng.shuffle(candidates)
    return [ShapeCase(f.name, no, f.text[:off], indent, f.text[off + len(line) :], line[len(indent) :])
            for f, no, off, indent, line in candidates[:n]]


def _whole_first_line(node: ast.stmt, line: str) -> bool:
    """The statement's first line stands alone: a one-line simple statement, or a compound
    statement's header ending with `:` on its line (a trailing comment aside)."""
    if hasattr(node, "body"):
        code = line.split("#", 1)[0] if "'" not in line and '"' not in line else line
        return code.rstrip().endswith(":") and node.body[0].lineno > node.lineno
    return node.end_lineno == node.lineno


def _window(case: ShapeCase, prefix_chars: int, suffix_chars: int) -> tuple[str, str]:
    before = case.before[-prefix_chars:]
    nl = before.find("\n")
    if len(case.before) > prefix_chars and nl >= 0:
        before = before[nl + 1 :]
    after = case.after[:suffix_chars]
    cut = after.rfind("\n")
    return before, after[: cut + 1] if cut > 0 else after


def parses(text: str) -> bool:
    try:
        ast.parse(text)
    except (SyntaxError, ValueError):
        return False
    return True


def next_code_line(after: str) -> str:
    """The first non-blank line of `after` (which starts with the cursor line's break), stripped."""
    for line in after.split("\n")[1:]:
        if line.strip():
            return line.strip()
    return ""


def evaluate_shape(engine, cases: list[ShapeCase], modes: tuple[str, ...] = ("auto", "line"), *, max_tokens: int = 64,
                   prefix_chars: int = 1500, suffix_chars: int = 600, on_case=None) -> list[ShapeScore]:
    """Ask `engine` (an `engine.api.Engine`) at every case in every mode; count as the
    module docstring says, for each generation shaped without and with `shape`'s
    post-processing (one row each: before/after from the same generations).
    `on_case(mode, case, text)` sees each shown suggestion (with it)."""
    from engine.api import InfillRequest  # noqa: PLC0415

    scores = []
    for mode_name in modes:
        start = time.monotonic()
        counts = {post: [0, 0, 0, 0] for post in (False, True)}  # shown, unparseable, duplicate, multi-line
        fresh_n = 0
        for i, case in enumerate(cases):
            text = case.before + case.indent + case.after
            cursor = len(case.before) + len(case.indent)
            ctx = CursorContext.at(text, cursor, offside=True)  # Python modules
            mode = choose_mode(ctx, "auto" if mode_name == "auto" else "never")
            fresh = fresh_line(ctx)
            fresh_n += fresh
            before, after = _window(case, prefix_chars, suffix_chars)
            req = InfillRequest(key=f"shape-{i}", prefix=before, increment=case.indent, suffix=after, format="efim", context="off",
                                max_tokens=max_tokens, stop=("\n",) if mode == "line" else (), fresh_line=fresh)
            done = engine.submit(req).result(timeout=600)
            if done.finish_reason == "error":
                raise RuntimeError(done.error or "engine error")
            target = next_code_line(case.after)
            for post, c in counts.items():
                suggestion = shape(done.text, ctx if post else ctx._replace(offside=False), mode, done=True, cut_short=done.finish_reason == "length",
                                   snap_indent=post, close_docstring=post).text
                if not suggestion:
                    continue
                c[0] += 1
                c[1] += not parses(case.before + case.indent + suggestion + case.after)
                c[2] += bool(target) and suggestion.split("\n")[-1].strip() == target
                c[3] += "\n" in suggestion
                if post and on_case is not None:
                    on_case(mode_name, case, suggestion)
        seconds = time.monotonic() - start
        scores += [ShapeScore(mode_name, post, len(cases), *c, fresh_n, seconds) for post, c in counts.items()]
    return scores


__all__ = ["ShapeCase", "ShapeScore", "shape_cases", "evaluate_shape", "parses", "next_code_line"]
