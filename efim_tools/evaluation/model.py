"""The model under evaluation: a base Hugging Face model, optionally with an efim-lora
adapter merged in (`efim_tools.training.lora.merge_state_dict`), and its tokenizer with the
adapter's added tokens at the adapter's ids."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, NamedTuple

from engine.adapters import SHIPPED_ADAPTER
from efim_tools.training.samples import FimIds

log = logging.getLogger(__name__)


class EvalModel(NamedTuple):
    model: Any  # a transformers causal LM in eval mode
    tokenizer: Any  # tokenizers.Tokenizer
    fim: FimIds | None  # None: the model has no FIM sentinels (prefix-only)
    name: str


def resolve_adapter(model_spec: str, adapter: str | None) -> Path | None:
    """`adapter`: "auto" (the shipped adapter for the default model, ready or not: this
    is what evaluates it), "none", or a folder."""
    if adapter in (None, "none", ""):
        return None
    if adapter == "auto":
        return SHIPPED_ADAPTER if model_spec == "default" and (SHIPPED_ADAPTER / "adapter_config.json").is_file() else None
    path = Path(adapter)
    if not path.is_dir():
        raise FileNotFoundError(f"adapter folder {path} does not exist")
    return path


def load_eval_model(model_spec: str = "default", adapter: str | None = "auto") -> EvalModel:
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415
    from tokenizers import AddedToken  # noqa: PLC0415

    from efim_tools.training import lora  # noqa: PLC0415
    from efim_tools.training.base import base_model_dir, load_causal_lm, load_tokenizer  # noqa: PLC0415

    model_dir = base_model_dir(model_spec)
    tokenizer = load_tokenizer(model_dir)
    model = load_causal_lm(model_dir)
    adapter_dir = resolve_adapter(model_spec, adapter)
    name = str(model_spec)
    if adapter_dir is not None:
        ad = lora.read_adapter(adapter_dir)
        if tokenizer.get_vocab_size() != int(ad.config["base_vocab_size"]):
            raise ValueError(f"adapter {adapter_dir} was trained on a {ad.config['base_vocab_size']}-token vocabulary, the model has {tokenizer.get_vocab_size()}")
        tied = bool(model.config.tie_word_embeddings)
        merged = lora.merge_state_dict(model.state_dict(), ad, tied=tied)
        config = model.config
        config.vocab_size = merged["model.embed_tokens.weight"].shape[0]
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        if tied:
            merged.pop("lm_head.weight", None)
        result = model.load_state_dict(merged, strict=False)
        missing = [k for k in result.missing_keys if not (tied and k == "lm_head.weight")]
        if missing or result.unexpected_keys:
            raise ValueError(f"merging {adapter_dir}: missing {missing[:3]}, unexpected {result.unexpected_keys[:3]}")
        if tied:
            model.tie_weights()
        model.eval()
        for token_id, content in ad.added_tokens:
            tokenizer.add_special_tokens([AddedToken(content, special=True, normalized=False)])
            if tokenizer.token_to_id(content) != token_id:
                raise ValueError(f"added token {content!r} got id {tokenizer.token_to_id(content)}, adapter expects {token_id}")
        name = f"{model_spec}+{adapter_dir.name}"
        log.info("merged adapter %s into %s", adapter_dir, model_dir)
    return EvalModel(model, tokenizer, FimIds.detect(tokenizer), name)


def export_merged(model_spec: str, adapter: str | None, dest: Path) -> Path:
    """Write a Hugging Face folder with the adapter merged in and its tokens added to
    `tokenizer.json`, so any HF-folder consumer (the product engine's loader included)
    detects the FIM template from the tokenizer like for any other model."""
    import json  # noqa: PLC0415
    import shutil  # noqa: PLC0415

    from safetensors.torch import load_file, save_file  # noqa: PLC0415

    from efim_tools.training import lora  # noqa: PLC0415
    from efim_tools.training.base import base_model_dir  # noqa: PLC0415

    src = base_model_dir(model_spec)
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    adapter_dir = resolve_adapter(model_spec, adapter)
    config = json.loads((src / "config.json").read_text())
    state = load_file(str(src / "model.safetensors"))
    tokenizer_json = json.loads((src / "tokenizer.json").read_text(encoding="utf-8"))
    if adapter_dir is not None:
        ad = lora.read_adapter(adapter_dir)
        tied = bool(config.get("tie_word_embeddings", False))
        state = lora.merge_state_dict(state, ad, tied=tied)
        if tied:
            state.pop("lm_head.weight", None)
        config["vocab_size"] = int(state["model.embed_tokens.weight"].shape[0])
        tokenizer_json = lora.add_tokens_to_tokenizer_json(tokenizer_json, ad.added_tokens)
    save_file({k: v.contiguous() for k, v in state.items()}, str(dest / "model.safetensors"), metadata={"format": "pt"})
    (dest / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (dest / "tokenizer.json").write_text(json.dumps(tokenizer_json, ensure_ascii=False), encoding="utf-8")
    for name in ("tokenizer_config.json", "generation_config.json"):
        if (src / name).is_file():
            shutil.copy(src / name, dest / name)
    return dest


__all__ = ["EvalModel", "load_eval_model", "resolve_adapter", "export_merged", "SHIPPED_ADAPTER"]
