"""The next edit after one of several parallel lines changed, without a model.

Lines are parallel when they have the same shape: the same indentation, the same tokens
with identifiers, numbers and strings abstracted, and the same pattern of repeats among
them (`self.a = a` and `self.b = b` are parallel; `self.a = b` is not). When the latest
change stays on one line, the line before it is one of a run of at least `MIN_RUN`
consecutive lines of that shape (lines already changed the same way count; comment lines
are passed over), the same change is offered at the nearest line of the run that does not
have it yet — below first, then above.

The change is carried over token by token, and only when it maps cleanly: the edited line's
tokens that differ before and after (one contiguous stretch) are replaced in the other line,
where a new token equal to one of the line's own tokens becomes the other line's token in
that place (`self.a = a` → `self.a = int(a)` gives `self.b = int(b)`), an identifier
given a prefix or suffix at a `_` becomes the other line's identifier with the same affix
(`self.a` → `self._a` gives `self._b`), and every other new token is copied. A changed
token that differs between the two lines and is not carried this way (`'a': 1` → `'a': 2`
next to `'b': 5`) means no edit there. Silence otherwise: a change over several lines, a
line that does not tokenize, a line half typed (a bracket left open, an operator at its
end), one literal changed into another (`8` → `15`, `None` → `-1`, a word in a string:
values of that line as often as a pattern — the noise set is made of them), `import` lines,
a run too short.
"""

from __future__ import annotations

import keyword
import re
from typing import NamedTuple

from efim_lsp.next_edit.history import Change
from efim_lsp.next_edit.proposer import NextEdit
from efim_lsp.next_edit.source import minimal

# Lines of one shape (the edited one included) needed before a change is carried over, and
# how far from the edited line the run is followed.
MIN_RUN = 3
RUN_LINES = 60

_TOKEN = re.compile(
    r"""(?P<comment>\#.*)
    |(?P<string>(?:[rRbBuUfF]{1,2})?(?:'''.*?'''|\"\"\".*?\"\"\"|'(?:\\.|[^\\'])*'|"(?:\\.|[^\\"])*"))
    |(?P<number>0[xXoObB][\da-fA-F_]+|(?:\d[\d_]*(?:\.[\d_]*)?|\.\d[\d_]*)(?:[eE][+-]?\d+)?[jJ]?)
    |(?P<name>[^\W\d]\w*)
    |(?P<op>\*\*=?|//=?|>>=?|<<=?|->|:=|\.\.\.|[-+*/%&|^@=!<>]=|[-+*/%&|^~@<>=.,:;()\[\]{}])
    |(?P<space>[ \t]+)""",
    re.VERBOSE,
)
_ABSTRACT = ("name", "number", "string")
_CLOSERS = (")", "]", "}", ",", ":")
_CONSTANTS = ("None", "True", "False", "-", "+")
_DEPTH = {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}


class Token(NamedTuple):
    kind: str  # name, number, string, op, keyword
    text: str
    start: int  # offsets in the line
    end: int


class Line(NamedTuple):
    text: str
    indent: str
    tokens: tuple[Token, ...]
    shape: tuple


def tokens_of(line: str) -> Line | None:
    """The line's tokens (comments dropped) and its shape, or None where it does not
    tokenize (an unterminated string, a character outside Python's tokens)."""
    body = line.rstrip("\r\n")
    stripped = body.lstrip(" \t")
    indent = body[: len(body) - len(stripped)]
    out: list[Token] = []
    pos = len(indent)
    while pos < len(body):
        m = _TOKEN.match(body, pos)
        if m is None:
            return None
        kind = m.lastgroup
        if kind == "name" and keyword.iskeyword(m.group()):
            kind = "keyword"
        if kind not in ("space", "comment"):
            out.append(Token(kind, m.group(), m.start(), m.end()))
        pos = m.end()
    first_seen: dict[str, int] = {}
    shape = []
    for i, tok in enumerate(out):
        if tok.kind in _ABSTRACT:
            shape.append((tok.kind, first_seen.setdefault(tok.text, i)))
        else:
            shape.append(tok.text)
    return Line(body, indent, tuple(out), tuple(shape))


def _same_shape(a: Line | None, b: Line | None) -> bool:
    return a is not None and b is not None and a.indent == b.indent and a.shape == b.shape


def propose(text: str, change: Change | None) -> NextEdit | None:
    if change is None:
        return None
    s, e = change.start, change.end
    if not (0 <= s <= e <= len(text)) or text[s:e] != change.new or any(c in change.old + change.new for c in "\r\n"):
        return None
    line_start = text.rfind("\n", 0, s) + 1
    line_end = text.find("\n", e)
    line_end = len(text) if line_end < 0 else line_end
    new_line = text[line_start:line_end]
    old_line = text[line_start:s] + change.old + text[e:line_end]
    old, new = tokens_of(old_line), tokens_of(new_line)
    if old is None or new is None or not new.tokens or len(old.tokens) < 3 or old.tokens[0].text in ("import", "from"):
        return None
    if not any(t.kind in _ABSTRACT for t in old.tokens):
        return None
    if _depth(new) != _depth(old) or (new.tokens[-1].kind == "op" and new.tokens[-1].text not in _CLOSERS and new.tokens[-1].text != old.tokens[-1].text):
        return None  # half typed: a bracket left open, a line ending in an operator
    stretch = _stretch(old.tokens, new.tokens)
    if stretch is None:
        return None
    p, qo, qn = stretch
    if _literal(old.tokens[p:qo]) and _literal(new.tokens[p:qn]):
        return None  # one literal for another: a value of this line, not a pattern (noise)
    run = 1  # the lines of the old or the new shape around the edited one
    below: list[tuple[int, Line]] = []
    above: list[tuple[int, Line]] = []
    for found, lines in ((below, _lines_below(text, line_end)), (above, _lines_above(text, line_start))):
        for at, body in lines:
            if body.lstrip(" \t").startswith("#"):
                continue
            line = tokens_of(body)
            if _same_shape(line, old):
                found.append((at, line))
            elif not _same_shape(line, new):
                break
            run += 1
    if run < MIN_RUN:
        return None
    for where, found in (("below", below), ("above", above)):
        for at, line in found:
            edit = _carry(old, new, stretch, line)
            if edit is None:
                continue
            a, b, new_text = minimal(text, at + edit[0], at + edit[1], edit[2], words=True)
            if a == b and not new_text:
                continue  # this line has it already
            return NextEdit(a, b, new_text, f"parallel line ({where})")
    return None


def _lines_below(text: str, end: int):
    """(start, text) of the lines after the one ending at `end`, up to `RUN_LINES`."""
    for _ in range(RUN_LINES):
        if end >= len(text):
            return
        start = end + 1
        end = text.find("\n", start)
        end = len(text) if end < 0 else end
        yield start, text[start:end]


def _lines_above(text: str, start: int):
    """(start, text) of the lines before the one starting at `start`, up to `RUN_LINES`."""
    for _ in range(RUN_LINES):
        if start == 0:
            return
        end = start - 1
        start = text.rfind("\n", 0, end) + 1
        yield start, text[start:end]


def _literal(tokens: tuple[Token, ...]) -> bool:
    """A value written out: numbers, strings, `None`/`True`/`False`, signs (`-1`, `'a' 'b'`)."""
    return bool(tokens) and all(t.kind in ("number", "string") or t.text in _CONSTANTS for t in tokens) and any(
        t.text not in ("-", "+") for t in tokens)


def _depth(line: Line) -> int:
    return sum(_DEPTH.get(t.text, 0) for t in line.tokens if t.kind == "op")


def _stretch(old: tuple[Token, ...], new: tuple[Token, ...]) -> tuple[int, int, int] | None:
    """(p, old end, new end): old[p:old end] became new[p:new end]; None when no token changed."""
    p = 0
    while p < len(old) and p < len(new) and old[p].text == new[p].text:
        p += 1
    s = 0
    while s < len(old) - p and s < len(new) - p and old[-1 - s].text == new[-1 - s].text:
        s += 1
    if p == len(old) and p == len(new):
        return None
    return p, len(old) - s, len(new) - s


def _carry(old: Line, new: Line, stretch: tuple[int, int, int], other: Line) -> tuple[int, int, str] | None:
    """The change of `old` into `new` made to `other` (a line of `old`'s shape): (start, end,
    text) in `other`'s offsets, or None where it does not map cleanly."""
    p, qo, qn = stretch
    O, N, C = old.tokens, new.tokens, other.tokens
    mine = {t.text: c.text for t, c in zip(O, C) if t.kind in _ABSTRACT}  # same shape: one each
    carried: set[str] = set()
    pieces: list[str] = []
    lo = N[p - 1].end if p > 0 else N[0].start
    hi = N[qn].start if qn < len(N) else N[-1].end
    at = lo
    for tok in N[p:qn]:
        pieces.append(new.text[at : tok.start])
        text = tok.text
        if tok.kind in _ABSTRACT and tok.text in mine:
            text = mine[tok.text]
            carried.add(tok.text)
        elif tok.kind == "name" and qo - p == 1 and qn - p == 1 and O[p].kind == "name" and O[p].text != C[p].text:
            text = _affixed(O[p].text, tok.text, C[p].text)
            if text is None:
                return None
            carried.add(O[p].text)
        pieces.append(text)
        at = tok.end
    pieces.append(new.text[at:hi])
    for t, c in zip(O[p:qo], C[p:qo]):
        if t.text != c.text and t.text not in carried:
            return None  # this line's own token there would be lost
    a = C[p - 1].end if p > 0 else C[0].start
    b = C[qo].start if qo < len(C) else C[-1].end
    return a, b, "".join(pieces)


def _affixed(old: str, new: str, other: str) -> str | None:
    """`other` with the prefix or suffix that turned `old` into `new` (at a `_`), or None."""
    if new.endswith(old) and new != old and new[: len(new) - len(old)].endswith("_"):
        return new[: len(new) - len(old)] + other
    if new.startswith(old) and new != old and new[len(old) :].startswith("_"):
        return other + new[len(old) :]
    return None


__all__ = ["MIN_RUN", "Line", "Token", "propose", "tokens_of"]
