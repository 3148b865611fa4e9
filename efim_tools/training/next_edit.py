"""Next-edit training questions (`efim train --next-edit P`): the probe layout of
`efim_lsp.next_edit.probe`, taught on edits synthesised from the training files. What is
asked lives here; `efim_tools.training.samples.next_edit_sample` tokenizes it.

A sample is one change made to a file and one candidate place the server would ask about:

    SUF suffix PRE prefix [increment] PROBE "-old line\\n+new line\\n@candidate line head" → answer EOT

The prompt up to PROBE is the document's prompt as inline completion renders it with the
cursor right after the changed token (the token itself the increment half the time, as an edit
session holds what was typed), so next edits share the document's resident KV. The candidates
are the server's own (`probe.token_change` and `probe.candidates` on the changed text), so the
model is trained on exactly the questions it will be asked. Answers:

    name / attribute renamed   the new name at an occurrence in the same function, the old
                               name outside it (another function's own variable)
    number changed             the old number (a value tuned at one place is not a pattern)
    word in a string changed   the old word

Changes are drawn with `ast` (functions, their locals and attributes, constants), parsed once
per file. Held-out modules never reach here: the builder draws from the training corpus.
"""

from __future__ import annotations

import ast
import functools
import keyword
import random
from collections import defaultdict
from typing import NamedTuple

from efim_lsp.next_edit import probe
from efim_lsp.next_edit.history import Change

from efim_tools.source_text import AstText

# Shares of the change kinds (name, attribute, number, word).
KIND_WEIGHTS = {"name": 0.55, "attribute": 0.15, "number": 0.2, "word": 0.1}
_AFFIXES = ("s", "_list", "_count", "_map", "_name", "_value", "_id", "2", "_obj", "_data", "_item", "_path")
_PREFIXES = ("new_", "old_", "my_", "the_", "raw_", "tmp_", "cur_", "_")


class _Spot(NamedTuple):
    text: str  # the file after the change
    change: Change
    function: tuple[int, int] | None  # the changed function's span in `text` (renames)


class _FileIndex(NamedTuple):
    names: list[tuple[tuple[int, int], str, list[int]]]  # (function span, local, offsets)
    attributes: list[tuple[tuple[int, int], str, list[int]]]  # (function span, attr, offsets of the attr)
    numbers: list[tuple[int, str]]  # (offset, literal text) inside functions
    words: list[tuple[int, str]]  # (offset, word) inside one-line strings in functions


@functools.lru_cache(maxsize=48)
def _index(text: str) -> _FileIndex | None:
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return None
    src = AstText(text)
    lines, starts, offset = src.lines, src.starts, src.offset

    names, attributes, numbers, words = [], [], [], []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or fn.end_lineno is None:
            continue
        span = (starts[fn.lineno - 1], starts[min(fn.end_lineno, len(lines))])
        found: dict[str, list[int]] = defaultdict(list)
        attrs: dict[str, list[int]] = defaultdict(list)
        local = {a.arg for a in ast.walk(fn.args) if isinstance(a, ast.arg)}
        for node in ast.walk(fn):
            if isinstance(node, ast.arg):
                found[node.arg].append(offset(node.lineno, node.col_offset))
            elif isinstance(node, ast.Name):
                found[node.id].append(offset(node.lineno, node.col_offset))
                if isinstance(node.ctx, ast.Store):
                    local.add(node.id)
            elif isinstance(node, ast.Attribute) and node.end_lineno == node.lineno and node.end_col_offset is not None:
                end = offset(node.end_lineno, node.end_col_offset)
                attrs[node.attr].append(end - len(node.attr))
            elif isinstance(node, ast.Constant) and node.lineno == node.end_lineno and node.end_col_offset is not None:
                s, e = offset(node.lineno, node.col_offset), offset(node.end_lineno, node.end_col_offset)
                if type(node.value) is int:
                    numbers.append((s, text[s:e]))
                elif isinstance(node.value, str):
                    literal = text[s:e]
                    for w in {w for w in literal.strip("'\"rbuf").split() if w.isalpha() and len(w) > 2}:
                        at = literal.find(w)
                        if at > 0:
                            words.append((s + at, w))
        for var in sorted(local - {"self", "cls"}):
            spots = sorted({p for p in found.get(var, ()) if text.startswith(var, p)})
            if len(spots) >= 2 and not keyword.iskeyword(var):
                names.append((span, var, spots))
        for attr, spots in sorted(attrs.items()):
            spots = sorted({p for p in spots if text.startswith(attr, p)})
            if len(spots) >= 2:
                attributes.append((span, attr, spots))
    return _FileIndex(names, attributes, numbers, words)


def _new_name(old: str, rng: random.Random, vocabulary: list[str]) -> str:
    r = rng.random()
    if r < 0.3:
        new = old + rng.choice(_AFFIXES)
    elif r < 0.5:
        new = rng.choice(_PREFIXES) + old.lstrip("_")
    elif r < 0.65 and len(old) > 4:
        new = old[: rng.randint(2, len(old) - 2)]
    elif r < 0.8 and vocabulary:
        new = rng.choice(vocabulary)
    else:
        new = old + "_" + rng.choice(vocabulary or ["x"]).strip("_")
    return new if new != old and new.isidentifier() and not keyword.iskeyword(new) else old + "_2"


def _new_number(old: str, rng: random.Random) -> str:
    try:
        value = int(old, 0)
    except ValueError:
        return old + "0"
    return str(rng.choice((value + rng.randint(1, 9), value * 2 + 1, max(0, value - rng.randint(1, 3)) if value > 3 else value + 10)))


def _new_word(old: str, rng: random.Random, vocabulary: list[str]) -> str:
    r = rng.random()
    options = [old[::-1], old.capitalize() if old.islower() else old.lower(), old + "s", old[:-1]]
    words = [w for w in vocabulary if w.isalpha() and w != old]
    new = rng.choice(words) if r < 0.5 and words else rng.choice(options)
    return new if new != old and new.isalpha() else old + "x"


def _spot(text: str, index: _FileIndex, kind: str, rng: random.Random) -> _Spot | None:
    vocabulary = [v for _, v, _ in index.names] + [a for _, a, _ in index.attributes]
    if kind in ("name", "attribute"):
        pool = index.names if kind == "name" else index.attributes
        if not pool:
            return None
        span, old, spots = rng.choice(pool)
        at = rng.choice(spots)
        new = _new_name(old, rng, vocabulary)
        if new in text[span[0]:span[1]]:  # a name the function already uses: not a rename
            new = old + rng.choice(_AFFIXES)
            if new in text[span[0]:span[1]]:
                return None
        changed = text[:at] + new + text[at + len(old):]
        delta = len(new) - len(old)
        return _Spot(changed, Change(at, old, new), (span[0], span[1] + delta))
    pool = index.numbers if kind == "number" else index.words
    if not pool:
        return None
    at, old = rng.choice(pool)
    new = _new_number(old, rng) if kind == "number" else _new_word(old, rng, vocabulary)
    return _Spot(text[:at] + new + text[at + len(old):], Change(at, old, new), None)


class Question(NamedTuple):
    """One next-edit question: the changed file, where the cursor is (right after the changed
    token, which starts at `token_start`), the probe asked, and the token that belongs there."""

    text: str
    token_start: int
    cursor: int
    probe: str
    answer: str
    carried: bool  # the answer is the new token


def draw_question(text: str, rng: random.Random) -> Question | None:
    """A next-edit question about the file `text`, or None when the draw found no change with a
    candidate (the caller draws again)."""
    index = _index(text)
    if index is None:
        return None
    kind = rng.choices(list(KIND_WEIGHTS), weights=list(KIND_WEIGHTS.values()))[0]
    spot = _spot(text, index, kind, rng)
    if spot is None:
        return None
    tc = probe.token_change(spot.text, spot.change)
    if tc is None:
        return None
    found = probe.candidates(spot.text, tc, limit=6)
    if not found:
        return None
    cand = rng.choice(found)
    carry = tc.kind in ("name", "attribute") and spot.function is not None and spot.function[0] <= cand.start < spot.function[1]
    if tc.kind == "attribute" and not carry:
        return None  # another method's use of an attribute: as often the same attribute; not taught
    return Question(spot.text, tc.start, tc.end, cand.probe, tc.new if carry else tc.old, carry)


__all__ = ["KIND_WEIGHTS", "Question", "draw_question"]
