"""Bad model files and choices: each is one `EngineError` that names the file and what is
wrong, raised before any weight is read (docs/model.md "Formats", "Bad input")."""

from __future__ import annotations

import json

import numpy as np
import pytest

from engine.api import EngineError
from engine.model import load_model
from engine.model import loader, preflight
from tiny_models import write_tiny_gguf


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("EFIM_CACHE_DIR", str(d))
    return d


@pytest.fixture
def no_weight_reads(monkeypatch):
    """Fails the test if any weight is read (the checks must come first)."""
    reads = []

    def refuse(*args, **kwargs):
        reads.append(args)
        raise AssertionError("weights were read before the check")

    monkeypatch.setattr(loader, "read_safetensors", refuse)
    return reads


def test_a_gguf_tensor_type_without_a_reader(tiny_model_factory, tmp_path, cache_dir):
    """Q8_1 (llama.cpp's activation-only type) has no dequantiser in gguf: the error names
    the file, the tensor and the type, and leaves no half-converted folder behind."""
    import gguf

    def q8_1(w, qtype):  # blocks of the right size; their content does not matter
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        return np.zeros((w.shape[0], w.shape[1] // block * size), dtype=np.uint8)

    path = write_tiny_gguf(tiny_model_factory("llama"), tmp_path / "q8_1.gguf", q8_0=("mlp.up_proj",), qtype="Q8_1", quantize=q8_1)
    with pytest.raises(EngineError, match=r"q8_1\.gguf: tensor 'blk\.0\.ffn_up\.weight' has GGML type Q8_1"):
        load_model(path, quant="auto")
    converted = cache_dir / "gguf"
    assert not converted.exists() or not [p for p in converted.iterdir() if p.is_dir()]


@pytest.mark.parametrize("keep", [0.5, 0.98])
def test_a_truncated_gguf(keep, tiny_model_factory, tmp_path, cache_dir):
    """Cut in the tensor data (0.98: only the last tensor's end is missing)."""
    full = write_tiny_gguf(tiny_model_factory("llama"), tmp_path / "full.gguf", q8_0=("_proj",), qtype="Q4_1")
    cut = tmp_path / "cut.gguf"
    data = full.read_bytes()
    cut.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(EngineError, match=r"cut\.gguf"):
        load_model(cut, quant="int4")


@pytest.mark.parametrize("damage", ["truncated", "garbage header"])
def test_a_damaged_safetensors_file(damage, tiny_model_factory, tmp_path, no_weight_reads):
    import shutil

    folder = shutil.copytree(tiny_model_factory("llama"), tmp_path / "model")
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    if damage == "truncated":
        weights.write_bytes(data[: len(data) - 1000])
    else:
        weights.write_bytes(len(data).to_bytes(8, "little") + b"{not json" + data[17:])
    with pytest.raises(EngineError, match=r"cannot read .*model\.safetensors as safetensors"):
        load_model(folder, quant="int4")
    assert no_weight_reads == []


def test_a_tokenizer_larger_than_the_embedding(tiny_model_factory, tmp_path, no_weight_reads):
    import shutil

    folder = shutil.copytree(tiny_model_factory("llama"), tmp_path / "model")
    tok = json.loads((folder / "tokenizer.json").read_text())
    rows = json.loads((folder / "config.json").read_text())["vocab_size"]
    tok["model"]["vocab"].update({f"extra{i}": rows + i for i in range(8)})  # ids past the embedding
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(EngineError, match=rf"tokenizer of .*model has {rows + 8} tokens but .*only {rows} rows"):
        load_model(folder)
    assert no_weight_reads == []


def test_a_config_vocabulary_that_disagrees_with_the_embedding(tiny_model_factory, tmp_path, no_weight_reads):
    import shutil

    folder = shutil.copytree(tiny_model_factory("llama"), tmp_path / "model")
    config = json.loads((folder / "config.json").read_text())
    config["vocab_size"] += 64
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(EngineError, match=r"vocab_size .* but model\.embed_tokens\.weight has"):
        load_model(folder)


def test_a_model_that_does_not_fit_next_to_the_kv_budget(tiny_model_factory, monkeypatch, no_weight_reads):
    """The check counts the built weights (by format), the files read and the caller's reserve."""
    folder = tiny_model_factory("llama")
    size = (folder / "model.safetensors").stat().st_size
    monkeypatch.setattr(preflight, "available_memory_bytes", lambda: 3 * size)
    with pytest.raises(EngineError, match=r"does not fit in memory: .*KV budget 1\.00 GiB"):
        load_model(folder, dtype="fp32", reserve_bytes=1 << 30)
    assert no_weight_reads == []


def test_the_memory_check_counts_the_format(tiny_model_factory, monkeypatch):
    """fp32 weights (as large as the fp32 file) + the file do not fit in 1.9x the file;
    int4 (~1/5 of it) + the file do."""
    folder = tiny_model_factory("llama", hidden_size=256, intermediate_size=256)
    size = (folder / "model.safetensors").stat().st_size
    monkeypatch.setattr(preflight, "available_memory_bytes", lambda: int(1.9 * size))
    with pytest.raises(EngineError, match="does not fit"):
        load_model(folder, dtype="fp32")
    assert load_model(folder, dtype="fp32", quant="int4").model.weight_bytes() < size / 4
