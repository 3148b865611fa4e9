"""Protocol fuzzing of the real `efim serve` process over stdio.

Every case (see `protocol_cases`: framing garbage, non-JSON, JSON that is not an object,
unknown methods and notifications, valid messages with members replaced, dropped or added,
positions past the end or negative, unopened and non-file URIs, lone surrogates, CRLF and
mixed line endings, astral characters, binary content) is followed by a valid request that
must be answered correctly: the canary document's text, unchanged, from `efim/documentText`.
A request case must get exactly one answer, with the code the spec gives where it gives one
and never InternalError (-32603: an unexpected exception in the server). The server must
never die, and its stdout must carry nothing but well-framed JSON-RPC.

EFIM_FUZZ_CASES sets the number of generated cases (default 150, about 20 s; the long run
in docs/reliability.md uses 5,000). Failures found are kept in corpus/ and replayed first.
"""

from __future__ import annotations

import base64
import json
import os
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings

from protocol_cases import CANARY, Case, cases
from stdio_client import ServerProcess, _key, has_response, inline_params

CASES = int(os.environ.get("EFIM_FUZZ_CASES", "150"))
CORPUS = Path(__file__).resolve().parent / "corpus"
CANARY_TEXT = "def canary(x):\r\n    return '😀' + x\n\tpass\n"
ANSWER_TIMEOUT = 10.0

tried = {"generated": 0, "corpus": 0, "requests answered": 0}


@pytest.fixture(scope="module")
def server():
    with ServerProcess() as proc:
        proc.initialize()
        proc.open(CANARY, CANARY_TEXT)
        yield proc
        assert proc.proc.poll() is None, f"the server died: {proc.stderr()[-3000:]}"
        assert not proc.violations, proc.violations
        assert proc.shutdown_and_exit() == 0


def check(server: ServerProcess, case: Case) -> None:
    """Send one case, then prove the server is alive and its state intact."""
    with server._lock:  # an id-null answer to an earlier case (framing damage can be a parse error)
        server._responses.pop(_key(None), None)
    server.send_bytes(case.raw)
    if case.kind in ("invalid-id", "parse-error"):  # not a valid request, or not JSON: answered with id null
        reply = server.wait_response(None, ANSWER_TIMEOUT)
        expected = -32600 if case.kind == "invalid-id" else -32700
        assert reply["error"]["code"] == expected and reply["id"] is None, (case, reply)
        tried["requests answered"] += 1
    if case.id is not None:
        reply = server.wait_response(case.id, ANSWER_TIMEOUT)
        error = reply.get("error")
        if case.codes:
            assert error is not None and error["code"] in case.codes, (case, reply)
        elif error is not None:
            assert error["code"] != -32603, ("InternalError: the server raised unexpectedly", case, reply)
            assert isinstance(error.get("message"), str) and error["message"], reply
        tried["requests answered"] += 1
    copy = server.document_text(CANARY)  # the valid request after the case, answered correctly
    assert copy["text"] == CANARY_TEXT and copy["inSync"], (case, copy)
    assert server.proc.poll() is None, f"the server died on {case}"
    if case.id is not None:
        time.sleep(0.01)
        assert not has_response(server, case.id), ("answered twice", case)


def corpus_cases() -> list[tuple[str, Case]]:
    out = []
    for path in sorted(CORPUS.glob("*.json")):
        entry = json.loads(path.read_text())
        codes = entry.get("codes")
        out.append((path.stem, Case(entry["kind"], base64.b64decode(entry["raw"]), entry.get("id"), None if codes is None else frozenset(codes))))
    return out


@pytest.mark.parametrize("name,case", corpus_cases(), ids=[n for n, _ in corpus_cases()])
def test_corpus_regressions(server, name, case):
    check(server, case)
    tried["corpus"] += 1


def test_generated_cases(server):
    @settings(max_examples=CASES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(case=cases)
    def run(case: Case):
        check(server, case)
        tried["generated"] += 1

    run()
    # After all that, a completion on the canary is still an ordinary answer (no model: no items).
    reply = server.request("textDocument/inlineCompletion", inline_params(CANARY, 1, 4))
    assert reply["result"] == {"items": []}, reply


def teardown_module() -> None:
    print(f"\nprotocol fuzz: {tried['generated']} generated cases and {tried['corpus']} corpus cases sent to one server "
          f"process, {tried['requests answered']} request cases answered; the canary answered after each")
