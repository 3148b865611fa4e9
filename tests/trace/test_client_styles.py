"""Tours in client styles (`efim trace synth --tour --client-styles`) and the client comparison
(`efim replay --compare clients`): the same person and edits in every style, each style
sending what its client sends at a jump; the report's grouping and percentiles; a replay
against the real server code (oracle engine) and one through `efim serve` on a tiny model."""

from __future__ import annotations

import hashlib
import json
import sys
import sysconfig
from pathlib import Path

import pytest

from efim_lsp.trace_format import read_trace, write_trace
from efim_tools import cli
from efim_tools.trace.clients import client_style, group_by_style, summarize_clients, table, to_json
from efim_tools.trace.document import TextDocument
from efim_tools.trace.jumps import first_keys, jump_marks, stop_patterns
from efim_tools.trace.person import RequestRecord
from efim_tools.trace.replay import Config, ConfigResult, ReplayOptions, replay_config
from efim_tools.trace.tour import CLIENT_STYLES, DEBOUNCE_MS, EDITOR_ASK_METHOD, EDITOR_ASK_MS, PATTERNS, TourOptions, synthesize_tours

HERE = Path(__file__).parent
REPO = HERE.parent.parent
ORACLE = [sys.executable, str(HERE / "oracle_server.py")]
STDLIB = Path(sysconfig.get_paths()["stdlib"])
SOURCES = [STDLIB / "textwrap.py", STDLIB / "shlex.py", STDLIB / "csv.py"]
ALL_STYLES = TourOptions(client_styles=CLIENT_STYLES, late_open_rate=0.5)


def styled(paths, **options) -> list[dict[str, object]]:
    """Tours in every style, grouped: [{style: Tour}, ...] one dict per tour."""
    tours = synthesize_tours(paths, ALL_STYLES._replace(**options))
    n = len(CLIENT_STYLES)
    return [{t.style: t for t in tours[k : k + n]} for k in range(0, len(tours), n)]


def sha1(text: str) -> str:
    return hashlib.sha1(text.encode("utf-8", "surrogatepass")).hexdigest()


def check_exact(tour) -> None:
    """Every change applied to a fresh document gives the text the plan said; nothing is
    edited, asked or closed in a document before its didOpen."""
    docs: dict[str, TextDocument] = {}
    expected = {index: (uri, digest) for index, uri, digest in tour.expected}
    for i, event in enumerate(tour.trace.events):
        if event.kind == "open":
            item = event.params["textDocument"]
            assert item["uri"] not in docs
            docs[item["uri"]] = TextDocument(item["uri"], item["text"], item["version"])
        elif event.kind in ("change", "complete", "cursor", "close"):
            assert event.uri in docs, f"event {i}: {event.kind} before didOpen"
            if event.kind == "change":
                for change in event.params["contentChanges"]:
                    docs[event.uri].apply_change(change)
                assert expected[i] == (event.uri, sha1(docs[event.uri].text)), f"event {i}"
    assert len(expected) > 0


def edits(trace) -> list[tuple[float, str, list]]:
    return [(e.t, e.uri, e.params["contentChanges"]) for e in trace.events if e.kind == "change"]


@pytest.mark.parametrize("seed", [0, 5])
def test_every_style_is_the_same_person_making_the_same_edits(seed):
    for group in styled(SOURCES, seed=seed, sessions=2, visits=10):
        assert list(group) == list(CLIENT_STYLES)
        ours = group["ours"].trace
        for style, tour in group.items():
            check_exact(tour)
            meta = tour.trace.header.meta
            assert meta["client_style"] == style == client_style(tour.trace)
            assert edits(tour.trace) == edits(ours)  # same keys, same times
            assert [e.t for e in tour.trace.events if e.kind == "open"] == [e.t for e in ours.events if e.kind == "open"]
            strip = [{k: v for k, v in j.items() if k not in ("id", "key_id")} for j in meta["jumps"]]
            assert strip == [{k: v for k, v in j.items() if k not in ("id", "key_id")} for j in ours.header.meta["jumps"]]
            assert sum(meta["patterns"].values()) == len(meta["jumps"]) == 10
            assert set(meta["patterns"]) <= set(PATTERNS)


def test_plain_sends_nothing_of_ours_and_asks_only_after_an_edit():
    for group in styled(SOURCES, seed=1, sessions=3, visits=10):
        trace = group["plain"].trace
        assert not [e for e in trace.events if e.kind == "cursor" or e.lsp_method.startswith("efim/")]
        previous = None
        for event in trace.events:
            if event.kind == "complete":
                assert previous == "change"  # one request per key press, nothing else
            previous = event.kind
        assert trace.completions == group["ours"].trace.completions
        assert first_keys(trace) == set(jump_marks(trace))


def test_an_editor_asks_about_the_landing_only_when_the_person_pauses_long_enough():
    asked = dropped = 0
    for group in styled(SOURCES, seed=6, sessions=3, visits=12):
        trace, plain = group["editor"].trace, group["plain"].trace
        events = trace.events
        assert not [e for e in events if e.lsp_method.startswith("efim/")]
        asks = [e for e in events if e.kind == "cursor"]
        assert asks and all(e.lsp_method == EDITOR_ASK_METHOD and e.id is not None for e in asks)
        ids = [e.id for e in events if e.id is not None]
        assert len(ids) == len(set(ids))  # requests of both kinds numbered once
        assert [e for e in events if e.kind != "cursor"] == [e for e in plain.events if e.kind != "cursor"] or \
            [(e.t, e.kind) for e in events if e.kind != "cursor"] == [(e.t, e.kind) for e in plain.events]
        for (i, mark), entry in zip(sorted(jump_marks(trace).items()), trace.header.meta["jumps"]):
            if mark.pattern == "file-switch":
                continue
            first_edit = max(j for j in range(i) if events[j].kind == "change")
            previous_key = max((j for j in range(first_edit) if events[j].kind == "complete"), default=-1)
            between = [e for e in events[previous_key + 1 : first_edit] if e.kind == "cursor"]
            landing_asks = [e for e in between if e.t >= events[first_edit].t - mark.pause_ms]
            if mark.pause_ms >= EDITOR_ASK_MS - DEBOUNCE_MS + 0.2:
                asked += 1
                (ask,) = landing_asks  # at the spot the first key edits
                (change,) = events[first_edit].params["contentChanges"]
                assert ask.params["position"] == change["range"]["start"] or ask.params["position"] == change["range"]["end"]
            elif mark.pause_ms < EDITOR_ASK_MS - DEBOUNCE_MS - 0.2:
                dropped += 1
                assert landing_asks == []  # the key came first
    assert asked > 10 and dropped > 3


def test_insert_enter_asks_at_the_landing_before_the_first_edit():
    for group in styled(SOURCES, seed=2, sessions=3, visits=10):
        trace = group["insert-enter"].trace
        events = trace.events
        assert not [e for e in events if e.kind == "cursor" or e.lsp_method.startswith("efim/")]
        marks, keys = jump_marks(trace), sorted(first_keys(trace))
        assert len(marks) == len(keys) == 10
        assert trace.completions == group["plain"].trace.completions + 10  # one more request per jump
        ours_cursors = [e for e in group["ours"].trace.events if e.kind == "cursor"]
        for (i, mark), k in zip(sorted(marks.items()), keys):
            assert i < k
            # the jump's request comes before any edit of the stop, at the spot the first key edits
            assert events[i - 1].kind != "change" and events[k - 1].kind == "change"
            assert [e.kind for e in events[i + 1 : k]] == ["change"]
            (change,) = events[k - 1].params["contentChanges"]
            assert events[i].uri == events[k - 1].uri and events[i].params["position"] == change["range"]["end"]
            # when our client would have notified the landing, and the pause counted from there
            landing = next(c for c in ours_cursors if c.t == events[i].t)
            assert landing.params["position"] == events[i].params["position"]
            assert mark.pause_ms == pytest.approx(events[k - 1].t - events[i].t, abs=0.11)


def test_a_file_switch_sends_no_edit_before_the_first_request_there():
    seen_late = seen_back = 0
    for group in styled(SOURCES, seed=3, sessions=3, visits=12):
        for style, tour in group.items():
            events = tour.trace.events
            opened_at_start = {e.uri for e in events if e.kind == "open" and e.t == 0.0}
            for (i, mark), entry in zip(sorted(jump_marks(tour.trace).items()), tour.trace.header.meta["jumps"]):
                if mark.pattern != "file-switch":
                    continue
                # what the client sent from the previous stop's last request to this jump's first
                previous = max((j for j in range(i) if events[j].kind == "complete"), default=-1)
                between = [e for e in events[previous + 1 : i] if e.t > 0.0]  # not the tabs restored at the start
                changes = [e for e in between if e.kind == "change"]
                if style == "insert-enter":
                    assert changes == []
                else:  # only the first key, right before its request, in the document switched to
                    assert changes == [events[i - 1]] and events[i - 1].uri == events[i].uri
                asks = [e for e in between if e.lsp_method == EDITOR_ASK_METHOD]  # the last stop's may be among them
                assert all(e.uri == events[i].uri for e in between if e not in asks)
                if entry["opened"]:  # a file opened now: its didOpen is the switch
                    seen_late += 1
                    assert events[i].uri not in opened_at_start and between[0].kind == "open"
                else:
                    seen_back += 1
                    assert not any(e.kind == "open" for e in between)
                assert any(e.kind == "cursor" and e.id is None for e in between) == (style == "ours")
                # the editor asks about the place it switched to (the file was navigated ≥ 300 ms)
                assert any(e.uri == events[i].uri for e in asks) == (style == "editor")
    assert seen_late and seen_back


def test_each_pattern_is_what_the_first_edit_does():
    counts = {p: 0 for p in PATTERNS}
    for group in styled(SOURCES, seed=4, sessions=4, visits=12):
        trace = group["plain"].trace
        events = trace.events
        for i, mark in jump_marks(trace).items():
            counts[mark.pattern] += 1
            (change,) = events[i - 1].params["contentChanges"]
            start, end = change["range"]["start"], change["range"]["end"]
            if mark.pattern == "file-switch":
                assert mark.switch
                continue
            assert not mark.switch
            if mark.pattern == "tail-deleted":  # one didChange deleting a selection of the line
                assert change["text"] == "" and start["line"] == end["line"] and end["character"] - start["character"] > 1
            elif mark.pattern == "backspaces":  # Backspace by Backspace, a request after each
                for j in range(i - 1, i + 5, 2):
                    (c,) = events[j].params["contentChanges"]
                    if c["text"]:
                        break
                    assert c["range"]["end"]["character"] - c["range"]["start"]["character"] == 1
                    assert events[j + 1].kind == "complete"
            elif mark.pattern == "new-line":  # Enter at a line's end: a new line under it
                assert change["text"].lstrip(" \t\r\n") == "" and "\n" in change["text"] and start == end
            elif mark.pattern == "paste":
                assert change["text"].count("\n") >= 1 and start == end and start["character"] == 0
        patterns = stop_patterns(trace)
        assert set(patterns.values()) <= set(PATTERNS)
        assert len(patterns) == trace.completions  # every request follows a jump
    assert all(counts.values()), counts


def test_an_edit_mix_gives_each_pattern_its_share_of_the_stops():
    """`--edit-mix`: the stops' first edits follow the weights (new-line weighted 0 never
    comes), the tour stays exact, and the header says which mix wrote it."""
    options = TourOptions(seed=9, visits=60, same_file_rate=1.0, client_styles=("plain",),
                          edit_mix=(("tail-deleted", 1.0), ("backspaces", 1.0), ("new-line", 0.0), ("paste", 2.0)))
    (tour,) = synthesize_tours(SOURCES, options)
    check_exact(tour)
    meta = tour.trace.header.meta
    assert meta["edit_mix"] == {"tail-deleted": 1.0, "backspaces": 1.0, "new-line": 0.0, "paste": 2.0}
    counts = {p: 0 for p in PATTERNS}
    for mark in jump_marks(tour.trace).values():
        counts[mark.pattern] += 1
    assert counts["new-line"] == 0 and counts["file-switch"] <= 1  # only the tour's first stop is a switch
    assert counts["tail-deleted"] >= 5 and counts["backspaces"] >= 5 and counts["paste"] >= counts["backspaces"], counts
    default = synthesize_tours(SOURCES, options._replace(edit_mix=()))[0].trace.header.meta
    assert "edit_mix" not in default  # tours without a mix are written as before it existed


@pytest.mark.parametrize("mix", [(("typo", 1.0),), (("paste", -1.0),), (("paste", 0.0),), (("paste", 1.0), ("paste", 2.0)),
                                 (("paste", float("nan")),)])
def test_a_bad_edit_mix_is_refused(mix):
    with pytest.raises(ValueError, match="--edit-mix"):
        TourOptions(edit_mix=mix).check()


def test_the_edit_mix_option_is_parsed_and_checked(tmp_path, capsys):
    out = tmp_path / "t.jsonl"
    base = ["trace", "synth", "--tour", *map(str, SOURCES), "-o", str(out), "--visits", "6", "--client-styles", "plain"]
    assert cli.main([*base, "--edit-mix", "backspaces=1, paste=0.5"]) == 0
    assert read_trace(out).header.meta["edit_mix"] == {"backspaces": 1.0, "paste": 0.5}
    for bad in ("backspaces", "backspaces=x", "typo=1"):
        assert cli.main([*base, "--edit-mix", bad]) != 0
        assert "--edit-mix" in capsys.readouterr().err


ANY_PYTHON = """\
# -*- coding: utf-8 -*-
\"\"\"A module no tour was tuned on: tabs, decorators, async, nested defs, unicode.\"\"\"
import functools


def decorate(fn):
\t@functools.wraps(fn)
\tdef inner(*args, **kwargs):
\t\tresult = fn(*args, **kwargs)
\t\treturn result
\treturn inner


class Ünïcode:
    @decorate
    def method(self, value: int = 3) -> int:
        doubled = value * 2  # 😀 astral
        return doubled + len("ß")

    async def fetch(self, items):
        async for item in items:
            yield item ** 2
        total = [x for x in range(10) if x % 2]
        return

def tail(xs):
    first, *rest = xs
    return rest or [first]
"""


@pytest.mark.parametrize("seed", [-7, 0, 2**40 + 3])
def test_any_python_files_and_any_seed(tmp_path, seed):
    odd = tmp_path / "odd.py"
    odd.write_text(ANY_PYTHON, encoding="utf-8")
    mine = [REPO / "efim_tools" / "trace" / "edits.py", REPO / "efim_tools" / "commands" / "trace.py", odd]
    for group in styled(mine, seed=seed, visits=8, files=3, undo_rate=0.5):
        for tour in group.values():
            check_exact(tour)
            assert len(jump_marks(tour.trace)) == 8


def test_tour_command_writes_one_trace_per_style(tmp_path, capsys):
    out = tmp_path / "tours"
    argv = ["trace", "synth", "--tour", *map(str, SOURCES), "-o", str(out), "--visits", "3", "--seed", "2"]
    assert cli.main(argv) == 0
    files = sorted(p.name for p in out.glob("*.jsonl"))
    assert files == [f"tour-000-{s}.jsonl" for s in sorted(CLIENT_STYLES)]
    traces = {f: read_trace(out / f) for f in files}
    assert {t.header.meta["client_style"] for t in traces.values()} == set(CLIENT_STYLES)
    assert all(t.header.meta["late_open_rate"] == 0.5 for t in traces.values())
    assert list(group_by_style(list(traces.values()))) == list(CLIENT_STYLES)
    err = capsys.readouterr().err
    assert "plain, " in err and "insert-enter, " in err
    # the navigation comparison replays every trace on one server: styles mixed there would warm each other
    assert cli.main(["replay", str(out), "--compare", "navigation", "-q"]) == 2
    assert "--compare clients" in capsys.readouterr().err
    assert cli.main([*argv, "--client-styles", "plain,insert-enter", "-o", str(tmp_path / "one.jsonl")]) == 2
    assert "one trace" in capsys.readouterr().err
    assert cli.main([*argv[:-4], "-o", str(tmp_path / "x"), "--client-styles", "plain,vim"]) == 2
    assert "--client-styles" in capsys.readouterr().err
    assert cli.main([*argv[:-4], "-o", str(tmp_path / "y.jsonl"), "--client-styles", "plain"]) == 0
    assert read_trace(tmp_path / "y.jsonl").header.meta["client_style"] == "plain"


def rec(trace, i, latency, ttft=None, pause=None, pattern=None, key=False, prefilled=None, prompt=None, warm=None, outcome="answered", chars=5):
    r = RequestRecord(user=0, trace=trace, index=i, sent_ms=float(i), outcome=outcome, latency_ms=latency, ttft_ms=ttft, chars=chars,
                      jump_pause_ms=pause, pattern=pattern, first_key=key, prefilled_tokens=prefilled, prompt_tokens=prompt)
    if warm is not None:
        r.warmup_submitted, r.warmup_cancelled, r.warmup_tokens = warm
    return r


def test_report_groups_by_pattern_and_splits_by_pause():
    records = [
        # insert-enter: the jump's request (no key), then its first key's
        rec("a", 0, 900.0, 880.0, pause=1500.0, pattern="file-switch", prefilled=1200, prompt=1300, warm=(1, 0, 300)),
        rec("a", 1, 40.0, 30.0, pattern="file-switch", key=True, prefilled=2, prompt=1301),
        rec("a", 2, 2.0, None, pattern="file-switch"),  # typing-through: client side only
        rec("a", 3, 700.0, 650.0, pause=20.0, pattern="backspaces", prefilled=1000, prompt=1250, warm=(1, 1, 64)),
        rec("a", 4, 60.0, 50.0, pattern="backspaces", key=True),
        rec("a", 5, 300.0, 280.0, pause=500.0, pattern="backspaces", prefilled=100, prompt=1200, warm=(2, 0, 900)),  # exactly the split: paused
        rec("a", 6, 20.0, 15.0, pattern="backspaces", key=True),
        rec("a", 7, None, outcome="error", pattern="backspaces"),
        rec("b", 0, 500.0, None, pause=100.0, pattern="file-switch", key=True, prefilled=1100, prompt=1100, chars=0),  # plain-like: the same request; empty
    ]
    result = ConfigResult(name="insert-enter", settings={}, records=records, wall_s=12.0,
                          stats_before={"warmup": {"submitted": 0}}, stats_after={"warmup": {"submitted": 4, "completed": 2, "cancelled": 1, "prefilledTokens": 1264, "computeMs": 900.0}})
    s = summarize_clients(result)
    assert s.style == "insert-enter" and s.requests == 9 and s.errors == 1 and s.answered == 8
    assert list(s.patterns) == ["file-switch", "backspaces"]  # PATTERNS order
    a = s.all
    assert a.jumps == 4 and a.paused.jumps == 2 and a.at_once.jumps == 2
    assert (a.paused.client.p50, a.paused.client.p95, a.paused.server.p50) == (300.0, 900.0, 280.0)
    assert (a.at_once.client.p50, a.at_once.client.p95) == (500.0, 700.0)  # nearest rank of [500, 700]
    assert (a.at_once.empty, a.paused.empty, a.at_once.server.n, a.at_once.server.p50) == (1, 0, 1, 650.0)  # no TTFT without a token
    assert (a.paused.first_key.n, a.paused.first_key.p50) == (2, 20.0)  # keys after the 1.5 s and 0.5 s jumps: [20, 40]
    assert (a.at_once.first_key.n, a.at_once.first_key.p50) == (2, 60.0)  # [60, 500]
    assert a.requests == 9 and a.client_all.n == 8 and a.server_all.n == 6  # the error has no time; typing-through and empty no TTFT
    assert (a.client_all.p95, a.client_all.p99) == (900.0, 900.0)
    assert a.prefilled_first_p50 == 1000 and a.prompt_first_p50 == 1200  # of [100, 1000, 1100, 1200] / [1100, 1200, 1250, 1300]
    assert a.warmup_before_first == {"submitted": 4.0, "cancelled": 1.0, "prefilledTokens": 1264.0}
    fs, bs = s.patterns["file-switch"], s.patterns["backspaces"]
    assert (fs.jumps, fs.requests, fs.paused.jumps, fs.at_once.jumps) == (2, 4, 1, 1)
    assert (fs.paused.client.p50, fs.paused.first_key.p50, fs.at_once.first_key.p50) == (900.0, 40.0, 500.0)
    assert fs.warmup_before_first == {"submitted": 1.0, "cancelled": 0.0, "prefilledTokens": 300.0}
    assert (bs.jumps, bs.requests, bs.paused.client.p50, bs.at_once.server.p50) == (2, 5, 300.0, 650.0)
    assert s.warmup == {"submitted": 4.0, "completed": 2.0, "cancelled": 1.0, "prefilledTokens": 1264.0, "computeMs": 900.0}
    text = table({"insert-enter": s})
    assert "First answer after a jump" in text and "file-switch" in text and "backspaces" in text
    row = next(line for line in text.splitlines() if line.startswith("insert-enter") and " all " in line)
    assert row.split("|")[1].split()[:5] == ["2", "300.0", "900.0", "280.0", "20.0"]
    assert row.split("|")[2].split()[:3] == ["2,", "1", "empty"]
    assert "4 started (2 done / 1 cancelled)" in text
    data = json.loads(json.dumps(to_json({"insert-enter": s}, {"x": 1})))
    cell = data["styles"]["insert-enter"]["patterns"]["backspaces"]
    assert cell["jumps"] == 2 and cell["paused"]["jumps"] == 1 and cell["paused"]["client"]["p50"] == 300.0
    assert data["pause_split_ms"] == 500.0
    # a server without warm-up numbers: reported as absent, not as zero
    bare = summarize_clients(ConfigResult(name="plain", settings={}, records=[rec("c", 0, 10.0, pause=900.0, pattern="paste")]))
    assert bare.warmup is None and bare.all.warmup_before_first is None and not bare.per_request
    assert "warm-ups not reported" in table({"plain": bare})


def oracle_env(tmp_path: Path, texts: list[str]) -> dict[str, str]:
    targets = tmp_path / "targets.json"
    targets.write_text(json.dumps(texts), encoding="utf-8")
    return {"EFIM_ORACLE_TARGETS": str(targets), "EFIM_ORACLE_LOG": str(tmp_path / "in.jsonl")}


async def test_styles_replayed_send_what_their_client_sends(tmp_path):
    (group,) = styled(SOURCES[:2], seed=6, visits=4, files=2)
    limit = 20
    for style, tour in group.items():
        log = tmp_path / style
        log.mkdir()
        env = oracle_env(log, [p.read_text(encoding="utf-8") for p in SOURCES[:2]])
        options = ReplayOptions(server=ORACLE, env=env, limit=limit, accept=False, request_stats=True, ready_timeout_s=60)
        result = await replay_config(Config(style, {}), [tour.trace], options)
        assert result.crashed is None and len(result.records) == limit
        sent = [json.loads(line)["method"] for line in (log / "in.jsonl").read_text(encoding="utf-8").splitlines()]
        assert ("efim/didMoveCursor" in sent) == (style == "ours")
        assert (EDITOR_ASK_METHOD in sent) == (style == "editor")
        jumps = [r for r in result.records if r.jump_pause_ms is not None]
        keys = [r for r in result.records if r.first_key]
        assert jumps and all(r.pattern is not None for r in result.records)
        if style == "insert-enter":
            assert [r.index + 1 for r in jumps if r.index + 1 < limit] == [r.index for r in keys]  # the key right after
        else:
            assert [r.index for r in jumps] == [r.index for r in keys]
        summary = summarize_clients(result)
        assert summary.all.jumps == len(jumps) and summary.per_request


def test_compare_clients_on_tiny_model(tiny_model_dir, tmp_path, capsys):
    for group in styled(SOURCES[:2], seed=1, visits=3, files=2):
        for style, tour in group.items():
            write_trace(tmp_path / f"tour-{style}.jsonl", tour.trace)
    out = tmp_path / "clients.json"
    limit = 8
    code = cli.main([
        "replay", str(tmp_path), "--compare", "clients", "--speed", "max", "--limit", str(limit),
        "--no-accept", "-q", "--config", json.dumps({"model": str(tiny_model_dir), "maxTokens": 4}), "--json", str(out),
    ])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    data = json.loads(out.read_text())
    assert list(data["styles"]) == list(CLIENT_STYLES)
    assert data["meta"]["traces_by_style"]["plain"][0].endswith("tour-plain.jsonl")
    for style, s in data["styles"].items():
        assert s["crashed"] is None and s["requests"] == limit and s["per_request"], style
        cell = s["all"]
        assert cell["jumps"] >= 1 and cell["jumps"] == cell["paused"]["jumps"] + cell["at_once"]["jumps"]
        assert cell["jumps"] == sum(c["jumps"] for c in s["patterns"].values())
        assert cell["prompt_first_p50"] >= cell["prefilled_first_p50"] > 0
        assert cell["client_all"]["p95"] <= cell["client_all"]["p99"]
        assert s["warmup"] is not None
        assert style in printed.out
    assert "First answer after a jump" in printed.out and "prefilled p50" in printed.out
