"""Adapters shipped with the package (data only): `smollm2-efim/` is the FIM/EFIM LoRA for
the embedded SmolLM2-135M-Instruct, format `efim-lora/1` (see `efim_tools.training.lora` and
docs/training.md).

`resolve_adapter` turns the `adapter` option ("auto" | "none" | a path) into a folder or
None. "auto" picks the shipped adapter for the default model only when its config marks
it `"ready": true` — the card's evaluation decides, not this code."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from engine.api import EngineError

log = logging.getLogger(__name__)

SHIPPED_ADAPTER = Path(__file__).resolve().parent / "smollm2-efim"


def _adapter_config(folder: Path) -> dict | None:
    """The folder's `adapter_config.json`, or None when it is missing or unreadable."""
    try:
        return json.loads((folder / "adapter_config.json").read_text())
    except (OSError, ValueError):
        return None


def shipped_adapter_ready(folder: Path | None = None) -> bool:
    """True when the shipped adapter is present and its card's evaluation marked it ready."""
    folder = SHIPPED_ADAPTER if folder is None else folder
    config = _adapter_config(folder)
    return config is not None and bool(config.get("ready")) and (folder / "adapter_model.safetensors").is_file()


def adapter_heals(adapter: Path) -> bool:
    """Whether completions with this adapter merged should use token healing.

    The adapter's `adapter_config.json` decides: `"healing": "on"|"off"` when its card's
    evaluation measured it; otherwise off for a fragment-trained adapter (it has seen
    increments that end inside a word), on for any other."""
    config = _adapter_config(adapter if adapter.is_dir() else adapter.parent)
    if config is None:
        return True
    healing = config.get("healing")
    if healing in ("on", "off"):
        return healing == "on"
    return not config.get("fragment_trained", False)


def adapter_probes(adapter: Path | None) -> bool:
    """Whether this adapter was trained on next-edit probes (`efim train --next-edit`): its
    config says `"next_edit": "probe"`, or its training record has a next-edit share."""
    if adapter is None:
        return False
    config = _adapter_config(adapter if adapter.is_dir() else adapter.parent)
    if config is None:
        return False
    if config.get("next_edit") == "probe":
        return True
    training = config.get("training")
    run = training.get("config") if isinstance(training, dict) else None
    share = run.get("next_edit_prob") if isinstance(run, dict) else None
    return isinstance(share, (int, float)) and share > 0


def resolve_adapter(model: str | Path, adapter: str | Path | None) -> Path | None:
    """The adapter folder/file to merge for `model`, or None.

    "none" / "" / None: no adapter. "auto": the shipped adapter when `model` is "default"
    and the adapter is marked ready, else none. Anything else: a path that must exist."""
    if adapter is None or str(adapter) in ("", "none"):
        return None
    if str(adapter) == "auto":
        if str(model) != "default":
            return None
        if shipped_adapter_ready(SHIPPED_ADAPTER):
            return SHIPPED_ADAPTER
        log.info("the shipped FIM adapter is not marked ready; the default model completes prefix-only")
        return None
    path = Path(adapter).expanduser()
    if not path.exists():
        raise EngineError(f"adapter {path} not found (expected 'auto', 'none', a LoRA .safetensors file or its folder)")
    return path


__all__ = ["SHIPPED_ADAPTER", "adapter_heals", "adapter_probes", "resolve_adapter", "shipped_adapter_ready"]
