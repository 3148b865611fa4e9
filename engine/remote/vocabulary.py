"""The tokenizer of the model a remote server serves, loaded without its weights.

The remote engine renders and tokenizes prompts itself (the local engine's code), so it
needs the served model's tokenizer: the `model` setting names it — "default" (the
embedded SmolLM2 GGUF, which llama.cpp can serve as is), a `.gguf` file (the same file the
server loads, e.g. one written by `efim export gguf`) or a Hugging Face folder. From a GGUF
only the metadata is read (the tokenizer is built as `engine.model.gguf` builds it for the
local engine; no tensor is read or converted); from a folder `tokenizer.json` and
`config.json`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple


class ServedVocabulary(NamedTuple):
    tokenizer: Any  # tokenizers.Tokenizer
    name: str
    architecture: str
    context_length: int
    eos_ids: tuple[int, ...]


def load_vocabulary(model: str | Path = "default") -> ServedVocabulary:
    """The tokenizer and context length of `model` (EngineError saying what is missing)."""
    from engine.model.loader import read_hf_config, read_tokenizer, resolve_spec  # noqa: PLC0415

    source = resolve_spec(model)
    if source.is_file():
        return _from_gguf(source)
    hf = read_hf_config(source)
    value = hf.get("eos_token_id")
    eos = tuple(value) if isinstance(value, list) else ((value,) if isinstance(value, int) else ())
    architecture = str(hf.get("model_type") or (hf.get("architectures") or ["unknown"])[0])
    tokenizer = read_tokenizer(source)
    return ServedVocabulary(tokenizer, source.name, architecture, int(hf.get("max_position_embeddings") or 4096), eos)


def _from_gguf(path: Path) -> ServedVocabulary:
    from engine.model.gguf import build_tokenizer, open_gguf  # noqa: PLC0415
    from engine.model.gguf_metadata import GGUFMetadata  # noqa: PLC0415

    meta = GGUFMetadata(open_gguf(path))
    arch = str(meta.require("general.architecture"))
    tokenizer = build_tokenizer(meta)
    eos = tuple(dict.fromkeys(int(i) for i in (meta.get("tokenizer.ggml.eos_token_id"), meta.get("tokenizer.ggml.eot_token_id"))
                              if i is not None))
    context = int(meta.get(f"{arch}.context_length", 4096))
    return ServedVocabulary(tokenizer, path.stem, arch, context, eos)


__all__ = ["ServedVocabulary", "load_vocabulary"]
