"""`load_engine`: a model (by name or path), its adapter, and a `LocalEngine` started on it.

Runs on the caller's thread — in the server, the model loader thread — and takes seconds
(torch import, weights, adapter merge); nothing here runs on the engine thread.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.api import EngineError

if TYPE_CHECKING:
    from engine.local import LocalEngine


def load_engine(
    model: str | Path = "default",
    *,
    dtype: str | None = None,
    quant: str | None = None,
    fim_tokens: str = "auto",
    kv_budget: int | str | None = None,
    threads: int | None = None,
    adapter: Path | str | None = "auto",
    fragment_trained: bool | None = None,
    **engine_options,
) -> "LocalEngine":
    """Load `model` (see `engine.model.loader.load_model`) and start an engine on it.
    `adapter`: "auto" (the shipped FIM adapter for the default model, when marked ready),
    "none", or a LoRA file/folder (`engine.adapters.resolve_adapter`). `fragment_trained`
    (token healing off) defaults to what the merged adapter's config says
    (`engine.adapters.adapter_heals`); without an adapter, healing is on."""
    from engine.adapters import adapter_heals, resolve_adapter  # noqa: PLC0415
    from engine.local import LocalEngine  # noqa: PLC0415  (engine.local re-exports this function)
    from engine.model.loader import load_model  # noqa: PLC0415

    if threads is not None:
        if threads < 1:
            raise EngineError(f"threads must be >= 1, not {threads}")
        torch.set_num_threads(threads)
    chosen = resolve_adapter(model, adapter)
    loaded = load_model(model, dtype=dtype, quant=quant, fim_tokens=fim_tokens, adapter=chosen)
    if fragment_trained is None:
        fragment_trained = chosen is not None and not adapter_heals(chosen)
    return LocalEngine(loaded, kv_budget=kv_budget, fragment_trained=fragment_trained, quant=quant, **engine_options)


__all__ = ["load_engine"]
