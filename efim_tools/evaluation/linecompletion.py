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
"""

from __future__ import annotations

import random
import time
from typing import NamedTuple

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


__all__ = ["LineCase", "LineScore", "line_cases", "evaluate_lines", "edit_similarity", "levenshtein"]
