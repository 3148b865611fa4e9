"""`efim eval ... --backend engine --quant Q`: the engine loaded as `efim serve --quant` loads
it (the model file itself, the adapter merged or computed by the engine's loader) instead of
a merged float copy — so a GGUF's int4 groups stay the file's under "mixed" (tiny models)."""

from __future__ import annotations

import pytest
import torch

from efim_tools.cli import build_parser
from efim_tools.commands.eval import _infiller
from efim_tools.evaluation.infill import EngineInfiller, TransformersInfiller
from efim_tools.evaluation.model import export_merged, load_eval_model
from efim_tools.training.train import TrainConfig, train
from tiny_models import write_tiny_gguf

CASES = [("def add(a, b):\n    return ", "\n\nprint(add(1, 2))\n", ""), ("import os\n\ndef main():\n", "\n", "    pa")]
WIDE = {"hidden_size": 256, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2}  # whole Q4 blocks


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("EFIM_CACHE_DIR", str(d))
    return d


def eval_args(*argv: str):
    return build_parser().parse_args(["eval", "humaneval-infilling", *argv])


def adapter_for(model_dir, tmp_path):
    """A one-step adapter (it adds the spm sentinels: the template the engine detects)."""
    run = train(TrainConfig(model=str(model_dir), out=str(tmp_path / "run"), steps=1, accum=1, min_window=24, max_window=48, threads=1, layout="spm"))
    return run.adapter_dir


def test_quant_choices_are_the_engines():
    from engine.model.loader import QUANT_CHOICES

    assert eval_args().quant is None  # the merged copy, as before
    for quant in QUANT_CHOICES:
        assert eval_args("--backend", "engine", "--quant", quant).quant == quant
    with pytest.raises(SystemExit):
        eval_args("--quant", "q3")


def test_quant_needs_the_engine_backend():
    with pytest.raises(ValueError, match="--backend engine"):
        _infiller(eval_args("--quant", "mixed"))


def test_served_engine_infills_as_the_merged_copy_does(tiny_model_factory, tmp_path, cache_dir):
    """Dense ("none", fp32): the adapter merged by the engine's loader gives the prompts and
    greedy infills of the merged folder and of transformers."""
    model_dir = tiny_model_factory("llama", fim_tokens=False)
    adapter = adapter_for(model_dir, tmp_path)
    ours = TransformersInfiller(load_eval_model(str(model_dir), str(adapter)))
    merged = EngineInfiller(export_merged(str(model_dir), str(adapter), tmp_path / "merged"), "tiny", dtype="fp32")
    served = EngineInfiller.as_served(str(model_dir), str(adapter), "none", dtype="fp32")
    try:
        assert served.engine.info().template == merged.engine.info().template == "efim-spm"
        assert served.engine.info().quant == "none" and served.name.endswith("(engine, quant none)")
        for prefix, suffix, inc in CASES:
            for fmt in ("fim", "efim"):
                a = ours.complete(prefix, suffix, inc, fmt, max_tokens=6, single_line=False)
                b = merged.complete(prefix, suffix, inc, fmt, max_tokens=6, single_line=False)
                c = served.complete(prefix, suffix, inc, fmt, max_tokens=6, single_line=False)
                assert a.prompt_tokens == b.prompt_tokens == c.prompt_tokens, (fmt, a, b, c)
                assert a.text == b.text == c.text, (fmt, a, b, c)
    finally:
        merged.close()
        served.close()


def test_mixed_keeps_the_gguf_groups_with_the_adapter_beside_them(tiny_model_factory, tmp_path, cache_dir):
    """`--quant mixed` on a Q4_1 GGUF with an adapter, through the command's own path: the
    decode-step weights are the file's groups bit for bit (as under "int4"), the adapter's
    low-rank term runs beside them, prefill has a dense copy, and it infills."""
    from engine.model import load_model
    from engine.model.quant import MixedLinear

    model_dir = tiny_model_factory("llama", fim_tokens=False, **WIDE)
    adapter = adapter_for(model_dir, tmp_path)
    gguf = write_tiny_gguf(model_dir, tmp_path / "tiny-q4_1.gguf", q8_0=("_proj",), qtype="Q4_1")
    infiller = _infiller(eval_args("--backend", "engine", "--model", str(gguf), "--adapter", str(adapter), "--quant", "mixed", "--threads", "1"))
    try:
        assert infiller.engine.info().quant == "mixed" and "quant mixed" in infiller.name
        model = infiller.engine.model
        up = model.layers[0].up
        assert isinstance(up, MixedLinear)
        kept = load_model(gguf, dtype=infiller.engine.info().dtype, quant="int4").model.layers[0].up  # no adapter
        assert torch.equal(up.packed.packed, kept.packed) and torch.equal(up.packed.scales_zeros, kept.scales_zeros)  # the file's groups
        assert kept.lora_a is None and up.packed.lora_a is not None  # the adapter beside them
        for prefix, suffix, inc in CASES:
            got = infiller.complete(prefix, suffix, inc, "efim", max_tokens=6, single_line=False)
            assert got.prompt_tokens > 0 and got.generated_tokens >= 1
    finally:
        infiller.close()
