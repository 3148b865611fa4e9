"""No drift: the server's copy of a document equals the client's after every edit script.

In-process (fast, the bulk): `efim_lsp.documents.DocumentStore` fed each batch as the
server's didChange handler feeds it, an `EditSession` following the edits (and asked for
prompt segments where the script makes a completion request), checked after every batch.
Through the real `efim serve` process: scripts over stdio, checked with `efim/documentText`
and the checksum in `efim/stats`.

Sizes: EFIM_DRIFT_SCRIPTS (in-process, default 500) and EFIM_DRIFT_PROCESS_SCRIPTS
(per position encoding through the process, default 40); docs/reliability.md has the
10,000-script command. Run with `-s` to see the counts.
"""

from __future__ import annotations

import itertools
import os

import pytest
from hypothesis import HealthCheck, given, settings

from edit_scripts import Script, play, scripts
from efim_lsp.documents import DocumentStore, Edit, FullChange, RangeChange, text_checksum
from efim_lsp.positions import line_starts
from efim_lsp.session import Budget, EditSession
from efim_lsp.window import TokenMeter
from stdio_client import ServerProcess

IN_PROCESS = int(os.environ.get("EFIM_DRIFT_SCRIPTS", "500"))
THROUGH_PROCESS = int(os.environ.get("EFIM_DRIFT_PROCESS_SCRIPTS", "40"))
BUDGET = Budget(24, 12)  # small windows (tokens at ~3 chars each): edits land inside, above and below them

checked = {"in-process": 0, "batches": 0, "segments": 0, "process": 0}


def wire_changes(changes: list) -> list:
    """What the server's didChange handler builds from `contentChanges`."""
    out = []
    for c in changes:
        if "range" in c:
            r = c["range"]
            out.append(RangeChange(r["start"]["line"], r["start"]["character"], r["end"]["line"], r["end"]["character"], c["text"]))
        else:
            out.append(FullChange(c["text"]))
    return out


@settings(max_examples=IN_PROCESS, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(script=scripts)
def test_documents_and_edit_session_never_drift(script: Script):
    store = DocumentStore(script.encoding)
    uri = "file:///drift.py"
    store.open(uri, "python", 0, script.text)
    doc = store.get(uri)
    session = EditSession(TokenMeter(None, 3.0))
    session.prefix_last = len(script.text) % 2 == 1  # both session rules (PSM; suffix-first / prefix-only)
    for version, step in enumerate(play(script), start=1):
        outcome = store.change(uri, version, wire_changes(step.changes))
        assert outcome.in_sync, doc.sync_problem
        assert doc.text == step.text, f"drift after batch {version}: {step.changes}"
        assert doc.checksum == text_checksum(step.text)
        if version % 3 == 0 or step.cursor is not None:  # the line table kept per edit, as if rebuilt
            assert list(doc.index.starts) == line_starts(doc.text), f"line table drift after batch {version}"
        # The edits the store reports are the client's, in code-point offsets.
        if not outcome.resynced:
            assert outcome.edits == [Edit(*e) for e in step.edits]
        else:
            session.forget("document replaced")
        for edit in outcome.edits:
            session.observe(edit)
        assert session.consistent(doc.text), f"edit session inconsistent after batch {version}"
        if step.cursor is not None:
            seg = session.segments(doc.index, step.cursor, BUDGET)
            assert session.consistent(doc.text)
            start = step.cursor - len(seg.increment) - len(seg.prefix)
            assert doc.text[start : step.cursor] == seg.prefix + seg.increment
            assert doc.text.startswith(seg.suffix, step.cursor)
            checked["segments"] += 1
        checked["batches"] += 1
    checked["in-process"] += 1


_uris = itertools.count()


@pytest.fixture(scope="module", params=["utf-16", "utf-8"])
def server(request):
    with ServerProcess() as proc:
        result = proc.initialize(encoding=request.param)
        assert result["capabilities"]["positionEncoding"] == request.param
        proc.encoding = request.param
        yield proc
        assert not proc.violations, proc.violations
        assert proc.shutdown_and_exit() == 0


def test_drift_through_the_server_process(server):
    @settings(max_examples=THROUGH_PROCESS, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(script=scripts)
    def run(script: Script):
        script = script._replace(encoding=server.encoding)
        uri = f"file:///drift/{next(_uris)}.py"
        server.open(uri, script.text)
        text = script.text
        for version, step in enumerate(play(script), start=1):
            server.notify("textDocument/didChange", {"textDocument": {"uri": uri, "version": version}, "contentChanges": step.changes})
            text = step.text
        copy = server.document_text(uri)
        assert copy["inSync"] and copy["text"] == text, f"drift: server has {copy['text']!r}, client {text!r}"
        assert copy["checksum"] == text_checksum(text)
        stats = server.result("efim/stats")["documents"][uri]
        assert stats["checksum"] == copy["checksum"] and stats["length"] == len(text)
        server.notify("textDocument/didClose", {"textDocument": {"uri": uri}})
        checked["process"] += 1

    run()


def teardown_module() -> None:
    print(f"\ndrift check: {checked['in-process']} edit scripts in-process ({checked['batches']} didChange batches, "
          f"{checked['segments']} session segment checks), {checked['process']} through the server process, each compared after every batch")
