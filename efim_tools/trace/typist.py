"""A model of a person typing a block of code back into a file, keystroke by keystroke.

Language-agnostic: it sees only text. What it models, and why:
- keys come in bursts (a word is typed at its own pace, drawn per word) with per-key
  jitter from a skewed (log-normal) distribution, slower after spaces and punctuation,
  slower still at the start of a line, plus rare long pauses (reading, thinking);
- the average rate is scaled to exactly `wpm` words of five characters per minute
  (the default 50 wpm is 250 keys a minute), so `--wpm` means what it says;
- Enter inserts the line break and the next line's indentation in one edit, as an
  editor's auto-indent does (`keys.key_presses`, the split every typist shares);
- typos: a neighbouring key, sometimes noticed only a key or two later, then fixed with
  one backspace per wrong character;
- jumps: the cursor leaves for another line (a line break inserted there, a completion
  asked there), pauses, removes it and comes back — the edit-elsewhere that makes a
  server's edit session rebase.

Contract: applying every `Keystroke` in order to `blank` (each `[start, end)` replaced by
`text`, spans in code points of the text as it is just before that keystroke) yields
`original` exactly.
"""

from __future__ import annotations

import math
import random
import re
from typing import NamedTuple

from efim_tools.trace.blocks import Block
from efim_tools.trace.keys import key_presses

_LINE_BREAK = re.compile(r"\r\n|\r|\n")
_QWERTY = ["1234567890-=", "qwertyuiop[]", "asdfghjkl;'", "zxcvbnm,./"]


class TypingStyle(NamedTuple):
    wpm: float = 50.0  # words of 5 characters per minute: 250 keys/min
    typo_rate: float = 0.03  # chance a letter or digit is mistyped
    jump_rate: float = 0.01  # chance per keystroke of jumping away and back

    def check(self) -> "TypingStyle":
        if not self.wpm > 0:
            raise ValueError(f"--wpm must be positive, got {self.wpm}")
        for name in ("typo_rate", "jump_rate"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"--{name.replace('_', '-')} must be in [0, 1), got {value}")
        return self


class Keystroke(NamedTuple):
    """One edit the editor reports; the completion request follows at `cursor`."""

    t: float  # ms since the document was opened
    start: int
    end: int
    text: str
    cursor: int  # code-point offset of the cursor after the edit
    kind: str  # "type", "typo", "backspace", "away", "back"


def _neighbour(ch: str, rng: random.Random) -> str:
    low = ch.lower()
    for row in _QWERTY:
        k = row.find(low)
        if k >= 0:
            options = [row[j] for j in (k - 1, k + 1) if 0 <= j < len(row)]
            wrong = rng.choice(options)
            return wrong.upper() if ch.isupper() else wrong
    return rng.choice("etaoinsr") if ch != "e" else "r"


class _Clock:
    """Per-key delays before rescaling: log-normal jitter × word pace × context factor."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.word_pace = 1.0

    def delay(self, prev: str, unit: str, kind: str) -> float:
        rng = self.rng
        if kind == "backspace":
            return rng.lognormvariate(math.log(0.55), 0.3)
        if not prev or not (prev[-1].isalnum() or prev[-1] == "_"):
            self.word_pace = rng.lognormvariate(0.0, 0.3)  # a new word: a new burst
        base = rng.lognormvariate(0.0, 0.45) * self.word_pace
        if _LINE_BREAK.match(unit):
            base *= 1.8
        elif prev and prev[-1] in " ([{,.:=":
            base *= 1.3
        if prev and _LINE_BREAK.match(prev) and rng.random() < 0.35:
            base += rng.lognormvariate(math.log(3.0), 0.5)  # thinking at a line start
        if rng.random() < 0.012:
            base += rng.lognormvariate(math.log(10.0), 0.4)  # reading, looking elsewhere
        return base


def type_block(original: str, block: Block, style: TypingStyle, rng: random.Random) -> tuple[str, list[Keystroke]]:
    """Blank `block` out of `original`; return the blank text and the keystrokes that retype it."""
    style.check()
    body = original[block.start : block.end]
    blank = original[: block.start] + original[block.end :]
    newline = m.group(0) if (m := _LINE_BREAK.search(original)) else "\n"
    units = key_presses(body)
    clock = _Clock(rng)
    raw: list[tuple[float, int, int, str, int, str]] = []  # (delay, start, end, text, cursor, kind)
    cursor = block.start
    prev = ""
    k = 0
    while k < len(units):
        unit = units[k]
        if rng.random() < style.jump_rate and k > 0:
            target = _jump_target(original, blank, block, cursor, rng)
            if target is not None:
                raw.append((clock.delay(prev, unit, "type") + rng.uniform(0.5, 2.0), target, target, newline, target + len(newline), "away"))
                raw.append((rng.lognormvariate(math.log(6.0), 0.5), target, target + len(newline), "", target, "back"))
        if len(unit) == 1 and unit.isalnum() and rng.random() < style.typo_rate:
            wrong = _neighbour(unit, rng)
            typed = [wrong]
            for u in units[k + 1 : k + 1 + rng.choice((0, 0, 1, 2))]:
                if len(u) != 1 or _LINE_BREAK.match(u):
                    break  # noticed by the end of the line at the latest
                typed.append(u)
            p = prev
            for j, ch in enumerate(typed):
                raw.append((clock.delay(p, ch, "type"), cursor + j, cursor + j, ch, cursor + j + 1, "typo"))
                p = ch
            notice = rng.lognormvariate(math.log(1.8), 0.35)
            for j in range(len(typed), 0, -1):
                pos = cursor + j - 1
                raw.append((notice if j == len(typed) else clock.delay(p, "", "backspace"), pos, pos + 1, "", pos, "backspace"))
        raw.append((clock.delay(prev, unit, "type"), cursor, cursor, unit, cursor + len(unit), "type"))
        cursor += len(unit)
        prev = unit
        k += 1
    return blank, _rescale(raw, style, rng)


def _jump_target(original: str, blank: str, block: Block, cursor: int, rng: random.Random) -> int | None:
    """End of a random line away from the body: before it, or after what is left to type.

    The current document is `original[:cursor] + blank[block.start:]`; lines after the
    cursor are those of `blank` past `block.start`, shifted by what was typed."""
    typed = cursor - block.start
    before = [m.start() for m in _LINE_BREAK.finditer(original, 0, block.start)]
    before = [p for p in before if p < block.start - 1]
    here = _LINE_BREAK.match(blank, block.start)  # the end of the line being typed
    after = [m.start() + typed for m in _LINE_BREAK.finditer(blank, here.end() if here else block.start)]
    candidates = [p for p in before + after if abs(p - cursor) > 200]
    if not candidates:
        return None
    return rng.choice(candidates)


def _rescale(raw: list[tuple[float, int, int, str, int, str]], style: TypingStyle, rng: random.Random) -> list[Keystroke]:
    """Scale the delays so keys arrive at `wpm * 5` a minute on average; accumulate times."""
    if not raw:
        return []
    mean_ms = 60000.0 / (style.wpm * 5.0)
    scale = mean_ms * len(raw) / sum(r[0] for r in raw)
    t = rng.uniform(400.0, 1200.0)  # the person finds the spot before the first key
    out = []
    for delay, start, end, text, cursor, kind in raw:
        t += max(delay * scale, 15.0)  # no two keys closer than 15 ms
        out.append(Keystroke(round(t, 1), start, end, text, cursor, kind))
    return out
