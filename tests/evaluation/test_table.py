"""`efim eval table` end to end on a tiny model with a one-step adapter."""

from __future__ import annotations

from pathlib import Path

from efim_tools.evaluation.table import ADAPTER_CONFIGS, BASE_CONFIGS, markdown, run_table
from efim_tools.training.train import TrainConfig, train

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "humaneval"


def test_table_rows_cover_every_configuration(tiny_model_factory, tmp_path):
    model_dir = tiny_model_factory("llama", fim_tokens=False)
    run = train(TrainConfig(model=str(model_dir), out=str(tmp_path / "run"), steps=1, accum=1, min_window=24, max_window=48, threads=1))
    rows = run_table(str(model_dir), [str(run.adapter_dir)], limit=2, line_limit=2, data=FIXTURES, out_jsonl=tmp_path / "rows.jsonl")
    assert [(r.format, r.increment, r.heal) for r in rows] == list(BASE_CONFIGS) + list(ADAPTER_CONFIGS)
    assert all(r.n == 2 and 0 <= r.pass_at_1 <= 1 for r in rows)
    assert sum(1 for _ in (tmp_path / "rows.jsonl").open()) == len(rows)
    table = markdown(rows)
    assert table.count("\n") == len(rows) + 1 and "efim" in table
