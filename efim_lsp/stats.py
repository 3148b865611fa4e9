"""Server-side counters and latency series behind the `efim/stats` request.

Times are measured at the server: `ttft` from a request's arrival (the moment
its message was read off stdin) to the engine's first generated token as seen
by the server; `latency` from arrival to the answer being handed to pygls (all answered requests;
`engine_latency` only those the engine computed, typing-through hits excluded).
"""

from __future__ import annotations

import math
from collections import Counter, deque
from typing import Any

from engine.api import EngineStats, RequestStats

_SERIES_LENGTH = 8192


class LatencySeries:
    """The last few thousand samples (ms) and their percentiles."""

    def __init__(self, maxlen: int = _SERIES_LENGTH):
        self._samples: deque[float] = deque(maxlen=maxlen)

    def add(self, ms: float) -> None:
        self._samples.append(ms)

    def __len__(self) -> int:
        return len(self._samples)

    def percentile(self, q: float) -> float:
        """Nearest-rank percentile (0 when empty)."""
        if not self._samples:
            return 0.0
        ordered = sorted(self._samples)
        rank = max(1, math.ceil(q / 100.0 * len(ordered)))
        return ordered[rank - 1]

    def summary(self) -> dict[str, float]:
        """p50/p95/p99 and the mean (0 when empty)."""
        out = {f"p{q}": round(self.percentile(q), 3) for q in (50, 95, 99)}
        out["mean"] = round(sum(self._samples) / len(self._samples), 3) if self._samples else 0.0
        return out


class ServerStats:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Zero every counter and series (`efim/stats` with `{"reset": true}`, for benchmarks)."""
        self.requests = 0
        self.served = 0
        self.typing_through_hits = 0
        self.cancelled = 0
        self.prompt_tokens = 0
        self.reused_tokens = 0
        self.prefilled_tokens = 0
        self.generated_tokens = 0
        self.shown = 0
        self.accepted = 0
        self.partially_accepted = 0
        self.accepted_chars = 0
        self.declined: Counter[str] = Counter()
        self.ttft = LatencySeries()
        self.latency = LatencySeries()  # every answered request (typing-through hits included)
        self.engine_latency = LatencySeries()  # requests the engine answered
        # Background warm-ups (navigation): what they cost, apart from the requests above.
        self.warm_submitted = 0
        self.warm_completed = 0
        self.warm_cancelled = 0
        self.warm_prefilled_tokens = 0
        self.warm_compute_ms = 0.0

    def add_warmup(self, stats: RequestStats, finish_reason: str) -> None:
        if finish_reason == "cancelled":
            self.warm_cancelled += 1
        else:
            self.warm_completed += 1
        self.warm_prefilled_tokens += stats.prefilled_tokens
        self.warm_compute_ms += max(0.0, stats.total_ms - stats.queue_ms)

    def add_engine_request(self, stats: RequestStats) -> None:
        self.prompt_tokens += stats.prompt_tokens
        self.reused_tokens += stats.reused_tokens
        self.prefilled_tokens += stats.prefilled_tokens
        self.generated_tokens += stats.generated_tokens

    @property
    def reuse_ratio(self) -> float:
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def to_wire(self, engine: EngineStats | None, sessions_active: int, rebases: int, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """The camelCase payload of `efim/stats`."""
        out: dict[str, Any] = {
            "requests": self.requests,
            "served": self.served,
            "typingThroughHits": self.typing_through_hits,
            "cancelled": self.cancelled,
            "promptTokens": self.prompt_tokens,
            "reusedTokens": self.reused_tokens,
            "prefilledTokens": self.prefilled_tokens,
            "generatedTokens": self.generated_tokens,
            "reuseRatio": round(self.reuse_ratio, 4),
            "ttftMs": self.ttft.summary(),
            "latencyMs": self.latency.summary(),
            "engineLatencyMs": self.engine_latency.summary(),
            "cacheBytes": engine.cache_bytes_used if engine else 0,
            # KV the running requests compute in, within the same --kv-budget as cacheBytes.
            "workingKvBytes": engine.working_kv_bytes if engine else 0,
            "sessions": {"active": sessions_active, "rebases": rebases},
            "shown": self.shown,
            "accepted": self.accepted,
            "partiallyAccepted": self.partially_accepted,
            "acceptedChars": self.accepted_chars,
            "declined": dict(self.declined),
            "warmup": {
                "submitted": self.warm_submitted,
                "completed": self.warm_completed,
                "cancelled": self.warm_cancelled,
                "prefilledTokens": self.warm_prefilled_tokens,
                "computeMs": round(self.warm_compute_ms, 1),
                "documentTokens": engine.document_tokens if engine else 0,
            },
            # Disk tier: "on", "off", or "off: <why>" after a disk failure turned it off.
            "kvDisk": {
                "state": engine.kv_disk if engine else "off",
                "loadedTokens": engine.kv_disk_loaded_tokens if engine else 0,
                "savedFiles": engine.kv_disk_saved_files if engine else 0,
            },
            # Prompt-lookup speculation: decode forwards, the verifying ones, drafts and accepted drafts.
            "speculation": {
                "decodeSteps": engine.decode_steps if engine else 0,
                "verifySteps": engine.verify_steps if engine else 0,
                "draftTokens": engine.draft_tokens if engine else 0,
                "acceptedTokens": engine.accepted_tokens if engine else 0,
            },
        }
        if extra:
            out.update(extra)
        return out
