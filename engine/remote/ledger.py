"""What the remote engine counts: requests, tokens as the server reported them, and the
latency series behind `efim/stats` "engine" (client TTFT, the server's prefill time and
their difference). Written on the remote loop thread; read from any thread (plain ints and
deques of floats; a summary copies before sorting)."""

from __future__ import annotations

import math
import time
from collections import deque

from engine.api import TOKEN_COUNTS, FinishReason, RequestStats
from engine.remote.dialects import Usage

_SERIES = 2048


class Ledger:
    """Counters of one remote engine (see the module docstring), named as the
    `EngineStats` fields they become (`EngineStats.from_counters`)."""

    def __init__(self) -> None:
        self.requests = self.completed = self.cancelled = 0
        self.prompt_tokens = self.reused_tokens = self.prefilled_tokens = self.generated_tokens = 0
        self.reuse_reported = 0  # requests whose answer said how many prompt tokens were cached
        self.resent = 0  # requests sent again because a kept-alive connection closed before answering
        self.warm_requests = self.warm_completed = self.warm_cancelled = self.warm_prefilled_tokens = 0
        self.client_ttft: deque[float] = deque(maxlen=_SERIES)
        self.server_prompt_ms: deque[float] = deque(maxlen=_SERIES)
        self.overhead_ms: deque[float] = deque(maxlen=_SERIES)  # client TTFT - server prompt_ms

    def request_stats(self, submitted: float, background: bool, usage: Usage, first: float | None, generated: int) -> RequestStats:
        """The request's stats as the server reported them. Prompt, reused and prefilled
        tokens come from the answer only: a request that ended before the server said
        anything (superseded while it prefilled, a fault) counts none of them — what the
        server computed for it is unknown, not zero and not all. A server that reports the
        prompt but no cached count is counted as having reused nothing."""
        now = time.monotonic()
        prompt = usage.prompt_tokens or 0
        cached = min(usage.cached_tokens, prompt) if usage.cached_tokens is not None else 0
        ttft = (first - submitted) * 1000 if first is not None else 0.0
        per_token = usage.ms_per_token
        if per_token is None and first is not None and generated > 1:
            per_token = (now - first) * 1000 / (generated - 1)
        c = self
        if first is not None and not background:
            c.client_ttft.append(ttft)
            if usage.prompt_ms is not None:
                c.server_prompt_ms.append(usage.prompt_ms)
                c.overhead_ms.append(ttft - usage.prompt_ms)
        if usage.cached_tokens is not None and not background:
            c.reuse_reported += 1
        return RequestStats(
            prompt_tokens=prompt,
            reused_tokens=cached,
            prefilled_tokens=max(0, prompt - cached),
            generated_tokens=usage.generated_tokens if usage.generated_tokens is not None else generated,
            ttft_ms=round(ttft, 3),
            total_ms=round((now - submitted) * 1000, 3),
            decode_ms_per_token=round(per_token or 0.0, 3),
        )

    def finished(self, background: bool, reason: FinishReason, stats: RequestStats) -> None:
        if background:
            self.warm_requests += 1
            self.warm_cancelled += reason == "cancelled"
            self.warm_completed += reason != "cancelled"
            self.warm_prefilled_tokens += stats.prefilled_tokens
            return
        self.requests += 1
        self.cancelled += reason == "cancelled"
        self.completed += reason != "cancelled"
        for name in TOKEN_COUNTS:
            setattr(self, name, getattr(self, name) + getattr(stats, name))


def merge_usage(old: Usage, new: Usage) -> Usage:
    return Usage(*(n if n is not None else o for o, n in zip(old, new)))


def summary(samples: deque[float]) -> dict[str, float] | None:
    if not samples:
        return None
    ordered = sorted(list(samples))

    def at(q: float) -> float:
        return round(ordered[max(1, math.ceil(q / 100 * len(ordered))) - 1], 2)

    return {"p50": at(50), "p95": at(95), "p99": at(99), "n": len(ordered)}



__all__ = ["Ledger", "merge_usage", "summary"]
