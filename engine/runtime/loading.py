"""Loading what an engine runs: a model by name or path, with its FIM adapter merged.

`load_model_for_engine` resolves the adapter ("auto": the shipped one for the default
model, when marked ready), loads and merges, sets torch's thread count, and says whether
the model was fragment-trained (token healing off). `engine.local.load_engine` starts a
`LocalEngine` on the result.

Runs on the caller's thread — in the server, the model loader thread — and takes seconds
(torch import, weights, adapter merge); nothing here runs on the engine thread.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import torch

from engine.api import EngineError


class EngineModel(NamedTuple):
    loaded: Any  # engine.model.loader.LoadedModel
    fragment_trained: bool  # healing off by default
    adapter: Path | None = None  # the adapter merged (the disk tier's fingerprint names it)


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
) -> EngineModel:
    """Load `model` (see `engine.model.loader.load_model`). `adapter`: "auto" (the shipped
    FIM adapter for the default model, when marked ready), "none", or a LoRA file/folder
    (`engine.adapters.resolve_adapter`). `fragment_trained` defaults to what the merged
    adapter's config says (`engine.adapters.adapter_heals`); without an adapter, healing is on.
    `reserve_bytes`: memory committed next to the weights (the KV budget), checked before loading."""
    from engine.adapters import adapter_heals, resolve_adapter  # noqa: PLC0415
    from engine.model.loader import load_model  # noqa: PLC0415

    if threads is not None:
        if threads < 1:
            raise EngineError(f"threads must be >= 1, not {threads}")
        torch.set_num_threads(threads)
    chosen = resolve_adapter(model, adapter)
    loaded = load_model(model, dtype=dtype, quant=quant, fim_tokens=fim_tokens, adapter=chosen, reserve_bytes=reserve_bytes)
    if fragment_trained is None:
        fragment_trained = chosen is not None and not adapter_heals(chosen)
    return EngineModel(loaded, fragment_trained, chosen)


__all__ = ["EngineModel", "load_model_for_engine"]
