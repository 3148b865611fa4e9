"""Line completion on the held-out stdlib modules: exact match and edit similarity.

A case is a real line of a held-out module (never trained on) with the cursor at a
random character inside it (after its indentation): the model sees the file before the
cursor and after the line, and must produce the rest of the line. Layouts:

    fim    : PRE (P + typed) SUF S MID          P = file up to the line start, S = after the line
    efim   : PRE P SUF S MID typed              typed = the line up to the cursor (the increment)
    prefix : P typed

Windows are cut at line boundaries to `prefix_chars` / `suffix_chars` characters.
Scores: exact match of the stripped completion, and edit similarity
1 - levenshtein(a, b) / max(len(a), len(b)).

True-blank cases (`blank_line_cases`, `evaluate_blank_lines`): the cursor on a real blank
line of a held-out module, as an editor sends it (prefix: the lines above; suffix: the
line break and the lines below), plain FIM. The right answer is nothing; the measurement
is how many answers the fresh-line rule makes non-blank (a letter or digit in them), with
the rule set where the language server would set it (`efim_lsp.suggest.fresh_line`).
"""

from __future__ import annotations

import random
import time
from typing import NamedTuple

from efim_lsp.suggest import CursorContext, fresh_line
from efim_tools.evaluation.infill import Format, Infiller
from efim_tools.training.data import SourceFile, held_out_files


class LineCase(NamedTuple):
    module: str
    line_no: int  # 1-based
    prefix: str  # whole lines before the completed line (windowed)
    typed: str  # the line up to the cursor
    target: str  # the rest of the line (no newline)
    suffix: str  # from the next line on (windowed)


class LineScore(NamedTuple):
    format: str
    heal: bool
    n: int
    exact_match: float
    edit_similarity: float
    seconds: float


def levenshtein(a: str, b: str) -> int:
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def edit_similarity(a: str, b: str) -> float:
    if not a and not b:
        return 1.0
    return 1.0 - levenshtein(a, b) / max(len(a), len(b))


def _window_start(text: str, end: int, chars: int) -> int:
    if end <= chars:
        return 0
    nl = text.find("\n", end - chars)
    return nl + 1 if 0 <= nl < end else end - chars


def line_cases(files: list[SourceFile] | None = None, n: int = 100, seed: int = 0, prefix_chars: int = 1500, suffix_chars: int = 600) -> list[LineCase]:
    """`n` cases spread over the held-out modules; lines with at least 8 non-blank
    characters that are not comments; the target keeps at least 3 characters."""
    files = files if files is not None else held_out_files()
    rng = random.Random(seed)
    candidates = []
    for f in files:
        offset = 0
        for line_no, line in enumerate(f.text.split("\n"), 1):
            code = line.strip()
            if len(code) >= 8 and not code.startswith("#"):
                candidates.append((f, line_no, offset, line))
            offset += len(line) + 1
    rng.shuffle(candidates)
    cases = []
    for f, line_no, offset, line in candidates[:n]:
        indent = len(line) - len(line.lstrip())
        cursor = rng.randint(indent, len(line.rstrip()) - 3)
        start = _window_start(f.text, offset, prefix_chars)
        after = offset + len(line) + 1
        suffix = f.text[after : after + suffix_chars]
        cut = suffix.rfind("\n")
        cases.append(LineCase(f.name, line_no, f.text[start:offset], line[:cursor], line[cursor:].rstrip(), suffix[: cut + 1] if cut > 0 else suffix))
    return cases


def evaluate_lines(infiller: Infiller, cases: list[LineCase], fmt: Format, *, heal: bool = False, max_tokens: int = 40) -> LineScore:
    start = time.monotonic()
    exact, sim = 0, 0.0
    for case in cases:
        if fmt == "efim" or fmt == "prefix":
            infill = infiller.complete(case.prefix, "\n" + case.suffix, case.typed, fmt, heal=heal, max_tokens=max_tokens, single_line=True)
        else:
            infill = infiller.complete(case.prefix + case.typed, "\n" + case.suffix, "", fmt, max_tokens=max_tokens, single_line=True)
        got = infill.text.rstrip()
        exact += got.strip() == case.target.strip()
        sim += edit_similarity(got, case.target)
    n = len(cases)
    return LineScore(fmt, heal, n, exact / n if n else 0.0, sim / n if n else 0.0, time.monotonic() - start)


class BlankCase(NamedTuple):
    module: str
    line_no: int  # 1-based: the blank line
    prefix: str  # whole lines above it (windowed), ending with a line break
    suffix: str  # its line break and the lines below (windowed)
    fresh_line: bool  # the language server's fresh-line test says so here


class BlankScore(NamedTuple):
    guard: float  # the rule's confidence guard (InfillRequest.fresh_line_guard)
    n: int  # true-blank cases
    fired: int  # cases where the server would set the rule
    non_blank_off: int  # answers with text, rule off
    non_blank_on: int  # answers with text, rule on where it fires
    made_non_blank: int  # blank with the rule off, text with it on
    seconds: float

    @property
    def made_rate(self) -> float:
        return self.made_non_blank / self.n if self.n else 0.0


def blank_line_cases(files: list[SourceFile] | None = None, n: int = 100, seed: int = 0, prefix_chars: int = 1500, suffix_chars: int = 600) -> list[BlankCase]:
    """`n` real blank lines spread over the held-out modules (a seeded shuffle), each with
    code above and below it."""
    files = files if files is not None else held_out_files()
    rng = random.Random(seed)
    candidates = []
    for f in files:
        lines = f.text.split("\n")
        offset = 0
        for i, line in enumerate(lines):
            if not line.strip() and any(x.strip() for x in lines[max(0, i - 3) : i]) and any(x.strip() for x in lines[i + 1 : i + 4]):
                candidates.append((f, i + 1, offset, line))
            offset += len(line) + 1
    rng.shuffle(candidates)
    cases = []
    for f, line_no, offset, line in candidates[:n]:
        start = _window_start(f.text, offset, prefix_chars)
        after = f.text[offset + len(line) : offset + len(line) + 1 + suffix_chars]  # from the blank line's break
        cut = after.rfind("\n")
        suffix = after[: cut + 1] if cut > 0 else after
        prefix = f.text[start:offset]
        rule = fresh_line(CursorContext.at(f.text, offset))  # on the whole file, as the server sees it
        cases.append(BlankCase(f.name, line_no, prefix, suffix, rule))
    return cases


def evaluate_blank_lines(infiller: Infiller, cases: list[BlankCase], guards: list[float], *, heal: bool = False, max_tokens: int = 24) -> list[BlankScore]:
    """Plain-FIM answers at true-blank cases without the rule, then with it (once per guard,
    only where it fires: elsewhere the answer is the same request). `heal`: token healing,
    which heals the prefix's final line break (the prompt ends at a line start)."""
    def has_text(case: BlankCase, **rule) -> bool:
        text = infiller.complete(case.prefix, case.suffix, "", "fim", heal=heal, max_tokens=max_tokens, single_line=True, **rule).text
        return any(ch.isalnum() for ch in text)

    start = time.monotonic()
    off = [has_text(c) for c in cases]
    base_s = time.monotonic() - start
    scores = []
    for guard in guards:
        t0 = time.monotonic()
        on = [has_text(c, fresh_line=True, fresh_line_guard=guard) if c.fresh_line else o for c, o in zip(cases, off)]
        scores.append(BlankScore(guard, len(cases), sum(c.fresh_line for c in cases), sum(off), sum(on),
                                 sum(b and not a for a, b in zip(off, on)), base_s + time.monotonic() - t0))
    return scores


__all__ = ["LineCase", "LineScore", "line_cases", "evaluate_lines", "edit_similarity", "levenshtein",
           "BlankCase", "BlankScore", "blank_line_cases", "evaluate_blank_lines"]
