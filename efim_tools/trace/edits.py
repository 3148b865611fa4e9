"""What a person does at the spot a jump lands on: small edits, one key press at a time.

Each action is planned on plain text and returns the `Step`s that perform it; a step is
one key press the editor reports as one `didChange` (Backspace, a character, Enter with
the next line's indentation, Ctrl+V, Ctrl+Z, a selection deleted), with the gap before
it. Offsets are code points of the text as it is just before that step.

- `retype_tail`: the cursor lands at the end of a line; the last few characters are
  deleted (one Backspace each, or selected and deleted at once) and typed back, so the
  line ends as it began.
- `new_line`: the cursor lands at the end of a line; Enter, then a line of code from
  elsewhere in the open files is typed.
- `paste`: the cursor lands at the start of a line; a few whole lines copied from
  elsewhere, re-indented to the spot, go in with one key press.
- `undo`: one key press takes back the last `new_line` or `paste` exactly.

Contract (checked by `apply_steps`, relied on by `tour.py`): applying an action's steps
to the text it was planned on gives its `Action.after`; for `retype_tail` that is the
text it started from, for `undo` the text before the action it undoes.
"""

from __future__ import annotations

import math
import random
import re
from typing import NamedTuple

_LINE_BREAK = re.compile(r"\r\n|\r|\n")

KEY_GAP_MS = (80.0, 250.0)  # between key presses inside an edit
SELECT_MS = (150.0, 450.0)  # selecting a line's tail before deleting it
UNDO_MS = (300.0, 1200.0)  # noticing the edit was wrong


class Step(NamedTuple):
    gap_ms: float  # since the previous step (the first step's gap is the caller's)
    start: int
    end: int
    text: str
    cursor: int  # code-point offset of the cursor after the step


class Action(NamedTuple):
    kind: str  # "retype-tail" | "new-line" | "paste" | "undo"
    landing: int  # where the cursor is before the first step
    steps: list[Step]
    after: str  # the text once every step is applied
    inserted: tuple[int, int] | None = None  # span a later `undo` removes (new-line, paste)


def key_gap(rng: random.Random) -> float:
    """A skewed gap between two key presses, inside `KEY_GAP_MS`."""
    lo, hi = KEY_GAP_MS
    return round(min(hi, max(lo, rng.lognormvariate(math.log(140.0), 0.35))), 1)


def apply_steps(text: str, steps: list[Step]) -> str:
    for step in steps:
        text = text[: step.start] + step.text + text[step.end :]
    return text


def line_span(text: str, offset: int) -> tuple[int, int]:
    """(start, end before the terminator) of the line holding `offset`."""
    start = max(text.rfind("\n", 0, offset), text.rfind("\r", 0, offset)) + 1
    m = _LINE_BREAK.search(text, offset)
    return start, (m.start() if m else len(text))


def indentation(line: str) -> str:
    return line[: len(line) - len(line.lstrip(" \t"))]


def newline_of(text: str) -> str:
    m = _LINE_BREAK.search(text)
    return m.group(0) if m else "\n"


def retype_tail(text: str, line_end: int, rng: random.Random, backspace_share: float = 0.6) -> Action:
    """Delete the last 4–24 characters of the line ending at `line_end` and type them back:
    Backspace by Backspace (`backspace_share` of the time) or as one selection."""
    start, end = line_span(text, line_end)
    content = text[start:end]
    room = len(content) - len(indentation(content)) - 1  # keep at least one character
    k = max(1, min(rng.randint(4, 24), room))
    tail = text[end - k : end]
    steps: list[Step] = []
    if rng.random() < backspace_share:
        for j in range(k):  # Backspace, one character at a time
            at = end - j - 1
            steps.append(Step(key_gap(rng), at, at + 1, "", at))
    else:  # Shift+Home-ish selection, then Delete
        steps.append(Step(round(rng.uniform(*SELECT_MS), 1), end - k, end, "", end - k))
    at = end - k
    for ch in tail:
        steps.append(Step(key_gap(rng), at, at, ch, at + 1))
        at += 1
    return Action("retype-tail", end, steps, text)


def new_line(text: str, line_end: int, donor: str, rng: random.Random) -> Action:
    """Enter at the end of the line ending at `line_end`, then type `donor` (one line's
    content, without indentation) at that line's indentation."""
    start, end = line_span(text, line_end)
    unit = newline_of(text) + indentation(text[start:end])
    steps = [Step(key_gap(rng), end, end, unit, end + len(unit))]
    at = end + len(unit)
    for ch in donor:
        steps.append(Step(key_gap(rng), at, at, ch, at + 1))
        at += 1
    inserted = unit + donor
    return Action("new-line", end, steps, text[:end] + inserted + text[end:], (end, end + len(inserted)))


def reindent(lines: list[str], indent: str) -> list[str]:
    """Lines moved so the first one sits at `indent`; deeper lines keep their relative depth
    (a line shallower than the first, only possible inside a string, is left alone)."""
    base = indentation(lines[0])
    return [indent + line[len(base) :] if line.startswith(base) else line for line in lines]


def paste(text: str, line_start: int, block: list[str], rng: random.Random) -> Action:
    """Ctrl+V of `block` (whole lines, without terminators) at the start of a line."""
    _, end = line_span(text, line_start)
    indent = indentation(text[line_start:end])
    nl = newline_of(text)
    pasted = "".join(line + nl for line in reindent(block, indent))
    step = Step(key_gap(rng), line_start, line_start, pasted, line_start + len(pasted))
    after = text[:line_start] + pasted + text[line_start:]
    return Action("paste", line_start, [step], after, (line_start, line_start + len(pasted)))


def undo(before: str, done: Action, rng: random.Random) -> Action:
    """Ctrl+Z of `done` (a new-line or paste) planned on `before`: back to `before`."""
    if done.inserted is None:
        raise ValueError(f"a {done.kind} inserts nothing to undo")
    a, b = done.inserted
    step = Step(round(rng.uniform(*UNDO_MS), 1), a, b, "", a)
    return Action("undo", done.steps[-1].cursor, [step], before)
