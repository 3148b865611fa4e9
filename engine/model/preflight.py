"""Checks of a model's files that read no weight: the vocabulary fits the embedding and the
built model fits in memory next to the KV budget. Each raises an `EngineError` naming the
file and what is wrong, so a load (or a model switch, which keeps the old model) fails
before any memory is committed."""

from __future__ import annotations

from pathlib import Path

from engine.api import EngineError
from engine.model.config import ModelConfig


def check_vocabulary(folder: Path, config: ModelConfig, tokenizer, shapes: dict[str, tuple[int, ...]]) -> None:
    """The tokenizer's ids must all have embedding rows (and lm_head rows): EngineError naming
    the folder otherwise. (Adapters and FIM sentinels add their rows later, checked again.)"""
    n_tokens = tokenizer.get_vocab_size(with_added_tokens=True)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        rows = shapes.get(name, (None,))[0]
        if rows is not None and rows < n_tokens:
            raise EngineError(
                f"tokenizer of {folder} has {n_tokens} tokens but the model's {name} only {rows} rows: "
                "the tokenizer does not belong to these weights"
            )
    embed = shapes.get("model.embed_tokens.weight")
    if embed is not None and embed[0] != config.vocab_size:
        raise EngineError(
            f"config.json of {folder} says vocab_size {config.vocab_size} but model.embed_tokens.weight has {embed[0]} rows"
        )


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo, or None where it cannot be read."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_memory(source: Path, files: list[Path], model_bytes: int, reserve_bytes: int) -> None:
    """Refuse a load that cannot fit: the built weights, the files read while building them
    (their tensors are freed as they are converted, so at most both at once) and what the
    caller reserves (the KV budget) against MemAvailable. EngineError before anything is read."""
    available = available_memory_bytes()
    if available is None:
        return
    read_bytes = sum(f.stat().st_size for f in files)
    need = model_bytes + read_bytes + reserve_bytes
    if need > available:
        gib = 1 << 30
        raise EngineError(
            f"{source} does not fit in memory: its weights take {model_bytes / gib:.2f} GiB once built "
            f"(+ {read_bytes / gib:.2f} GiB of files read while building) and the KV budget {reserve_bytes / gib:.2f} GiB, "
            f"but only {available / gib:.2f} GiB is available; use a smaller --kv-budget, quant 'int4', or a smaller model"
        )


__all__ = ["check_vocabulary", "check_memory", "available_memory_bytes"]
