"""The client comparison: what a jump costs under each client style, pattern by pattern.

`efim replay --compare clients` replays tours written in several client styles (`tour.py`:
`plain`, `editor`, `insert-enter`, `ours`; each trace's header names its style), each style's
traces on a fresh server with the same settings (the defaults, plus `--config`), paced
(`person.py`: each answer awaited, every recorded pause kept) with per-request server
numbers (`probe.py`), and reports per style, for all jumps and per jump pattern
(`tour.PATTERNS`; a pattern's cell holds its jumps and the requests that follow them up
to the next jump):

- the first answer after a jump, split by the pause before the first key (at least
  `PAUSE_SPLIT_MS`, or typed at once): p50/p95 measured client side (request written →
  whole answer read: what a person waits for), next to the server's TTFT p50; and the
  client-side p50 of the first key's answer (the same request, except for a client that
  asks at the jump before any edit);
- every request of the cell: client side p95/p99 and server TTFT p95/p99;
- the work behind the first answer: that request's prefilled tokens next to its prompt
  (the window) — what is left of the window is the head start the server had — and the
  warm-ups the server started and cancelled, and the tokens they prefilled, between the
  previous answer and that one (`efim/stats` "warmup"); per style, the replay's totals.

Each cell says how many jumps it has, and how many of their first answers came back
empty (a server that cannot finish a request within its `timeoutMs` answers with nothing:
the person waited and got no suggestion). The server's TTFT exists for answers in which
the engine generated a token; a typing-through answer, or an empty one, has only its
client-side time.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import msgspec

from efim_lsp.trace_format import Trace
from efim_tools.trace.jumps import PAUSE_SPLIT_MS
from efim_tools.trace.navigation import Distribution, distribution, warmup_spent
from efim_tools.trace.person import RequestRecord
from efim_tools.trace.replay import ConfigResult
from efim_tools.trace.report import fmt_number, percentile
from efim_tools.trace.tour import CLIENT_STYLES, PATTERNS

ALL = "all"  # the cell of every jump of a style
WARMUP_COUNTS = (("submitted", "warmup_submitted"), ("cancelled", "warmup_cancelled"), ("prefilledTokens", "warmup_tokens"))


def client_style(trace: Trace) -> str:
    """The style a trace was written in: its header's; a tour from before client styles is
    `ours`; any other trace (recorded, or typing sessions) `unstyled`."""
    meta = trace.header.meta
    style = meta.get("client_style")
    if isinstance(style, str) and style:
        return style
    return "ours" if meta.get("tour") else "unstyled"


def group_by_style(traces: list[Trace]) -> dict[str, list[Trace]]:
    """Traces by client style, in `CLIENT_STYLES` order (then any other style by name)."""
    groups: dict[str, list[Trace]] = defaultdict(list)
    for trace in traces:
        groups[client_style(trace)].append(trace)
    order = [s for s in CLIENT_STYLES if s in groups] + sorted(s for s in groups if s not in CLIENT_STYLES)
    return {s: groups[s] for s in order}


class FirstAnswers(msgspec.Struct, kw_only=True):
    jumps: int
    empty: int  # first answers that offered no text (e.g. the server gave up past its `timeoutMs`)
    client: Distribution  # the jump's first request: request written -> whole answer read
    server: Distribution  # its TTFT, where the engine computed the answer
    first_key: Distribution  # client side: the answer to the first request after the jump's first edit


class Cell(msgspec.Struct, kw_only=True):
    jumps: int
    paused: FirstAnswers  # pause before the first key >= PAUSE_SPLIT_MS
    at_once: FirstAnswers  # shorter pause: typed at once
    requests: int  # every request of the cell's jumps
    client_all: Distribution
    server_all: Distribution
    prefilled_first_p50: float | None  # the jump's first request: tokens the server prefilled
    prompt_first_p50: float | None  # ... out of its prompt (the window)
    warmup_before_first: dict[str, float] | None  # started / cancelled / tokens before that answer; None: not reported


class ClientSummary(msgspec.Struct, kw_only=True):
    style: str
    all: Cell
    patterns: dict[str, Cell]
    warmup: dict[str, float] | None  # efim/stats "warmup" over the replay; None: not reported
    per_request: bool  # the server's numbers came per request (else server columns are empty)
    requests: int
    answered: int
    errors: int
    wall_s: float
    crashed: str | None = None


def _latency(record: RequestRecord) -> float | None:
    return record.latency_ms if record.outcome in ("answered", "late") else None


def _first_answers(jumps: list[RequestRecord], keys: list[RequestRecord]) -> FirstAnswers:
    return FirstAnswers(
        jumps=len(jumps),
        empty=sum(1 for r in jumps if _latency(r) is not None and r.chars == 0),
        client=distribution([v for v in map(_latency, jumps) if v is not None]),
        server=distribution([r.ttft_ms for r in jumps if r.ttft_ms is not None and _latency(r) is not None]),
        first_key=distribution([v for v in map(_latency, keys) if v is not None]),
    )


def _warmup_before(jumps: list[RequestRecord]) -> dict[str, float] | None:
    reported = [r for r in jumps if any(getattr(r, field) is not None for _, field in WARMUP_COUNTS)]
    if not reported:
        return None
    return {key: sum(getattr(r, field) or 0.0 for r in reported) for key, field in WARMUP_COUNTS}


def cell(records: list[RequestRecord], pauses: dict[tuple[str, int], float]) -> Cell:
    """The numbers of `records` (one cell's requests); `pauses` maps a first-key request
    (by trace and index) to the pause before its jump's first key."""
    jumps = [r for r in records if r.jump_pause_ms is not None]
    keys = [(r, pauses[r.trace, r.index]) for r in records if r.first_key and (r.trace, r.index) in pauses]
    paused = [r for r in jumps if r.jump_pause_ms >= PAUSE_SPLIT_MS]
    at_once = [r for r in jumps if r.jump_pause_ms < PAUSE_SPLIT_MS]
    prefilled = [r.prefilled_tokens for r in jumps if r.prefilled_tokens is not None]
    prompts = [r.prompt_tokens for r in jumps if r.prompt_tokens is not None]
    return Cell(
        jumps=len(jumps),
        paused=_first_answers(paused, [r for r, pause in keys if pause >= PAUSE_SPLIT_MS]),
        at_once=_first_answers(at_once, [r for r, pause in keys if pause < PAUSE_SPLIT_MS]),
        requests=len(records),
        client_all=distribution([v for v in map(_latency, records) if v is not None]),
        server_all=distribution([r.ttft_ms for r in records if r.ttft_ms is not None and _latency(r) is not None]),
        prefilled_first_p50=percentile(prefilled, 50),
        prompt_first_p50=percentile(prompts, 50),
        warmup_before_first=_warmup_before(jumps),
    )


def summarize_clients(result: ConfigResult) -> ClientSummary:
    """One style's replay (`result.name` is the style)."""
    records = result.records
    pauses: dict[tuple[str, int], float] = {}  # first-key request -> its jump's pause
    last_pause: dict[str, float] = {}  # per trace copy: the pause of the jump its requests follow
    for r in sorted(records, key=lambda r: (r.trace, r.index)):
        if r.jump_pause_ms is not None:
            last_pause[r.trace] = r.jump_pause_ms
        if r.first_key and r.trace in last_pause:
            pauses[r.trace, r.index] = last_pause[r.trace]
    by_pattern: dict[str, list[RequestRecord]] = defaultdict(list)
    for r in records:
        if r.pattern is not None:
            by_pattern[r.pattern].append(r)
    order = [p for p in PATTERNS if p in by_pattern] + sorted(p for p in by_pattern if p not in PATTERNS)
    return ClientSummary(
        style=result.name,
        all=cell(records, pauses),
        patterns={p: cell(by_pattern[p], pauses) for p in order},
        warmup=warmup_spent(result),
        per_request=any(r.ttft_ms is not None or r.prefilled_tokens is not None for r in records),
        requests=len(records),
        answered=sum(1 for r in records if r.outcome == "answered"),
        errors=sum(1 for r in records if r.outcome in ("error", "timeout")),
        wall_s=round(result.wall_s, 3),
        crashed=result.crashed,
    )


def _rows(summaries: dict[str, ClientSummary]):
    for name, s in summaries.items():
        yield name, ALL, s.all
        for pattern, c in s.patterns.items():
            yield "", pattern, c


def _n(value: float | None, digits: int = 1) -> str:
    return fmt_number(value, digits)


def _jumps(answers: FirstAnswers) -> str:
    return f"{answers.jumps}, {answers.empty} empty" if answers.empty else str(answers.jumps)


def table(summaries: dict[str, ClientSummary]) -> str:
    """Two plain-text blocks: the first answer after a jump, then every request and the work."""
    split = f"{PAUSE_SPLIT_MS / 1000:g} s"
    head = (
        f"{'style':<12} {'pattern':<12} | {'paused >= ' + split + ': jumps':>22} {'client p50':>10} {'p95':>7} {'server p50':>10} "
        f"{'key p50':>7} | {'typed at once: jumps':>20} {'client p50':>10} {'p95':>7} {'server p50':>10} {'key p50':>7}"
    )
    lines = ["First answer after a jump, ms", head, "-" * len(head)]
    for name, pattern, c in _rows(summaries):
        a, b = c.paused, c.at_once
        lines.append(
            f"{name:<12} {pattern:<12} | {_jumps(a):>22} {_n(a.client.p50):>10} {_n(a.client.p95):>7} {_n(a.server.p50):>10} "
            f"{_n(a.first_key.p50):>7} | {_jumps(b):>20} {_n(b.client.p50):>10} {_n(b.client.p95):>7} {_n(b.server.p50):>10} "
            f"{_n(b.first_key.p50):>7}"
        )
    head2 = (
        f"{'style':<12} {'pattern':<12} | {'jumps':>5} {'requests':>8} {'client p95':>10} {'p99':>7} {'server p95':>10} {'p99':>7} | "
        f"{'first answer: prefilled p50':>27} {'prompt p50':>10} | {'warm-ups before it: started':>27} {'cancelled':>9} {'tokens':>8}"
    )
    lines += ["", "All requests, and the work behind the first answer", head2, "-" * len(head2)]
    for name, pattern, c in _rows(summaries):
        w = c.warmup_before_first
        lines.append(
            f"{name:<12} {pattern:<12} | {c.jumps:>5} {c.requests:>8} {_n(c.client_all.p95):>10} {_n(c.client_all.p99):>7} "
            f"{_n(c.server_all.p95):>10} {_n(c.server_all.p99):>7} | {_n(c.prefilled_first_p50, 0):>27} {_n(c.prompt_first_p50, 0):>10} | "
            f"{_n(w['submitted'] if w else None, 0):>27} {_n(w['cancelled'] if w else None, 0):>9} {_n(w['prefilledTokens'] if w else None, 0):>8}"
        )
    lines += [
        "",
        "client: request written -> whole answer read (what a person waits for); server: TTFT the server measured "
        "(answers with a generated token only); empty: first answers without a suggestion (a server past its timeoutMs "
        "answers with nothing)",
        "key: client side, the answer to the first key's request (insert-enter asks at the jump, before that key); "
        f"paused: >= {split} from the jump to the first key; prompt: the first answer's window, prefilled: what the "
        "server still computed of it; warm-ups: efim/stats \"warmup\" between the previous answer and the jump's first",
    ]
    for name, s in summaries.items():
        w = s.warmup
        warm = (
            f"warm-ups over the replay {int(w.get('submitted', 0))} started ({int(w.get('completed', 0))} done / "
            f"{int(w.get('cancelled', 0))} cancelled), {_n(w.get('prefilledTokens'), 0)} tokens, {_n(w.get('computeMs'), 0)} ms"
            if w else "warm-ups not reported"
        )
        if w and "answerHits" in w:  # efim_lsp.answer_ahead
            warm += f"; answers ahead {int(w.get('answers', 0))} with a suggestion, {int(w['answerHits'])} requests answered from one"
        line = f"{name}: {s.requests} requests, {s.answered} answered, {s.errors} errors; {warm}; replay {s.wall_s:.1f} s"
        if not s.per_request:
            line += "; no per-request server numbers (server columns empty)"
        if s.crashed:
            line += "; SERVER CRASHED (partial results)"
        lines.append(line)
    return "\n".join(lines)


def to_json(summaries: dict[str, ClientSummary], meta: dict[str, Any]) -> dict[str, Any]:
    return {"styles": {name: msgspec.to_builtins(s) for name, s in summaries.items()}, "pause_split_ms": PAUSE_SPLIT_MS, "meta": meta}
