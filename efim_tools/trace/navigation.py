"""The navigation comparison: what a jump costs under each of the server's navigation settings.

`efim replay --compare navigation` replays the same traces (tours: `tour.py`) on a fresh
server per configuration of `NAVIGATION_CONFIGS`, paced (`person.py`: each answer
awaited, every recorded pause kept) with per-request server numbers (`probe.py`), and
reports per configuration:

- TTFT p50/p95/p99/max over all requests;
- TTFT of the first request after a jump (`jumps.py`), split by the pause before it:
  at least `PAUSE_SPLIT_MS` (the server had time to warm up) or less (no pause);
- keystroke TTFT p50: every other request (keys inside an edit);
- prefilled tokens per jump: the server's prefill for each jump's first request;
- warm-up: what the server spent in the background (`efim/stats` "warmup": submitted,
  completed, cancelled, prefilled tokens, compute ms), when it reports it.

TTFT is the server's (request read → first token) for each request the engine
answered; a request answered without the engine (a typing-through hit) counts with its
client-side latency; a replay without per-request server numbers falls back to client
latency for every request, and the table says so.
"""

from __future__ import annotations

from typing import Any

import msgspec

from efim_tools.trace.jumps import PAUSE_SPLIT_MS
from efim_tools.trace.person import RequestRecord
from efim_tools.trace.replay import ConfigResult
from efim_tools.trace.report import fmt_number, percentile

NAVIGATION_CONFIGS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("today", {"warmAhead": False, "documentKv": False}),
    ("warm-ahead", {"warmAhead": True, "documentKv": False}),
    ("document-kv", {"warmAhead": False, "documentKv": True}),
    ("all", {"warmAhead": True, "documentKv": True}),
)
WARMUP_KEYS = ("submitted", "completed", "cancelled", "prefilledTokens", "computeMs", "answers", "answerHits")


class Distribution(msgspec.Struct, kw_only=True):
    n: int
    p50: float | None
    p95: float | None
    p99: float | None
    max: float | None


def distribution(values: list[float]) -> Distribution:
    return Distribution(
        n=len(values),
        p50=percentile(values, 50),
        p95=percentile(values, 95),
        p99=percentile(values, 99),
        max=max(values) if values else None,
    )


class NavigationSummary(msgspec.Struct, kw_only=True):
    ttft_all: Distribution
    ttft_keys: Distribution  # requests that are not the first after a jump
    ttft_jump_paused: Distribution  # first after a jump, pause >= PAUSE_SPLIT_MS
    ttft_jump_no_pause: Distribution  # first after a jump, shorter pause
    jumps: int
    prefilled_per_jump: float | None  # mean over jumps with server numbers
    prefilled_per_jump_p50: float | None
    prefilled_per_key: float | None
    warmup: dict[str, float] | None  # efim/stats "warmup" over the replay; None: not reported
    ttft_source: str  # "server" | "server+client" (typing-through hits) | "client-latency"
    latency_fallbacks: int  # answered requests counted with their client latency (typing-through hits)
    requests: int
    answered: int
    errors: int
    wall_s: float
    crashed: str | None = None


def _ttft(record: RequestRecord, per_request: bool) -> float | None:
    if record.outcome not in ("answered", "late"):
        return None
    if per_request and record.ttft_ms is not None:
        return record.ttft_ms
    return record.latency_ms


def warmup_spent(result: ConfigResult) -> dict[str, float] | None:
    """The background warm-up over the replay: efim/stats "warmup" after minus before; None:
    the server reports none."""
    after = (result.stats_after or {}).get("warmup") if isinstance(result.stats_after, dict) else None
    if not isinstance(after, dict):
        return None
    before = (result.stats_before or {}).get("warmup") if isinstance(result.stats_before, dict) else None
    before = before if isinstance(before, dict) else {}
    out = {}
    for key in WARMUP_KEYS:
        value = after.get(key)
        if isinstance(value, (int, float)):
            base = before.get(key, 0)
            out[key] = float(value) - float(base if isinstance(base, (int, float)) else 0)
    return out


def summarize_navigation(result: ConfigResult) -> NavigationSummary:
    records = result.records
    per_request = any(r.ttft_ms is not None for r in records)
    values: list[float] = []
    keys: list[float] = []
    paused: list[float] = []
    quick: list[float] = []
    fallbacks = 0
    for r in records:
        value = _ttft(r, per_request)
        if value is None:
            continue
        if r.ttft_ms is None or not per_request:
            fallbacks += 1
        values.append(value)
        if r.jump_pause_ms is None:
            keys.append(value)
        elif r.jump_pause_ms >= PAUSE_SPLIT_MS:
            paused.append(value)
        else:
            quick.append(value)
    jump_prefill = [r.prefilled_tokens for r in records if r.jump_pause_ms is not None and r.prefilled_tokens is not None]
    key_prefill = [r.prefilled_tokens for r in records if r.jump_pause_ms is None and r.prefilled_tokens is not None]
    source = "client-latency" if not per_request else ("server+client" if fallbacks else "server")
    return NavigationSummary(
        ttft_all=distribution(values),
        ttft_keys=distribution(keys),
        ttft_jump_paused=distribution(paused),
        ttft_jump_no_pause=distribution(quick),
        jumps=sum(1 for r in records if r.jump_pause_ms is not None),
        prefilled_per_jump=sum(jump_prefill) / len(jump_prefill) if jump_prefill else None,
        prefilled_per_jump_p50=percentile(jump_prefill, 50),
        prefilled_per_key=sum(key_prefill) / len(key_prefill) if key_prefill else None,
        warmup=warmup_spent(result),
        ttft_source=source,
        latency_fallbacks=fallbacks if per_request else 0,
        requests=len(records),
        answered=sum(1 for r in records if r.outcome == "answered"),
        errors=sum(1 for r in records if r.outcome in ("error", "timeout")),
        wall_s=round(result.wall_s, 3),
        crashed=result.crashed,
    )


def _dist_cells(d: Distribution, *fields: str) -> str:
    return " ".join(f"{fmt_number(getattr(d, f)):>7}" for f in fields)


def table(summaries: dict[str, NavigationSummary]) -> str:
    """Two plain-text blocks: TTFT by kind of request, then the work behind it."""
    split = f"{PAUSE_SPLIT_MS / 1000:g} s"
    head = (
        f"{'config':<12} | {'all p50':>7} {'p95':>7} {'p99':>7} {'max':>7} | {'keys p50':>8} | "
        f"{'jump, paused >= ' + split + ': n':>24} {'p50':>7} {'p95':>7} {'max':>7} | "
        f"{'no pause: n':>11} {'p50':>7} {'p95':>7} {'max':>7}"
    )
    lines = ["TTFT, ms", head, "-" * len(head)]
    for name, s in summaries.items():
        lines.append(
            f"{name:<12} | {_dist_cells(s.ttft_all, 'p50', 'p95', 'p99', 'max')} | {fmt_number(s.ttft_keys.p50):>8} | "
            f"{s.ttft_jump_paused.n:>24} {_dist_cells(s.ttft_jump_paused, 'p50', 'p95', 'max')} | "
            f"{s.ttft_jump_no_pause.n:>11} {_dist_cells(s.ttft_jump_no_pause, 'p50', 'p95', 'max')}"
        )
    head2 = (
        f"{'config':<12} | {'prefilled/jump':>14} {'p50':>7} | {'prefilled/key':>13} | "
        f"{'warm-ups (done/cancelled)':>25} {'warm tokens':>11} {'warm ms':>9} | {'requests':>8} {'typing-through':>14} {'errors':>6}"
    )
    lines += ["", "Work", head2, "-" * len(head2)]
    for name, s in summaries.items():
        w = s.warmup
        warm = (
            f"{int(w.get('submitted', 0))} ({int(w.get('completed', 0))}/{int(w.get('cancelled', 0))})" if w else "not reported"
        )
        lines.append(
            f"{name:<12} | {fmt_number(s.prefilled_per_jump):>14} {fmt_number(s.prefilled_per_jump_p50, 0):>7} | "
            f"{fmt_number(s.prefilled_per_key):>13} | {warm:>25} {fmt_number(w.get('prefilledTokens') if w else None, 0):>11} "
            f"{fmt_number(w.get('computeMs') if w else None, 0):>9} | {s.requests:>8} {s.latency_fallbacks:>14} {s.errors:>6}"
        )
    sources = {s.ttft_source for s in summaries.values()}
    lines.append("")
    note = {
        "server": "TTFT measured by the server per request (efim/stats after each answer)",
        "server+client": "TTFT measured by the server per request; answers without the engine (typing-through) count with their client latency",
        "client-latency": "no per-request server TTFT: client-side latency (request -> whole answer) shown instead",
    }
    lines += [note[src] for src in sorted(sources)]
    lines.append(
        f"jump: the first request after a jump (cursor notification, then keys); paused: >= {split} from the "
        "notification to the first key; prefilled/jump: the server's prefill for that request; warm-ups: background "
        "work the server reported (efim/stats \"warmup\")"
    )
    for name, s in summaries.items():
        if s.crashed:
            lines.append(f"{name}: SERVER CRASHED (partial results)")
    return "\n".join(lines)


def to_json(summaries: dict[str, NavigationSummary], meta: dict[str, Any]) -> dict[str, Any]:
    return {"configs": {name: msgspec.to_builtins(s) for name, s in summaries.items()}, "pause_split_ms": PAUSE_SPLIT_MS, "meta": meta}
