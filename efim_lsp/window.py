"""Prompt windows: how much of the text before and after the cursor goes into a prompt.

The prefix window starts at a line boundary on a coarse grid (every
`GRID_LINES` lines; finer for small windows, at most 1/8 of their lines), and it is *sticky*: a new window keeps the previous start
as long as the text from there to the cursor still fits the budget. When it no
longer fits, the start jumps forward to the first grid line that leaves
`SLACK` of the budget free, so the next move is tens of lines of typing away.
Why: the prefix window's tokens open every prompt; as long as its start stays
put the engine's radix cache serves them, while any move of the start makes
every token behind it new — a full prefill, the latency tail EFIM exists to
remove (docs/design.md, "Prefix stability").

The suffix window ends at the last whole line within budget. It is not
snapped: the suffix begins at the cursor, so a rebase changes it anyway.

Token counts come from a `TokenMeter`: a chars-per-token ratio calibrated with
the engine's tokenizer, plus one exact count per cut to check the estimate
(a rebase costs two `count_tokens` calls; keystrokes inside a session none).
"""

from __future__ import annotations

import bisect
import logging
import math
from typing import Callable, NamedTuple

from efim_lsp.positions import LineIndex

log = logging.getLogger(__name__)

GRID_LINES = 16
SLACK = 0.25
_MAX_REFINES = 4


class Window(NamedTuple):
    """Document offsets: the prompt's prefix is `text[start:cursor]`, its suffix `text[cursor:end]`."""

    start: int
    end: int


class TokenMeter:
    """Token counts for window budgets: an exact counter when there is one, else a ratio."""

    def __init__(self, count_tokens: Callable[[str], int] | None = None, chars_per_token: float = 3.0):
        self._count = count_tokens
        self.chars_per_token = chars_per_token
        self.exact_counts = 0  # how often the tokenizer was asked (kept "sparingly": per rebase only)

    def calibrated(self, sample: str) -> "TokenMeter":
        """A meter with the same counter and its ratio measured on `sample` alone (the
        starting ratio when there is no counter or the sample is short): cuts made with it
        depend on the text, not on what this meter counted before."""
        fresh = TokenMeter(self._count)
        if self._count is not None and len(sample) >= 256:
            try:
                n = int(self._count(sample))
            except Exception as exc:  # as in tokens(): an estimate rather than no window
                log.debug("count_tokens failed (%s); using the starting ratio", exc)
            else:
                if n > 0:
                    fresh.chars_per_token = len(sample) / n
        return fresh

    def chars_for(self, tokens: int) -> int:
        return int(tokens * self.chars_per_token)

    def tokens(self, text: str) -> int:
        """Tokens of `text`; exact when a counter is available (and recalibrates the ratio)."""
        if not text:
            return 0
        if self._count is not None:
            try:
                n = int(self._count(text))
            except Exception as exc:  # a tokenizer that chokes (lone surrogates...) must not stop completion
                log.debug("count_tokens failed (%s); using the estimate", exc)
            else:
                self.exact_counts += 1
                if len(text) >= 256 and n > 0:
                    # A running average: one window of unusual density must not swing it.
                    self.chars_per_token = 0.5 * self.chars_per_token + 0.5 * len(text) / n
                return n
        return math.ceil(len(text) / self.chars_per_token)


def prefix_start(index: LineIndex, cursor: int, budget: int, meter: TokenMeter, sticky: int | None = None) -> int:
    """Offset where the prefix window begins (see the module docstring for the policy)."""
    text = index.text
    if budget <= 0:
        return cursor
    starts = index.starts
    if cursor <= meter.chars_for(budget) and meter.tokens(text[:cursor]) <= budget:
        return 0
    cursor_line = bisect.bisect_right(starts, cursor) - 1
    if (
        sticky is not None
        and 0 <= sticky <= cursor
        and _is_line_start(starts, sticky)
        and cursor - sticky <= meter.chars_for(budget)
        and meter.tokens(text[sticky:cursor]) <= budget
    ):
        return sticky
    chars = int(meter.chars_for(budget) * (1.0 - SLACK))
    start = cursor
    for _ in range(_MAX_REFINES):
        target = cursor - chars
        line = bisect.bisect_left(starts, target)
        grid = _grid(cursor_line - line)
        snapped = -(-line // grid) * grid
        if snapped <= cursor_line:
            start = starts[snapped]
        elif line <= cursor_line:
            start = starts[line]  # no grid line between the target and the cursor
        else:
            start = max(starts[cursor_line], target)  # one huge line: cut inside it
        n = meter.tokens(text[start:cursor])
        if n <= budget:
            return start
        chars = int((cursor - start) * budget / n * 0.9)  # the measured density, with a margin
    log.debug("prefix window still over budget after refining; cutting at the character budget")
    return max(start, cursor - meter.chars_for(budget) // 2)


def suffix_end(index: LineIndex, cursor: int, budget: int, meter: TokenMeter) -> int:
    """Offset where the suffix window ends: the last whole line within budget."""
    text = index.text
    if budget <= 0:
        return cursor
    if len(text) - cursor <= meter.chars_for(budget) and meter.tokens(text[cursor:]) <= budget:
        return len(text)
    starts = index.starts
    chars = meter.chars_for(budget)
    end = cursor
    for _ in range(_MAX_REFINES):
        limit = cursor + chars
        line = bisect.bisect_right(starts, limit) - 1
        end = starts[line] if starts[line] > cursor else min(limit, len(text))
        n = meter.tokens(text[cursor:end])
        if n <= budget:
            return end
        chars = int((end - cursor) * budget / n * 0.9)
    return min(end, cursor + meter.chars_for(budget) // 2)


def cut(index: LineIndex, cursor: int, prefix_budget: int, suffix_budget: int, meter: TokenMeter, sticky: int | None = None) -> Window:
    return Window(prefix_start(index, cursor, prefix_budget, meter, sticky), suffix_end(index, cursor, suffix_budget, meter))


def _grid(window_lines: int) -> int:
    """Grid step for a window of about `window_lines` lines: at most 1/8 of it, a power of
    two (so it changes rarely as the window's line count drifts), capped at GRID_LINES."""
    step = 1
    while step * 2 <= min(GRID_LINES, window_lines // 8):
        step *= 2
    return step


def _is_line_start(starts: list[int], offset: int) -> bool:
    i = bisect.bisect_left(starts, offset)
    return i < len(starts) and starts[i] == offset
