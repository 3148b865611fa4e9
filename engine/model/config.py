"""The model's shape and numerics, read once from a Hugging Face `config.json`.

Only the fields the forward pass needs; everything architecture-specific (norm kind,
MLP kind, which projections carry a bias) is spelled out here so `transformer.py`
never branches on the architecture name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.api import EngineError

# HF `model_type` -> our architecture family.
_ARCHITECTURES = {
    "llama": "llama",  # Llama 2/3, CodeLlama, DeepSeek-Coder (1.x), SmolLM/SmolLM2
    "qwen2": "qwen2",  # Qwen2, Qwen2.5, Qwen2.5-Coder
    "starcoder2": "starcoder2",
}
SUPPORTED_ARCHITECTURES = tuple(_ARCHITECTURES)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # "llama" | "qwen2" | "starcoder2"
    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    norm: str  # "rms" | "layer"
    norm_eps: float
    mlp: str  # "gated_silu" | "gelu_tanh"
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    tie_embeddings: bool
    rope_theta: float
    rope_scaling: dict | None  # {"rope_type": "linear"|"llama3", "factor": ..., ...} or None
    rope_style: str  # "neox": rotate halves (all supported architectures)
    max_position: int
    bos_id: int | None
    eos_ids: tuple[int, ...]

    @property
    def q_size(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.n_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> "ModelConfig":
        """Read a Hugging Face `config.json` dict; EngineError for anything unsupported."""
        model_type = config.get("model_type")
        arch = _ARCHITECTURES.get(model_type or "")
        if arch is None:
            raise EngineError(
                f"unsupported model architecture {model_type!r} (config.json 'model_type'); "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        try:
            return _from_hf(arch, config)
        except KeyError as exc:
            raise EngineError(f"config.json of a {model_type!r} model lacks the field {exc.args[0]!r}") from None


def _rope(config: dict[str, Any]) -> tuple[float, dict | None]:
    """(theta, scaling) from either transformers 5's `rope_parameters` or the older
    `rope_theta` + `rope_scaling` pair."""
    params = dict(config.get("rope_parameters") or {})
    legacy = config.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    scaling = {**legacy, **{k: v for k, v in params.items() if k != "rope_theta"}}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type in (None, "default"):
        return theta, None
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise EngineError(f"unsupported RoPE scaling {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    scaling["rope_type"] = rope_type
    scaling.pop("type", None)
    return theta, scaling


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


def _from_hf(arch: str, c: dict[str, Any]) -> ModelConfig:
    hidden = int(c["hidden_size"])
    n_heads = int(c["num_attention_heads"])
    n_kv = int(c.get("num_key_value_heads") or n_heads)
    head_dim = int(c.get("head_dim") or hidden // n_heads)
    theta, scaling = _rope(c)
    common = dict(
        architecture=arch,
        vocab_size=int(c["vocab_size"]),
        hidden_size=hidden,
        n_layers=int(c["num_hidden_layers"]),
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        intermediate_size=int(c["intermediate_size"]),
        rope_theta=theta,
        rope_scaling=scaling,
        rope_style="neox",
        max_position=int(c.get("max_position_embeddings") or 4096),
        bos_id=None if c.get("bos_token_id") is None else int(c["bos_token_id"]),
        eos_ids=_eos_ids(c.get("eos_token_id")),
    )
    if arch == "starcoder2":
        bias = bool(c.get("use_bias", True))
        act = c.get("hidden_act", "gelu_pytorch_tanh")
        if act not in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast"):
            raise EngineError(f"unsupported StarCoder2 activation {act!r}; supported: gelu_pytorch_tanh")
        return ModelConfig(
            **common,
            norm="layer",
            norm_eps=float(c.get("norm_epsilon", 1e-5)),
            mlp="gelu_tanh",
            qkv_bias=bias,
            o_bias=bias,
            mlp_bias=bias,
            tie_embeddings=bool(c.get("tie_word_embeddings", True)),
        )
    act = c.get("hidden_act", "silu")
    if act != "silu":
        raise EngineError(f"unsupported {arch} activation {act!r}; supported: silu")
    attn_bias = bool(c.get("attention_bias", False))
    return ModelConfig(
        **common,
        norm="rms",
        norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        mlp="gated_silu",
        qkv_bias=True if arch == "qwen2" else attn_bias,
        o_bias=False if arch == "qwen2" else attn_bias,
        mlp_bias=bool(c.get("mlp_bias", False)),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
    )


__all__ = ["ModelConfig", "SUPPORTED_ARCHITECTURES", "SUPPORTED_ROPE_TYPES"]
