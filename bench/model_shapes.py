"""Models in the real shapes of the code models people load, with random weights, for
speed measurements: decode and prefill speed depend on the shapes and the weight format,
not on what the weights learned.

- "135m": the embedded default model itself (SmolLM2-135M, real weights; `load_model`).
- "0.5b" / "1.5b": Qwen2.5-Coder-0.5B / -1.5B shapes, from `transformers.Qwen2Config`
  (the same config fields a downloaded `config.json` holds), with random bf16 weights
  built in memory under a fixed seed and handed to `Transformer` directly — no folder is
  written (1.5B parameters written and read back would cost more than the measurement).

Benchmark code, outside the serving path.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

# Qwen2.5-Coder's published config.json values (the fields that set the shapes).
_QWEN25_CODER = {
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, tie_word_embeddings=True),
}
_QWEN_COMMON = dict(vocab_size=151936, max_position_embeddings=32768, rms_norm_eps=1e-6,
                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})

SHAPES = ("135m", "0.5b", "1.5b")
SHAPE_LABELS = {"135m": "SmolLM2-135M (embedded)", "0.5b": "Qwen2.5-Coder-0.5B shape", "1.5b": "Qwen2.5-Coder-1.5B shape"}


class BenchModel(NamedTuple):
    shape: str
    quant: str | None
    model: Any  # engine.model.Transformer
    path: Any  # the Hugging Face folder (135m) or None (random, in memory)


class FormatUnavailable(Exception):
    """The engine does not offer this weight format (e.g. int4 before it lands)."""


def qwen2_config(shape: str) -> dict[str, Any]:
    """The `config.json` dict of a Qwen2.5-Coder model of `shape` ("0.5b" | "1.5b")."""
    import transformers  # noqa: PLC0415

    if shape not in _QWEN25_CODER:
        raise ValueError(f"no Qwen2.5-Coder shape {shape!r}; expected one of {tuple(_QWEN25_CODER)}")
    return transformers.Qwen2Config(**_QWEN_COMMON, **_QWEN25_CODER[shape]).to_dict()


def random_weights(config: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    """Hugging Face parameter names -> random bf16 tensors of a Qwen2 model's shapes (std
    0.02, norms 1): enough for speed, meaningless as a model."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    d = hidden // heads
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, dtype=torch.float32) * 0.02).to(torch.bfloat16)

    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": rand(config["vocab_size"], hidden),
                                  "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        w[p + "post_attention_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        for name, rows in (("q", heads * d), ("k", kv_heads * d), ("v", kv_heads * d)):
            w[p + f"self_attn.{name}_proj.weight"] = rand(rows, hidden)
            w[p + f"self_attn.{name}_proj.bias"] = rand(rows)
        w[p + "self_attn.o_proj.weight"] = rand(hidden, heads * d)
        w[p + "mlp.gate_proj.weight"] = rand(inter, hidden)
        w[p + "mlp.up_proj.weight"] = rand(inter, hidden)
        w[p + "mlp.down_proj.weight"] = rand(hidden, inter)
    return w


def build(
    shape: str, quant: str | None, dtype: str = "bf16", weights: dict[str, torch.Tensor] | None = None, adapter: bool = False
) -> BenchModel:
    """The model of `shape` in weight format `quant` (None = dense `dtype`). Raises
    `FormatUnavailable` when the engine does not know `quant`. `weights`: the random
    weights of a Qwen2 shape made once by `random_weights` and shared by its formats
    (the model reads them and never writes them; generating 1.5B values takes longer
    than timing them). `adapter`: the embedded model with its shipped FIM adapter, loaded as
    `efim serve` loads it (`mixed` then prefills on int8 GEMMs; without `adapter` the mixed
    form keeps its bf16 copies)."""
    from engine.api import EngineError  # noqa: PLC0415
    from engine.model import load_model  # noqa: PLC0415

    try:
        if shape == "135m" and adapter:  # exactly as `efim serve` loads it (a mixed model: int8 prefill)
            from engine.runtime.loading import load_model_for_engine  # noqa: PLC0415

            loaded = load_model_for_engine("default", dtype=dtype, quant=quant).loaded
            return BenchModel(shape, quant, loaded.model, loaded.path)
        if shape == "135m":
            loaded = load_model("default", dtype=dtype, quant=quant)
            return BenchModel(shape, quant, loaded.model, loaded.path)
        return BenchModel(shape, quant, random_model(qwen2_config(shape), quant, dtype, weights=weights), None)
    except (ValueError, EngineError) as exc:
        if quant is not None and str(quant) in str(exc):
            raise FormatUnavailable(str(exc)) from exc
        raise


def random_model(config: dict[str, Any], quant: str | None, dtype: str = "bf16", seed: int = 0,
                 weights: dict[str, torch.Tensor] | None = None):
    """A `Transformer` of a Qwen2 `config.json` dict with `random_weights` (or `weights`,
    which stays intact: the model takes entries from a copy of the dict)."""
    from engine.model import ModelConfig, Transformer  # noqa: PLC0415

    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    w = dict(weights) if weights is not None else random_weights(config, seed)
    if quant == "mixed":  # int4 for decode steps, a bf16 copy of each layer weight for prefill
        return Transformer(ModelConfig.from_hf(config), w, dtype=torch_dtype, quant="int4", dense_prefill=True)
    return Transformer(ModelConfig.from_hf(config), w, dtype=torch_dtype, quant=quant)


def kv_bytes_per_token(model: Any, context: int) -> int:
    """KV bytes a decode step reads at `context` tokens: K and V of every layer."""
    c = model.config
    probe = model.new_kv(1)
    elem = probe.k.element_size()
    return 2 * c.n_layers * c.n_kv_heads * c.head_dim * context * elem


__all__ = ["SHAPES", "SHAPE_LABELS", "BenchModel", "FormatUnavailable", "qwen2_config", "random_weights", "random_model", "build",
           "kv_bytes_per_token"]
