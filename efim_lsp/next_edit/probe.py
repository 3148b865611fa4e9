"""Next edits the model decides: candidate places from the latest change, each asked as a probe.

The latest change is widened to the token around it (`token_change`): a name or an attribute
renamed, a number changed, a word inside a string changed. Its candidates are the other
occurrences of the old token within `LINES_AROUND` lines, of the same kind (an attribute only
where it is an attribute; a number outside strings and comments), the nearest below first, then
the nearest above, at most `MAX_CANDIDATES`. The model is asked about each in turn, after the
document's own prompt (the KV it already holds for inline completion), with a *probe*:

    <the header line of the def/class around the change; empty at the top level>
    -<the changed line as it was>
    +<the changed line as it is>
    <the header line of the def/class around the candidate>
    @<the candidate's line up to the candidate>

(the headers say whether both are in one function: a renamed local is carried only there)

and answers the token that belongs there: the new one (carry the edit there) or the old one
(leave it). The first candidate answered with the new token is the proposal; none is silence.
The model learns this layout in the next-edit training round (`efim_tools.training.next_edit`,
`efim train --next-edit P`); the engine appends the probe after the prompt
(`InfillRequest.probe`). No engine here: callers run the probes (`efim eval next-edit
--proposer model`).
"""

from __future__ import annotations

import re
from typing import Literal, NamedTuple

from efim_lsp.next_edit.history import Change
from efim_lsp.next_edit.proposer import NextEdit, enclosing_block, is_attribute, is_word, literal_spans, widened

ChangeKind = Literal["name", "attribute", "number", "word"]

# How far from the change a candidate may be (lines), and how many are asked.
LINES_AROUND = 120
MAX_CANDIDATES = 3

_IDENTIFIER = re.compile(r"[^\W\d]\w*\Z")
_NUMBER = re.compile(r"\d[\w.]*\Z")
_HEADER = re.compile(r"(async\s+def|def|class)\s")


class TokenChange(NamedTuple):
    """The token `old` at `start` is now `new` (`text[start:end] == new`)."""

    start: int
    end: int
    old: str
    new: str
    kind: ChangeKind


class Candidate(NamedTuple):
    start: int  # the old token's span in the current text
    end: int
    probe: str  # what the model is asked (module docstring)


def token_change(text: str, change: Change | None) -> TokenChange | None:
    """`change` widened to the whole token around it, with its kind; None when it is not one
    token turned into another of the same kind."""
    if change is None or "\n" in change.old or "\n" in change.new:
        return None
    word = widened(text, change)
    if word is None:
        return None
    left, right, old, new = word
    if not old or not new or old == new:
        return None
    line_start = text.rfind("\n", 0, left) + 1
    line_end = text.find("\n", right)
    quoted = literal_spans(text, line_start, line_end if line_end >= 0 else len(text))
    if any(a <= left < b for a, b in quoted):
        if any(text[a] == "#" for a, b in quoted if a <= left < b) or not (old.isalpha() and new.isalpha()):
            return None  # comments, and strings' non-words, are not asked about
        return TokenChange(left, right, old, new, "word")
    if _IDENTIFIER.match(old) and _IDENTIFIER.match(new):
        return TokenChange(left, right, old, new, "attribute" if is_attribute(text, left) else "name")
    if _NUMBER.match(old) and _NUMBER.match(new):
        return TokenChange(left, right, old, new, "number")
    return None


def candidates(text: str, tc: TokenChange, limit: int = MAX_CANDIDATES) -> list[Candidate]:
    """The places to ask about, in the order asked (module docstring)."""
    lo = _line_start_back(text, tc.start, LINES_AROUND)
    hi = _line_end_forward(text, tc.end, LINES_AROUND)
    quoted = literal_spans(text, lo, hi)
    spans = []
    for m in re.finditer(re.escape(tc.old), text[lo:hi]):
        a, b = lo + m.start(), lo + m.end()
        if (a > 0 and is_word(text[a - 1])) or (b < len(text) and is_word(text[b])):
            continue
        inside = next((q for q in quoted if q[0] <= a < q[1]), None)
        if tc.kind == "word":
            if inside is None or text[inside[0]] == "#":
                continue
        elif inside is not None:
            continue
        elif tc.kind in ("name", "attribute") and is_attribute(text, a) != (tc.kind == "attribute"):
            continue
        spans.append((a, b))
    below = [sp for sp in spans if sp[0] >= tc.end]
    above = [sp for sp in reversed(spans) if sp[1] <= tc.start]
    before, after = _lines_of(text, tc)
    scope = scope_line(text, tc.start)
    out = []
    for a, b in (below + above)[:limit]:
        head = text[text.rfind("\n", 0, a) + 1 : a]
        out.append(Candidate(a, b, probe_text(scope, before, after, scope_line(text, a), head)))
    return out


def probe_text(scope: str, before: str, after: str, where: str, head: str) -> str:
    """The probe's text (module docstring): the change's def/class header, the changed line
    before and after, the candidate's header, then the candidate's line up to it."""
    return f"{scope}\n-{before}\n+{after}\n{where}\n@{head}"


def scope_line(text: str, offset: int) -> str:
    """The first line of the innermost def/class around `offset` (by indentation), stripped of
    its line break; "" at the top level."""
    lo, _ = enclosing_block(text, offset)
    end = text.find("\n", lo)
    line = text[lo : end if end >= 0 else len(text)].rstrip()
    return line if _HEADER.match(line.lstrip()) else ""  # the whole text: the top level


def accepts(answer: str, tc: TokenChange) -> bool:
    """Whether the model's answer at a candidate carries the edit there."""
    return answer.split("\n", 1)[0].strip() == tc.new


def as_edit(candidate: Candidate, tc: TokenChange) -> NextEdit:
    return NextEdit(candidate.start, candidate.end, tc.new, f"model: {tc.kind} {tc.old} -> {tc.new}")


def _lines_of(text: str, tc: TokenChange) -> tuple[str, str]:
    """The changed line as it was and as it is."""
    a = text.rfind("\n", 0, tc.start) + 1
    b = text.find("\n", tc.end)
    b = len(text) if b < 0 else b
    after = text[a:b]
    return after[: tc.start - a] + tc.old + after[tc.end - a :], after


def _line_start_back(text: str, at: int, lines: int) -> int:
    pos = at
    for _ in range(lines + 1):
        pos = text.rfind("\n", 0, pos)
        if pos < 0:
            return 0
    return pos + 1


def _line_end_forward(text: str, at: int, lines: int) -> int:
    pos = at
    for _ in range(lines + 1):
        pos = text.find("\n", pos + 1)
        if pos < 0:
            return len(text)
    return pos


__all__ = ["Candidate", "LINES_AROUND", "MAX_CANDIDATES", "TokenChange", "accepts", "as_edit", "candidates", "probe_text", "scope_line", "token_change"]
