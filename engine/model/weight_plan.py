"""What each linear weight of a model becomes before any is read: `plan_weights` decides
dense, int8 or int4 per tensor for a `quant` setting (and, for a GGUF, from each tensor's
GGML type), and the `WeightPlan` it returns says how many bytes the built model will take
(the loader's memory check) and turns the read tensors into `engine.model.quant.WeightSource`s.
The formats are described in docs/model.md "Formats"."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import NamedTuple

import torch

from engine.model.config import ModelConfig
from engine.model.quant import WeightSource

log = logging.getLogger(__name__)

_LINEAR_SUFFIXES = ("_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# GGML types whose class "auto" keeps as int8 (5 to 8 bits a weight); float types stay
# dense; every other quantised type (Q4_x and below: Q2_K, Q3_K, IQ*, TQ*, MXFP4) is int4.
_INT8_CLASS = ("Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0", "Q8_1", "Q8_K")
_BYTES_PER_WEIGHT = {"int8": 1.0, "int4": 0.5 + 4 / 32}  # + a bf16 scale and zero per 32


class WeightPlan(NamedTuple):
    """What each linear weight becomes (`engine.model.quant.WeightSource` kinds)."""

    source: Path  # the GGUF file or HF folder
    model_quant: str | None  # Transformer's quant for plain tensors: None, "int8" or "int4"
    kinds: dict[str, str]  # weight name -> kind, where it differs from model_quant
    kept: frozenset[str]  # names whose int4 groups are read from the GGUF's own blocks
    head: str  # the lm_head's weight (the embedding when tied)
    # quant "mixed": the packed layer weights also keep a bf16 copy for prefill (MixedLinear).
    dense_prefill: bool = False

    def kind(self, name: str) -> str:
        return self.kinds.get(name, self.model_quant or "dense")

    def model_bytes(self, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype) -> int:
        """Bytes of the built model: linears by kind, everything else in `dtype` (the embedding
        too, unless it is the tied int8 lm_head, whose rows it then reads)."""
        dense = torch.finfo(dtype).bits // 8
        total = 0.0
        for name, shape in shapes.items():
            n = 1
            for d in shape:
                n *= d
            linear = name.endswith(_LINEAR_SUFFIXES) or name == self.head
            total += n * (_BYTES_PER_WEIGHT.get(self.kind(name), dense) if linear else dense)
            if self.dense_prefill and linear and name != self.head and self.kind(name) != "dense":
                total += n * dense  # the bf16 copy prefill multiplies on
            if name == "model.embed_tokens.weight" == self.head and self.kind(name) != "int8":
                total += n * dense  # the lookup table stays dense beside a dense or int4 lm_head
        return int(total)

    def apply(self, weights: dict[str, torch.Tensor]) -> None:
        """Put each planned weight into `weights` as a `WeightSource` (kept groups read here)."""
        if self.kept:
            from engine.model.gguf import int4_groups  # noqa: PLC0415

            for name, groups in int4_groups(self.source, set(self.kept)).items():
                weights[name] = WeightSource("int4", groups=groups)
        for name, kind in self.kinds.items():
            if name not in self.kept and name in weights:
                weights[name] = WeightSource(kind, dense=weights[name])


def plan_weights(source: Path, config: ModelConfig, shapes: dict[str, tuple[int, ...]], quant: str) -> WeightPlan:
    """Decide each linear weight's form for `quant` (module docstring), from the GGUF's tensor
    types where the source is one. Logs one line for GGUF types no packed kernel keeps."""
    head = "lm_head.weight" if "lm_head.weight" in shapes and not config.tie_embeddings else "model.embed_tokens.weight"
    linears = [n for n in shapes if n.endswith(_LINEAR_SUFFIXES) or n == head]
    types: dict[str, str] = {}
    if source.is_file() and quant in ("int4", "mixed", "auto"):
        from engine.model.gguf import gguf_tensor_types  # noqa: PLC0415

        types = gguf_tensor_types(source)
    from engine.model.gguf import FLOAT_TYPES, INT4_BLOCK_TYPES  # noqa: PLC0415

    kinds: dict[str, str] = {}
    kept: set[str] = set()
    requantised: dict[str, list] = {}  # GGML type -> [tensors, what they become]

    def requantise(ggml: str, kind: str) -> None:
        requantised.setdefault(ggml, [0, kind])[0] += 1

    if quant == "auto":
        model_quant = None
        for name in linears:
            ggml = types.get(name, "F32")
            kind = "dense" if ggml in FLOAT_TYPES else "int8" if ggml in _INT8_CLASS else "int4"
            if kind != "dense":
                kinds[name] = kind
            if ggml in INT4_BLOCK_TYPES:
                kept.add(name)
            elif kind != "dense":
                requantise(ggml, kind)
    elif quant in ("int4", "mixed"):
        model_quant = "int4"
        kinds[head] = "int8"  # as llama.cpp's Q4 files keep the output matrix at 6-8 bits
        for name in linears:
            if name != head and types.get(name) in INT4_BLOCK_TYPES:
                kept.add(name)
                kinds[name] = "int4"
            elif name != head and name in types and types[name] not in FLOAT_TYPES:
                requantise(types[name], "int4")
    else:
        model_quant = None if quant == "none" else quant
    if requantised:
        log.info(
            "%s: no packed kernel keeps %s: dequantised by gguf and requantised",
            source.name,
            ", ".join(f"{t} ({n} tensors -> {kind})" for t, (n, kind) in sorted(requantised.items())),
        )
    return WeightPlan(source, model_quant, kinds, frozenset(kept), head, dense_prefill=quant == "mixed")


__all__ = ["WeightPlan", "plan_weights"]
