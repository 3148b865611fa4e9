"""The product engine, given the merged folder, detects the FIM template from the added
tokens and produces the same greedy infills as the transformers path (tiny model, fp32)."""

from __future__ import annotations

import pytest

from efim_tools.evaluation.infill import TransformersInfiller, EngineInfiller
from efim_tools.evaluation.model import export_merged, load_eval_model
from efim_tools.training.train import TrainConfig, train


@pytest.mark.parametrize(("layout", "template"), [("psm", "starcoder"), ("spm", "efim-spm")])
def test_engine_backend_matches_transformers_on_merged_adapter(tiny_model_factory, tmp_path, layout, template):
    model_dir = tiny_model_factory("llama", fim_tokens=False)
    run = train(TrainConfig(model=str(model_dir), out=str(tmp_path / "run"), steps=1, accum=1, min_window=24, max_window=48, threads=1, layout=layout))
    merged = export_merged(str(model_dir), str(run.adapter_dir), tmp_path / "merged")
    ours = TransformersInfiller(load_eval_model(str(model_dir), str(run.adapter_dir)))
    engine = EngineInfiller(merged, "tiny", dtype="fp32")
    try:
        assert engine.engine.info().template == template
        cases = [("def add(a, b):\n    return ", "\n\nprint(add(1, 2))\n", ""), ("import os\n\ndef main():\n", "\n", "    pa")]
        for prefix, suffix, inc in cases:
            for fmt in ("fim", "efim"):
                a = ours.complete(prefix, suffix, inc, fmt, max_tokens=6, single_line=False)
                b = engine.complete(prefix, suffix, inc, fmt, max_tokens=6, single_line=False)
                assert a.prompt_tokens == b.prompt_tokens, (fmt, a, b)
                assert a.text == b.text, (fmt, a, b)
    finally:
        engine.close()
