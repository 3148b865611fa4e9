"""Which of the CPU kernels in C (`kernels/cpu`) a model runs, chosen once when it is built.

Each kernel has a torch path the model keeps for when it is absent: no C compiler,
`EFIM_C_KERNELS=0`, a model that is not bf16 on the CPU, a non-reference (Triton) kernel set,
or a CPU without the instructions its loops need. `Transformer` asks here at construction and
holds what it gets; `names` is what `efim/stats` `model.info.c_kernels` reports.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, NamedTuple

import torch

import kernels
from engine.model.int8_prefill import Int8GemmLinear
from engine.model.quant import Int4Linear, MixedLinear
from engine.paths import cache_root

if TYPE_CHECKING:
    from kernels.cpu.decode_attention import DecodeAttention
    from kernels.cpu.decode_layers import LayerPlan
    from kernels.cpu.prefill_attention import PrefillAttention
    from kernels.cpu.row_ops import RowOps

log = logging.getLogger(__name__)


class CpuKernels(NamedTuple):
    """The C kernels of a bf16 CPU model's steps; None where the model keeps torch's path."""

    row_ops: "RowOps | None" = None
    decode_attention: "DecodeAttention | None" = None
    prefill_attention: "PrefillAttention | None" = None


def load(dtype: torch.dtype, device: torch.device, probe: torch.Tensor, head_dim: int) -> CpuKernels:
    """The row operations, the decode attention and the prefill attention for a model of
    `dtype` on `device` whose kernel set is chosen by `probe` (a tensor on that device)."""
    if dtype != torch.bfloat16 or device.type != "cpu":
        return CpuKernels()
    from kernels.cpu.decode_attention import DecodeAttention  # noqa: PLC0415
    from kernels.cpu.prefill_attention import PrefillAttention  # noqa: PLC0415
    from kernels.cpu.row_ops import RowOps  # noqa: PLC0415

    folder = cache_root() / "kernels"
    # A step's norms and SiLU * up in one C call each (a prefill's rows over the OpenMP threads).
    row_ops = RowOps.load(folder) if kernels.resolve("rms_norm", probe) is kernels.reference.rms_norm else None
    if kernels.backend_for("attention", probe) != "reference":
        return CpuKernels(row_ops)
    # A decode step's attention (one query row) in one C call: 2.3-3.3x torch's flash kernel per
    # layer (kernels/cpu/decode_attention.py) where its loops are the faster ones for this head size.
    attend = DecodeAttention.load(folder)
    decode = attend if attend is not None and attend.faster(1, head_dim) else None
    # A prefill step's attention (17 rows and more) in one C call where the CPU has AVX512-BF16:
    # 1.3-3.1x torch's flash kernel per layer (kernels/cpu/prefill_attention.py).
    return CpuKernels(row_ops, decode, PrefillAttention.load(folder))


def _few_rows_form(linear):
    """What a step of few rows multiplies by: a mixed linear's packed form, else the linear."""
    return linear.packed if isinstance(linear, MixedLinear) else linear


def packed_int4(linear):
    """(the int4 kernel's packed weight a step of few rows multiplies `linear` by, its bias or
    None), where that one call holds every term of the product but the bias (the adapter's
    low-rank term fused); None where the step does anything else (engine.model.quant.Int4Linear,
    MixedLinear)."""
    packed = _few_rows_form(linear)
    rows_c = packed.rows_c if isinstance(packed, Int4Linear) else None
    if rows_c is None or packed.lora_c is not None:
        return None
    if packed.lora_a is not None and rows_c.low_rank is None:
        return None
    return rows_c, packed.bias


def decode_layer_plan(model) -> "tuple[LayerPlan, int] | None":
    """`kernels.cpu.decode_layers`' plan of the model's layers and the most rows a step may have
    for it (a mixed linear's few-row threshold), or None where some layer is not what it runs:
    needs the row operations and the fused RoPE attention in C, RMSNorm, a gated SiLU MLP, neox
    RoPE and every linear packed for the int4 kernel with all of its terms inside but a bias."""
    c = model.config
    k = model.cpu_kernels
    if k.row_ops is None or k.decode_attention is None or c.norm != "rms" or c.mlp != "gated_silu" or c.rope_style != "neox":
        return None
    from kernels.cpu.decode_layers import DecodeLayers, LayerWeights  # noqa: PLC0415

    rows, layers = 1 << 30, []
    for layer in model.layers:
        linears = (layer.qkv, layer.o, layer.up, layer.down)
        packed = [packed_int4(lin) for lin in linears]
        if any(p is None for p in packed):
            return None
        rows = min([rows, *(lin.rows for lin in linears if hasattr(lin, "rows"))])  # a mixed linear's threshold
        (qkv, qkv_b), (o, o_b), (up, up_b), (down, down_b) = packed
        layers.append(LayerWeights(layer.norm1.w, qkv, o, layer.norm2.w, up, down, (qkv_b, o_b, up_b, down_b)))
    lib = DecodeLayers.load(cache_root() / "kernels")
    plan = None if lib is None else lib.plan(layers, n_heads=c.n_heads, n_kv_heads=c.n_kv_heads, head_dim=c.head_dim,
                                             eps=c.norm_eps)
    if plan is None:
        return None
    if not _same_bits(model, plan):
        log.warning("the decode layers' one C call did not give the bits of the calls it replaces: the model keeps those")
        return None
    return plan, min(rows, plan.max_rows)


def _same_bits(model, plan: "LayerPlan") -> bool:
    """Whether a two-row step at a fresh position gives the same hidden states and KV rows
    through `plan` as through the model's per-kernel calls (run once, at load)."""
    from engine.model.sequence_kv import SequenceKV  # noqa: PLC0415
    from kernels.cpu.decode_layers import Segment  # noqa: PLC0415

    c = model.config
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(2, c.hidden_size, generator=gen).to(model.dtype)  # [2, hidden]
    shape = (c.n_layers, c.n_kv_heads, 8, c.head_dim)
    kvs = [SequenceKV(torch.zeros(shape, dtype=model.dtype), torch.zeros(shape, dtype=model.dtype)) for _ in range(2)]
    before = torch.randn(2, c.n_layers, c.n_kv_heads, 3, c.head_dim, generator=gen)  # keys, values
    for kv in kvs:  # the same three rows before the step, in both
        kv.k.narrow(2, 0, 3).copy_(before[0])
        kv.v.narrow(2, 0, 3).copy_(before[1])
    cos, sin = model.rope_tables(torch.arange(3, 5))
    with torch.inference_mode():
        want, _ = model._layers(h.clone(), kvs[0], 3, cos, sin)  # (the model's plan is not set yet)
        got = h.clone()
        ran = plan.run(got, cos, sin, [Segment(kvs[1].k, kvs[1].v, 3, 2)], model.scale)
    return ran and torch.equal(got, want) and all(torch.equal(a[:, :, :5], b[:, :, :5]) for a, b in (
        (kvs[0].k, kvs[1].k), (kvs[0].v, kvs[1].v)))


def names(model) -> tuple[str, ...]:
    """The CPU kernels in C `model` runs (kernels/cpu), for `EngineInfo.c_kernels`."""
    k = model.cpu_kernels
    out = [name for name, kernel in (("decode_attention", k.decode_attention), ("prefill_attention", k.prefill_attention),
                                     ("row_ops", k.row_ops)) if kernel is not None]
    linears = [getattr(layer, n) for layer in model.layers for n in ("qkv", "o", "up", "down")]
    packed = [_few_rows_form(lin) for lin in linears]
    if any(getattr(p, "lora_c", None) is not None or getattr(getattr(p, "rows_c", None), "low_rank", None) is not None
           for p in packed):
        out.append("low_rank")
    if any(isinstance(getattr(lin, "dense", None), Int8GemmLinear) for lin in linears):
        out.append("int8_rows")
    if any(getattr(p, "rows_c", None) is not None for p in packed):
        out.append("int4_gemv")
    if model.decode_layers is not None:
        out.append("decode_layers")
    return tuple(out)


__all__ = ["CpuKernels", "load", "decode_layer_plan", "packed_int4", "names"]
