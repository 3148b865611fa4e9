"""Loading what an engine runs: a model by name or path, with its FIM adapter merged.

`load_model_for_engine` resolves the adapter ("auto": the shipped one for the default
model, when marked ready), loads and merges, sets torch's thread count, and says whether
the model was fragment-trained (token healing off). `engine.local.load_engine` starts a
`LocalEngine` on the result.

Runs on the caller's thread — in the server, the model loader thread — and takes seconds
(torch import, weights, adapter merge); nothing here runs on the engine thread.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch

from engine.api import EngineError


log = logging.getLogger(__name__)


class EngineModel(NamedTuple):
    loaded: Any  # engine.model.loader.LoadedModel
    fragment_trained: bool  # healing off by default
    adapter: Path | None = None  # the adapter merged (the disk tier's fingerprint names it)
    quant: str = "none"  # the weight form it runs (resolved when none was asked for)


def default_weight_form(model: str | Path = "default") -> str:
    """The weight form an engine runs when none is asked for: "mixed" for a GGUF whose layer
    weights are Q4 blocks — decode steps on the file's own int4 groups (a quarter of bf16's
    bytes per step), prefill steps on a bf16 copy of the same values — else "none" (the
    checkpoint in the compute dtype). Measured on the embedded model (docs/model.md "Formats"):
    decode 2.3x faster than bf16, prefill level, HumanEval and characters saved level.
    Falls back to "none" with one warning when the int4 kernel fails its check here."""
    from engine.model.gguf import INT4_BLOCK_TYPES, gguf_tensor_types  # noqa: PLC0415
    from engine.model.loader import resolve_spec  # noqa: PLC0415

    try:
        source = resolve_spec(model)
    except EngineError:
        return "none"  # load_model reports the bad spec
    if not source.is_file():
        return "none"
    try:
        types = gguf_tensor_types(source)
    except Exception:  # noqa: BLE001 - load_model reports an unreadable file
        return "none"
    layers = [t for name, t in types.items() if name.endswith("_proj.weight")]
    if not layers or any(t not in INT4_BLOCK_TYPES for t in layers):
        return "none"
    problem = _int4_kernel_problem()
    if problem is not None:
        log.warning("weight form: bf16, not mixed (the int4 kernel fails its check on this machine: %s)", problem)
        return "none"
    return "mixed"


def _int4_kernel_problem() -> str | None:
    """None when torch's packed int4 kernel computes a small product right here, else why not."""
    from engine.model.quant import Int4Linear  # noqa: PLC0415

    try:
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(64, 64, generator=gen) * 0.05
        x = torch.randn(3, 64, generator=gen)
        lin = Int4Linear.quantize(w, None, torch.float32)
        err = (lin(x) - x @ lin.dequantize().float().T).abs().max().item()
    except Exception as exc:  # noqa: BLE001 - any failure means: do not use it
        return f"{type(exc).__name__}: {exc}"
    return None if err < 1e-3 else f"wrong results (max error {err:.3g})"


def load_model_for_engine(
    model: str | Path = "default",
    *,
    dtype: str | None = None,
    quant: str | None = None,
    fim_tokens: str = "auto",
    threads: int | None = None,
    adapter: Path | str | None = "auto",
    fragment_trained: bool | None = None,
    reserve_bytes: int = 0,
    prefill: str | None = None,
) -> EngineModel:
    """Load `model` (see `engine.model.loader.load_model`). `adapter`: "auto" (the shipped
    FIM adapter for the default model, when marked ready), "none", or a LoRA file/folder
    (`engine.adapters.resolve_adapter`). `fragment_trained` defaults to what the merged
    adapter's config says (`engine.adapters.adapter_heals`); without an adapter, healing is on.
    `reserve_bytes`: memory committed next to the weights (the KV budget), checked before loading.
    `quant` None: `default_weight_form`. `prefill`: the form of a mixed model's prefill steps —
    "int8" GEMMs (`engine.model.int8_prefill`; docs/model.md "int8 prefill"), or "bf16" (its
    bf16 copies); None: int8 where the model is mixed and the conversion can run, else bf16
    (one info line). An explicit "int8" that cannot apply warns."""
    from engine.adapters import adapter_heals, resolve_adapter  # noqa: PLC0415
    from engine.model.loader import load_model  # noqa: PLC0415
    from engine.runtime.native_caches import bound_native_caches  # noqa: PLC0415

    bound_native_caches()  # before the first oneDNN kernel of this process (engine.runtime.native_caches)

    if threads is not None:
        if threads < 1:
            raise EngineError(f"threads must be >= 1, not {threads}")
        torch.set_num_threads(threads)
    chosen = resolve_adapter(model, adapter)
    if prefill not in (None, "bf16", "int8"):
        raise EngineError(f"prefill must be 'bf16' or 'int8', not {prefill!r}")
    if quant is None:
        quant = default_weight_form(model)
        if quant == "mixed":
            log.info("weight form: mixed (int4 decode steps on the file's Q4 groups, prefill on a copy); --quant none for bf16 alone")
    loaded = load_model(model, dtype=dtype, quant=quant, fim_tokens=fim_tokens, adapter=chosen, reserve_bytes=reserve_bytes)
    if prefill == "int8" or (prefill is None and quant == "mixed"):
        _int8_prefill(loaded, chosen, asked=prefill == "int8")
    c_kernels = loaded.model.c_kernels()
    if loaded.model.dtype == torch.bfloat16 and loaded.model.device.type == "cpu":
        log.info("decode step: %s", f"C kernels {', '.join(c_kernels)}" if c_kernels else "torch ops only (no C kernels built)")
    if fragment_trained is None:
        fragment_trained = chosen is not None and not adapter_heals(chosen)
    return EngineModel(loaded, fragment_trained, chosen, quant)


def _int8_prefill(loaded, adapter: Path | None, *, asked: bool) -> None:
    """The mixed model's prefill on int8 GEMMs (the conversion stored on disk once:
    `engine.runtime.int8_prefill_cache`), or one log line saying why it stays bf16 (a warning
    when int8 was `asked` for, else info)."""
    from engine.model import int8_prefill  # noqa: PLC0415
    from engine.model.loader import _return_freed_memory  # noqa: PLC0415
    from engine.paths import cache_root  # noqa: PLC0415
    from engine.runtime import int8_prefill_cache  # noqa: PLC0415
    from kernels.cpu.int8_rows import Int8Rows  # noqa: PLC0415

    decline = log.warning if asked else log.info  # why it stays bf16: a warning only when int8 was asked for
    if not int8_prefill.supported(loaded.model):
        decline("prefill: bf16 (int8 prefill needs a mixed bf16 CPU model: --quant mixed)")
        return
    rows = Int8Rows.load(cache_root() / "kernels")  # built once, kept beside the other kernels
    if rows is None:
        decline("prefill: bf16 (int8 prefill needs the int8_rows C kernel, which did not build)")
        return
    started = time.perf_counter()
    calibration = int8_prefill.calibration_ids(loaded.tokenizer)
    if not calibration:
        decline("prefill: bf16 (int8 prefill found no calibration text beside the engine's modules)")
        return
    stored = int8_prefill_cache.cache_path(int8_prefill_cache.cache_key(loaded, adapter, calibration))
    freed = int8_prefill_cache.restore(loaded.model, stored, rows)
    if freed is not None:
        how = f"read from {stored}"
    else:
        freed = int8_prefill.convert(loaded.model, calibration, rows)
        how = f"smoothed on {len(calibration)} calibration windows"
        if int8_prefill_cache.save(loaded.model, stored):
            how += f", stored in {stored}"
    _return_freed_memory()
    log.info("prefill: int8 GEMMs, %s (%.1f s; %.0f MB of bf16 copies freed)", how, time.perf_counter() - started, freed / 1e6)


__all__ = ["EngineModel", "default_weight_form", "load_model_for_engine"]
