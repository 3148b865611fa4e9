"""The replayer against the real server code over stdio, with a scripted (oracle) engine.

The oracle engine (tests/trace/oracle_server.py) continues every prompt with what the
original file says comes next, so suggestions are known in advance: the replayer must
accept them and still leave exactly the original text; slowed down, its requests are
long enough for the next key press to cancel them under `--speed realtime`."""

from __future__ import annotations

import hashlib
import json
import shlex
import stat
import sys
from pathlib import Path

import msgspec
import pytest

from efim_tools import cli
from efim_tools.trace.document import TextDocument
from efim_lsp.trace_format import read_trace, read_traces, write_trace
from efim_tools.trace.replay import Config, ReplayOptions, replay_config
from efim_tools.trace.report import summarize, table
from efim_tools.trace.synth import SynthOptions, synthesize

HERE = Path(__file__).parent
ORACLE = [sys.executable, str(HERE / "oracle_server.py")]

SOURCE = (
    "import os\r\n"
    "\r\n"
    "\r\n"
    "def label(path, width=20):\r\n"
    "    \"\"\"A short label for a path: 📁 for folders.\"\"\"\r\n"
    "    name = os.path.basename(path) or path\r\n"
    "    if os.path.isdir(path):\r\n"
    "        name = '📁 ' + name\r\n"
    "    if len(name) > width:\r\n"
    "        name = name[: width - 1] + '…'\r\n"
    "    return name.ljust(width)\r\n"
    "\r\n"
    "\r\n"
    "def total_size(paths):\r\n"
    "    total = 0\r\n"
    "    for p in paths:\r\n"
    "        if os.path.isfile(p):\r\n"
    "            total += os.path.getsize(p)  # bytes, 𝔟\r\n"
    "    return total\r\n"
)


def sha1(text: str) -> str:
    return hashlib.sha1(text.encode("utf-8")).hexdigest()


@pytest.fixture()
def workload(tmp_path):
    src = tmp_path / "labels.py"
    src.write_bytes(SOURCE.encode("utf-8"))
    traces = synthesize([src], SynthOptions(seed=5, sessions=2, min_chars=40))
    paths = [write_trace(tmp_path / f"t{i}.jsonl", t) for i, t in enumerate(traces)]
    targets = tmp_path / "targets.json"
    targets.write_text(json.dumps([SOURCE]), encoding="utf-8")
    return paths, targets


def oracle_env(targets: Path, **extra: str) -> dict[str, str]:
    return {"EFIM_ORACLE_TARGETS": str(targets), **extra}


def text_before_complete(trace, n: int) -> str:
    """The document as the trace has it just before its n-th (0-based) completion request."""
    doc = None
    seen = 0
    for event in trace.events:
        if event.kind == "open":
            doc = TextDocument("u", event.params["textDocument"]["text"])
        elif event.kind == "change":
            for change in event.params["contentChanges"]:
                doc.apply_change(change)
        elif event.kind == "complete":
            if seen == n:
                break
            seen += 1
    return doc.text


async def test_accepting_oracle_suggestions_rebuilds_the_file(workload):
    paths, targets = workload
    traces = read_traces(paths)
    options = ReplayOptions(server=ORACLE, env=oracle_env(targets), ready_timeout_s=60)
    result = await replay_config(Config("oracle", {}), traces, options)
    assert result.crashed is None
    assert result.accepts > 0
    assert result.accepted_chars >= 3 * result.accepts
    # accepting skipped the key presses that would have typed the same text
    assert len(result.records) < sum(t.completions for t in traces)
    # and the text ended exactly as the person's typing would have left it
    assert sorted(result.final_digests.values()) == [sha1(SOURCE)] * 2
    stats = result.stats_after
    assert stats["accepted"] + stats["partiallyAccepted"] == result.accepts
    assert stats["shown"] > 0
    assert stats["declined"].get("document out of sync", 0) == 0
    summary = summarize(result)
    assert summary.errors == 0 and summary.answered == len(result.records)
    assert summary.prefilled_per_request is not None and summary.reuse_ratio is not None
    # characters saved: what the oracle's accepted suggestions supplied, of all the person put in
    typed_by_hand = sum(
        len(change.get("text", "")) for t in traces for e in t.events if e.kind == "change" for change in e.params["contentChanges"]
    )
    assert summary.shown > 0 and summary.accepts == result.accepts
    assert summary.acceptance_rate == result.accepts / summary.shown
    # accepting skips key presses (typos and their corrections among them), never adds any
    assert 0 < result.typed_chars < typed_by_hand
    assert result.typed_chars + result.accepted_chars <= typed_by_hand
    assert summary.chars_saved == result.accepted_chars / (result.accepted_chars + result.typed_chars)
    print(f"oracle: characters saved {summary.chars_saved:.3f}, acceptance {summary.acceptance_rate:.3f}")
    assert summary.chars_saved > 0.5  # the oracle always suggests the rest of the true text
    # a replay that never accepts reports no characters saved (not 0 %); it runs with warm-ahead
    # off, so each trace's first request is the cold start (with it on, the edit that blanks the
    # body is a cursor signal: a warm-up prefills the cold prompt before the first key)
    typing_only = await replay_config(Config("oracle", {"warmAhead": False}), traces, options._replace(accept=False))
    assert typing_only.typed_chars == typed_by_hand and typing_only.accepts == 0
    cold = summarize(typing_only)
    assert cold.chars_saved is None and cold.acceptance_rate is None
    # a serial replay measures each trace's first request (cold start) on its own
    for run in (result, typing_only):
        assert run.first_requests["traces"] == 2 and run.first_requests["requests"] == 2
    assert typing_only.first_requests["prefilledTokens"] >= len(SOURCE) // 2  # the oracle's cold prompt
    assert cold.prefilled_per_request_warm < cold.prefilled_per_request
    assert cold.reuse_ratio_warm > cold.reuse_ratio
    # with warm-ahead on, the first request found its prompt already computed
    assert result.first_requests["prefilledTokens"] < typing_only.first_requests["prefilledTokens"]


async def test_a_person_cycles_to_the_alternative_that_matches(workload):
    """With `alternatives` > 1 the replayer checks every item against what is typed next:
    here the first item is always a decoy and the alternative the true continuation, so the
    first item never matches, some item often does, and the person accepts the alternative."""
    paths, targets = workload
    traces = read_traces(paths)
    options = ReplayOptions(server=ORACLE, env=oracle_env(targets, EFIM_ORACLE_DECOY="1"), ready_timeout_s=60)
    result = await replay_config(Config("alternatives", {"alternatives": 3}), traces, options)
    assert result.crashed is None
    summary = summarize(result)
    assert summary.most_items == 2  # the decoy and the truth (the other fork's copy of it is dropped as a duplicate)
    assert summary.checked > 0 and summary.first_matched == 0
    assert summary.any_matched > 0 and summary.accepts == summary.any_matched
    taken = [r.accepted_item for r in result.records if r.accepted]
    assert taken and set(taken) == {1}
    assert sorted(result.final_digests.values()) == [sha1(SOURCE)] * 2  # accepting the alternative left the true text
    assert "the first item matched 0 (0.0%)" in table({"alternatives": summary})
    single = summarize(await replay_config(Config("one item", {}), traces, options))  # n == 1: no decoy
    assert single.most_items == 1 and single.first_matched == single.any_matched > 0


async def test_realtime_users_cancel_running_requests(workload, tmp_path):
    paths, targets = workload
    traces = read_traces(paths)
    for trace in traces:  # a fast typist (~600 keys/min) keeps the test short
        trace.events = [msgspec.structs.replace(e, t=e.t * 0.4) for e in trace.events]
    limit = 14
    options = ReplayOptions(
        server=ORACLE,
        env=oracle_env(targets, EFIM_ORACLE_TOKEN_MS="12"),  # a suggestion takes ~0.2-0.7 s
        users=3,  # three people, two traces: the first trace is replayed twice at once
        speed="realtime",
        limit=limit,
        accept=False,
        ready_timeout_s=60,
    )
    result = await replay_config(Config("slow", {}), traces, options)
    assert result.crashed is None
    records = result.records
    assert len(records) == 3 * limit
    assert {r.user for r in records} == {0, 1, 2}
    # the three people typed at the same time
    spans = [(min(r.sent_ms for r in records if r.user == u), max(r.sent_ms for r in records if r.user == u)) for u in range(3)]
    assert max(s for s, _ in spans) < min(e for _, e in spans)
    outcomes = {r.outcome for r in records}
    assert "cancelled" in outcomes or "late" in outcomes
    assert result.cancels_sent > 0
    assert result.stats_after["cancelled"] > 0  # the server saw and honoured them
    assert all(r.outcome in ("answered", "cancelled", "late") for r in records)
    # each copy's document ended where the trace is before its (limit+1)-th request
    expected = {t.name: sha1(text_before_complete(t, limit)) for t in traces}
    for key, digest in result.final_digests.items():
        name = key.split(":")[0].split("#")[0]
        assert digest == expected[name]
    assert len(result.final_digests) == 3


def test_server_crash_reports_stderr_tail_and_partial_results(workload, tmp_path, monkeypatch, capsys):
    paths, targets = workload
    out = tmp_path / "crash.json"
    for key, value in oracle_env(targets, EFIM_ORACLE_CRASH_AFTER="4").items():
        monkeypatch.setenv(key, value)
    code = cli.main(["replay", str(paths[0]), "--server", shlex.join(ORACLE), "--no-accept", "--json", str(out), "-q"])
    captured = capsys.readouterr()
    assert code == 1, captured.err
    assert "crashing on purpose after 4 requests" in captured.err
    assert "exited with code 3" in captured.err
    assert "SERVER CRASHED (partial results)" in captured.out
    summary = json.loads(out.read_text())["configs"]["replay"]
    assert summary["requests"] >= 4 and summary["answered"] >= 4
    assert "crashing on purpose" in summary["crashed"]


def test_malformed_trace_is_reported_with_its_line(workload, tmp_path, capsys):
    paths, _ = workload
    lines = paths[0].read_text(encoding="utf-8").splitlines()
    lines[6] = '{"t": 1, "kind": "change"'
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert cli.main(["replay", str(bad), "-q"]) == 2
    assert f"{bad}:7: malformed trace event" in capsys.readouterr().err


async def test_recorded_session_replays_to_the_same_text(workload, tmp_path):
    paths, targets = workload
    record_dir = tmp_path / "rec" / "traces"
    trace = read_trace(paths[0])
    options = ReplayOptions(server=ORACLE, env=oracle_env(targets, EFIM_ORACLE_RECORD=str(record_dir)), ready_timeout_s=60)
    settings = {"maxTokens": 48}
    first = await replay_config(Config("live", settings), [trace], options)
    assert first.crashed is None and first.accepts > 0
    (path,) = record_dir.glob("*.jsonl")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(record_dir.stat().st_mode) == 0o700
    recorded = read_trace(path)
    assert recorded.header.source == "record"
    assert recorded.header.client["name"] == "efim replay"
    assert recorded.header.settings == settings
    assert recorded.header.position_encoding == "utf-16"
    kinds = [e.kind for e in recorded.events]
    assert {"open", "change", "complete", "show", "accept", "close"} <= set(kinds)
    assert kinds.count("complete") == len(first.records)
    assert all(b.t >= a.t for a, b in zip(recorded.events, recorded.events[1:]))
    # replaying the recording (no accepting: its edits already contain the accepted text)
    again = await replay_config(
        Config("again", {}), [recorded], ReplayOptions(server=ORACLE, env=oracle_env(targets), accept=False, ready_timeout_s=60)
    )
    assert again.crashed is None
    assert list(again.final_digests.values()) == [sha1(SOURCE)]
    assert len(again.records) == len(first.records)


def test_plot_without_matplotlib_fails_before_replaying(workload, capsys):
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("matplotlib is installed here")
    paths, _ = workload
    assert cli.main(["replay", str(paths[0]), "--server", "false", "--plot", "x.png", "-q"]) == 2
    assert "--plot needs matplotlib" in capsys.readouterr().err
