"""Speed probes for the model alone (no cache, no scheduler): decode ms/token, prefill
tokens/s, the same for `transformers`' own model, and the machine's memory bandwidth.

Benchmark code, not serving code: used by `bench/model_speed.py` and by `bench/engine_bench.py`
(`efim bench engine`, memory bandwidth). Timings on a shared machine drift; callers should
interleave configurations and compare ratios.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, NamedTuple

import torch

from engine.model.transformer import Transformer


class ProbeTiming(NamedTuple):
    median: float
    samples: tuple[float, ...]


def _timing(samples: list[float]) -> ProbeTiming:
    return ProbeTiming(statistics.median(samples), tuple(samples))


def memory_bandwidth_gbs(mib: int = 256, repeats: int = 5) -> float:
    """Read bandwidth (GB/s) of a sum over a buffer much larger than the last-level cache; best of `repeats`."""
    x = torch.ones(mib * (1 << 20) // 4, dtype=torch.float32)
    x.sum()  # touch the pages
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


@torch.inference_mode()
def engine_decode_ms(model: Transformer, prompt: torch.Tensor, steps: int = 32) -> float:
    """Mean ms per greedy decode step after prefilling `prompt` (one sequence)."""
    kv = model.new_kv(prompt.shape[0] + steps + 1)
    logits = model.forward(prompt, kv, 0)
    pos = prompt.shape[0]
    tok = logits[-1].argmax().view(1)
    model.forward(tok, kv, pos)  # warm-up step (first-call allocations)
    pos += 1
    t = time.perf_counter()
    for _ in range(steps):
        logits = model.forward(tok, kv, pos)
        tok = logits[-1].argmax().view(1)
        pos += 1
    return (time.perf_counter() - t) / steps * 1e3


@torch.inference_mode()
def engine_prefill_tok_s(model: Transformer, ids: torch.Tensor, step: int) -> float:
    """Tokens/s of a prefill of `ids` from position 0 in prefill steps of `step` tokens."""
    kv = model.new_kv(ids.shape[0])
    t = time.perf_counter()
    for start in range(0, ids.shape[0], step):
        end = min(start + step, ids.shape[0])
        model.forward(ids[start:end], kv, start, "last" if end == ids.shape[0] else "none")
    return ids.shape[0] / (time.perf_counter() - t)


@torch.inference_mode()
def hf_decode_ms(hf_model, prompt: torch.Tensor, steps: int = 32) -> float:
    """transformers' own per-token cost: forward with its KV cache, one token at a time."""
    out = hf_model(prompt.unsqueeze(0), use_cache=True)
    past = out.past_key_values
    tok = out.logits[0, -1].argmax().view(1, 1)
    out = hf_model(tok, past_key_values=past, use_cache=True)  # warm-up
    past = out.past_key_values
    t = time.perf_counter()
    for _ in range(steps):
        out = hf_model(tok, past_key_values=past, use_cache=True)
        past = out.past_key_values
        tok = out.logits[0, -1].argmax().view(1, 1)
    return (time.perf_counter() - t) / steps * 1e3


@torch.inference_mode()
def hf_prefill_tok_s(hf_model, ids: torch.Tensor) -> float:
    t = time.perf_counter()
    hf_model(ids.unsqueeze(0), use_cache=True, logits_to_keep=1)
    return ids.shape[0] / (time.perf_counter() - t)


def interleaved(probes: dict[str, Callable[[], float]], rounds: int) -> dict[str, ProbeTiming]:
    """Run every probe once per round, round-robin, so load drift hits all of them alike."""
    samples: dict[str, list[float]] = {name: [] for name in probes}
    for _ in range(rounds):
        for name, probe in probes.items():
            samples[name].append(probe())
    return {name: _timing(s) for name, s in samples.items()}


__all__ = [
    "ProbeTiming",
    "memory_bandwidth_gbs",
    "engine_decode_ms",
    "engine_prefill_tok_s",
    "hf_decode_ms",
    "hf_prefill_tok_s",
    "interleaved",
]
