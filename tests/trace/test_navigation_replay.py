"""Replaying navigation: cursor notifications reach the server, pauses are kept, jumps are
reported apart — against the real server code with the oracle engine
(tests/trace/oracle_server.py), and once through `efim serve` on a tiny model."""

from __future__ import annotations

import hashlib
import json
import sys
import sysconfig
from pathlib import Path

import pytest

from efim_lsp.trace_format import Event, Header, Trace, write_trace
from efim_tools import cli
from efim_tools.trace.document import TextDocument
from efim_tools.trace.jumps import meta_entry
from efim_tools.trace.navigation import NAVIGATION_CONFIGS, summarize_navigation
from efim_tools.trace.person import RequestRecord
from efim_tools.trace.replay import Config, ConfigResult, ReplayOptions, replay_config
from efim_tools.trace.tour import TourOptions, synthesize_tours

HERE = Path(__file__).parent
ORACLE = [sys.executable, str(HERE / "oracle_server.py")]
STDLIB = Path(sysconfig.get_paths()["stdlib"])
SOURCES = [STDLIB / "textwrap.py", STDLIB / "shlex.py"]

A = "def first(x):\n    y = x + 1\n    return y * 2\n\n\ndef second(items):\n    total = sum(items)\n    return total\n"
B = "def other(name):\n    greeting = 'hello ' + name\n    return greeting.upper()\n"


def sha1(text: str) -> str:
    return hashlib.sha1(text.encode("utf-8", "surrogatepass")).hexdigest()


def oracle_env(tmp_path: Path, texts: list[str], **extra: str) -> dict[str, str]:
    targets = tmp_path / "targets.json"
    targets.write_text(json.dumps(texts), encoding="utf-8")
    return {"EFIM_ORACLE_TARGETS": str(targets), "EFIM_ORACLE_LOG": str(tmp_path / "in.jsonl"), **extra}


def notifications(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "in.jsonl").read_text(encoding="utf-8").splitlines()]


def texts_before(trace: Trace, limit: int) -> dict[str, str]:
    """Each document as the trace has it before its (limit+1)-th completion request."""
    docs: dict[str, TextDocument] = {}
    seen = 0
    for event in trace.events:
        if event.kind == "open":
            item = event.params["textDocument"]
            docs[item["uri"]] = TextDocument(item["uri"], item["text"])
        elif event.kind == "change":
            for change in event.params["contentChanges"]:
                docs[event.uri].apply_change(change)
        elif event.kind == "complete":
            if seen == limit:
                break
            seen += 1
    return {uri: doc.text for uri, doc in docs.items()}


async def test_tour_replay_sends_every_cursor_notification_and_stays_exact(tmp_path):
    (tour,) = synthesize_tours(SOURCES, TourOptions(seed=6, visits=6, files=2))
    trace = tour.trace
    limit = 45
    env = oracle_env(tmp_path, [p.read_text(encoding="utf-8") for p in SOURCES])
    options = ReplayOptions(server=ORACLE, env=env, limit=limit, accept=False, request_stats=True, ready_timeout_s=60)
    result = await replay_config(Config("oracle", {}), [trace], options)
    assert result.crashed is None
    assert len(result.records) == limit
    # the notifications the trace holds before its (limit+1)-th request, in order, as sent
    completes = [i for i, e in enumerate(trace.events) if e.kind == "complete"]
    cut = completes[limit] if limit < len(completes) else len(trace.events)
    wanted = [(e.uri, e.params["position"]) for e in trace.events[:cut] if e.kind == "cursor"]
    got = [(n["params"]["textDocument"]["uri"], n["params"]["position"]) for n in notifications(tmp_path) if n["method"] == "efim/didMoveCursor"]
    assert got == wanted and len(got) >= 2
    # each document ended exactly where the trace says
    expected = {uri: sha1(text) for uri, text in texts_before(trace, limit).items()}
    assert {key.split(":", 1)[1]: digest for key, digest in result.final_digests.items()} == expected
    # the jumps' first requests are marked; the server's numbers came per request
    jumps = [r for r in result.records if r.jump_pause_ms is not None]
    listed = {j["id"] for j in trace.header.meta["jumps"]}
    ids = [trace.events[i].id for i in completes[:limit]]
    assert [r.index for r in jumps] == [k for k, request_id in enumerate(ids) if request_id in listed]
    assert all(r.prefilled_tokens is not None for r in result.records)
    assert any(r.ttft_ms is not None for r in result.records)
    # the segments add up to the replay's totals
    assert result.stats_after["requests"] == limit
    assert result.stats_after["prefilledTokens"] == sum(r.prefilled_tokens for r in result.records)


def hand_built() -> tuple[Trace, list[float]]:
    """Two files; jumps after 0.8 s, 0.02 s (no pause) and 1.2 s (to the other file)."""
    ua, ub = "file:///nav/a.py", "file:///nav/b.py"
    docs = {ua: TextDocument(ua, A, 1), ub: TextDocument(ub, B, 1)}
    events = [Event(t=0.0, kind="open", params={"textDocument": {"uri": u, "languageId": "python", "version": 1, "text": d.text}}) for u, d in docs.items()]
    jumps, pauses = [], []
    request = 0
    t = 100.0

    def key(uri: str, start: int, end: int, text: str) -> int:
        nonlocal request, t
        doc = docs[uri]
        change = doc.edit(start, end, text)
        doc.version += 1
        events.append(Event(t=t, kind="change", params={"textDocument": {"uri": uri, "version": doc.version}, "contentChanges": [change]}))
        request += 1
        cursor = start + len(text)
        events.append(Event(t=t + 1, kind="complete", id=request, params={"textDocument": {"uri": uri}, "position": doc.position_at(cursor).to_lsp(), "context": {"triggerKind": 2}}))
        t += 120.0
        return request

    for uri, line_end, pause, switch in ((ua, A.index("\n", 20), 800.0, True), (ua, A.index("return total") + 12, 20.0, False), (ub, B.index("\n", 20), 1200.0, True)):
        events.append(Event(t=t, kind="cursor", params={"textDocument": {"uri": uri}, "position": docs[uri].position_at(line_end).to_lsp()}))
        t += pause
        pauses.append(pause)
        tail = docs[uri].text[line_end - 3 : line_end]
        first = key(uri, line_end - 1, line_end, "")  # backspace x3, then retype
        key(uri, line_end - 2, line_end - 1, "")
        key(uri, line_end - 3, line_end - 2, "")
        for j, ch in enumerate(tail):
            key(uri, line_end - 3 + j, line_end - 3 + j, ch)
        jumps.append(meta_entry(first, pause, switch))
        t += 300.0
    events += [Event(t=t + 100, kind="close", params={"textDocument": {"uri": u}}) for u in docs]
    return Trace(header=Header(meta={"jumps": jumps}), events=events), pauses


async def test_paced_replay_keeps_pauses_and_reports_jumps_apart(tmp_path):
    trace, pauses = hand_built()
    env = oracle_env(tmp_path, [A, B], EFIM_ORACLE_TOKEN_MS="1")
    options = ReplayOptions(server=ORACLE, env=env, speed="paced", accept=False, request_stats=True, ready_timeout_s=60)
    result = await replay_config(Config("paced", {}), [trace], options)
    assert result.crashed is None
    assert [r.jump_pause_ms for r in result.records if r.jump_pause_ms is not None] == pauses
    assert [r.index for r in result.records if r.jump_pause_ms is not None] == [0, 6, 12]
    assert [r.jump_switch for r in result.records if r.jump_pause_ms is not None] == [True, False, True]
    # paced: the server saw each pause between the notification and the first key, never shortened
    seen = notifications(tmp_path)
    moves = [n["at"] for n in seen if n["method"] == "efim/didMoveCursor"]
    firsts = [next(n["at"] for n in seen if n["method"] == "textDocument/didChange" and n["at"] > m) for m in moves]
    for moved, first, pause in zip(moves, firsts, pauses):
        assert first - moved >= pause / 1000 - 0.05
    summary = summarize_navigation(result)
    assert summary.jumps == 3
    assert summary.ttft_jump_paused.n == 2 and summary.ttft_jump_no_pause.n == 1
    assert summary.ttft_keys.n + 3 == summary.ttft_all.n == len(result.records) == 18
    assert summary.ttft_source in ("server", "server+client")
    # A paused jump's prompt is computed by the server's warm-up during the pause (warmAhead is
    # on by default): the replayer reports that work with the request, whose own prefill is small.
    for i in (0, 12):
        rec = result.records[i]
        assert rec.warmup_tokens >= 20 and rec.prefilled_tokens < rec.warmup_tokens, rec


def test_navigation_summary_splits_by_pause():
    def rec(i, ttft, pause=None, prefilled=None, outcome="answered", latency=50.0):
        return RequestRecord(user=0, trace="t", index=i, sent_ms=float(i), outcome=outcome, latency_ms=latency,
                             ttft_ms=ttft, jump_pause_ms=pause, prefilled_tokens=prefilled)

    records = [
        rec(0, 900.0, pause=1500.0, prefilled=400),
        rec(1, 20.0, prefilled=1),
        rec(2, None, prefilled=0, latency=2.0),  # typing-through: client latency
        rec(3, 300.0, pause=100.0, prefilled=300),
        rec(4, 30.0, prefilled=2),
        rec(5, 80.0, pause=500.0, prefilled=50),  # exactly the split: paused
        rec(6, None, outcome="cancelled"),
    ]
    result = ConfigResult(name="x", settings={}, records=records, stats_before={"warmup": {"submitted": 0, "computeMs": 0.0}},
                          stats_after={"warmup": {"submitted": 3, "completed": 2, "cancelled": 1, "prefilledTokens": 640, "computeMs": 812.5}})
    s = summarize_navigation(result)
    assert (s.ttft_jump_paused.n, s.ttft_jump_paused.p50, s.ttft_jump_paused.max) == (2, 80.0, 900.0)
    assert (s.ttft_jump_no_pause.n, s.ttft_jump_no_pause.p50) == (1, 300.0)
    assert (s.ttft_keys.n, s.ttft_keys.p50) == (3, 20.0)
    assert (s.ttft_all.n, s.ttft_all.max, s.ttft_all.p50) == (6, 900.0, 30.0)  # nearest rank of [2, 20, 30, 80, 300, 900]
    assert s.prefilled_per_jump == 250.0 and s.prefilled_per_key == 1.0
    assert s.warmup == {"submitted": 3.0, "completed": 2.0, "cancelled": 1.0, "prefilledTokens": 640.0, "computeMs": 812.5}
    assert s.ttft_source == "server+client" and s.latency_fallbacks == 1
    # no warm-up block from the server: reported as absent, not as zero
    assert summarize_navigation(ConfigResult(name="y", settings={}, records=records, stats_after={"requests": 7})).warmup is None


def test_compare_navigation_on_tiny_model(tiny_model_dir, tmp_path, capsys):
    (tour,) = synthesize_tours(SOURCES, TourOptions(seed=1, visits=3, files=2))
    write_trace(tmp_path / "tour.jsonl", tour.trace)
    out = tmp_path / "nav.json"
    limit = 10
    code = cli.main([
        "replay", str(tmp_path / "tour.jsonl"), "--compare", "navigation", "--speed", "max", "--limit", str(limit),
        "--no-accept", "-q", "--config", json.dumps({"model": str(tiny_model_dir), "maxTokens": 4}), "--json", str(out),
    ])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    data = json.loads(out.read_text())
    assert list(data["configs"]) == [name for name, _ in NAVIGATION_CONFIGS]
    assert data["meta"]["settings"]["all"]["warmAhead"] is True and data["meta"]["settings"]["today"]["documentKv"] is False
    for name, s in data["configs"].items():
        assert s["crashed"] is None, name
        assert s["requests"] == limit and s["ttft_all"]["n"] == limit
        assert s["ttft_source"] in ("server", "server+client")
        assert s["jumps"] >= 1 and s["prefilled_per_jump"] is not None
        assert s["ttft_all"]["p50"] <= s["ttft_all"]["p95"] <= s["ttft_all"]["max"]
        assert name in printed.out
    assert data["configs"]["today"]["prefilled_per_jump"] > 0  # no warm-up: a jump prefills
    assert "TTFT, ms" in printed.out and "prefilled/jump" in printed.out
