"""The quality comparison table (docs/training.md) in one run: each model loaded once, every configuration
on the same tasks (same seeded subset, same increment cuts).

Rows: base model prefix-only (standard, and with the EFIM increment as its own segment,
healing off/on); each adapter under FIM, and under EFIM with healing off/on.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import NamedTuple

from efim_tools.evaluation import humaneval
from efim_tools.evaluation.infill import TransformersInfiller
from efim_tools.evaluation.linecompletion import evaluate_lines, line_cases
from efim_tools.evaluation.model import load_eval_model

log = logging.getLogger(__name__)


class Row(NamedTuple):
    model: str
    format: str
    increment: str  # "none" | "cut"
    heal: bool
    n: int
    pass_at_1: float
    passed: int
    seconds: float
    line_n: int = 0
    line_exact: float = float("nan")
    line_edit_sim: float = float("nan")


BASE_CONFIGS = (("prefix", "none", False), ("prefix", "cut", False), ("prefix", "cut", True))
ADAPTER_CONFIGS = (("fim", "none", False), ("efim", "cut", False), ("efim", "cut", True))


def run_table(model: str, adapters: list[str], *, base: bool = True, split: str = "single-line", limit: int = 30, line_limit: int = 0, data: Path | None = None, seed: int = 0, out_jsonl: Path | None = None) -> list[Row]:
    tasks = humaneval.select(humaneval.load_tasks(split, data), limit, seed)
    cases = line_cases(n=line_limit, seed=seed) if line_limit else []
    rows: list[Row] = []
    plan = ([("none", BASE_CONFIGS)] if base else []) + [(a, ADAPTER_CONFIGS) for a in adapters]
    for adapter, configs in plan:
        em = load_eval_model(model, adapter)
        infiller = TransformersInfiller(em)
        for fmt, inc, heal in configs:
            start = time.monotonic()
            res = humaneval.evaluate(infiller, tasks, split, fmt, heal=heal, increment=inc, seed=seed)
            line = None
            if cases:
                line = evaluate_lines(infiller, cases, fmt, heal=heal) if inc == "cut" or fmt == "fim" else None
            row = Row(em.name if adapter == "none" else str(adapter), fmt, inc, heal, res.n, res.pass_at_1, sum(r.passed for r in res.results), time.monotonic() - start,
                      *((line.n, line.exact_match, line.edit_similarity) if line else ()))
            rows.append(row)
            log.info("%s", row)
            if out_jsonl is not None:
                with Path(out_jsonl).open("a") as fh:
                    fh.write(json.dumps({**row._asdict(), "split": split, "results": [r._asdict() for r in res.results]}) + "\n")
    return rows


def markdown(rows: list[Row]) -> str:
    head = "| model | format | increment | healing | HumanEval pass@1 (passed/n) | line exact | line edit sim | s |\n|---|---|---|---|---|---|---|---|"
    lines = [head]
    for r in rows:
        ex = "" if r.line_n == 0 else f"{r.line_exact:.3f} (n={r.line_n})"
        es = "" if r.line_n == 0 else f"{r.line_edit_sim:.3f}"
        lines.append(f"| {r.model} | {r.format} | {r.increment} | {'on' if r.heal else 'off'} | {r.pass_at_1:.3f} ({r.passed}/{r.n}) | {ex} | {es} | {r.seconds:.0f} |")
    return "\n".join(lines)


__all__ = ["Row", "run_table", "markdown", "BASE_CONFIGS", "ADAPTER_CONFIGS"]
