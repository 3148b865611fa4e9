"""The next edit after a change, without a model: repeat a rename at the next occurrence.

The latest change is widened to the identifier around it: `max_len` → `max_length` after
typing "gth", `n` → `count` after retyping a selection. When the old identifier still occurs
in the enclosing function (or class, or the module when the change is at the top level), the
nearest occurrence below the change is proposed, else the nearest above — the same rename
there (an attribute only where it is an attribute, a variable only where it is not; never
inside a string or a comment). Silence otherwise: a change that is not one identifier becoming another (new code
typed, a literal changed, lines deleted), or a name with no other occurrence.

Call sites after a signature change and parallel lines are `call_sites` and `parallel`
(tried after this one, `dispatch`); a module-level name's uses in other open documents (and
below the renamed def in its own) are `other_files`, asked by the service when these are
silent. Not covered yet: a model ranking the candidates (#34).
"""

from __future__ import annotations

import bisect
import keyword
import re
from typing import NamedTuple

from efim_lsp.next_edit.history import Change
from efim_lsp.positions import line_starts

_IDENTIFIER = re.compile(r"[^\W\d]\w*\Z")
_BLOCK_HEAD = re.compile(r"(async\s+def|def|class)\s")


class NextEdit(NamedTuple):
    """Replace `text[start:end]` by `new_text` (code-point offsets of the current text)."""

    start: int
    end: int
    new_text: str
    reason: str


class Rename(NamedTuple):
    start: int  # the renamed identifier's span in the current text
    end: int
    old: str
    new: str


def widened(text: str, change: Change) -> Rename | None:
    """`change` widened to the whole word around it: the span of the new word in `text`, the
    word before the change and now (not checked to be identifiers); None when `text` does not
    hold the change's new text where the history says."""
    s, e = change.start, change.end
    if not (0 <= s <= e <= len(text)) or text[s:e] != change.new:
        return None
    left = s
    while left > 0 and is_word(text[left - 1]):
        left -= 1
    right = e
    while right < len(text) and is_word(text[right]):
        right += 1
    return Rename(left, right, text[left:s] + change.old + text[e:right], text[left:right])


def rename_of(text: str, change: Change) -> Rename | None:
    """The identifier `change` turned into another one, widened to the whole word."""
    word = widened(text, change)
    if word is None:
        return None
    left, right, old, new = word
    if old == new or not _IDENTIFIER.match(old) or not _IDENTIFIER.match(new):
        return None
    if keyword.iskeyword(old) or keyword.iskeyword(new):
        return None  # `if` -> `elif`, `True` -> `False`: syntax or a literal, not a name
    return Rename(left, right, old, new)


def enclosing_block(text: str, offset: int) -> tuple[int, int]:
    """The span of the innermost `def`/`class` around `offset` (by indentation), or the
    whole text at the top level."""
    if not text:
        return 0, 0
    starts = line_starts(text)  # the server's own line breaks (documents, positions)
    lines = [text[a:b] for a, b in zip(starts, [*starts[1:], len(text)])]
    row = max(0, bisect.bisect_right(starts, offset) - 1)
    head = None
    here = lines[row]
    limit = _indent(here) if here.strip() else 1 << 30
    if _BLOCK_HEAD.match(here.lstrip()):
        head = row  # the change is on a def line (a parameter): that function
    else:
        for r in range(row - 1, -1, -1):
            line = lines[r]
            if not line.strip():
                continue
            indent = _indent(line)
            if indent < limit:
                if _BLOCK_HEAD.match(line.lstrip()):
                    head = r
                    break
                limit = indent
                if indent == 0:
                    break
    if head is None:
        return 0, len(text)
    head_indent = _indent(lines[head])
    end_row = len(lines)
    for r in range(head + 1, len(lines)):
        line = lines[r]
        if line.strip() and _indent(line) <= head_indent and not line.lstrip().startswith((")", "]", "}")):
            end_row = r
            break
    return starts[head], (starts[end_row] if end_row < len(lines) else len(text))


def propose(text: str, change: Change | None) -> NextEdit | None:
    """The same rename at the next occurrence of the old name, or None."""
    if change is None:
        return None
    rename = rename_of(text, change)
    if rename is None:
        return None
    lo, hi = enclosing_block(text, rename.start)
    quoted = literal_spans(text, lo, hi)
    if _inside(quoted, rename.start):
        return None  # a word in a string or a comment: not a name being renamed
    pattern = re.compile(rf"(?<!\w){re.escape(rename.old)}(?!\w)")
    # An attribute (`.name`) and a variable of the same name are different things: only
    # occurrences of the same kind (`os.path` is not the local `path`).
    attribute = is_attribute(text, rename.start)
    spans = [
        (m.start(), m.end())
        for m in pattern.finditer(text, lo, hi)
        if is_attribute(text, m.start()) == attribute and not _inside(quoted, m.start())
    ]
    below = [sp for sp in spans if sp[0] >= rename.end]
    above = [sp for sp in spans if sp[1] <= rename.start]
    if below:
        start, end = below[0]
        where = "below"
    elif above:
        start, end = above[-1]
        where = "above"
    else:
        return None
    return NextEdit(start, end, rename.new, f"rename {rename.old} -> {rename.new} ({where})")


def literal_spans(text: str, lo: int, hi: int) -> list[tuple[int, int]]:
    """Strings (quoted once or three times) and `#` comments in `text[lo:hi]`, as spans, by a
    plain scan (Python-like syntax; escapes honoured)."""
    spans: list[tuple[int, int]] = []
    i = lo
    while i < hi:
        ch = text[i]
        if ch == "#":
            end = text.find("\n", i, hi)
            end = hi if end < 0 else end
            spans.append((i, end))
            i = end
        elif ch in "'\"":
            quote = ch * 3 if text.startswith(ch * 3, i) else ch
            j = i + len(quote)
            while j < hi:
                if text[j] == "\\":
                    j += 2
                    continue
                if text.startswith(quote, j):
                    j += len(quote)
                    break
                if len(quote) == 1 and text[j] == "\n":
                    break  # an unterminated one-line string ends at its line
                j += 1
            spans.append((i, min(j, hi)))
            i = max(j, i + 1)
        else:
            i += 1
    return spans


def _inside(spans: list[tuple[int, int]], offset: int) -> bool:
    return any(a <= offset < b for a, b in spans)


def is_attribute(text: str, start: int) -> bool:
    i = start - 1
    while i >= 0 and text[i] in " \t":
        i -= 1
    return i >= 0 and text[i] == "."


def is_word(ch: str) -> bool:
    return ch.isalnum() or ch == "_"


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" \t"))



__all__ = ["NextEdit", "Rename", "enclosing_block", "is_attribute", "is_word", "literal_spans", "propose", "rename_of", "widened"]
