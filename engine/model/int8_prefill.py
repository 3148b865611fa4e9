"""Prefill on int8 GEMMs: weights and activations both in int8 (W8A8) for steps of many rows.

A mixed model (`engine.model.quant.MixedLinear`) multiplies a decode step's few rows on its
packed int4 weight and a prefill's many rows on a bf16 copy. On x86 with VNNI an int8 GEMM
does twice the multiply-adds of a bf16 one per instruction: `torch._int_mm` multiplied
114 x 576 x 3072 in 0.50 ms against oneDNN's bf16 1.0 ms on a 2-core AVX512-BF16 EPYC, and
with the rows quantised and the sums dequantised in one C pass each (kernels/cpu/int8_rows)
a whole layer's four linears run ~1.6x faster. `Int8GemmLinear` is that linear; `convert`
puts it in place of the bf16 copies of each layer's q/k/v, o and gate/up linears (resident
bytes: int4 + int8 instead of int4 + bf16; `down` stays bf16, see `_LINEARS`). It is the
default prefill of a mixed model (engine.runtime.loading); `state` and `restore` let a later
load skip the calibration (engine.runtime.int8_prefill_cache).

What int8 activations cost in quality is their outlier channels: a row's one large channel
sets its scale and rounds the others to a few levels (on the embedded model, activations
alone quantised per row gave KL 0.024 against the bf16 prefill, weights alone 0.004). The
smoothing of SmoothQuant (Xiao et al., 2023) moves that range into the weights: each input
channel j is divided by s_j = max|X_j|^a / max|W_j|^(1-a) in the activations and multiplied
by it in the weights, exact before rounding. max|X_j| comes from a calibration pass at load:
the bf16 model prefills a few windows of Python source shipped with this package
(`calibration_ids`), each linear's input channel maxima recorded. Measured choices are in
docs/model.md ("int8 prefill").
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from engine.model.quant import DenseLinear, MixedLinear

# SmoothQuant's migration strength (0: all range stays in the activations; 1: all of it moves
# into the weights). Measured on the embedded model: 0.3 / 0.5 / 0.7 gave KL 0.020 / 0.009 /
# 0.015 against the bf16 prefill (docs/model.md "int8 prefill").
SMOOTHING_ALPHA = 0.5
# Calibration: windows of this many tokens, this many of them (about 0.4 s of bf16 prefill
# on 2 cores for the embedded model).
CALIBRATION_WINDOW = 256
CALIBRATION_WINDOWS = 3
# The linears that go int8. `down` stays bf16: its input (SiLU(gate) * up, 1,536 channels) has
# the widest outliers, and on the embedded model keeping it bf16 took the prefill's KL against
# bf16 from 0.0091 to 0.0058 (top-1 0.947 -> 0.962) and levelled the first window's exact lines,
# for about half of the speed gain at 512 rows (docs/model.md "int8 prefill"). Raising its
# migration strength instead made it worse (a = 0.7 / 0.8 / 0.9: KL 0.0145 / 0.0200 / 0.0287),
# and keeping it bf16 only in the layers with the widest channel ratios helped little (the 8
# widest of 30: KL 0.0078).
_LINEARS = ("qkv", "o", "up")


# Each thread's int32 products, reused from call to call (`_product_buffer`).
_PRODUCTS = threading.local()


def _product_buffer(rows: int, n: int) -> torch.Tensor:  # [rows, n] int32
    """Room for one int8 GEMM's int32 product, in a buffer of this thread's that grows to the
    largest product seen and is then reused: the product is read once, by the dequantising
    pass right after. A fresh tensor per call was a fresh mapping for every product above
    glibc's mmap threshold (1 MiB in an engine, engine.local): the gate/up product of a
    ~100-row first window is 1.2 MB, and its page faults, ~300 a layer, took a cold
    first window's engine TTFT from ~30 to 41-94 ms (docs/navigation.md, "Page faults in a
    cold first window")."""
    need = rows * n
    buf = getattr(_PRODUCTS, "buf", None)
    if buf is None or buf.numel() < need:
        buf = _PRODUCTS.buf = torch.empty(need, dtype=torch.int32)
    return buf[:need].view(rows, n)


class Int8GemmLinear:
    """`y = x @ W.T` with x quantised per row and W per output channel, both int8, after
    dividing x's channels by `smoothing` (and multiplying W's by it)."""

    __slots__ = ("weight_t", "scales", "inverse_smoothing", "bias", "out_features", "in_features", "_rows")

    def __init__(
        self, weight_t: torch.Tensor, scales: torch.Tensor, inverse_smoothing: torch.Tensor, bias: torch.Tensor | None, rows
    ) -> None:
        self.weight_t = weight_t.contiguous()  # [K, N] int8 (what `_int_mm` takes)
        self.bias = bias  # [N] bf16 | None
        self.scales = scales.contiguous()  # [N] float32
        self.inverse_smoothing = inverse_smoothing.contiguous()  # [K] float32
        self.in_features, self.out_features = weight_t.shape
        self._rows = rows  # kernels.cpu.int8_rows.Int8Rows

    @classmethod
    def from_weight(
        cls, weight: torch.Tensor, bias: torch.Tensor | None, channel_max: torch.Tensor | None, rows,
        alpha: float = SMOOTHING_ALPHA,
    ) -> "Int8GemmLinear":
        """From a dense weight [N, K] and the calibration's per-input-channel maxima [K]
        (None: no smoothing)."""
        w = weight.float()
        if channel_max is None:
            smoothing = torch.ones(w.shape[1])
        else:
            w_max = w.abs().amax(0).clamp(min=1e-8)  # [K]
            smoothing = (channel_max.float().clamp(min=1e-5) ** alpha / w_max ** (1 - alpha)).clamp(min=1e-4, max=1e4)
        w = w * smoothing.unsqueeze(0)
        scales = (w.abs().amax(1) / 127).clamp(min=1e-12)  # [N]
        q = torch.round(w / scales.unsqueeze(1)).clamp_(-127, 127).to(torch.int8)  # [N, K]
        return cls(q.t(), scales, 1.0 / smoothing, None if bias is None else bias.to(torch.bfloat16), rows)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] bf16 -> [M, N] bf16
        x = x if x.stride(-1) == 1 else x.contiguous()
        q, row_scales = self._rows.quantize(x, self.inverse_smoothing)
        product = torch._int_mm(q, self.weight_t, out=_product_buffer(q.shape[0], self.out_features))  # [M, N] int32
        y = self._rows.dequantize(product, row_scales, self.scales)
        return y if self.bias is None else y.add_(self.bias)

    def nbytes(self) -> int:
        n = self.weight_t.numel() + 4 * (self.scales.numel() + self.inverse_smoothing.numel())
        return n + (0 if self.bias is None else 2 * self.bias.numel())


class _ChannelMax:
    """Wraps a linear, recording the largest |x| each input channel saw."""

    def __init__(self, inner) -> None:
        self.inner, self.seen = inner, None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = x.detach().abs().amax(0).float()
        self.seen = m if self.seen is None else torch.maximum(self.seen, m)
        return self.inner(x)


def calibration_ids(tokenizer, *, windows: int = CALIBRATION_WINDOWS, size: int = CALIBRATION_WINDOW) -> list[list[int]]:
    """Token windows of this package's own Python source (present wherever the engine is):
    the middle of the largest modules, one window each."""
    root = Path(__file__).resolve().parents[1]
    files = sorted(root.rglob("*.py"), key=lambda p: (-p.stat().st_size, str(p)))
    out: list[list[int]] = []
    for path in files:
        ids = tokenizer.encode(path.read_text(encoding="utf-8")).ids
        if len(ids) >= size:
            mid = (len(ids) - size) // 2
            out.append(ids[mid : mid + size])
        if len(out) == windows:
            break
    return out


def supported(model) -> bool:
    """A bf16 CPU model whose converted linears are mixed (int4/int8 decode, bf16 prefill)."""
    return (
        model.dtype == torch.bfloat16 and model.device.type == "cpu"
        and all(isinstance(getattr(layer, n), MixedLinear) and isinstance(getattr(layer, n).dense, DenseLinear)
                for layer in model.layers for n in _LINEARS)
    )


def convert(model, calibration: list[list[int]], rows) -> int:
    """Replace every mixed linear's bf16 copy by an `Int8GemmLinear` smoothed on the channel
    maxima the bf16 model shows over `calibration` (token windows). Returns the bytes freed.
    The model must be `supported`."""
    linears = [(layer, n) for layer in model.layers for n in _LINEARS]
    probes = {}
    for layer, n in linears:
        mixed = getattr(layer, n)
        probes[(id(layer), n)] = probe = _ChannelMax(mixed.dense)
        mixed.dense = probe
    try:
        for ids in calibration:
            kv = model.new_kv(len(ids))
            model.forward(torch.tensor(ids, dtype=torch.int64), kv, 0, "none")
    finally:
        for layer, n in linears:
            getattr(layer, n).dense = probes[(id(layer), n)].inner
    freed = 0
    for layer, n in linears:
        mixed = getattr(layer, n)
        dense = mixed.dense
        mixed.dense = Int8GemmLinear.from_weight(dense.dense_weight(), dense.bias, probes[(id(layer), n)].seen, rows)
        freed += dense.nbytes() - mixed.dense.nbytes()
    return freed


_PARTS = ("weight_t", "scales", "inverse_smoothing")


def in_use(model) -> bool:
    """Whether `convert` (or `restore`) put int8 GEMMs in this model's prefill steps."""
    return any(isinstance(getattr(layer, n, None), MixedLinear) and isinstance(getattr(layer, n).dense, Int8GemmLinear)
               for layer in model.layers for n in _LINEARS)


def state(model) -> dict[str, torch.Tensor]:
    """The converted linears' tensors by `{layer}.{linear}.{part}` (what `restore` takes back),
    from a model `convert` ran on."""
    out: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(model.layers):
        for n in _LINEARS:
            linear = getattr(layer, n).dense
            if not isinstance(linear, Int8GemmLinear):
                raise ValueError(f"layer {i}'s {n} is not converted")
            for part in _PARTS:
                out[f"{i}.{n}.{part}"] = getattr(linear, part)
    return out


def restore(model, tensors: dict[str, torch.Tensor], rows) -> int:
    """Put back the `state` of an earlier `convert` of the same model (same weights, same
    calibration): no calibration pass, no quantisation. Returns the bytes freed. Raises
    ValueError, the model untouched, when the tensors do not fit its linears."""
    built = []
    expected = {f"{i}.{n}.{part}" for i in range(len(model.layers)) for n in _LINEARS for part in _PARTS}
    if set(tensors) != expected:
        raise ValueError(f"{len(set(tensors) ^ expected)} tensor names differ from the model's linears")
    for i, layer in enumerate(model.layers):
        for n in _LINEARS:
            mixed = getattr(layer, n)
            weight_t, scales, inverse = (tensors[f"{i}.{n}.{part}"] for part in _PARTS)
            k, m = mixed.dense.in_features, mixed.dense.out_features
            if (weight_t.dtype, tuple(weight_t.shape), tuple(scales.shape), tuple(inverse.shape)) != (torch.int8, (k, m), (m,), (k,)) \
                    or scales.dtype != torch.float32 or inverse.dtype != torch.float32:
                raise ValueError(f"layer {i}'s {n}: stored tensors do not fit a {m} x {k} linear")
            bias = mixed.dense.bias
            built.append((mixed, Int8GemmLinear(weight_t, scales, inverse, None if bias is None else bias.to(torch.bfloat16), rows)))
    freed = 0
    for mixed, linear in built:
        freed += mixed.dense.nbytes() - linear.nbytes()
        mixed.dense = linear
    return freed


__all__ = ["Int8GemmLinear", "calibration_ids", "convert", "in_use", "restore", "state", "supported", "SMOOTHING_ALPHA"]
