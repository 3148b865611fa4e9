"""The tiny-model factory other tests rely on: loadable by transformers, deterministic, code-shaped tokenizer."""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer

from tiny_models import EOS_TOKEN, FIM_TOKENS, make_tiny_model


@pytest.mark.parametrize("tiny_model_dir", ["llama", "qwen2", "starcoder2"], indirect=True)
def test_tiny_model_loads_in_transformers(tiny_model_dir):
    import transformers

    config = json.loads((tiny_model_dir / "config.json").read_text())
    tok = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    assert tok.get_vocab_size() == config["vocab_size"]
    for name in (EOS_TOKEN, *FIM_TOKENS):
        assert tok.token_to_id(name) is not None, name
    assert config["num_key_value_heads"] < config["num_attention_heads"]  # GQA exercised
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ids = tok.encode("def add(a, b):\n    return a + b\n").ids
    # byte-level BPE trained on real Python merges whole keywords and indentation
    assert len(ids) < 20
    assert tok.decode(ids) == "def add(a, b):\n    return a + b\n"
    logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), config["vocab_size"])
    assert torch.isfinite(logits).all()


def test_tiny_model_is_deterministic_and_fim_optional(tmp_path):
    a = make_tiny_model(tmp_path / "a", "qwen2", seed=3, num_hidden_layers=2)
    b = make_tiny_model(tmp_path / "b", "qwen2", seed=3, num_hidden_layers=2)
    c = make_tiny_model(tmp_path / "c", "qwen2", seed=4, num_hidden_layers=2, fim_tokens=False)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert json.loads((a / "config.json").read_text())["num_hidden_layers"] == 2
    tok_c = Tokenizer.from_file(str(c / "tokenizer.json"))
    assert tok_c.token_to_id("<fim_prefix>") is None
    assert tok_c.token_to_id(EOS_TOKEN) is not None
