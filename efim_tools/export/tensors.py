"""The weights of a GGUF export: llama.cpp's tensor names, its Q/K row order, and the
storage type of each tensor for an export type (`--type`).

Storage rules (llama.cpp's converter and `llama-quantize` do the same):
- 1-D tensors (norms, biases) stay F32: tiny, and llama.cpp computes norms in F32.
- 2-D weights take the export type. For the 4/5-bit types the token embedding (and the
  output head) stay Q8_0: with tied embeddings that matrix is the output head, where 4-bit
  error moves the argmax most; the source GGUF of the default model makes the same choice.
- A row length that is not a multiple of the type's block (32) falls back to F16.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from engine.model.gguf import HF_TO_GGUF_GLOBAL, HF_TO_GGUF_LAYER

# `--type` -> (GGML type name of 2-D weights, llama.cpp file type name)
EXPORT_TYPES: dict[str, tuple[str, str]] = {
    "f32": ("F32", "ALL_F32"),
    "f16": ("F16", "MOSTLY_F16"),
    "bf16": ("BF16", "MOSTLY_BF16"),
    "q8_0": ("Q8_0", "MOSTLY_Q8_0"),
    "q5_1": ("Q5_1", "MOSTLY_Q5_1"),
    "q5_0": ("Q5_0", "MOSTLY_Q5_0"),
    "q4_1": ("Q4_1", "MOSTLY_Q4_1"),
    "q4_0": ("Q4_0", "MOSTLY_Q4_0"),
}
DEFAULT_TYPE = "q8_0"
_SUB_8_BIT = ("q5_1", "q5_0", "q4_1", "q4_0")

# HF parameter name -> llama.cpp tensor name: the loader's table read backwards (one table).
_LAYER = HF_TO_GGUF_LAYER
_GLOBAL = HF_TO_GGUF_GLOBAL
# Tensors that stay Q8_0 under the 4/5-bit types (see the module docstring).
_HEAD_TENSORS = ("token_embd.weight", "output.weight")


class GgufTensor(NamedTuple):
    """One tensor as the GGUF writer takes it: `data` already in the storage type
    (uint8 blocks for quantised types, uint16 for BF16), `ggml_type` its GGML type name."""

    name: str
    data: np.ndarray
    ggml_type: str


def check_type(export_type: str) -> str:
    """`export_type` normalised; ValueError naming the choices for an unknown one."""
    t = str(export_type).lower()
    if t not in EXPORT_TYPES:
        raise ValueError(f"unknown export type {export_type!r}; expected one of: {', '.join(EXPORT_TYPES)}")
    return t


def gguf_name(hf_name: str) -> str:
    """llama.cpp's name of an HF parameter (`model.layers.3.self_attn.q_proj.weight` ->
    `blk.3.attn_q.weight`); ValueError for a parameter llama.cpp has no slot for."""
    stem, _, suffix = hf_name.rpartition(".")
    if stem in _GLOBAL:
        return f"{_GLOBAL[stem]}.{suffix}"
    if stem.startswith("model.layers."):
        _, _, index, rest = stem.split(".", 3)
        if rest in _LAYER:
            return f"blk.{index}.{_LAYER[rest]}.{suffix}"
    raise ValueError(f"parameter {hf_name!r} has no llama.cpp tensor name")


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's Q/K row order for "llama" models (rows of each head: halves ->
    interleaved pairs); the inverse of `engine.model.gguf.unpermute_qk`."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def storage_type(name: str, shape: tuple[int, ...], export_type: str) -> str:
    """The GGML type name `name` is stored in under `export_type` (module docstring)."""
    if len(shape) < 2:
        return "F32"
    ggml = EXPORT_TYPES[export_type][0]
    if export_type in _SUB_8_BIT and name in _HEAD_TENSORS:
        ggml = "Q8_0"
    if ggml not in ("F32", "F16", "BF16") and shape[-1] % 32:
        return "F16"
    return ggml


def encode(array: np.ndarray, ggml_type: str) -> np.ndarray:
    """`array` (float32, row-major [out, in]) in GGML type `ggml_type`, as gguf.quants does."""
    import gguf  # noqa: PLC0415

    return gguf.quants.quantize(np.ascontiguousarray(array, dtype=np.float32), gguf.GGMLQuantizationType[ggml_type])


def gguf_tensors(weights: dict, config: dict, export_type: str):
    """Yield a `GgufTensor` per HF parameter of `weights` (torch tensors), in a stable
    order. `config` is the HF config (architecture, head counts, tied embeddings)."""
    arch = config["model_type"]
    tied = bool(config.get("tie_word_embeddings", False))
    for hf_name in sorted(weights, key=_order):
        if tied and hf_name == "lm_head.weight":
            continue  # llama.cpp reads the tied head from token_embd
        name = gguf_name(hf_name)
        array = weights[hf_name].float().numpy()  # [out, in] or [n]
        if arch == "llama" and (".q_proj." in hf_name or ".k_proj." in hf_name):
            heads = config["num_attention_heads"] if ".q_proj." in hf_name else config["num_key_value_heads"]
            array = permute_qk(array, int(heads))
        ggml_type = storage_type(name, array.shape, export_type)
        yield GgufTensor(name, encode(array, ggml_type), ggml_type)


def _order(hf_name: str) -> tuple[int, int, str]:
    """Embedding first, then layers by index, then the final norm and head."""
    if hf_name.startswith("model.layers."):
        return (1, int(hf_name.split(".")[2]), hf_name)
    return (0 if hf_name.startswith("model.embed_tokens") else 2, 0, hf_name)


__all__ = ["EXPORT_TYPES", "DEFAULT_TYPE", "GgufTensor", "check_type", "gguf_name", "permute_qk", "storage_type", "gguf_tensors"]
