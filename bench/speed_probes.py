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


def fixed_cost_ms(n_layers: int, steps: int = 64, rounds: int = 5) -> dict[str, float]:
    """The per-step fixed cost of a served decode step: ms per greedy step of a model with
    `n_layers` layers in the served layout (int4 weights packed for the C kernel, RMSNorm, a
    gated MLP, one 64-dim head) but 64-wide layers and a 256-entry vocabulary, where no kernel
    has work to speak of: what remains is Python, dispatch, the calls' own costs and their
    parallel regions. "one_call": the layers in one C call where the model has it
    (kernels/cpu/decode_layers.py); "calls": the same model's per-kernel calls. Medians of
    `rounds` alternated rounds."""
    import transformers  # noqa: PLC0415

    from bench.model_shapes import random_weights  # noqa: PLC0415
    from engine.model import ModelConfig  # noqa: PLC0415

    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=n_layers, num_attention_heads=1,
        num_key_value_heads=1, max_position_embeddings=1024, tie_word_embeddings=True,
    ).to_dict()
    # bench.model_shapes' random checkpoint (a Qwen2 layout), without its q/k/v biases: the served model has none.
    w = {name: t for name, t in random_weights(config).items() if not name.endswith(".bias")}
    model = Transformer(ModelConfig.from_hf(config), w, dtype=torch.bfloat16, quant="int4")
    plan = model.decode_layers
    prompt = torch.arange(64) % 256
    times: dict[str, list[float]] = {"one_call": [], "calls": []}
    try:
        with torch.inference_mode():
            for _ in range(rounds):
                for name in times if plan is not None else ("calls",):
                    model.decode_layers = plan if name == "one_call" else None
                    times[name].append(engine_decode_ms(model, prompt, steps))
    finally:
        model.decode_layers = plan
    return {name: statistics.median(xs) for name, xs in times.items() if xs}
