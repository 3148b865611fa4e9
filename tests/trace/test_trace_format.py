"""The trace file format: round trip, version refusal, malformed lines reported by number."""

from __future__ import annotations

import json
import os
import stat

import pytest

from efim_lsp.trace_format import (
    FORMAT_VERSION,
    Event,
    Header,
    Trace,
    TraceError,
    expand_paths,
    read_trace,
    write_trace,
)


def _sample() -> Trace:
    uri = "file:///tmp/ünï.py"
    return Trace(
        header=Header(
            created="2026-01-01T00:00:00.000+00:00",
            source="record",
            client={"name": "Visual Studio Code", "version": "1.99"},
            model="default",
            settings={"promptFormat": "efim", "cache": True, "maxTokens": 32},
            meta={"note": "emoji 😀 and CRLF"},
        ),
        events=[
            Event(t=0.0, kind="open", params={"textDocument": {"uri": uri, "languageId": "python", "version": 1, "text": "def f():\r\n    x = '😀'\r\n"}}),
            Event(t=120.5, kind="change", params={"textDocument": {"uri": uri, "version": 2}, "contentChanges": [{"range": {"start": {"line": 1, "character": 4}, "end": {"line": 1, "character": 4}}, "text": "r"}]}),
            Event(t=121.0, kind="complete", id=3, params={"textDocument": {"uri": uri}, "position": {"line": 1, "character": 5}, "context": {"triggerKind": 2}}),
            Event(t=130.0, kind="cancel", params={"id": 3}),
            Event(t=150.0, kind="show", params={"item": {"insertText": "eturn"}}),
            Event(t=151.0, kind="accept", method="workspace/executeCommand", params={"command": "efim.accept", "arguments": []}),
            Event(t=900.0, kind="close", params={"textDocument": {"uri": uri}}),
        ],
    )


def test_round_trip_keeps_every_field(tmp_path):
    trace = _sample()
    path = write_trace(tmp_path / "a.jsonl", trace)
    back = read_trace(path)
    assert back.header == trace.header
    assert back.events == trace.events
    assert back.events[1].lsp_method == "textDocument/didChange"
    assert back.events[5].lsp_method == "workspace/executeCommand"
    assert back.completions == 1
    # one JSON object per line, header first
    lines = path.read_bytes().splitlines()
    assert len(lines) == 1 + len(trace.events)
    assert json.loads(lines[0])["format"] == "efim-trace"


def test_files_are_private(tmp_path):
    path = write_trace(tmp_path / "a.jsonl", _sample())
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_unknown_version_is_refused_clearly(tmp_path):
    path = tmp_path / "future.jsonl"
    path.write_text(json.dumps({"format": "efim-trace", "version": FORMAT_VERSION + 1, "whatever": 1}) + "\n")
    with pytest.raises(TraceError, match=r"version 2 is not supported.*reads version 1"):
        read_trace(path)


def test_not_a_trace_is_refused(tmp_path):
    path = tmp_path / "other.jsonl"
    path.write_text('{"hello": "world"}\n')
    with pytest.raises(TraceError, match=r":1: not an efim-trace file"):
        read_trace(path)


@pytest.mark.parametrize(
    "bad",
    [
        "{not json",
        json.dumps({"t": 1.0, "kind": "typo", "params": {}}),  # unknown kind
        json.dumps({"t": "soon", "kind": "change", "params": {}}),  # wrong type
        json.dumps({"kind": "change", "params": {}}),  # missing t
    ],
)
def test_malformed_line_reports_its_number(tmp_path, bad):
    path = write_trace(tmp_path / "a.jsonl", _sample())
    lines = path.read_text(encoding="utf-8").splitlines()
    lines.insert(3, bad)  # becomes line 4 of the file
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(TraceError, match=rf"a\.jsonl:4: malformed trace event"):
        read_trace(path)


def test_directory_expands_to_its_traces(tmp_path):
    write_trace(tmp_path / "b.jsonl", _sample())
    write_trace(tmp_path / "a.jsonl", _sample())
    assert [p.name for p in expand_paths([tmp_path])] == ["a.jsonl", "b.jsonl"]
    with pytest.raises(FileNotFoundError):
        expand_paths([tmp_path / "missing.jsonl"])
