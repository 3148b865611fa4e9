"""The tokenizer of the model a remote server serves, loaded without its weights.

The remote engine renders and tokenizes prompts itself (the local engine's code), so it
needs the served model's tokenizer: the `model` setting names it — "default" (the
embedded SmolLM2 GGUF, which llama.cpp can serve as is), a `.gguf` file (converted once
into the cache folder the local engine also uses) or a Hugging Face folder. Only
`tokenizer.json` and `config.json` are read here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

from engine.api import EngineError


class ServedVocabulary(NamedTuple):
    tokenizer: Any  # tokenizers.Tokenizer
    name: str
    architecture: str
    context_length: int
    eos_ids: tuple[int, ...]


def load_vocabulary(model: str | Path = "default") -> ServedVocabulary:
    """The tokenizer and context length of `model` (EngineError saying what is missing)."""
    from engine.model.config import ModelConfig  # noqa: PLC0415
    from engine.model.loader import cache_root, read_hf_config, read_tokenizer, resolve_spec  # noqa: PLC0415

    source = resolve_spec(model)
    if source.is_file():
        from engine.model.gguf import convert_gguf  # noqa: PLC0415

        folder = convert_gguf(source, cache_root())
    else:
        folder = source
    hf = read_hf_config(folder)
    try:
        config = ModelConfig.from_hf(hf)
        architecture, context, eos = config.architecture, int(config.max_position), tuple(config.eos_ids)
    except Exception:  # an architecture the local engine cannot run may still be served remotely
        architecture = str((hf.get("architectures") or ["unknown"])[0])
        context = int(hf.get("max_position_embeddings") or 4096)
        value = hf.get("eos_token_id")
        eos = tuple(value) if isinstance(value, list) else ((value,) if isinstance(value, int) else ())
    tokenizer = read_tokenizer(folder)
    if tokenizer.get_vocab_size(with_added_tokens=True) == 0:
        raise EngineError(f"the tokenizer of {folder} is empty")
    name = source.stem if source.is_file() else source.name
    return ServedVocabulary(tokenizer, name, architecture, context, eos)


__all__ = ["ServedVocabulary", "load_vocabulary"]
