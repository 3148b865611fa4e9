"""Linear layers: dense (fp32 / bf16) and weight-only int8.

Decoding one token on a CPU reads every weight once, so bytes per weight set the speed:
int8 halves bf16's bytes. `Int8Linear` keeps one int8 row per output channel and one
scale per row (symmetric, no zero point) and multiplies with
`aten._weight_int8pack_mm`, which dequantises inside the GEMV. That kernel is a
matrix-vector routine: for many rows at once (prefill) it loses to a real GEMM, so
above `_GEMM_ROWS` rows the weight is dequantised into a bf16 scratch matrix per call
and multiplied by oneDNN — cheap next to the GEMM it feeds.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

# Rows (tokens) from which a dequantise-then-GEMM beats the fused int8 GEMV (measured on
# a 2-core AVX512-BF16 machine: at 16 rows the two are level, at 64 the GEMM wins 2x).
_GEMM_ROWS = 16
# `_weight_int8pack_mm` gives wrong results unless the reduction length is a multiple of 16.
_PACK_K_MULTIPLE = 16


class Linear(Protocol):
    out_features: int
    in_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...  # [M, K] -> [M, N]

    def nbytes(self) -> int: ...


class DenseLinear:
    """`y = x @ W.T + b` in the weight's dtype.

    bf16 weights on a CPU are pre-packed once into oneDNN's blocked layout
    (`mkldnn._reorder_linear_weight`) and multiplied with `mkldnn._linear_pointwise`: the
    plain `F.linear` re-lays the weight out on every call, which halves its speed (a
    1536x576 GEMV: 37 us packed vs 74 us here). fp32 keeps `F.linear` (MKL), which is
    already fast and is the path correctness tests compare against transformers.
    """

    __slots__ = ("weight", "bias", "out_features", "in_features", "_packed")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = bias  # [N] | None
        self._packed = _pack_bf16(weight)
        # The packed copy replaces the plain one (same bytes, opaque layout).
        self.weight = weight.contiguous() if self._packed is None else None  # [N, K]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def dense_weight(self) -> torch.Tensor:  # [N, K]
        if self.weight is not None:
            return self.weight
        eye = torch.eye(self.in_features, dtype=torch.bfloat16, device="cpu")  # recover W.T column by column
        return torch.ops.mkldnn._linear_pointwise(eye, self._packed, None, "none", [], "").t().contiguous()

    def nbytes(self) -> int:
        n = self.out_features * self.in_features * (2 if self._packed is not None else self.weight.element_size())
        return n + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())


def _pack_bf16(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN-packed copy of a bf16 CPU weight, or None where packing is unavailable."""
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 1)
    except (RuntimeError, AttributeError):  # a torch build without these oneDNN ops
        return None
    return packed


class Int8Linear:
    """Weight-only int8 with a per-output-channel scale: `W ≈ W_q * scales[:, None]`."""

    __slots__ = ("weight", "scales", "bias", "out_features", "in_features", "_packable")

    def __init__(self, weight_q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight = weight_q.contiguous()  # [N, K] int8
        self.scales = scales.contiguous()  # [N] activation dtype
        self.bias = bias  # [N] | None
        self.out_features, self.in_features = weight_q.shape
        self._packable = self.in_features % _PACK_K_MULTIPLE == 0

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> "Int8Linear":
        q, scales = quantize_rows(weight, dtype)
        return cls(q, scales, None if bias is None else bias.to(dtype))

    def dequantize(self) -> torch.Tensor:  # [N, K] in the scales' dtype
        return self.weight.to(self.scales.dtype) * self.scales.unsqueeze(1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] < _GEMM_ROWS and self._packable and x.dtype == self.scales.dtype:
            y = torch.ops.aten._weight_int8pack_mm(x, self.weight, self.scales)  # [M, N]
            if self.bias is not None:
                y.add_(self.bias)
            return y
        return F.linear(x, self.dequantize().to(x.dtype), self.bias)

    def nbytes(self) -> int:
        n = self.weight.numel() + self.scales.numel() * self.scales.element_size()
        return n + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())


def quantize_rows(weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: returns (int8 [N, K], scales [N] in `dtype`).

    The scale is rounded to `dtype` before quantising, so `q * scale` reconstructs with
    exactly the scale the kernel will use."""
    amax = torch.linalg.vector_norm(weight, ord=float("inf"), dim=1, dtype=torch.float32)  # [N]
    scales = (amax.clamp_(min=1e-8) / 127.0).to(dtype)  # [N]
    inv = 1.0 / scales.float()  # [N]
    q = torch.mul(weight, inv.unsqueeze(1)).round_().clamp_(-127, 127).to(torch.int8)  # [N, K]
    return q, scales


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, quant: str | None) -> Linear:
    if quant is None:
        return DenseLinear(weight.to(dtype), None if bias is None else bias.to(dtype))
    if quant == "int8":
        return Int8Linear.quantize(weight, bias, dtype)
    raise ValueError(f"unknown quantisation {quant!r}; expected None or 'int8'")


__all__ = ["Linear", "DenseLinear", "Int8Linear", "quantize_rows", "make_linear"]
