"""The LoRA adapter: starts as a no-op, trains, saves in efim-lora/1, merges exactly,
loads for evaluation and changes the model's output."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from tokenizers import AddedToken, Tokenizer

from efim_tools.training import lora
from efim_tools.training.samples import FIM_SENTINELS


@pytest.fixture(scope="module")
def plain_tiny(tiny_model_factory):
    """A tiny llama without FIM tokens, like the default model."""
    return tiny_model_factory("llama", fim_tokens=False)


def _load(path):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    return model


def _train_a_little(model, vocab: int, steps: int = 3) -> None:
    params = lora.trainable_parameters(model)
    opt = torch.optim.AdamW(params, lr=5e-2)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab + 4, (1, 24), generator=gen)  # [1, T] including new token ids
    for _ in range(steps):
        logits = model(input_ids=ids).logits  # [1, T, V+4]
        loss = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()


def test_attach_is_a_noop_until_trained(plain_tiny):
    model = _load(plain_tiny)
    ids = torch.tensor([[5, 17, 99, 300]])
    before = model(input_ids=ids).logits
    vocab = model.config.vocab_size
    params = lora.attach_lora(model, lora.LoraConfig(r=4, alpha=8), n_added_tokens=4)
    after = model(input_ids=ids).logits  # [1, 4, V+4]
    assert after.shape[-1] == vocab + 4
    torch.testing.assert_close(after[..., :vocab], before)
    n_lora = sum(isinstance(m, lora.LoRALinear) for m in model.modules())
    assert n_lora == 7 * model.config.num_hidden_layers
    assert all(p.requires_grad for p in params)
    assert not any(p.requires_grad for n, p in model.named_parameters() if "lora_" not in n and "added_rows" not in n)


def test_saved_adapter_merges_to_the_same_logits_and_loads_for_eval(plain_tiny, tmp_path):
    from efim_tools.evaluation.infill import TransformersInfiller
    from efim_tools.evaluation.model import load_eval_model

    model = _load(plain_tiny)
    vocab = model.config.vocab_size
    lora.attach_lora(model, lora.LoraConfig(r=4, alpha=8), n_added_tokens=4)
    _train_a_little(model, vocab)
    tok = Tokenizer.from_file(str(plain_tiny / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in FIM_SENTINELS])
    added = {t: tok.token_to_id(t) for t in FIM_SENTINELS}
    assert sorted(added.values()) == list(range(vocab, vocab + 4))
    dest = lora.save_adapter(model, tmp_path / "adapter", lora.LoraConfig(r=4, alpha=8), added, vocab, dtype=torch.float32)
    cfg = json.loads((dest / "adapter_config.json").read_text())
    assert cfg["format"] == lora.ADAPTER_FORMAT and cfg["base_vocab_size"] == vocab and cfg["tie_word_embeddings"]

    ids = torch.tensor([[vocab, 5, 17, vocab + 2, 99, vocab + 1, 300]])  # sentinels mixed with text
    with torch.no_grad():
        want = model(input_ids=ids).logits
    em = load_eval_model(str(plain_tiny), str(dest))
    with torch.no_grad():
        got = em.model(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
    assert em.fim is not None and em.fim.prefix == added["<fim_prefix>"]

    # the adapter changes the model's greedy output on a FIM prompt vs the base
    base = load_eval_model(str(plain_tiny), "none")
    assert base.fim is None
    text = "def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x, y):\n        self.x"
    with torch.no_grad():
        base_ids = torch.tensor([tok.encode(text).ids])
        a = base.model(input_ids=base_ids).logits[0, -1]
        b = em.model(input_ids=base_ids).logits[0, -1, :vocab]
    assert not torch.allclose(a, b, atol=1e-3)
    out = TransformersInfiller(em).complete("def add(a, b):\n", "\n", "", "fim", max_tokens=8, single_line=False)
    assert out.prompt_tokens > 3  # runs end to end on the merged model


def test_reading_a_foreign_folder_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        lora.read_adapter(tmp_path)
    (tmp_path / lora.WEIGHTS_FILE).write_bytes(b"")
    (tmp_path / lora.CONFIG_FILE).write_text(json.dumps({"format": "peft"}))
    with pytest.raises(ValueError, match="format"):
        lora.read_adapter(tmp_path)


def test_tokenizer_json_additions_keep_ids(plain_tiny):
    tj = json.loads((plain_tiny / "tokenizer.json").read_text())
    vocab = Tokenizer.from_str(json.dumps(tj)).get_vocab_size()
    added = [(vocab + i, t) for i, t in enumerate(FIM_SENTINELS)]
    tok = Tokenizer.from_str(json.dumps(lora.add_tokens_to_tokenizer_json(tj, added)))
    assert [tok.token_to_id(t) for _, t in added] == [i for i, _ in added]
    with pytest.raises(ValueError):
        lora.add_tokens_to_tokenizer_json(tj, [(vocab + 7, "<|endoftext|>")])


def test_engine_loader_merges_the_adapter_like_ours(plain_tiny, tmp_path):
    """The engine's loader (`engine.model.loader.merge_adapter`) and our merge agree on the
    shared format: same LoRA deltas (alpha from metadata), same appended rows."""
    from safetensors.torch import load_file

    loader = pytest.importorskip("engine.model.loader")
    model = _load(plain_tiny)
    vocab = model.config.vocab_size
    cfg = lora.LoraConfig(r=4, alpha=12)
    lora.attach_lora(model, cfg, n_added_tokens=4)
    _train_a_little(model, vocab, steps=2)
    added = {t: vocab + i for i, t in enumerate(FIM_SENTINELS)}
    dest = lora.save_adapter(model, tmp_path / "adapter", cfg, added, vocab)
    base = load_file(str(plain_tiny / "model.safetensors"))
    ours = lora.merge_state_dict(base, lora.read_adapter(dest), tied=True)
    theirs = dict(base)
    config = loader.merge_adapter(dest / lora.WEIGHTS_FILE, json.loads((plain_tiny / "config.json").read_text()), theirs)
    assert config["vocab_size"] == vocab + 4
    for key in ("model.layers.0.self_attn.q_proj.weight", "model.layers.2.mlp.down_proj.weight", "model.embed_tokens.weight"):
        torch.testing.assert_close(theirs[key], ours[key])
    assert not torch.equal(ours["model.layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.weight"])
