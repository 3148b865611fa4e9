"""HumanEval infilling (Bavarian et al. 2022; data MIT licence): greedy pass@1.

Splits: single-line, multi-line, random-span-light. The middle is generated from
`prompt` (prefix) and `suffix`, then `prompt + middle + suffix + test + check(entry_point)`
runs in the sandbox.

EFIM protocol (the paper's): the canonical middle is cut at a random character (seeded
per task) and the part before the cut becomes the increment `inc`; the model generates
the rest. `increment="cut"` gives the other formats the same `inc` (FIM: inside the
prefix segment; prefix-only: its own segment) so layouts can be compared on identical
information; `"none"` is standard infilling.
"""

from __future__ import annotations

import gzip
import json
import logging
import random
import time
from pathlib import Path
from typing import Iterable, Literal, NamedTuple

from efim_tools.evaluation.infill import Format, Infiller
from efim_tools.evaluation.sandbox import Limits, run_program

log = logging.getLogger(__name__)

Split = Literal["single-line", "multi-line", "random-span-light"]
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


class EvalResult(NamedTuple):
    split: str
    format: str
    n: int
    pass_at_1: float
    heal: bool
    results: list[TaskResult]
    seconds: float


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


def run_task(infiller: Infiller, task: Task, split: Split, fmt: Format, *, heal: bool, with_increment: bool, seed: int, limits: Limits) -> TaskResult:
    start = time.monotonic()
    cut = increment_cut(task, seed) if with_increment else 0
    inc = task.middle[:cut]
    single = split == "single-line"
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
        )
        middle = inc + infill.text
    except Exception as exc:  # noqa: BLE001 — one bad sample must not stop the run
        log.warning("%s: generation failed: %s", task.task_id, exc)
        return TaskResult(task.task_id, False, "error", inc, "", time.monotonic() - start)
    if task.middle.endswith("\n") and not middle.endswith("\n") and split != "random-span-light":
        middle += "\n"  # line-aligned splits: the suffix starts a new line
    result = run_program(program(task, middle), limits)
    return TaskResult(task.task_id, result.passed, result.status, inc, middle, time.monotonic() - start)


def evaluate(infiller: Infiller, tasks: Iterable[Task], split: Split, fmt: Format, *, heal: bool = False, increment: str = "auto", seed: int = 0, limits: Limits = Limits(), on_result=None) -> EvalResult:
    """Greedy pass@1 over `tasks`. `increment`: "auto" (cut for efim only), "cut", "none"."""
    if increment not in ("auto", "cut", "none"):
        raise ValueError(f"increment must be auto, cut or none, not {increment!r}")
    with_inc = increment == "cut" or (increment == "auto" and fmt == "efim")
    start = time.monotonic()
    results = []
    for task in tasks:
        r = run_task(infiller, task, split, fmt, heal=heal, with_increment=with_inc, seed=seed, limits=limits)
        results.append(r)
        if on_result is not None:
            on_result(r)
    n = len(results)
    return EvalResult(split, fmt, n, sum(r.passed for r in results) / n if n else 0.0, heal, results, time.monotonic() - start)


__all__ = ["Task", "TaskResult", "EvalResult", "load_tasks", "select", "increment_cut", "program", "evaluate", "run_task", "split_path", "SPLIT_FILES", "DEFAULT_DATA"]
