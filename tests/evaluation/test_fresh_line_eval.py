"""The fresh-line measurements' plumbing (efim eval humaneval-infilling --fresh-line,
blank-lines, shape) with stand-in completers; the model-backed numbers are in docs/training.md."""

from __future__ import annotations

import ast
from pathlib import Path

from efim_tools.evaluation import humaneval
from efim_tools.evaluation.infill import Infill
from efim_tools.evaluation.linecompletion import blank_line_cases, evaluate_blank_lines
from efim_tools.evaluation.shape import evaluate_shape, next_code_line, shape_cases
from engine.api import Completion, RequestStats

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "humaneval"


class _Blank:
    """Answers a blank line unless asked under the fresh-line rule; records the flags."""

    name = "blank"

    def __init__(self):
        self.flags = []

    def complete(self, prefix, suffix, increment, fmt, *, fresh_line=False, fresh_line_guard=1.0, **kw):
        self.flags.append((fresh_line, fresh_line_guard))
        return Infill("x = 1" if fresh_line else "", 1, 1, False, "stop")


def test_humaneval_counts_blank_answers_and_sets_the_rule_where_the_server_would():
    tasks = humaneval.load_tasks("single-line", FIXTURES)
    off = humaneval.evaluate(_Blank(), tasks, "single-line", "fim", increment="none")
    assert off.blank == off.n and off.blank_rate == 1.0 and off.fresh_line == 0
    inf = _Blank()
    on = humaneval.evaluate(inf, tasks, "single-line", "fim", increment="none", fresh_line="rule", fresh_line_guard=0.8)
    expected = [humaneval.fresh_line_applies(t, "", "single-line") for t in tasks]
    assert [f for f, _ in inf.flags] == expected and {g for _, g in inf.flags} == {0.8}
    assert on.fresh_line == sum(expected) and on.blank == on.n - sum(expected)
    assert humaneval.is_blank("  ()\n") and not humaneval.is_blank("    x")


def test_blank_line_cases_are_real_blank_lines_and_scored_against_the_rule_off():
    cases = blank_line_cases(n=40, seed=1)
    assert len(cases) == 40 and any(c.fresh_line for c in cases) and not all(c.fresh_line for c in cases)
    for c in cases:
        assert c.prefix.endswith("\n") and c.suffix.startswith("\n") and c.suffix[1:].split("\n", 1)[0].strip()
    inf = _Blank()
    (score,) = evaluate_blank_lines(inf, cases, [0.9])
    fired = sum(c.fresh_line for c in cases)
    assert (score.n, score.fired, score.non_blank_off, score.non_blank_on, score.made_non_blank) == (40, fired, 0, fired, fired)
    assert len(inf.flags) == 40 + fired  # the rule's pass asks only where it fires


class _Handle:
    def __init__(self, text):
        self._text = text

    def result(self, timeout=None):
        return Completion(text=self._text, finish_reason="stop", stats=RequestStats())


class _EchoEngine:
    """Answers each request with `answer(request)`."""

    def __init__(self, answer):
        self.answer = answer
        self.requests = []

    def submit(self, request):
        self.requests.append(request)
        return _Handle(self.answer(request))


def test_shape_counts_unparseable_and_duplicated_suggestions():
    cases = shape_cases(n=30, seed=2)
    assert len(cases) == 30
    for c in cases:
        ast.parse(c.before + c.indent + c.original + c.after)
    by_prefix = {c.before[-200:]: c for c in cases}

    def original(request):
        return by_prefix[request.prefix[-200:]].original

    before, after = evaluate_shape(_EchoEngine(original), cases, ("line",))
    assert not before.post and after.post
    assert after.shown == 30 and after.unparseable == 0
    _, broken = evaluate_shape(_EchoEngine(lambda r: "x = (("), cases, ("line",))
    assert broken.unparseable == broken.shown == 30
    # One space too many after the indentation: unparseable as generated, fixed by the snap.
    off, on = evaluate_shape(_EchoEngine(lambda r: " " + original(r)), cases, ("line",))
    assert off.unparseable > 10 and on.unparseable < off.unparseable // 2
    # A docstring opened and left open: unparseable as generated, closed by the shaping
    # (where a compound header was emptied, its body below still makes the file unparseable).
    off, on = evaluate_shape(_EchoEngine(lambda r: '"""Return the thing.'), cases, ("line",))
    headers = sum(c.original.rstrip().endswith(":") for c in cases)
    assert 0 < headers
    assert off.unparseable == off.shown == 30 and on.unparseable <= headers + 2 < 30

    def repeat(request):
        c = by_prefix[request.prefix[-200:]]
        return "pass\n" + c.indent + next_code_line(c.after)

    _, dup = evaluate_shape(_EchoEngine(repeat), cases, ("auto",))
    # shape() cuts a block where it repeats the next line; the `pass` left where a header was
    # emptied (its body below is deeper) is dropped by the off-side rule
    assert dup.shown == 30 - headers and dup.duplicate == 0
    assert 0 < dup.fresh_line < dup.n  # statement starts at top level are not fresh lines
