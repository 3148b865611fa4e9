"""Linear layers: dense (fp32 / bf16), weight-only int8 and group-wise int4.

Decoding one token on a CPU reads every weight once, so bytes per weight set the speed:
int8 halves bf16's bytes, int4 quarters them. `Int8Linear` keeps one int8 row per output
channel and one scale per row (symmetric, no zero point) and multiplies with
`aten._weight_int8pack_mm`, which dequantises inside the GEMV. `Int4Linear` keeps 4-bit
codes in groups of 32 along the input dimension, each group with a scale and a zero
(`w = (q - 8) * scale + zero`, torch's convention), and multiplies with
`aten._weight_int4pack_mm_for_cpu`. GGUF's Q4_0 / Q4_1 / Q4_K blocks are exactly such
groups, so they load without a detour through bf16 (`Int4Groups`; docs/model.md
"Formats"). Both kernels are matrix-vector routines whose cost grows with every row: for
many rows at once (prefill) they lose to a real GEMM, so above a row count the weight is
dequantised into a scratch matrix per call and multiplied by oneDNN.

`WeightSource` carries a weight from a checkpoint to `make_linear` with the form the
loader chose for it (kept int4 groups, or a dense matrix bound for int8 / int4 / dense).
"""

from __future__ import annotations

import logging
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F

from engine.paths import cache_root

log = logging.getLogger(__name__)

# Rows (tokens) from which a dequantise-then-GEMM beats the fused int8 GEMV (measured on
# a 2-core AVX512-BF16 machine: at 16 rows the two are level, at 64 the GEMM wins 2x).
_GEMM_ROWS = 16
# `_weight_int8pack_mm` gives wrong results unless the reduction length is a multiple of 16.
_PACK_K_MULTIPLE = 16
# int4: torch's CPU kernel takes groups of 32, 64, 128 or 256; GGUF's blocks are 32 wide.
INT4_GROUP = 32
# `_convert_weight_to_int4pack_for_cpu` lays rows out in blocks of 64 (see `_unpack_int4`).
_INT4_N_MULTIPLE = 64
# Rows from which dequantise-then-GEMM beats the fused int4 GEMV (docs/model.md "Formats":
# the kernel costs ~7-40 us per row on these shapes, unpacking a matrix ~0.7-2.2 ms: on the
# fused q/k/v at 64 rows the kernel is 2.6x faster, at 128 level, at 256 2x slower).
_INT4_GEMM_ROWS = 96
# A mixed linear (`MixedLinear`, quant "mixed") multiplies up to this many rows on its packed
# int4/int8 weight (a decode step, a speculation verify) and more on its bf16 copy (prefill).
MIXED_PACKED_ROWS = 8
# Problems already logged once (kernel name -> what was logged).
_WARNED: dict[str, str] = {}


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


class Int4Groups(NamedTuple):
    """Exact 4-bit groups of a weight [N, K]: `w[n, g*G + j] = scale[n, g] * q[n, g*G + j] + minimum[n, g]`.

    GGUF Q4_1 is this with fp16 d/m, Q4_0 with minimum = -8 d, Q4_K with scale = d * sc
    and minimum = -dmin * m per 32-weight sub-block."""

    q: torch.Tensor  # [N, K] uint8, 0..15
    scale: torch.Tensor  # [N, K / G] float32
    minimum: torch.Tensor  # [N, K / G] float32

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self) -> torch.Tensor:  # [N, K] float32
        n, k = self.q.shape
        g = k // self.scale.shape[1]
        w = self.q.view(n, -1, g).float() * self.scale.unsqueeze(2) + self.minimum.unsqueeze(2)  # [N, K/G, G]
        return w.view(n, k)

    @staticmethod
    def cat(parts: list["Int4Groups"]) -> "Int4Groups":
        return Int4Groups(*(torch.cat([getattr(p, f) for p in parts]) for f in Int4Groups._fields))


class LowRank(NamedTuple):
    """A low-rank addition `B @ A` to a weight [N, K] (a LoRA adapter, its scale folded into B)."""

    a: torch.Tensor  # [R, K]
    b: torch.Tensor  # [N, R]

    @staticmethod
    def cat(parts: list["LowRank | None"], rows: list[int]) -> "LowRank | None":
        """The addition to the row-concatenation of weights with `rows` rows each: A stacked,
        B block-diagonal (each part's rows see only its own A)."""
        if all(p is None for p in parts):
            return None
        k = next(p.a.shape[1] for p in parts if p is not None)
        a = torch.cat([p.a.float() for p in parts if p is not None])  # [sum R, K]
        b = torch.zeros(sum(rows), a.shape[0])  # [sum N, sum R]
        r0 = n0 = 0
        for p, n in zip(parts, rows):
            if p is not None:
                r = p.a.shape[0]
                b[n0 : n0 + n, r0 : r0 + r] = p.b.float()
                r0 += r
            n0 += n
        assert a.shape[1] == k
        return LowRank(a, b)


class Int4Linear:
    """Weight-only int4, groups of `group` input weights with a scale and zero each.

    `packed` is `_convert_weight_to_int4pack_for_cpu`'s layout ([N/64, K, 32] bytes: the low
    nibble holds row j of a 64-row block, the high nibble row j + 32); `scales_zeros`
    [K/G, N, 2] is in the activation dtype, as the kernel requires. Rounding a GGUF fp16
    scale to bf16 moves a weight by at most 8 * d * 2^-9 = d / 64, 1/64 of one 4-bit step.

    Where the C kernel for few rows takes the weight (kernels/cpu/int4_gemv.py: a bf16 model on
    a CPU with AVX512-BF16), the weight is kept in that kernel's layout only (`rows_c`) and
    torch's layout is rebuilt on demand (`packed`, `scales_zeros`: for a dequantised copy, not
    on a step's path); steps of more rows than it takes in one call run it in slices."""

    __slots__ = (
        "_packed", "_scales_zeros", "scales_dtype", "bias", "out_features", "in_features", "group", "lora_a", "lora_b",
        "lora_c", "rows_c",
    )

    def __init__(
        self, packed: torch.Tensor, scales_zeros: torch.Tensor, bias: torch.Tensor | None, group: int,
        lora: "LowRank | None" = None,
    ) -> None:
        self._packed = packed  # [N, K/2] uint8 (torch's kernel layout)
        self._scales_zeros = scales_zeros  # [K/G, N, 2]
        self.scales_dtype = scales_zeros.dtype
        self.bias = bias  # [N] | None
        self.group = group
        self.out_features = packed.shape[0]
        self.in_features = packed.shape[1] * 2
        # An adapter kept beside the file's groups instead of merged into them: y += (x A^T) B^T
        # in float32. Measured for one decode row on this 2-core AVX-512 machine (no AMX), rank
        # 16, K 576 -> N 960: a oneDNN-packed bf16 pair 32 us, plain bf16 mm 35 us, float32 mm
        # 5.4 us — at 120 pairs per step of the embedded model, ~3 ms of a ~20 ms decode step.
        self.lora_a = None if lora is None else lora.a.float().t().contiguous()  # [K, R]
        self.lora_b = None if lora is None else lora.b.float().t().contiguous()  # [R, N]
        # A decode step's few rows on the weight repacked for AVX512-BF16 dot products
        # (kernels/cpu/int4_gemv.py: 2.2-2.5x torch's kernel per call on this model's shapes);
        # None where the CPU lacks them, the C kernels are off or the shape does not fit.
        self.rows_c = self._pack_rows_c()
        self.lora_c = None
        if self.rows_c is not None:  # one copy of the weight resident: the C kernel's
            self._packed = self._scales_zeros = None
            if lora is not None:
                # The adapter's term inside the same call, added before the output's one rounding
                # (no second pass over y, no second call).
                fused = self.rows_c.with_low_rank(lora.a.float(), lora.b.float())
                if fused is not None:
                    self.rows_c, lora = fused, None
        # Otherwise the same term for a decode step's few rows in a C call of its own
        # (kernels/cpu/low_rank.py: 13.7 -> 11.5 ms a step of the served model); None without
        # a C compiler.
        if lora is not None and scales_zeros.dtype == torch.bfloat16:
            from kernels.cpu.low_rank import LowRankAdd  # noqa: PLC0415

            self.lora_c = LowRankAdd.pack(lora.a.float(), lora.b.float(), cache_root() / "kernels")

    @property
    def packed(self) -> torch.Tensor:  # [N, K/2] uint8, torch's int4 layout
        if self._packed is not None:
            return self._packed
        codes = self.rows_c.codes().to(torch.int32)  # [N, K]
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)

    @property
    def scales_zeros(self) -> torch.Tensor:  # [K/G, N, 2] in the activation dtype
        if self._scales_zeros is not None:
            return self._scales_zeros
        scale, zero = self.rows_c.scale_zero()  # [N, K/G] each
        return torch.stack((scale, zero), -1).transpose(0, 1).contiguous()

    @staticmethod
    def supports(out_features: int, in_features: int, group: int = INT4_GROUP) -> bool:
        return out_features % _INT4_N_MULTIPLE == 0 and in_features % group == 0

    def _pack_rows_c(self):
        if self.scales_dtype != torch.bfloat16 or self._packed.device.type != "cpu":
            return None
        from kernels.cpu.int4_gemv import Int4Gemv  # noqa: PLC0415

        if not Int4Gemv.takes(self.out_features, self.in_features, self.group):
            return None
        kernel = Int4Gemv.load(cache_root() / "kernels")
        if kernel is None or not kernel.vector:
            return None
        problem = kernel.problem()
        if problem is not None:
            if "int4_gemv" not in _WARNED:
                _WARNED["int4_gemv"] = problem
                log.warning("the int4 C kernel fails its check on this machine (%s): torch's int4 kernel runs", problem)
            return None
        codes = _unpack_int4(self._packed, self.in_features).t()  # [N, K]
        return kernel.pack(codes, self._scales_zeros[:, :, 0].t(), self._scales_zeros[:, :, 1].t())

    @classmethod
    def from_groups(
        cls, groups: Int4Groups, bias: torch.Tensor | None, dtype: torch.dtype, lora: "LowRank | None" = None
    ) -> "Int4Linear":
        n, k = groups.q.shape
        group = k // groups.scale.shape[1]
        if not cls.supports(n, k, group):
            raise ValueError(f"int4 needs out_features % {_INT4_N_MULTIPLE} == 0 and in_features % {group} == 0, got {n}x{k}")
        zero = groups.minimum + 8.0 * groups.scale  # [N, K/G]: the value of code 8
        scales_zeros = torch.stack((groups.scale, zero), -1).transpose(0, 1).to(dtype).contiguous()  # [K/G, N, 2]
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(groups.q.to(torch.int32).contiguous(), 2)  # [N, K/2]
        return cls(packed, scales_zeros, None if bias is None else bias.to(dtype), group, lora)

    @classmethod
    def quantize(
        cls, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, group: int = INT4_GROUP
    ) -> "Int4Linear":
        return cls.from_groups(quantize_groups(weight, dtype, group), bias, dtype)

    def _dequantize_t(self) -> torch.Tensor:  # [K, N] in the scales' dtype
        k, n, g = self.in_features, self.out_features, self.group
        if self.rows_c is not None:
            return self.rows_c.dequantize_t()  # the same roundings, one pass in C
        w_t = _unpack_int4(self._packed, k).to(self.scales_dtype)  # [K, N] codes 0..15
        scale = self._scales_zeros[:, :, 0].unsqueeze(1)  # [K/G, 1, N]
        offset = (self._scales_zeros[:, :, 1] - 8 * self._scales_zeros[:, :, 0]).unsqueeze(1)  # [K/G, 1, N]
        return torch.addcmul(offset, w_t.view(k // g, g, n), scale).view(k, n)  # [K, N]

    def dequantize(self) -> torch.Tensor:  # [N, K] in the scales' dtype (the low-rank term included)
        w_t = self._dequantize_t()  # [K, N]
        if self.lora_a is not None:
            w_t = w_t.float().addmm_(self.lora_a, self.lora_b).to(w_t.dtype)  # + A^T B^T
        return w_t.t()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] < _INT4_GEMM_ROWS and x.dtype == self.scales_dtype:
            # The kernels refuse strided rows (the fused small-row RMSNorm returns a column slice).
            x = x.contiguous()
            rows_c = self.rows_c
            if rows_c is None:
                y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self._packed, self.group, self._scales_zeros)  # [M, N]
            else:
                if x.shape[0] <= rows_c.max_rows:
                    y = rows_c.rows(x)  # [M, N]: a step's own contiguous bf16 rows, as `rows` asks
                else:
                    step = rows_c.max_rows
                    y = torch.cat([rows_c.rows(x[i : i + step]) for i in range(0, x.shape[0], step)])  # [M, N]
                if rows_c.low_rank is not None:  # the adapter's term is in y already
                    return y if self.bias is None else y.add_(self.bias)
            if self.lora_c is not None and x.shape[0] <= self.lora_c.max_rows:
                # The step's own bf16 rows and the kernel's fresh output: what add_rows asks.
                self.lora_c.add_rows(x, y)
                return y if self.bias is None else y.add_(self.bias)
        else:
            y = torch.mm(x, self._dequantize_t().to(x.dtype))  # [M, N]
        if self.lora_a is not None and (self.lora_c is None or not self.lora_c(x, y)):
            y.add_(torch.mm(torch.mm(x.float(), self.lora_a), self.lora_b))  # [M, R] -> [M, N], float32
        return y if self.bias is None else y.add_(self.bias)

    def _weight_nbytes(self) -> int:
        if self.rows_c is not None:
            return self.rows_c.nbytes()
        return self._packed.numel() + self._scales_zeros.numel() * self._scales_zeros.element_size()

    def nbytes(self) -> int:
        n = self._weight_nbytes() + (0 if self.rows_c is None else self.rows_c.low_rank_nbytes())
        if self.lora_a is not None:
            n += (self.lora_a.numel() + self.lora_b.numel()) * 4
        if self.lora_c is not None:
            n += self.lora_c.nbytes()
        return n + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())

    def step_nbytes(self) -> int:
        """Bytes a step of few rows reads: the packed weight and the low-rank term in the form
        that step uses (the C kernel's copy where there is one)."""
        n = self._weight_nbytes()
        if self.rows_c is not None and self.rows_c.low_rank is not None:
            n += self.rows_c.low_rank_nbytes()
        elif self.lora_c is not None:
            n += self.lora_c.nbytes()
        elif self.lora_a is not None:
            n += (self.lora_a.numel() + self.lora_b.numel()) * 4
        return n + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())


class MixedLinear:
    """One weight in two forms, each used where it is fastest: the packed int4 (or int8)
    weight for a few rows — a decode step reads every weight once, so fewer bytes per weight
    is a faster step — and a oneDNN-packed bf16 copy for many rows, where the packed kernels'
    per-row cost (or a dequantise per call) loses to a real GEMM. The bf16 copy holds the
    checkpoint's values: for a GGUF's kept int4 groups those are the groups' own values (a kept
    low-rank term merged), so both forms compute one function; for a float checkpoint they are
    the original weights, so prefill keeps bf16's quality and only decode steps round to the
    packed grid (docs/model.md "Formats").
    Resident bytes are the two together; a decode step reads only the packed one."""

    __slots__ = ("packed", "dense", "out_features", "in_features", "rows")

    def __init__(self, packed: "Int4Linear | Int8Linear", dense: DenseLinear, rows: int = MIXED_PACKED_ROWS) -> None:
        if (packed.out_features, packed.in_features) != (dense.out_features, dense.in_features):
            raise ValueError("the two forms of a mixed linear must have one shape")
        self.packed, self.dense, self.rows = packed, dense, rows
        self.out_features, self.in_features = dense.out_features, dense.in_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N]
        return self.packed(x) if x.shape[0] <= self.rows else self.dense(x)

    def nbytes(self) -> int:
        return self.packed.nbytes() + self.dense.nbytes()

    def step_nbytes(self) -> int:
        """Bytes a decode step reads (the packed form)."""
        step = getattr(self.packed, "step_nbytes", None)
        return step() if step is not None else self.packed.nbytes()


def _unpack_int4(packed: torch.Tensor, k: int) -> torch.Tensor:  # [N, K/2] uint8 -> [K, N] uint8
    """Codes of the kernel's packed layout, transposed (the GEMM wants W^T)."""
    n = packed.shape[0]
    v = packed.view(n // _INT4_N_MULTIPLE, k, 32)  # [N/64, K, 32]
    codes = torch.stack((v & 15, v >> 4), 2)  # [N/64, K, 2, 32]: rows j and j + 32 of each block
    return codes.permute(1, 0, 2, 3).reshape(k, n)  # [K, N]


def quantize_groups(weight: torch.Tensor, dtype: torch.dtype, group: int = INT4_GROUP) -> Int4Groups:
    """Asymmetric round-to-nearest int4 per group of `group` input weights (GGUF Q4_1's rule).

    Scale and zero are rounded to `dtype` first and the codes chosen against the rounded
    values, so the kernel reconstructs exactly what was chosen."""
    n, k = weight.shape
    w = weight.float().view(n, k // group, group)  # [N, K/G, G]
    lo, hi = w.amin(2), w.amax(2)  # [N, K/G]
    scale = ((hi - lo) / 15.0).clamp_(min=1e-8).to(dtype).float()  # [N, K/G]
    zero = (lo + 8.0 * scale).to(dtype).float()  # [N, K/G]: the value of code 8
    q = ((w - zero.unsqueeze(2)) / scale.unsqueeze(2) + 8.0).round_().clamp_(0, 15).to(torch.uint8)  # [N, K/G, G]
    return Int4Groups(q.view(n, k), scale, zero - 8.0 * scale)


# ------------------------------------------------------------------- weight sources

WEIGHT_KINDS = ("dense", "int8", "int4")


class WeightSource:
    """A weight matrix [N, K] on its way from a checkpoint to `make_linear`, with the form
    its linear layer takes (`kind`: "dense" | "int8" | "int4"), whatever the model-wide
    `quant` says. Holds either exact int4 groups (kept from a GGUF) or a dense float matrix.

    It stands in for a tensor where the loader and `Transformer._build` handle weights:
    `.to(device)` is itself (CPU), `.to(dtype)` / `.float()` are the dense values,
    `torch.cat` of sources along rows is a source (groups stay groups when every part has
    them; otherwise dense, of the widest kind: dense > int8 > int4)."""

    __slots__ = ("kind", "groups", "dense", "lora")

    def __init__(
        self, kind: str, *, groups: Int4Groups | None = None, dense: torch.Tensor | None = None,
        lora: LowRank | None = None,
    ) -> None:
        if kind not in WEIGHT_KINDS or (groups is None) == (dense is None) or (groups is not None and kind != "int4"):
            raise ValueError(f"bad WeightSource({kind!r}, groups={groups is not None}, dense={dense is not None})")
        if lora is not None and groups is None:
            raise ValueError("a low-rank term is kept only beside int4 groups (dense weights merge it)")
        self.kind, self.groups, self.dense, self.lora = kind, groups, dense, lora

    @property
    def shape(self) -> torch.Size:
        return self.groups.shape if self.groups is not None else self.dense.shape

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32 if self.groups is not None else self.dense.dtype

    def float(self) -> torch.Tensor:  # [N, K] float32 (a kept low-rank term added)
        if self.groups is None:
            return self.dense.float()
        w = self.groups.dequantize()
        return w if self.lora is None else w.addmm_(self.lora.b.float(), self.lora.a.float())

    def to(self, target) -> "WeightSource | torch.Tensor":
        if isinstance(target, torch.dtype):
            return self.float().to(target)
        if torch.device(target).type != "cpu":
            raise ValueError("quantised weights are built on the CPU")
        return self

    def with_values(self, dense: torch.Tensor) -> "WeightSource":
        """The same kind for new values (e.g. rows appended): groups are not kept."""
        return WeightSource(self.kind, dense=dense)

    def with_low_rank(self, a: torch.Tensor, b: torch.Tensor) -> "WeightSource":
        """Kept groups plus the addition `b @ a` ([N, R] @ [R, K]), computed beside them
        instead of merged: requantising a merged matrix to 4 bits would move every weight by
        up to half a step of a new grid (on the embedded model: KL 0.41 vs 0.004 kept)."""
        if self.groups is None:
            raise ValueError("with_low_rank needs kept int4 groups")
        lora = LowRank(a.float(), b.float())
        if self.lora is not None:
            lora = LowRank(torch.cat([self.lora.a, lora.a]), torch.cat([self.lora.b, lora.b], 1))
        return WeightSource("int4", groups=self.groups, lora=lora)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch.cat or kwargs.get("dim", args[1] if len(args) > 1 else 0) != 0:
            raise TypeError(f"WeightSource supports torch.cat along rows only, not {getattr(func, '__name__', func)}")
        parts = list(args[0])
        sources = [p for p in parts if isinstance(p, WeightSource)]
        if all(isinstance(p, WeightSource) and p.groups is not None for p in parts):
            lora = LowRank.cat([p.lora for p in parts], [p.shape[0] for p in parts])
            return WeightSource("int4", groups=Int4Groups.cat([p.groups for p in parts]), lora=lora)
        dense = torch.cat([p.float() for p in parts])
        if len(sources) < len(parts):
            return dense  # a plain tensor among them: the whole takes the model-wide form
        return WeightSource(min((s.kind for s in sources), key=WEIGHT_KINDS.index), dense=dense)  # the widest


def make_linear(
    weight: "torch.Tensor | WeightSource", bias: torch.Tensor | None, dtype: torch.dtype, quant: str | None,
    *, dense_copy: bool = False,
) -> Linear:
    """The linear layer for `weight`: a `WeightSource` takes its own kind, a tensor the
    model-wide `quant` (None, "int8" or "int4"). int4 for a shape the kernel cannot take
    (out_features not a multiple of 64) falls back to int8, logged. `dense_copy`: a packed
    (int8 / int4) layer also keeps a bf16 copy for many rows (`MixedLinear`)."""
    packed = _make_linear(weight, bias, dtype, quant)
    if not dense_copy or isinstance(packed, DenseLinear):
        return packed
    values = weight.float() if isinstance(weight, WeightSource) else weight
    return MixedLinear(packed, DenseLinear(values.to(dtype), None if bias is None else bias.to(dtype)))


def _make_linear(
    weight: "torch.Tensor | WeightSource", bias: torch.Tensor | None, dtype: torch.dtype, quant: str | None
) -> Linear:
    if quant not in (None, "int8", "int4"):
        raise ValueError(f"unknown quantisation {quant!r}; expected None, 'int8' or 'int4'")
    kind = weight.kind if isinstance(weight, WeightSource) else (quant or "dense")
    n, k = weight.shape
    if kind == "int4" and not Int4Linear.supports(n, k):
        log.info("int4 needs out_features %% %d == 0 and in_features %% %d == 0; a %dx%d weight is int8",
                 _INT4_N_MULTIPLE, INT4_GROUP, n, k)
        kind = "int8"
    if kind == "int4":
        if isinstance(weight, WeightSource) and weight.groups is not None:
            return Int4Linear.from_groups(weight.groups, bias, dtype, weight.lora)
        return Int4Linear.quantize(weight.float(), bias, dtype)
    if kind == "int8":
        return Int8Linear.quantize(weight.float() if isinstance(weight, WeightSource) else weight, bias, dtype)
    return DenseLinear(weight.to(dtype), None if bias is None else bias.to(dtype))


__all__ = [
    "Linear",
    "DenseLinear",
    "Int8Linear",
    "Int4Linear",
    "MixedLinear",
    "MIXED_PACKED_ROWS",
    "Int4Groups",
    "LowRank",
    "WeightSource",
    "WEIGHT_KINDS",
    "INT4_GROUP",
    "quantize_rows",
    "quantize_groups",
    "make_linear",
]
