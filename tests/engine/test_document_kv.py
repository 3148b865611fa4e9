"""Whole-document pieces: boundaries that stay put under edits elsewhere, nearest-first
order, and the n-gram lookup that finds a prompt's runs in stored pieces."""

from __future__ import annotations

import random

import pytest

from engine.cacheblend.document_kv import MIN_RUN, DocumentPass, cut_pieces, nearest_first
from tiny_models import stdlib_sources


@pytest.fixture(scope="module")
def sources():
    return stdlib_sources(("textwrap.py", "shlex.py", "bisect.py", "string.py"))


def _texts(text, pieces):
    return [text[p.start : p.end] for p in pieces]


def test_pieces_cover_the_text_at_line_starts_within_bounds(sources):
    for text in sources:
        pieces = cut_pieces(text, 200, 800)
        assert "".join(_texts(text, pieces)) == text
        assert all(p.start == 0 or text[p.start - 1] == "\n" for p in pieces)
        assert all(p.end - p.start >= 200 for p in pieces[:-1])
        longest_line = max(len(line) for line in text.splitlines(keepends=True))
        assert all(p.end - p.start <= 800 + longest_line for p in pieces)


@pytest.mark.parametrize("seed", range(6))
def test_an_edit_changes_only_the_pieces_near_it(sources, seed):
    rng = random.Random(seed)
    text = sources[seed % len(sources)]
    before = cut_pieces(text)
    at = rng.randrange(len(text))
    edit = rng.choice(["x = 1\n", "", "    # note\n", "def g():\n    pass\n\n"])
    cut = rng.randrange(0, 40)
    edited = text[:at] + edit + text[at + cut :]
    after = set(_texts(edited, cut_pieces(edited)))
    changed = [p for p in before if text[p.start : p.end] not in after]
    # Boundaries depend only on the lines since the previous one: every piece before the
    # edit survives, and the pieces after it resynchronise at the next anchor line.
    assert all(p.end > at for p in changed)
    assert len(changed) <= 5, (len(changed), len(before))


def test_nearest_first_starts_with_the_piece_holding_the_cursor(sources):
    text = sources[0]
    pieces = cut_pieces(text)
    cursor = pieces[len(pieces) // 2].start + 3
    order = nearest_first(pieces, cursor)
    assert order[0] == len(pieces) // 2
    gaps = [min(abs(pieces[i].start - cursor), abs(pieces[i].end - cursor)) for i in order[1:]]
    assert gaps == sorted(gaps)
    assert sorted(order) == list(range(len(pieces)))


def test_a_pass_keeps_the_pieces_around_the_cursor_within_its_token_cap(sources):
    text = sources[1]
    pieces = cut_pieces(text)
    cursor = pieces[-1].start
    tokens = lambda s: [ord(c) for c in s]  # one id per character: enough for the order
    full = DocumentPass("k", text, cursor, tokens, max_tokens=10**9).ids_in_order()
    assert sum(map(len, full)) == len(text)
    capped = DocumentPass("k", text, cursor, tokens, max_tokens=len(text) // 3).ids_in_order()
    assert sum(map(len, capped)) <= len(text) // 3
    assert capped[0] == tuple(tokens(text[pieces[-1].start :]))  # the cursor's piece first
    assert MIN_RUN >= 8


def test_a_pass_after_an_edit_tokenizes_only_the_pieces_the_edit_changed(sources):
    text = sources[2]
    calls: list[str] = []

    def tokens(s):
        calls.append(s)
        return [ord(c) for c in s]

    first = DocumentPass("k", text, 0, tokens, max_tokens=10**9)
    first.ids_in_order()
    n_pieces = len(calls)
    at = len(text) // 2
    edited = text[:at] + "z = 3\n" + text[at:]
    second = DocumentPass("k", edited, at, tokens, max_tokens=10**9)
    second.memo = first.memo
    calls.clear()
    second.ids_in_order()
    assert 1 <= len(calls) <= 5 < n_pieces


def test_a_huge_document_is_cut_only_around_the_cursor(sources):
    from engine.cacheblend.document_kv import CHARS_PER_TOKEN_BOUND  # noqa: PLC0415

    huge = sources[0] * 200  # several MB
    seen: list[int] = []
    work = DocumentPass("k", huge, len(huge) // 2, lambda s: seen.append(len(s)) or [1] * (len(s) // 4), max_tokens=2000)
    order = work.ids_in_order()
    assert order and sum(map(len, order)) <= 2000
    assert sum(seen) <= 2 * 2000 * CHARS_PER_TOKEN_BOUND + 2 * 1300 < len(huge) // 100
