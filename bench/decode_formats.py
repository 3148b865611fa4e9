"""Decode ms/token per model shape and weight format, each next to its memory-bandwidth
floor measured in the same run (part of `efim bench engine`).

The floor of one decode step is the bytes it must read — every linear weight (lm_head
included; `Transformer.weight_bytes()`) plus the KV rows of the context — over the read
bandwidth of this machine, measured with the same torch threads around the shape's timings:
a probe before each format and one after the last, and the best of them is the shape's
bandwidth (on a shared machine a single probe can land on a bad moment and put the floor
above the decode it bounds). The table shows the ratio decode / floor.

Benchmark code, outside the serving path.
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Any, NamedTuple

import torch

from bench import model_shapes, speed_probes

log = logging.getLogger(__name__)

FORMATS = ("bf16", "int8", "int4", "mixed", "served")
# "served": the embedded model as `efim serve` runs it — mixed, with the shipped FIM adapter's
# low-rank term beside the int4 groups and its prefill steps on int8 GEMMs (135M only; llama.cpp
# runs the file without the adapter). "mixed" keeps its bf16 prefill copies.


class DecodeRow(NamedTuple):
    shape: str
    format: str
    decode_ms: float | None  # None: the format is not available (see `note`)
    floor_ms: float | None
    weight_bytes: int | None
    kv_bytes: int | None
    bandwidth_gbs: float
    prefill_tok_s: float | None  # model-level prefill at the same shape/format
    note: str = ""

    @property
    def vs_floor(self) -> float | None:
        return self.decode_ms / self.floor_ms if self.decode_ms and self.floor_ms else None


def _quant(fmt: str) -> str | None:
    if fmt not in FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}; expected one of {FORMATS}")
    return None if fmt == "bf16" else "mixed" if fmt == "served" else fmt


@torch.inference_mode()
def decode_ms_at(model: Any, context: int, steps: int, rounds: int) -> float:
    """Best-of-`rounds` mean ms of a greedy decode step at ~`context` tokens of context
    (random prompt ids; the step's cost does not depend on them)."""
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.vocab_size, (context,), generator=gen)  # [context]
    best = float("inf")
    for _ in range(rounds):
        best = min(best, speed_probes.engine_decode_ms(model, prompt, steps))
    return best


def measure_shape(
    shape: str, formats: list[str], *, context: int, steps: int, rounds: int, prefill_tokens: int
) -> list[DecodeRow]:
    """Every format of one shape: build it, time decode (and a model-level prefill), free it."""
    probes = [speed_probes.memory_bandwidth_gbs()]
    weights = model_shapes.random_weights(model_shapes.qwen2_config(shape)) if shape != "135m" else None
    timed = []  # (fmt, decode ms, weight bytes, kv bytes, prefill tok/s) or (fmt, note)
    for fmt in formats:
        if timed:  # the first format has the probe above
            probes.append(speed_probes.memory_bandwidth_gbs())
        if fmt == "served" and shape != "135m":
            timed.append((fmt, "n/a (the shipped adapter is the embedded 135M model's)"))
            continue
        t0 = time.perf_counter()
        try:
            bm = model_shapes.build(shape, _quant(fmt), weights=weights, adapter=fmt == "served")
        except model_shapes.FormatUnavailable as exc:
            timed.append((fmt, f"n/a (not available: {exc})"))
            continue
        built_s = time.perf_counter() - t0
        model = bm.model
        weight_bytes = model.weight_bytes()
        kv_bytes = model_shapes.kv_bytes_per_token(model, context)
        ms = decode_ms_at(model, context, steps, rounds)
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(0, model.vocab_size, (prefill_tokens,), generator=gen)  # [T]
        with torch.inference_mode():
            prefill = max(speed_probes.engine_prefill_tok_s(model, ids, 512) for _ in range(max(1, rounds - 1)))
        log.info("%s %s: built in %.1f s, %.2f ms/token", shape, fmt, built_s, ms)
        timed.append((fmt, ms, weight_bytes, kv_bytes, prefill))
        del bm, model
        gc.collect()
    del weights
    gc.collect()
    probes.append(speed_probes.memory_bandwidth_gbs())
    bandwidth = max(probes)
    log.info("%s: bandwidth probes %s GB/s", shape, ", ".join(f"{p:.1f}" for p in probes))
    rows = []
    for t in timed:
        if len(t) == 2:
            rows.append(DecodeRow(shape, t[0], None, None, None, None, bandwidth, None, t[1]))
            continue
        fmt, ms, weight_bytes, kv_bytes, prefill = t
        floor = (weight_bytes + kv_bytes) / (bandwidth * 1e9) * 1e3
        rows.append(DecodeRow(shape, fmt, ms, floor, weight_bytes, kv_bytes, bandwidth, prefill))
    return rows


def measure(shapes: list[str], formats: list[str], *, context: int = 64, steps: int = 24, rounds: int = 2,
            prefill_tokens: int = 512) -> list[DecodeRow]:
    for s in shapes:
        if s not in model_shapes.SHAPES:
            raise ValueError(f"unknown model shape {s!r}; expected one of {model_shapes.SHAPES}")
    rows: list[DecodeRow] = []
    for s in shapes:
        rows.extend(measure_shape(s, formats, context=context, steps=steps, rounds=rounds,
                                  prefill_tokens=prefill_tokens))
    return rows


def render(rows: list[DecodeRow], context: int, llama_tg_ms: dict[str, float | None]) -> list[str]:
    """Table lines; `llama_tg_ms` maps shape -> llama.cpp's tg ms/token on the same GGUF (or None)."""

    def f(x: float | None, spec: str = ".2f") -> str:
        return "n/a" if x is None else format(x, spec)

    out = [f"decode at a {context}-token context: ms/token (floor = (weights + KV read) / bandwidth of the same run)",
           f"  {'shape':<28}{'format':<7}{'ms/token':>10}{'floor':>8}{'x floor':>9}{'weights MB':>12}"
           f"{'GB/s':>7}{'prefill tok/s':>15}"]
    for r in rows:
        if r.decode_ms is None:
            out.append(f"  {model_shapes.SHAPE_LABELS[r.shape]:<28}{r.format:<7}{r.note}")
            continue
        out.append(f"  {model_shapes.SHAPE_LABELS[r.shape]:<28}{r.format:<7}{f(r.decode_ms):>10}{f(r.floor_ms):>8}"
                   f"{f(r.vs_floor):>9}{r.weight_bytes / 1e6:>12.0f}{r.bandwidth_gbs:>7.1f}{f(r.prefill_tok_s, '.0f'):>15}")
    for shape, ms in llama_tg_ms.items():
        if ms is not None:
            gguf = "the embedded Q4_1 GGUF" if shape == "135m" else "a random Q4_1 GGUF of the shape"
            out.append(f"  {model_shapes.SHAPE_LABELS[shape]:<28}{'llama':<7}{f(ms):>10}   llama.cpp tg64 on {gguf}")
    return out


def as_json(rows: list[DecodeRow]) -> list[dict[str, Any]]:
    return [{**r._asdict(), "vs_floor": r.vs_floor} for r in rows]


__all__ = ["FORMATS", "DecodeRow", "decode_ms_at", "measure_shape", "measure", "render", "as_json"]
