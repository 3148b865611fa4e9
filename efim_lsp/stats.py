"""Server-side counters and latency series behind the `efim/stats` request.

Times are measured at the server: `ttft` from a request's arrival (the moment
its message was read off stdin) to the engine's first generated token as seen
by the server; `latency` from arrival to the answer being handed to pygls (all answered requests;
`engine_latency` only those the engine computed, typing-through hits excluded).
"""

from __future__ import annotations

import logging
import math
from collections import Counter, deque
from dataclasses import dataclass, field, fields
from typing import Any

from engine.api import TOKEN_COUNTS, EngineStats, RequestStats

log = logging.getLogger(__name__)

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


# `efim/stats` reports each count under its field's name in camelCase (`_counts`), in
# these groups, in this order.
_REQUEST_COUNTS = ("requests", "served", "typing_through_hits", "import_names", "first_window_answers", "first_window_warmups", "cancelled", "deadline_cuts",
                   *TOKEN_COUNTS)
_SUGGESTION_COUNTS = ("shown", "accepted", "partially_accepted", "accepted_chars")
_WARM_COUNTS = ("warm_submitted", "warm_completed", "warm_cancelled", "warm_prefilled_tokens", "warm_position_signals",
                "warm_left", "warm_after_deadline_cuts", "warm_answers", "warm_answer_hits", "warm_answer_tokens")  # under "warmup"
_NEXT_EDIT_COUNTS = (
    "next_edit_requests", "next_edit_offered", "next_edit_empty", "next_edit_shown", "next_edit_accepted",
    "next_edit_stale_accepts", "next_edit_probes", "next_edit_model_offers",
)  # under "nextEdit"
_DISK_COUNTS = ("kv_disk_loaded_tokens", "kv_disk_saved_files")  # `EngineStats`', under "kvDisk"
_SPECULATION_COUNTS = ("decode_steps", "verify_steps", "draft_tokens", "accepted_tokens")  # `EngineStats`'


@dataclass(eq=False)
class ServerStats:
    """The server's record: its requests and the engine's token counts of those the engine
    computed (`TOKEN_COUNTS`, named as in `RequestStats`), the suggestions' fate, latency
    series and its warm-ups' cost. `to_wire` adds the engine's record (`EngineStats`)."""

    requests: int = 0
    served: int = 0
    typing_through_hits: int = 0
    import_names: int = 0  # answered with the names a `from X import` list needs (efim_lsp.context.import_names)
    first_window_answers: int = 0  # answered from a small window while the full one warmed (efim_lsp.first_window)
    first_window_warmups: int = 0  # small windows prefilled ahead of the full one at a cursor signal
    cancelled: int = 0
    deadline_cuts: int = 0  # answers the `timeoutMs` deadline ended (shown cut to whole words, or declined)
    prompt_tokens: int = 0
    reused_tokens: int = 0
    prefilled_tokens: int = 0
    generated_tokens: int = 0
    shown: int = 0
    accepted: int = 0
    partially_accepted: int = 0
    accepted_chars: int = 0
    declined: Counter[str] = field(default_factory=Counter)
    ttft: LatencySeries = field(default_factory=LatencySeries)
    latency: LatencySeries = field(default_factory=LatencySeries)  # every answered request (typing-through hits included)
    engine_latency: LatencySeries = field(default_factory=LatencySeries)  # requests the engine answered
    # Next edits (efim_lsp.next_edit): requests, offered, answered empty, shown, accepted.
    next_edit_requests: int = 0
    next_edit_offered: int = 0
    next_edit_empty: int = 0
    next_edit_shown: int = 0
    next_edit_accepted: int = 0
    next_edit_stale_accepts: int = 0
    # The model's next edits (nextEdit "model"): probes asked, offers they made.
    next_edit_probes: int = 0
    next_edit_model_offers: int = 0
    # Background warm-ups (navigation): what they cost, apart from the requests above.
    warm_submitted: int = 0
    warm_completed: int = 0
    warm_cancelled: int = 0
    warm_prefilled_tokens: int = 0
    # Cursor places read from editors' own requests (document highlights, code actions) and
    # taken as cursor signals (efim_lsp.handlers.cursor_requests).
    warm_position_signals: int = 0
    # Warm-ups ended because a cursor signal put the person in another document.
    warm_left: int = 0
    # Warm-ups that finish a prompt the `timeoutMs` deadline cut before it was prefilled.
    warm_after_deadline_cuts: int = 0
    # Answers computed ahead at settled cursor signals (efim_lsp.answer_ahead): those that gave
    # a suggestion, the requests answered from one, the tokens they generated.
    warm_answers: int = 0
    warm_answer_hits: int = 0
    warm_answer_tokens: int = 0
    warm_compute_ms: float = 0.0

    def reset(self) -> None:
        """Zero every counter and series (`efim/stats` with `{"reset": true}`, for benchmarks)."""
        fresh = ServerStats()
        for f in fields(self):
            setattr(self, f.name, getattr(fresh, f.name))

    def add_warmup(self, stats: RequestStats, finish_reason: str) -> None:
        if finish_reason == "cancelled":
            self.warm_cancelled += 1
        else:
            self.warm_completed += 1
        self.warm_prefilled_tokens += stats.prefilled_tokens
        self.warm_compute_ms += max(0.0, stats.total_ms - stats.queue_ms)

    def add_engine_request(self, stats: RequestStats) -> None:
        log.debug(
            "engine request: prompt %d, reused %d, prefilled %d, healed %d, generated %d; queue %.1f ms, "
            "TTFT %.1f ms, total %.1f ms; %d decode steps (%d verify, %d of %d drafts accepted)",
            stats.prompt_tokens, stats.reused_tokens, stats.prefilled_tokens, stats.healed_tokens, stats.generated_tokens,
            stats.queue_ms, stats.ttft_ms, stats.total_ms, stats.decode_steps, stats.verify_steps, stats.accepted_tokens,
            stats.draft_tokens,
        )
        for name in TOKEN_COUNTS:
            setattr(self, name, getattr(self, name) + getattr(stats, name))

    @property
    def reuse_ratio(self) -> float:
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def to_wire(self, engine: EngineStats | None, sessions_active: int, rebases: int, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """The camelCase payload of `efim/stats` (no engine: its counts are 0)."""
        e = engine if engine is not None else EngineStats()
        out: dict[str, Any] = {
            **_counts(self, _REQUEST_COUNTS),
            "reuseRatio": round(self.reuse_ratio, 4),
            "ttftMs": self.ttft.summary(),
            "latencyMs": self.latency.summary(),
            "engineLatencyMs": self.engine_latency.summary(),
            "cacheBytes": e.cache_bytes_used,
            # KV the running requests compute in, within the same --kv-budget as cacheBytes.
            "workingKvBytes": e.working_kv_bytes,
            "sessions": {"active": sessions_active, "rebases": rebases},
            **_counts(self, _SUGGESTION_COUNTS),
            "declined": dict(self.declined),
            "warmup": {
                **_counts(self, _WARM_COUNTS, drop="warm_"),
                "computeMs": round(self.warm_compute_ms, 1),
                "documentTokens": e.document_tokens,
            },
            "nextEdit": _counts(self, _NEXT_EDIT_COUNTS, drop="next_edit_"),
            # Disk tier: "on", "off", or "off: <why>" after a disk failure turned it off.
            "kvDisk": {"state": e.kv_disk, **_counts(e, _DISK_COUNTS, drop="kv_disk_")},
            # Prompt-lookup speculation: decode forwards, the verifying ones, drafts and accepted drafts.
            "speculation": _counts(e, _SPECULATION_COUNTS),
        }
        if extra:
            out.update(extra)
        return out


def _counts(record: object, names: tuple[str, ...], drop: str = "") -> dict[str, Any]:
    """`record`'s counts `names` by their wire keys: the name without `drop`, in camelCase."""
    return {_camel(name.removeprefix(drop)): getattr(record, name) for name in names}


def _camel(name: str) -> str:
    head, *words = name.split("_")
    return head + "".join(w.capitalize() for w in words)
