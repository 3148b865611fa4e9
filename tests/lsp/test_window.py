"""Prompt windows: budgets respected, line-aligned, stable under small cursor moves."""

import sysconfig
from pathlib import Path

import pytest

from efim_lsp.positions import LineIndex
from efim_lsp.window import GRID_LINES, TokenMeter, cut, prefix_start, suffix_end


def count(text: str) -> int:
    """A stand-in tokenizer: words and punctuation runs (a real count, not a ratio)."""
    import re

    return len(re.findall(r"\w+|[^\w\s]+|\s+", text))


@pytest.fixture(scope="module")
def source() -> str:
    return (Path(sysconfig.get_paths()["stdlib"]) / "argparse.py").read_text()


def test_windows_fit_the_budget_and_start_on_line_boundaries(source):
    index = LineIndex(source)
    meter = TokenMeter(count)
    used = []
    for cursor in range(2000, len(source) - 2000, 997):
        w = cut(index, cursor, 300, 120, meter)
        assert count(source[w.start : cursor]) <= 300
        assert count(source[cursor : w.end]) <= 120
        assert w.start in index.starts
        assert w.end in index.starts or w.end == len(source)
        used.append(count(source[w.start : cursor]) / 300)
    # The budget is used, not wasted (the grid and the slack give some away on purpose).
    assert sum(used) / len(used) >= 0.6 and min(used) >= 0.3


def test_window_start_snaps_to_the_grid(source):
    index = LineIndex(source)
    w = cut(index, len(source) // 2, 1536, 100, TokenMeter(count))
    assert index.starts.index(w.start) % GRID_LINES == 0


def test_small_cursor_moves_keep_the_window_start(source):
    index = LineIndex(source)
    meter = TokenMeter(count)
    line = 300
    cursor = index.starts[line]
    first = prefix_start(index, cursor, 400, meter)
    starts = set()
    for step in range(1, 12):  # move down a few lines, one rebase each, sticky start passed on
        c = index.starts[line + step] + 4
        starts.add(prefix_start(index, c, 400, meter, sticky=first))
    assert starts == {first}


def test_without_sticky_start_the_grid_still_limits_changes(source):
    index = LineIndex(source)
    meter = TokenMeter(None, 3.5)  # a fixed ratio: isolate the grid from calibration drift
    starts = [prefix_start(index, index.starts[l], 1536, meter) for l in range(500, 500 + GRID_LINES)]
    assert all(index.starts.index(s) % 8 == 0 for s in starts)
    assert len(set(starts)) <= 3


def test_sticky_start_moves_once_it_no_longer_fits(source):
    index = LineIndex(source)
    meter = TokenMeter(count)
    first = prefix_start(index, index.starts[200], 300, meter)
    far = index.starts[400]
    moved = prefix_start(index, far, 300, meter, sticky=first)
    assert moved > first and count(source[moved:far]) <= 300


def test_whole_prefix_and_suffix_when_they_fit():
    text = "a = 1\nb = 2\n"
    index = LineIndex(text)
    assert cut(index, 6, 100, 100, TokenMeter(count)) == (0, len(text))


def test_zero_budgets_and_one_huge_line():
    text = "x" * 5000
    index = LineIndex(text)
    meter = TokenMeter(None, 4.0)
    assert prefix_start(index, 2500, 0, meter) == 2500
    assert suffix_end(index, 2500, 0, meter) == 2500
    start = prefix_start(index, 2500, 100, meter)
    end = suffix_end(index, 2500, 100, meter)
    assert 0 < 2500 - start <= 400 and 0 < end - 2500 <= 400


def test_exact_counts_are_used_sparingly(source):
    calls = []
    meter = TokenMeter(lambda s: calls.append(1) or count(s))
    cut(LineIndex(source), len(source) // 2, 1536, 512, meter)
    assert 1 <= len(calls) <= 6
