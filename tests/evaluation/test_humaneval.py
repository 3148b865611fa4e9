"""HumanEval infilling plumbing on the fixture subset (MIT licence alongside)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from efim_tools.evaluation import humaneval
from efim_tools.evaluation.sandbox import run_program

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "humaneval"


@pytest.mark.parametrize("split", ["single-line", "multi-line", "random-span-light"])
def test_canonical_middles_pass_and_wrong_ones_fail(split):
    tasks = humaneval.load_tasks(split, FIXTURES)
    assert len(tasks) >= 3
    for task in tasks:
        assert run_program(humaneval.program(task, task.middle)).passed, task.task_id
        assert not run_program(humaneval.program(task, "    return None\n")).passed, task.task_id


def test_efim_cut_is_seeded_and_inside_the_middle():
    for task in humaneval.load_tasks("single-line", FIXTURES):
        cut = humaneval.increment_cut(task, seed=0)
        assert cut == humaneval.increment_cut(task, seed=0)
        assert 1 <= cut < len(task.middle.rstrip("\n"))
    cuts = {humaneval.increment_cut(t, seed=s) for t in humaneval.load_tasks("single-line", FIXTURES) for s in range(5)}
    assert len(cuts) > 5


def test_selection_is_a_fixed_subset():
    tasks = humaneval.load_tasks("single-line", FIXTURES)
    assert humaneval.select(tasks, 2, seed=1) == humaneval.select(tasks, 2, seed=1)
    assert len(humaneval.select(tasks, None)) == len(tasks)


def test_bad_data_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        humaneval.load_tasks("single-line", tmp_path)
    bad = tmp_path / humaneval.SPLIT_FILES["single-line"]
    with gzip.open(bad, "wt") as fh:
        fh.write(json.dumps({"task_id": "x"}) + "\n")
    with pytest.raises(ValueError, match="not a HumanEval"):
        humaneval.load_tasks("single-line", tmp_path)
    with pytest.raises(ValueError):
        humaneval.split_path("two-line", FIXTURES)


class _Oracle:
    """A completer that returns the canonical rest of the middle (checks the harness, not a model)."""

    def __init__(self, tasks, broken=False):
        self.by_prompt = {t.prompt + "\0" + t.suffix: t for t in tasks}
        self.broken = broken

    def complete(self, prefix, suffix, increment, fmt, **kw):
        from efim_tools.evaluation.infill import Infill

        if self.broken:
            raise RuntimeError("model crashed")
        task = self.by_prompt[prefix + "\0" + suffix]
        assert task.middle.startswith(increment)
        rest = task.middle[len(increment) :]
        if kw.get("single_line"):
            rest = rest.split("\n", 1)[0]
        return Infill(rest, 1, 1, False, "eos")


@pytest.mark.parametrize("fmt", ["fim", "efim"])
def test_evaluate_scores_an_oracle_at_one(fmt):
    tasks = humaneval.load_tasks("single-line", FIXTURES)
    res = humaneval.evaluate(_Oracle(tasks), tasks, "single-line", fmt)
    assert res.n == len(tasks) and res.pass_at_1 == 1.0
    assert all(bool(r.increment) == (fmt == "efim") for r in res.results)


def test_indent_increment_is_the_middles_indentation():
    tasks = humaneval.load_tasks("single-line", FIXTURES)
    res = humaneval.evaluate(_Oracle(tasks), tasks, "single-line", "efim", increment="indent")
    assert res.pass_at_1 == 1.0
    for task, r in zip(tasks, res.results):
        assert r.increment == task.middle[: len(task.middle) - len(task.middle.lstrip(" \t"))] and not r.increment.strip()
    assert any(r.increment for r in res.results)
    with pytest.raises(ValueError, match="indent"):
        humaneval.evaluate(_Oracle(tasks), tasks, "single-line", "efim", increment="dedent")


def test_a_crashing_generation_counts_as_failure():
    tasks = humaneval.load_tasks("multi-line", FIXTURES)
    res = humaneval.evaluate(_Oracle(tasks, broken=True), tasks, "multi-line", "fim")
    assert res.n == len(tasks) and res.pass_at_1 == 0.0
    assert {r.status for r in res.results} == {"error"}


def test_cli_json_on_a_tiny_model(tiny_model_dir, capsys):
    from efim_tools.cli import main

    code = main(["eval", "humaneval-infilling", "--model", str(tiny_model_dir), "--adapter", "none", "--data", str(FIXTURES), "--split", "single-line", "--format", "efim", "--heal", "on", "--limit", "2", "--json", "--threads", "1"])
    assert code == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["split"] == "single-line" and doc["format"] == "efim" and doc["n"] == 2
    assert 0.0 <= doc["pass_at_1"] <= 1.0
