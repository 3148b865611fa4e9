"""Per-request server numbers for a serial replay, from `efim/stats` segments.

`efim serve` answers a completion without its own timings, and `efim/stats` gives
percentiles, not samples. So after each answered request the probe asks for the stats
*with reset*: what comes back covers exactly the time since the previous answer — that
request (one TTFT sample: its `ttftMs.p50` is its TTFT), the tokens it prefilled, and
any background warm-up the server ran while the person paused before it.

Contracts:
- Only for replays where requests never overlap (one user, each answer awaited): a
  segment with more or less than one request gives no TTFT (the record keeps None).
- Before resetting it waits (polling every `POLL_S`) until the request's tokens are
  accounted — a stream stopped early is accounted when the engine's terminal event
  arrives, a moment after the answer — and the token counters stop moving, at most
  `SETTLE_S`; the time it takes is reported in `paused_s`.
- The segments add up: `totals()` is what one `efim/stats` over the whole replay would
  have counted (summed counters, warm-up included), so reports built on deltas hold.
- A server without `efim/stats` or its reset: the probe turns itself off at the first
  error and the records keep what the answers said.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from efim_tools.trace.client import LspClient, ResponseError
from efim_tools.trace.person import RequestRecord

SUMMED = (
    "requests", "served", "typingThroughHits", "cancelled", "promptTokens", "reusedTokens",
    "prefilledTokens", "generatedTokens", "shown", "accepted", "partiallyAccepted", "acceptedChars",
)
WARMUP_SUMMED = ("submitted", "completed", "cancelled", "prefilledTokens", "computeMs", "answers", "answerHits")
POLL_S = 0.02
SETTLE_S = 2.0
_MOVING = ("promptTokens", "prefilledTokens", "reusedTokens", "cancelled")


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


class RequestProbe:
    def __init__(self, client: LspClient) -> None:
        self.client = client
        self.enabled = True
        self.paused_s = 0.0
        self.sums: dict[str, float] = {}
        self.warmup: dict[str, float] | None = None  # None until the server reports one
        self.last: dict[str, Any] | None = None

    async def _stats(self, params: Any) -> dict[str, Any] | None:
        try:
            stats = await self.client.request("efim/stats", params)
        except ResponseError:
            self.enabled = False
            return None
        return stats if isinstance(stats, dict) else None

    async def segment(self) -> dict[str, Any] | None:
        """The counters since the previous segment, once they are settled; then zeroed."""
        deadline = time.perf_counter() + SETTLE_S
        previous = None
        while time.perf_counter() < deadline:
            stats = await self._stats(None)
            if stats is None:
                return None
            accounted = (_number(stats.get("promptTokens")) or 0) > 0 or (_number(stats.get("typingThroughHits")) or 0) > 0
            snapshot = tuple(stats.get(k) for k in _MOVING)
            if snapshot == previous and (accounted or not stats.get("requests")):
                break
            previous = snapshot
            await asyncio.sleep(POLL_S)
        seg = await self._stats({"reset": True})
        if seg is not None:
            self._add(seg)
        return seg

    def _add(self, seg: dict[str, Any]) -> None:
        self.last = seg
        for key in SUMMED:
            value = _number(seg.get(key))
            if value is not None:
                self.sums[key] = self.sums.get(key, 0.0) + value
        warm = seg.get("warmup")
        if isinstance(warm, dict):
            self.warmup = self.warmup or {}
            for key in WARMUP_SUMMED:
                value = _number(warm.get(key))
                if value is not None:
                    self.warmup[key] = self.warmup.get(key, 0.0) + value

    async def after_request(self, record: RequestRecord) -> None:
        if not self.enabled:
            return
        t = time.perf_counter()
        seg = await self.segment()
        self.paused_s += time.perf_counter() - t
        if seg is None:
            return
        if record.ttft_ms is None and _number(seg.get("requests")) == 1:
            p50 = _number((seg.get("ttftMs") or {}).get("p50")) if isinstance(seg.get("ttftMs"), dict) else None
            record.ttft_ms = p50 if p50 else None  # an empty series reads 0: no token was generated
        record.prompt_tokens = _number(seg.get("promptTokens"))
        record.prefilled_tokens = _number(seg.get("prefilledTokens"))
        warm = seg.get("warmup")
        if isinstance(warm, dict):
            record.warmup_tokens = _number(warm.get("prefilledTokens"))
            record.warmup_ms = _number(warm.get("computeMs"))
            record.warmup_submitted = _number(warm.get("submitted"))
            record.warmup_cancelled = _number(warm.get("cancelled"))

    async def finish(self) -> dict[str, Any] | None:
        """The last segment (what was still running), then the replay's totals."""
        if self.enabled:
            await self.segment()
        return self.totals()

    def totals(self) -> dict[str, Any] | None:
        """An `efim/stats`-shaped dict of the summed segments (no latency percentiles:
        the per-request records carry those)."""
        if self.last is None:
            return None
        out = {k: v for k, v in self.last.items() if k not in SUMMED and k not in ("ttftMs", "latencyMs", "engineLatencyMs")}
        out.update(self.sums)
        if self.warmup is not None:
            out["warmup"] = dict(self.last.get("warmup") or {}, **self.warmup)
        return out
