"""Line-completion cases come only from held-out modules; metrics behave."""

from __future__ import annotations

from efim_tools.evaluation.linecompletion import edit_similarity, evaluate_lines, levenshtein, line_cases
from efim_tools.training.data import HELD_OUT_MODULES


def test_levenshtein_and_similarity():
    assert levenshtein("kitten", "sitting") == 3
    assert edit_similarity("abc", "abc") == 1.0 and edit_similarity("", "") == 1.0
    assert edit_similarity("abcd", "wxyz") == 0.0


def test_cases_are_held_out_and_consistent():
    cases = line_cases(n=40, seed=3)
    assert len(cases) == 40 and cases == line_cases(n=40, seed=3)
    assert {c.module for c in cases} <= set(HELD_OUT_MODULES)
    for c in cases:
        assert len(c.target) >= 1 and "\n" not in c.typed + c.target
        assert c.prefix == "" or c.prefix.endswith("\n")


class _Echo:
    def __init__(self, cases):
        self.answers = {c.typed: c.target for c in cases}

    def complete(self, prefix, suffix, increment, fmt, **kw):
        from efim_tools.evaluation.infill import Infill

        typed = increment if fmt in ("efim", "prefix") else prefix[prefix.rfind("\n") + 1 :]
        return Infill(self.answers[typed], 1, 1, False, "newline")


def test_perfect_completer_scores_one():
    cases = line_cases(n=10, seed=1)
    for fmt in ("fim", "efim"):
        score = evaluate_lines(_Echo(cases), cases, fmt)
        assert score.exact_match == 1.0 and score.edit_similarity == 1.0 and score.n == 10


def test_windows_of_other_sizes_keep_the_same_lines_and_cursors():
    """`efim eval lines --windows`: one row per window size, on the same cases."""
    full = line_cases(n=20, seed=4, prefix_chars=4600, suffix_chars=1500)
    small = line_cases(n=20, seed=4, prefix_chars=600, suffix_chars=200)
    assert [(c.module, c.line_no, c.typed, c.target) for c in full] == [(c.module, c.line_no, c.typed, c.target) for c in small]
    assert all(f.prefix.endswith(s.prefix) and f.suffix.startswith(s.suffix) for f, s in zip(full, small))
    assert sum(len(c.prefix) for c in small) < sum(len(c.prefix) for c in full) / 3


def test_a_bad_window_spec_is_refused_before_the_model_loads():
    import argparse

    import pytest

    from efim_tools.commands.eval import run_lines

    with pytest.raises(SystemExit, match="BEFORE:AFTER"):
        run_lines(argparse.Namespace(windows=["1500x600"]))
