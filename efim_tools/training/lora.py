"""LoRA adapters for the decoder's projections, plus new embedding rows for added tokens.

On-disk format "efim-lora/1" (a folder; what the model loader merges):

    adapter_model.safetensors
        {module}.lora_A.weight      [r, in]    module = HF name, e.g. model.layers.0.self_attn.q_proj
        {module}.lora_B.weight      [out, r]
        model.embed_tokens.extra    [k, hidden]   rows appended to the input embedding
        lm_head.extra               [k, hidden]   only for untied heads (tied heads reuse the rows above)
      metadata: format, rank, alpha (W += alpha / rank · B @ A), added_tokens (JSON [[id, content], ...])
    adapter_config.json   format, r, lora_alpha, scale, target_modules, base_vocab_size,
                          added_tokens [{id, content}], tie_word_embeddings, fragment_trained, training stats
    added_tokens.json     {content: id} (the Hugging Face file of the same name)

Merge (`merge_state_dict`): W ← W + scale · B @ A for every pair (in fp32), the
embedding (and untied head) get the added rows appended, vocab_size grows by k, and the
added tokens are appended to the tokenizer as special tokens with exactly those ids.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterable, NamedTuple

import torch
from torch import nn
from torch.nn import functional as F

ADAPTER_FORMAT = "efim-lora/1"
WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
ADDED_TOKENS_FILE = "added_tokens.json"
# Names shared with `engine.model.loader.merge_adapter` (same tensor names and metadata keys).
EMBED_ROWS_KEY = "model.embed_tokens.extra"
HEAD_ROWS_KEY = "lm_head.extra"
_LEGACY_ROW_SUFFIX = ".added_rows"  # checkpoints written before the names were agreed
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraConfig(NamedTuple):
    r: int = 16
    alpha: float = 32.0
    targets: tuple[str, ...] = DEFAULT_TARGETS

    @property
    def scale(self) -> float:
        return self.alpha / self.r


class LoRALinear(nn.Module):
    """`base(x) + scale · (x @ Aᵀ) @ Bᵀ`; the base stays frozen, B starts at zero so the
    wrapped model is initially unchanged."""

    def __init__(self, base: nn.Linear, r: int, scale: float):
        super().__init__()
        self.base = base
        self.scale = scale
        self.lora_A = nn.Parameter(torch.empty(r, base.in_features))  # [r, in]
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r))  # [out, r]
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        base.weight.requires_grad_(False)
        if base.bias is not None:
            base.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + F.linear(F.linear(x, self.lora_A), self.lora_B) * self.scale  # [..., out]


class ExtendedEmbedding(nn.Module):
    """A frozen embedding [V, D] plus trainable rows [k, D] for ids V..V+k-1."""

    def __init__(self, base: nn.Embedding, added: torch.Tensor):
        super().__init__()
        self.base = base
        self.base_vocab = base.num_embeddings
        self.added_rows = nn.Parameter(added)  # [k, D]
        base.weight.requires_grad_(False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        is_new = ids >= self.base_vocab  # [B, T]
        out = self.base(ids.clamp(max=self.base_vocab - 1))  # [B, T, D]
        if bool(is_new.any()):
            new = F.embedding((ids - self.base_vocab).clamp(min=0), self.added_rows)  # [B, T, D]
            out = torch.where(is_new.unsqueeze(-1), new.to(out.dtype), out)
        return out


class ExtendedHead(nn.Module):
    """Output projection over V + k tokens: the frozen head's logits, then the added rows'."""

    def __init__(self, weight: torch.Tensor, added_rows: nn.Parameter):
        super().__init__()
        self.weight = weight  # [V, D], frozen (possibly the tied embedding's tensor)
        self.added_rows = added_rows  # [k, D]

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.cat([F.linear(h, self.weight), F.linear(h, self.added_rows.to(h.dtype))], dim=-1)  # [..., V+k]


def attach_lora(model: nn.Module, config: LoraConfig, n_added_tokens: int, seed: int = 0) -> list[nn.Parameter]:
    """Freeze `model`, wrap every target projection in `LoRALinear` and give the embedding
    (and head) `n_added_tokens` trainable rows initialised at the mean embedding.
    Returns the trainable parameters."""
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        for p in model.parameters():
            p.requires_grad_(False)
        wrapped = 0
        for name, module in list(model.named_modules()):
            for child_name, child in list(module.named_children()):
                if child_name in config.targets and isinstance(child, nn.Linear):
                    setattr(module, child_name, LoRALinear(child, config.r, config.scale))
                    wrapped += 1
        if wrapped == 0:
            raise ValueError(f"no linear modules named {config.targets} in the model")
        if n_added_tokens:
            emb: nn.Embedding = model.get_input_embeddings()
            base_w = emb.weight.detach()
            rows = base_w.mean(0, keepdim=True).repeat(n_added_tokens, 1) + 0.01 * base_w.std() * torch.randn(n_added_tokens, base_w.shape[1])
            ext = ExtendedEmbedding(emb, rows.to(base_w.dtype))
            model.set_input_embeddings(ext)
            head = model.get_output_embeddings()
            tied = head.weight.data_ptr() == emb.weight.data_ptr()
            head.weight.requires_grad_(False)
            head_rows = ext.added_rows if tied else nn.Parameter(rows.clone())
            model.lm_head = ExtendedHead(head.weight, head_rows)
            model.config.vocab_size = emb.num_embeddings + n_added_tokens
    finally:
        torch.random.set_rng_state(gen_state)
    return trainable_parameters(model)


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    seen, params = set(), []
    for p in model.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            params.append(p)
    if isinstance(getattr(model, "lm_head", None), ExtendedHead) and id(model.lm_head.added_rows) not in seen:
        params.append(model.lm_head.added_rows)
    return params


def adapter_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's tensors under their on-disk names (fp32, detached copies)."""
    out: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            out[f"{name}.lora_A.weight"] = module.lora_A.detach().float().clone()
            out[f"{name}.lora_B.weight"] = module.lora_B.detach().float().clone()
    emb = model.get_input_embeddings()
    if isinstance(emb, ExtendedEmbedding):
        out[EMBED_ROWS_KEY] = emb.added_rows.detach().float().clone()
        head = model.lm_head
        if isinstance(head, ExtendedHead) and head.added_rows is not emb.added_rows:
            out[HEAD_ROWS_KEY] = head.added_rows.detach().float().clone()
    return out


def load_adapter_tensors(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy saved tensors back into an `attach_lora`-ed model (for resuming)."""
    current = dict(_adapter_parameters(model))
    tensors = {k.replace(_LEGACY_ROW_SUFFIX, ".extra") if k.endswith(_LEGACY_ROW_SUFFIX) else k: v for k, v in tensors.items()}
    missing = set(current) - set(tensors)
    if missing:
        raise ValueError(f"adapter lacks {sorted(missing)[:3]}... ({len(missing)} tensors)")
    with torch.no_grad():
        for name, param in current.items():
            if tuple(param.shape) != tuple(tensors[name].shape):
                raise ValueError(f"{name}: shape {tuple(tensors[name].shape)} != model's {tuple(param.shape)}")
            param.copy_(tensors[name])


def _adapter_parameters(model: nn.Module) -> Iterable[tuple[str, nn.Parameter]]:
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            yield f"{name}.lora_A.weight", module.lora_A
            yield f"{name}.lora_B.weight", module.lora_B
    emb = model.get_input_embeddings()
    if isinstance(emb, ExtendedEmbedding):
        yield EMBED_ROWS_KEY, emb.added_rows
        if isinstance(model.lm_head, ExtendedHead) and model.lm_head.added_rows is not emb.added_rows:
            yield HEAD_ROWS_KEY, model.lm_head.added_rows


def save_adapter(model: nn.Module, dest: Path, config: LoraConfig, added_tokens: dict[str, int], base_vocab_size: int, *, dtype: torch.dtype = torch.bfloat16, extra: dict[str, Any] | None = None) -> Path:
    """Write the adapter folder (format in the module docstring). bf16 keeps a rank-16
    adapter of SmolLM2-135M near 10 MB."""
    from safetensors.torch import save_file  # noqa: PLC0415

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.to(dtype).contiguous() for k, v in adapter_tensors(model).items()}
    metadata = {
        "format": ADAPTER_FORMAT,
        "rank": str(config.r),
        "alpha": str(config.alpha),
        "added_tokens": json.dumps(sorted((i, t) for t, i in added_tokens.items())),
    }
    save_file(tensors, str(dest / WEIGHTS_FILE), metadata=metadata)
    cfg = {
        "format": ADAPTER_FORMAT,
        "r": config.r,
        "lora_alpha": config.alpha,
        "scale": config.scale,
        "target_modules": list(config.targets),
        "base_vocab_size": base_vocab_size,
        "added_tokens": [{"id": i, "content": t} for t, i in sorted(added_tokens.items(), key=lambda kv: kv[1])],
        "tie_word_embeddings": HEAD_ROWS_KEY not in tensors,
        **(extra or {}),
    }
    (dest / CONFIG_FILE).write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
    (dest / ADDED_TOKENS_FILE).write_text(json.dumps(added_tokens, indent=2) + "\n", encoding="utf-8")
    return dest


class Adapter(NamedTuple):
    tensors: dict[str, torch.Tensor]
    config: dict[str, Any]

    @property
    def added_tokens(self) -> list[tuple[int, str]]:
        return [(t["id"], t["content"]) for t in self.config.get("added_tokens", [])]


def read_adapter(path: Path) -> Adapter:
    from safetensors.torch import load_file  # noqa: PLC0415

    path = Path(path)
    if not (path / WEIGHTS_FILE).is_file() or not (path / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"{path} is not an adapter folder (needs {WEIGHTS_FILE} and {CONFIG_FILE})")
    config = json.loads((path / CONFIG_FILE).read_text(encoding="utf-8"))
    if config.get("format") != ADAPTER_FORMAT:
        raise ValueError(f"{path}: adapter format {config.get('format')!r}, expected {ADAPTER_FORMAT!r}")
    return Adapter(load_file(str(path / WEIGHTS_FILE)), config)


def merge_state_dict(state: dict[str, torch.Tensor], adapter: Adapter, *, tied: bool) -> dict[str, torch.Tensor]:
    """A new state dict of the base weights with the adapter merged in (see module docstring).
    `state` uses Hugging Face names (`model.layers.0.self_attn.q_proj.weight`, ...)."""
    out = dict(state)
    scale = float(adapter.config["scale"])
    base_vocab = int(adapter.config["base_vocab_size"])
    for key, a in adapter.tensors.items():
        if not key.endswith(".lora_A.weight"):
            continue
        module = key[: -len(".lora_A.weight")]
        b = adapter.tensors[f"{module}.lora_B.weight"]
        wkey = f"{module}.weight"
        if wkey not in out:
            raise ValueError(f"adapter targets {module}, which the base model does not have")
        w = out[wkey]
        delta = b.float() @ a.float()  # [out, in]
        if delta.shape != w.shape:
            raise ValueError(f"{module}: adapter delta {tuple(delta.shape)} != weight {tuple(w.shape)}")
        out[wkey] = (w.float() + scale * delta).to(w.dtype)
    if EMBED_ROWS_KEY in adapter.tensors:
        emb_key = "model.embed_tokens.weight"
        emb = out[emb_key]
        if emb.shape[0] != base_vocab:
            raise ValueError(f"base embedding has {emb.shape[0]} rows, adapter expects {base_vocab}")
        out[emb_key] = torch.cat([emb, adapter.tensors[EMBED_ROWS_KEY].to(emb.dtype)], 0)  # [V+k, D]
        if not tied:
            head = out["lm_head.weight"]
            rows = adapter.tensors.get(HEAD_ROWS_KEY, adapter.tensors[EMBED_ROWS_KEY])
            out["lm_head.weight"] = torch.cat([head, rows.to(head.dtype)], 0)  # [V+k, D]
        elif "lm_head.weight" in out:
            out["lm_head.weight"] = out[emb_key]
    return out


def add_tokens_to_tokenizer_json(tokenizer_json: dict[str, Any], added: list[tuple[int, str]]) -> dict[str, Any]:
    """`tokenizer.json` (parsed) with `added` special tokens at exactly their ids."""
    tj = json.loads(json.dumps(tokenizer_json))
    present = {t["content"]: t["id"] for t in tj.get("added_tokens", [])}
    vocab = tj["model"]["vocab"]
    for token_id, content in added:
        if content in present or content in vocab:
            have = present.get(content, vocab.get(content))
            if have != token_id:
                raise ValueError(f"tokenizer already has {content!r} as id {have}, adapter needs {token_id}")
            continue
        tj.setdefault("added_tokens", []).append(
            {"id": token_id, "content": content, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True}
        )
    return tj


__all__ = [
    "ADAPTER_FORMAT",
    "LoraConfig",
    "LoRALinear",
    "ExtendedEmbedding",
    "ExtendedHead",
    "attach_lora",
    "trainable_parameters",
    "adapter_tensors",
    "load_adapter_tensors",
    "save_adapter",
    "Adapter",
    "read_adapter",
    "merge_state_dict",
    "add_tokens_to_tokenizer_json",
]
