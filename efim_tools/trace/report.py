"""Turning replay results into numbers: per-configuration summary, comparison table, JSON, plot.

Where each number comes from (the table's footer says it again):
- TTFT: per request from the server when its answers carry one; otherwise the
  server's own `efim/stats` percentiles (arrival of the request → first generated
  token, measured inside the server; each configuration runs on a fresh server, so
  they cover exactly this replay); only if neither exists, client-side latency.
- latency: client-side, request written to the server's stdin → answer parsed.
- prefilled tokens per request and reuse ratio: deltas of the server's counters over
  the replay, divided by the completion requests the replayer sent.
- completions/s: answers delivered while still current, over the replay's wall time.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Literal

import msgspec

from efim_tools.trace.replay import ConfigResult

TtftSource = Literal["server-per-request", "server-stats", "client-latency", "none"]
BASELINE = "fim"


class Summary(msgspec.Struct, kw_only=True):
    ttft_ms_p50: float | None
    ttft_ms_p95: float | None
    ttft_ms_p99: float | None
    latency_ms_p50: float | None
    latency_ms_p95: float | None
    prefilled_per_request: float | None
    reuse_ratio: float | None
    completions_per_s: float
    requests: int
    # the same two without each trace's first request (a document's cold start);
    # measured in serial replays only (--users 1 --speed max), else None
    prefilled_per_request_warm: float | None = None
    reuse_ratio_warm: float | None = None
    answered: int = 0
    cancelled: int = 0
    late: int = 0
    errors: int = 0
    accepts: int = 0
    accepted_chars: int = 0
    # Characters saved: the share of the text the person put in that accepted suggestions
    # supplied (accepted / (accepted + typed by hand)); shown = answers that offered text.
    typed_chars: int = 0
    shown: int = 0
    chars_saved: float | None = None  # None when the replay did not accept (--no-accept)
    acceptance_rate: float | None = None
    # Alternatives: of the shown answers checked against the next typed text, how many had a
    # first (greedy) item that matched, and how many had any item that matched.
    checked: int = 0
    first_matched: int = 0
    any_matched: int = 0
    most_items: int = 0
    typing_through_hits: int | None = None
    ttft_source: TtftSource = "none"
    wall_s: float = 0.0
    ready_s: float = 0.0
    crashed: str | None = None


def percentile(values: Iterable[float], q: float) -> float | None:
    """Nearest-rank percentile, as the server computes it; None for no values."""
    ordered = sorted(values)
    if not ordered:
        return None
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[rank - 1]


def _delta(after: dict[str, Any] | None, before: dict[str, Any] | None, key: str) -> float | None:
    if not isinstance(after, dict) or not isinstance(after.get(key), (int, float)):
        return None
    base = before.get(key, 0) if isinstance(before, dict) else 0
    return float(after[key]) - float(base if isinstance(base, (int, float)) else 0)


def summarize(result: ConfigResult) -> Summary:
    records = result.records
    latencies = [r.latency_ms for r in records if r.latency_ms is not None]
    per_request_ttft = [r.ttft_ms for r in records if r.ttft_ms is not None]
    stats_ttft = (result.stats_after or {}).get("ttftMs") if isinstance(result.stats_after, dict) else None
    before_ttft = (result.stats_before or {}).get("ttftMs") if isinstance(result.stats_before, dict) else None
    if per_request_ttft:
        source: TtftSource = "server-per-request"
        ttft = tuple(percentile(per_request_ttft, q) for q in (50, 95, 99))
    elif isinstance(stats_ttft, dict) and stats_ttft.get("p50") and not (before_ttft or {}).get("p50"):
        source = "server-stats"
        ttft = tuple(float(stats_ttft[k]) if stats_ttft.get(k) is not None else None for k in ("p50", "p95", "p99"))
    elif latencies:
        source = "client-latency"
        ttft = tuple(percentile(latencies, q) for q in (50, 95, 99))
    else:
        source, ttft = "none", (None, None, None)
    n = len(records)
    prefilled = _delta(result.stats_after, result.stats_before, "prefilledTokens")
    prompt = _delta(result.stats_after, result.stats_before, "promptTokens")
    reused = _delta(result.stats_after, result.stats_before, "reusedTokens")
    hits = _delta(result.stats_after, result.stats_before, "typingThroughHits")
    answered = sum(1 for r in records if r.outcome == "answered")
    shown = sum(1 for r in records if r.outcome == "answered" and r.chars > 0)
    checked = [r for r in records if r.first_matched is not None]
    warm_prefill = warm_reuse = None
    first = result.first_requests
    if first and prefilled is not None and prompt is not None and reused is not None:
        warm_n = n - int(first.get("traces", 0))
        if warm_n > 0:
            warm_prefill = (prefilled - first["prefilledTokens"]) / warm_n
        warm_prompt = prompt - first["promptTokens"]
        if warm_prompt > 0:
            warm_reuse = (reused - first["reusedTokens"]) / warm_prompt
    return Summary(
        prefilled_per_request_warm=warm_prefill,
        reuse_ratio_warm=warm_reuse,
        ttft_ms_p50=ttft[0],
        ttft_ms_p95=ttft[1],
        ttft_ms_p99=ttft[2],
        latency_ms_p50=percentile(latencies, 50),
        latency_ms_p95=percentile(latencies, 95),
        prefilled_per_request=(prefilled / n) if prefilled is not None and n else None,
        reuse_ratio=(reused / prompt) if reused is not None and prompt else None,
        completions_per_s=answered / result.wall_s if result.wall_s > 0 else 0.0,
        requests=n,
        answered=answered,
        cancelled=sum(1 for r in records if r.outcome == "cancelled"),
        late=sum(1 for r in records if r.outcome == "late"),
        errors=sum(1 for r in records if r.outcome in ("error", "timeout")),
        accepts=result.accepts,
        accepted_chars=result.accepted_chars,
        typed_chars=result.typed_chars,
        shown=shown,
        chars_saved=(result.accepted_chars / (result.accepted_chars + result.typed_chars)
                     if result.accepting and result.accepted_chars + result.typed_chars else None),
        acceptance_rate=(result.accepts / shown) if result.accepting and shown else None,
        checked=len(checked),
        first_matched=sum(1 for r in checked if r.first_matched),
        any_matched=sum(1 for r in checked if r.any_matched),
        most_items=max((r.items for r in records), default=0),
        typing_through_hits=int(hits) if hits is not None else None,
        ttft_source=source,
        wall_s=round(result.wall_s, 3),
        ready_s=round(result.ready_s, 3),
        crashed=result.crashed,
    )


def ratio(value: float | None, base: float | None) -> float | None:
    if value is None or base is None or base == 0:
        return None
    return value / base


def fmt_number(value: float | None, digits: int = 1) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}"


def _fmt_ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def table(summaries: dict[str, Summary], baseline: str = BASELINE) -> str:
    """Plain-text comparison table; ratio columns are against `baseline` when present."""
    base = summaries.get(baseline)
    warm = any(s.prefilled_per_request_warm is not None for s in summaries.values())
    head = (
        f"{'config':<12} {'TTFT p50':>9} {'p95':>8} {'p99':>8} {'lat p50':>9} {'p95':>8} "
        f"{'prefill/req':>11} {'reuse':>6}" + (f" {'warm':>7} {'reuse':>6}" if warm else "")
        + f" {'compl/s':>8} {'reqs':>5}"
    )
    if base is not None:
        head += f" | vs {baseline}: {'TTFT p50':>8} {'prefill':>8}" + (f" {'warm':>7}" if warm else "") + f" {'compl/s':>8}"
    lines = [head, "-" * len(head)]
    for name, s in summaries.items():
        line = (
            f"{name:<12} {fmt_number(s.ttft_ms_p50):>9} {fmt_number(s.ttft_ms_p95):>8} {fmt_number(s.ttft_ms_p99):>8} "
            f"{fmt_number(s.latency_ms_p50):>9} {fmt_number(s.latency_ms_p95):>8} {fmt_number(s.prefilled_per_request):>11} "
            f"{fmt_number(s.reuse_ratio, 3):>6}"
            + (f" {fmt_number(s.prefilled_per_request_warm):>7} {fmt_number(s.reuse_ratio_warm, 3):>6}" if warm else "")
            + f" {fmt_number(s.completions_per_s, 2):>8} {s.requests:>5}"
        )
        if base is not None:
            line += (
                f" | {'':>{len(baseline) + 4}}{_fmt_ratio(ratio(s.ttft_ms_p50, base.ttft_ms_p50)):>8} "
                f"{_fmt_ratio(ratio(s.prefilled_per_request, base.prefilled_per_request)):>8}"
                + (f" {_fmt_ratio(ratio(s.prefilled_per_request_warm, base.prefilled_per_request_warm)):>7}" if warm else "")
                + f" {_fmt_ratio(ratio(s.completions_per_s, base.completions_per_s)):>8}"
            )
        lines.append(line)
    sources = sorted({s.ttft_source for s in summaries.values()})
    lines.append("")
    lines.append(
        "times in ms; TTFT: "
        + ", ".join(
            {
                "server-per-request": "per request, measured by the server",
                "server-stats": "server-measured (efim/stats ttftMs: request arrival -> first token)",
                "client-latency": "NOT available from the server; client-side full latency shown instead",
                "none": "no data",
            }[src]
            for src in sources
        )
        + "; latency: client-side (request written -> answer read)"
    )
    if warm:
        lines.append(
            "warm: prefilled tokens per request and reuse without each trace's first request "
            "(a document's cold start, which no cache can help)"
        )
    for name, s in summaries.items():
        extra = f"{name}: {s.answered} answered"
        if s.cancelled or s.late:
            extra += f", {s.cancelled} cancelled, {s.late} answered after cancel"
        if s.errors:
            extra += f", {s.errors} errors/timeouts"
        if s.chars_saved is not None:
            extra += (
                f", {s.shown} suggestions shown, {s.accepts} accepted"
                + (f" ({s.acceptance_rate:.1%})" if s.acceptance_rate is not None else "")
                + f"; characters saved {s.accepted_chars} of {s.accepted_chars + s.typed_chars}"
                + (f" ({s.chars_saved:.1%})" if s.chars_saved is not None else "")
            )
        if s.most_items > 1 and s.checked:
            extra += (
                f"; of {s.checked} answers checked against the next typed text, the first item matched"
                f" {s.first_matched} ({s.first_matched / s.checked:.1%}), any of up to {s.most_items} items"
                f" {s.any_matched} ({s.any_matched / s.checked:.1%})"
            )
        if s.typing_through_hits:
            extra += f", {s.typing_through_hits} typing-through hits"
        extra += f"; replay {s.wall_s:.1f} s after {s.ready_s:.1f} s start-up"
        if s.crashed:
            extra += "; SERVER CRASHED (partial results)"
        lines.append(extra)
    return "\n".join(lines)


JSON_KEYS = (
    "ttft_ms_p50", "ttft_ms_p95", "ttft_ms_p99", "latency_ms_p50", "latency_ms_p95",
    "prefilled_per_request", "reuse_ratio", "completions_per_s", "requests",
)


def to_json(summaries: dict[str, Summary], meta: dict[str, Any], baseline: str = BASELINE) -> dict[str, Any]:
    """`{"configs": {NAME: {...}}, "ratios_vs_<baseline>": {NAME: {...}}, "meta": {...}}`.

    Each configuration holds every `Summary` field, `JSON_KEYS` always among them (TTFT
    p50/p95/p99, latency p50/p95, tokens prefilled per request, reuse ratio, completions/s,
    requests); its ratios are against `baseline`: TTFT p50, latency p50, tokens prefilled per
    request (all and warm), completions/s."""
    configs = {name: msgspec.to_builtins(s) for name, s in summaries.items()}
    base = summaries.get(baseline)
    ratios = {}
    if base is not None:
        for name, s in summaries.items():
            ratios[name] = {
                "ttft_ms_p50": ratio(s.ttft_ms_p50, base.ttft_ms_p50),
                "latency_ms_p50": ratio(s.latency_ms_p50, base.latency_ms_p50),
                "prefilled_per_request": ratio(s.prefilled_per_request, base.prefilled_per_request),
                "prefilled_per_request_warm": ratio(s.prefilled_per_request_warm, base.prefilled_per_request_warm),
                "completions_per_s": ratio(s.completions_per_s, base.completions_per_s),
            }
    return {"configs": configs, "ratios_vs_" + baseline: ratios, "meta": meta}


def plot(results: list[ConfigResult], path: str) -> str:
    """Per-request TTFT (or latency when the server gives no per-request TTFT) per
    configuration, in the order the requests were sent. Needs the `plot` extra."""
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'efim-lsp[plot]'") from None
    per_request = any(r.ttft_ms is not None for res in results for r in res.records)
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for res in results:
        records = sorted(res.records, key=lambda r: r.sent_ms)
        ys = [(r.ttft_ms if per_request else r.latency_ms) for r in records]
        xs = [i for i, y in enumerate(ys) if y is not None]
        ax.plot(xs, [y for y in ys if y is not None], marker=".", linewidth=0.8, markersize=3, label=res.name)
    ax.set_yscale("log")
    ax.set_xlabel("completion request (keystroke), in send order")
    ax.set_ylabel("TTFT, ms (server)" if per_request else "latency, ms (client: request -> answer)")
    ax.set_title("efim replay: per-keystroke " + ("time to first token" if per_request else "completion latency"))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
