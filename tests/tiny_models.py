"""Tiny randomly initialised models for tests and benchmarks (no network, no hub).

`make_tiny_model(dest, arch)` writes a Hugging Face folder — `config.json`,
`model.safetensors`, `tokenizer.json`, `tokenizer_config.json` — whose weights come
from `transformers`' own initialisation under a fixed seed, and whose tokenizer is a
small byte-level BPE trained at run time on CPython stdlib sources (so code tokenizes
the way it does with a real code model: identifiers merged, indentation runs merged).

The same (arch, fim_tokens, seed, overrides) always gives the same files.
"""

from __future__ import annotations

import functools
import json
import sysconfig
import time
from pathlib import Path
from typing import Any

EOS_TOKEN = "<|endoftext|>"
FIM_TOKENS = ("<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>", "<file_sep>", "<repo_name>")
ARCHITECTURES = ("llama", "qwen2", "starcoder2")

# Small but code-shaped: a few thousand lines of real Python are enough for ~1.5k merges.
_TRAINING_FILES = ("textwrap.py", "shlex.py", "bisect.py", "heapq.py", "fnmatch.py", "string.py", "copy.py")
_VOCAB_SIZE = 1536

_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2)


def stdlib_sources(names: tuple[str, ...] = _TRAINING_FILES) -> list[str]:
    """Text of a few CPython stdlib modules (read at run time; never committed)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return [(root / name).read_text(encoding="utf-8") for name in names if (root / name).is_file()]


def settle(eng, timeout: float = 120.0) -> None:
    """Wait until a local engine has no foreground or background work left, then check the
    pool's and the blend store's integrity (engine tests, between steps)."""
    end = time.monotonic() + timeout
    while eng.scheduler.background_pending() or not eng.scheduler.idle():
        assert time.monotonic() < end, "background work did not finish"
        time.sleep(0.01)
    eng.cache.check_integrity()
    eng.scheduler.blend_store.check_integrity()


@functools.lru_cache(maxsize=4)
def tiny_tokenizer_json(fim_tokens: bool = True) -> str:
    """Serialized byte-level BPE tokenizer (cached per process: training takes ~0.5 s)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: PLC0415

    specials = [EOS_TOKEN, *(FIM_TOKENS if fim_tokens else ())]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB_SIZE,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(stdlib_sources(), trainer=trainer)
    return tok.to_str()


def _hf_config(arch: str, vocab_size: int, eos_id: int, overrides: dict[str, Any]):
    import transformers  # noqa: PLC0415

    common: dict[str, Any] = dict(
        _SHAPE,
        vocab_size=vocab_size,
        max_position_embeddings=1024,
        # Larger than the usual 0.02 so that random logits are not all near-ties
        # (greedy-token comparisons in tests would otherwise be coin flips).
        initializer_range=0.1,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
    )
    if arch == "llama":
        cls = transformers.LlamaConfig
        common.update(tie_word_embeddings=True, rms_norm_eps=1e-5)  # SmolLM2-like
    elif arch == "qwen2":
        cls = transformers.Qwen2Config  # QKV bias is built into the architecture
        common.update(tie_word_embeddings=False, rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    elif arch == "starcoder2":
        cls = transformers.Starcoder2Config
        common.update(use_bias=True, hidden_act="gelu_pytorch_tanh", norm_epsilon=1e-5, tie_word_embeddings=True)
    else:
        raise ValueError(f"unknown tiny architecture {arch!r}; expected one of {ARCHITECTURES}")
    common.update(overrides)
    return cls(**common)


def make_tiny_model(
    dest: Path,
    arch: str = "llama",
    *,
    fim_tokens: bool = True,
    seed: int = 0,
    **overrides: Any,
) -> Path:
    """Write a tiny random `arch` model ("llama", "qwen2", "starcoder2") into `dest`.

    `overrides` go to the transformers config (e.g. `num_hidden_layers=2`,
    `rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}`,
    `tie_word_embeddings=False`). Returns `dest`.
    """
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415
    from tokenizers import Tokenizer  # noqa: PLC0415

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    tok_json = tiny_tokenizer_json(fim_tokens)
    tokenizer = Tokenizer.from_str(tok_json)
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    config = _hf_config(arch, tokenizer.get_vocab_size(), eos_id, overrides)

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    model.save_pretrained(dest, safe_serialization=True)

    (dest / "tokenizer.json").write_text(tok_json, encoding="utf-8")
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "model_max_length": config.max_position_embeddings,
        "additional_special_tokens": list(FIM_TOKENS) if fim_tokens else [],
    }
    (dest / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2), encoding="utf-8")
    return dest


# HF parameter name (after "model.layers.N.") -> GGUF tensor name (after "blk.N."): the loader's table.
from engine.model.gguf import HF_TO_GGUF_LAYER as _GGUF_LAYER  # noqa: E402
_GGUF_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def _permute_qk(w, n_head: int):
    """llama.cpp's converter permutation for Llama Q/K rows (halves -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(hf_folder: Path, dest: Path, *, q8_0: tuple[str, ...] = (), qtype: str = "Q8_0", quantize=None) -> Path:
    """Write the HF folder of a tiny model as a GGUF file the way llama.cpp's converter
    does (its tensor names, Q/K rows permuted for "llama", vocabulary and merges as
    metadata). Tensors whose HF name contains one of `q8_0` are stored quantised as
    `qtype` (GGML type name; default Q8_0) by `quantize(w, type)` (default gguf's own),
    all others as F32. Returns `dest`."""
    import gguf  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    from safetensors.numpy import load_file  # noqa: PLC0415

    hf_folder, dest = Path(hf_folder), Path(dest)
    config = json.loads((hf_folder / "config.json").read_text())
    arch = config["model_type"]
    tok = json.loads((hf_folder / "tokenizer.json").read_text())
    weights = load_file(str(hf_folder / "model.safetensors"))

    writer = gguf.GGUFWriter(str(dest), arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    rope = config.get("rope_parameters") or {}
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    if arch == "starcoder2":
        writer.add_layer_norm_eps(config["norm_epsilon"])
    else:
        writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])

    vocab = tok["model"]["vocab"]
    specials = {t["content"] for t in tok["added_tokens"] if t["special"]}
    tokens = sorted(vocab, key=vocab.get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in specials else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])

    for name, w in weights.items():
        stem, _, suffix = name.rpartition(".")
        if stem.startswith("model.layers."):
            _, _, idx, rest = stem.split(".", 3)
            gguf_name = f"blk.{idx}.{_GGUF_LAYER[rest]}.{suffix}"
        else:
            gguf_name = f"{_GGUF_GLOBAL[stem]}.{suffix}"
        w = w.astype(np.float32)
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            heads = config["num_attention_heads"] if ".q_proj." in name else config["num_key_value_heads"]
            w = _permute_qk(w, heads)
        if any(k in name for k in q8_0) and w.ndim == 2:
            qt = gguf.GGMLQuantizationType[qtype]
            q = (quantize or gguf.quants.quantize)(w, qt)
            writer.add_tensor(gguf_name, q, raw_shape=q.shape, raw_dtype=qt)
        else:
            writer.add_tensor(gguf_name, np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dest


__all__ = ["make_tiny_model", "write_tiny_gguf", "tiny_tokenizer_json", "stdlib_sources", "EOS_TOKEN", "FIM_TOKENS", "ARCHITECTURES"]
