"""HumanEval infilling (Bavarian et al. 2022; data MIT licence): greedy pass@1.

Splits: single-line, multi-line, random-span-light. The middle is generated from
`prompt` (prefix) and `suffix`, then `prompt + middle + suffix + test + check(entry_point)`
runs in the sandbox.

EFIM protocol (the paper's): the canonical middle is cut at a random character (seeded
per task) and the part before the cut becomes the increment `inc`; the model generates
the rest. `increment="cut"` gives the other formats the same `inc` (FIM: inside the
prefix segment; prefix-only: its own segment) so layouts can be compared on identical
information; `"none"` is standard infilling.

The fresh-line rule (`fresh_line="rule"`): each task is asked with `fresh_line` set where the
language server would set it — `efim_lsp.suggest.fresh_line` on the document an editor
holds with the middle's line empty (`prompt + increment + "\n" + suffix` for the
line-aligned splits). A *blank answer* is a generated middle with no letter or digit in it
(`EvalResult.blank`).
"""

from __future__ import annotations

import gzip
import json
import logging
import random
import time
from pathlib import Path
from typing import Iterable, Literal, NamedTuple

from efim_lsp.suggest import CursorContext
from efim_lsp.suggest import fresh_line as fresh_line_rule
from efim_tools.evaluation.infill import Format, Infiller
from efim_tools.evaluation.sandbox import Limits, run_program
from engine.api import DEFAULT_FRESH_LINE_GUARD

log = logging.getLogger(__name__)

Split = Literal["single-line", "multi-line", "random-span-light"]
FreshLineMode = Literal["off", "rule"]
SPLIT_FILES = {
    "single-line": "HumanEval-SingleLineInfilling.jsonl.gz",
    "multi-line": "HumanEval-MultiLineInfilling.jsonl.gz",
    "random-span-light": "HumanEval-RandomSpanInfillingLight.jsonl.gz",
}
DEFAULT_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "humaneval-infilling"


class Task(NamedTuple):
    task_id: str
    prompt: str
    suffix: str
    middle: str  # canonical solution
    test: str
    entry_point: str


class TaskResult(NamedTuple):
    task_id: str
    passed: bool
    status: str
    increment: str
    completion: str  # the full generated middle (increment included)
    seconds: float
    fresh_line: bool = False  # asked under the fresh-line rule (the server's test said so)


class EvalResult(NamedTuple):
    split: str
    format: str
    n: int
    pass_at_1: float
    heal: bool
    results: list[TaskResult]
    seconds: float
    blank: int = 0  # generated middles (the increment excluded) without a letter or digit
    fresh_line: int = 0  # tasks asked under the fresh-line rule

    @property
    def blank_rate(self) -> float:
        return self.blank / self.n if self.n else 0.0


def split_path(split: Split, data: Path | None = None) -> Path:
    if split not in SPLIT_FILES:
        raise ValueError(f"unknown split {split!r}; expected one of {sorted(SPLIT_FILES)}")
    path = Path(data) if data else DEFAULT_DATA
    if path.is_dir():
        path = path / SPLIT_FILES[split]
    if not path.is_file():
        raise FileNotFoundError(f"HumanEval infilling data not found at {path} (pass --data)")
    return path


def load_tasks(split: Split, data: Path | None = None) -> list[Task]:
    path = split_path(split, data)
    opener = gzip.open if path.suffix == ".gz" else open
    tasks = []
    with opener(path, "rt", encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                tasks.append(Task(row["task_id"], row["prompt"], row["suffix"], row["canonical_solution"], row["test"], row["entry_point"]))
            except (json.JSONDecodeError, KeyError) as exc:
                raise ValueError(f"{path}:{line_no}: not a HumanEval infilling record ({exc})") from exc
    return tasks


def select(tasks: list[Task], limit: int | None, seed: int = 0) -> list[Task]:
    """A seeded random subset (the first `limit` of a fixed shuffle), so small runs
    spread over many problems instead of the first few."""
    order = list(tasks)
    random.Random(seed).shuffle(order)
    return order[:limit] if limit else order


def increment_cut(task: Task, seed: int = 0) -> int:
    """Characters of the canonical middle that form the increment: a random character
    position, at least one character before and after it (trailing newline excluded)."""
    body = task.middle.rstrip("\n")
    if len(body) < 2:
        return 0
    return random.Random(f"{seed}:{task.task_id}").randint(1, len(body) - 1)


def program(task: Task, middle: str) -> str:
    return f"{task.prompt}{middle}{task.suffix}\n{task.test}\ncheck({task.entry_point})\n"


def _dedented(line: str) -> bool:
    return bool(line.strip()) and not line[0].isspace()


def is_blank(text: str) -> bool:
    """No letter or digit: an answer the editor shows as nothing (or as punctuation only)."""
    return not any(ch.isalnum() for ch in text)


def fresh_line_applies(task: Task, increment: str, split: Split) -> bool:
    """The language server's fresh-line test on the document an editor would hold: the
    middle's line empty up to `increment` (line-aligned splits: its own line)."""
    aligned = split != "random-span-light" and task.prompt.endswith("\n") and task.middle.endswith("\n")
    text = task.prompt + increment + ("\n" if aligned else "") + task.suffix
    return fresh_line_rule(CursorContext.at(text, len(task.prompt) + len(increment)))


def run_task(infiller: Infiller, task: Task, split: Split, fmt: Format, *, heal: bool, with_increment: bool, seed: int, limits: Limits,
             fresh_line: FreshLineMode = "off", fresh_line_guard: float = DEFAULT_FRESH_LINE_GUARD, indent: bool = False) -> TaskResult:
    """`indent`: the increment is the middle's leading indentation (an auto-indenting editor's
    fresh line), instead of a seeded cut (`with_increment`) or nothing."""
    start = time.monotonic()
    cut = len(task.middle) - len(task.middle.lstrip(" \t")) if indent else increment_cut(task, seed) if with_increment else 0
    inc = task.middle[:cut]
    single = split == "single-line"
    fresh = fresh_line == "rule" and fresh_line_applies(task, inc, split)
    try:
        infill = infiller.complete(
            task.prompt,
            task.suffix,
            inc,
            fmt,
            heal=heal,
            max_tokens=48 if single else 192,
            single_line=single,
            stop_line=_dedented if (fmt == "prefix" and not single) else None,
            fresh_line=fresh,
            fresh_line_guard=fresh_line_guard,
        )
        middle = inc + infill.text
    except Exception as exc:  # noqa: BLE001 — one bad sample must not stop the run
        log.warning("%s: generation failed: %s", task.task_id, exc)
        return TaskResult(task.task_id, False, "error", inc, "", time.monotonic() - start, fresh)
    if task.middle.endswith("\n") and not middle.endswith("\n") and split != "random-span-light":
        middle += "\n"  # line-aligned splits: the suffix starts a new line
    result = run_program(program(task, middle), limits)
    return TaskResult(task.task_id, result.passed, result.status, inc, middle, time.monotonic() - start, fresh)


def evaluate(infiller: Infiller, tasks: Iterable[Task], split: Split, fmt: Format, *, heal: bool = False, increment: str = "auto", seed: int = 0, limits: Limits = Limits(), on_result=None,
             fresh_line: FreshLineMode = "off", fresh_line_guard: float = DEFAULT_FRESH_LINE_GUARD) -> EvalResult:
    """Greedy pass@1 over `tasks`. `increment`: "auto" (cut for efim only), "cut", "none",
    "indent" (the middle's leading indentation, as typed by an auto-indenting editor).
    `fresh_line`: "rule" asks under the fresh-line rule where the server would."""
    if increment not in ("auto", "cut", "none", "indent"):
        raise ValueError(f"increment must be auto, cut, none or indent, not {increment!r}")
    with_inc = increment == "cut" or (increment == "auto" and fmt == "efim")
    start = time.monotonic()
    results = []
    for task in tasks:
        r = run_task(infiller, task, split, fmt, heal=heal, with_increment=with_inc, seed=seed, limits=limits,
                     fresh_line=fresh_line, fresh_line_guard=fresh_line_guard, indent=increment == "indent")
        results.append(r)
        if on_result is not None:
            on_result(r)
    n = len(results)
    blank = sum(is_blank(r.completion[len(r.increment):]) for r in results)
    return EvalResult(split, fmt, n, sum(r.passed for r in results) / n if n else 0.0, heal, results, time.monotonic() - start,
                      blank, sum(r.fresh_line for r in results))


__all__ = ["Task", "TaskResult", "EvalResult", "load_tasks", "select", "increment_cut", "program", "evaluate", "run_task", "is_blank", "fresh_line_applies", "split_path", "SPLIT_FILES", "DEFAULT_DATA"]
