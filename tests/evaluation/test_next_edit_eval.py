"""`efim eval next-edit` on two real standard-library modules: every category is drawn, the
rename cases are answered at the expected place, noise gets no edit, and a missing module is
a clear error."""

from __future__ import annotations

import ast
import json
import subprocess
import sys

import pytest

from efim_tools.evaluation.next_edit import CATEGORIES, evaluate, samples


def test_samples_cover_the_categories_and_the_baseline_finds_the_renames():
    cases = samples(["textwrap", "shlex"], seed=3, per_category=40)
    found = {c.category for c in cases}
    assert {"rename-below", "rename-above", "noise"} <= found <= set(CATEGORIES)
    for case in cases:
        if case.expected is not None:
            start, end, new = case.edit
            assert case.before[start:end] != new  # a real change
    scores, _ = evaluate(cases)
    assert scores["rename-below"].exact >= 0.8 and scores["rename-above"].location >= 0.8
    assert scores["noise"].silent >= 0.8
    assert samples(["textwrap", "shlex"], seed=3, per_category=40) == cases  # same seed, same samples


def test_the_command_prints_json_and_refuses_an_unknown_module():
    out = subprocess.run([sys.executable, "-m", "efim_tools.cli", "eval", "next-edit", "--files", "textwrap", "--per-category", "10", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["task"] == "next-edit" and report["categories"]["rename-below"]["n"] > 0
    bad = subprocess.run([sys.executable, "-m", "efim_tools.cli", "eval", "next-edit", "--files", "no_such_module_here"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "no standard-library module" in bad.stderr


def test_call_site_and_parallel_samples_are_real_edits_answered_at_the_expected_place():
    cases = samples(["calendar", "difflib"], seed=5, per_category=40)
    by = {c: [x for x in cases if x.category == c] for c in ("call-site", "parallel")}
    assert len(by["call-site"]) == 40 and len(by["parallel"]) >= 8
    for case in by["call-site"] + by["parallel"]:
        start, end, new = case.edit
        assert case.before[start:end] != new and case.expected is not None
        after = case.before[:start] + new + case.before[end:]
        exp = case.expected
        assert 0 <= exp.start <= exp.end <= len(after) and after[exp.start : exp.end] != exp.text
    for case in by["call-site"]:  # the signature changed, and the call fixed, still parse
        start, end, new = case.edit
        after = case.before[:start] + new + case.before[end:]
        ast.parse(after[: case.expected.start] + case.expected.text + after[case.expected.end :])
    scores, _ = evaluate(by["call-site"] + by["parallel"])
    assert scores["call-site"].exact >= 0.9 and scores["parallel"].location >= 0.7


def test_an_unknown_proposer_is_refused_and_a_model_proposer_needs_a_model():
    with pytest.raises(ValueError, match="unknown proposer"):
        evaluate([], "oracle")
    with pytest.raises(ValueError, match="needs a model"):
        evaluate([], "model")


def test_the_textual_baseline_finds_renames_but_answers_noise_where_the_rules_stay_silent():
    cases = samples(["textwrap", "shlex"], seed=3, per_category=40)
    rules, _ = evaluate(cases)
    naive, _ = evaluate(cases, "textual")
    assert naive["rename-below"].location >= 0.5  # the next occurrence is often the next use
    assert naive["noise"].silent < rules["noise"].silent  # a number changed: the naive one repeats it
    assert naive["call-site"].exact < rules["call-site"].exact


class _Done:
    def __init__(self, text):
        self.text, self.finish_reason, self.error = text, "stop", None


class _Handle:
    def __init__(self, text):
        self._done = _Done(text)

    def result(self, timeout=None):
        return self._done


class _ProbeEngine:
    """Answers a probe with the new name only at lines that start with `yes_at`."""

    def __init__(self, yes_at: str, new: str):
        self.yes_at, self.new = yes_at, new
        self.requests, self.forgotten = [], []

    def submit(self, request):
        self.requests.append(request)
        if not request.probe:
            return _Handle("x")
        head = request.probe.rsplit("\n@", 1)[1]
        return _Handle(self.new if head.lstrip().startswith(self.yes_at) else "old")

    def count_tokens(self, text):
        return len(text)

    def forget_document(self, key):
        self.forgotten.append(key)


def test_the_model_proposer_asks_after_the_document_prompt_and_takes_the_first_yes():
    from efim_lsp.next_edit.history import EditHistory
    from efim_tools.evaluation.next_edit_model import ModelProposer

    text = "def f(n):\n    a = n + 1\n    b = n * 2\n    return n\n"
    at = text.index("n + 1")
    history = EditHistory()
    history.observe(at, at + 1, "n", "count")
    text = text[:at] + "count" + text[at + 1:]
    engine = _ProbeEngine("return", "count")
    got = ModelProposer(engine).propose(text, history.last)
    assert got is not None and text[got.start:got.end] == "n" and text[:got.start].endswith("return ")
    doc, *probes = engine.requests
    assert not doc.probe and [p.probe.rsplit("@", 1)[1] for p in probes] == ["    b = ", "    return "]
    for p in probes:  # the document's prompt, the probe after it
        assert (p.prefix, p.increment, p.suffix, p.heal) == (doc.prefix, doc.increment, doc.suffix, False)
    assert doc.increment == "count" and engine.forgotten
    silent = _ProbeEngine("nowhere", "count")
    assert ModelProposer(silent).propose(text, history.last) is None


def test_other_file_samples_come_from_a_package_and_are_answered_in_the_importer():
    cases = samples([], seed=1, per_category=50, packages=["json", "xml.dom"])
    assert cases and {c.category for c in cases} == {"other-file"}
    for case in cases:
        start, end, new = case.edit
        old = case.before[start:end]
        assert new == old + "_new" and case.before[: start].endswith("def ")
        exp = case.expected
        assert case.other[exp.start : exp.end] == old and exp.text == new
    scores, _ = evaluate(cases)
    assert scores["other-file"].exact >= 0.9
    with pytest.raises(FileNotFoundError):
        samples([], seed=1, per_category=5, packages=["no_such_package_here"])
