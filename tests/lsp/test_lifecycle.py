"""The LSP lifecycle of the real `efim serve` process, over its pipes (stdlib client):
initialize / shutdown / exit by the spec, and a prompt, clean end on stdin closing or SIGTERM.

The stop-time bound asserted is the spec's 2 s (measured: 0.1-0.6 s on a loaded 2-core
machine); the measured times are printed (`-s`)."""

from __future__ import annotations

import signal
import time

import pytest

from stdio_client import NO_MODEL, ServerProcess, alive, children_of, inline_params

URI = "file:///work/life.py"
STOP_BOUND_S = 2.0


def test_requests_before_initialize_get_server_not_initialized_and_notifications_are_dropped():
    with ServerProcess() as server:
        for method in ("efim/stats", "textDocument/inlineCompletion", "shutdown", "no/suchMethod"):
            reply = server.request(method, {"textDocument": {"uri": URI}, "position": {"line": 0, "character": 0}})
            assert reply["error"]["code"] == -32002, reply
        server.open(URI, "dropped = 1\n")  # a notification before initialize: dropped
        server.initialize()
        reply = server.request("efim/documentText", {"textDocument": {"uri": URI}})
        assert reply["error"]["code"] == -32602 and "unknown document" in reply["error"]["message"]
        assert server.shutdown_and_exit() == 0
        assert not server.violations


def test_a_second_initialize_is_an_invalid_request_and_changes_nothing():
    with ServerProcess() as server:
        server.initialize()
        server.open(URI, "x = 1\n")
        reply = server.request("initialize", {"processId": None, "rootUri": None, "capabilities": {}})
        assert reply["error"]["code"] == -32600, reply
        assert server.document_text(URI)["text"] == "x = 1\n"  # the session goes on
        assert server.shutdown_and_exit() == 0


def test_after_shutdown_every_request_gets_invalid_request_and_exit_exits_0():
    with ServerProcess() as server:
        server.initialize()
        server.open(URI, "x = 1\n")
        assert server.request("shutdown")["result"] is None
        for method, params in [
            ("efim/stats", None),
            ("efim/documentText", {"textDocument": {"uri": URI}}),
            ("textDocument/inlineCompletion", {"textDocument": {"uri": URI}, "position": {"line": 0, "character": 0}}),
            ("shutdown", None),
            ("initialize", {"processId": None, "rootUri": None, "capabilities": {}}),
            ("no/suchMethod", {}),
        ]:
            reply = server.request(method, params, timeout=5)
            assert reply["error"]["code"] == -32600, (method, reply)
        server.notify("textDocument/didClose", {"textDocument": {"uri": URI}})  # dropped, no reply
        started = time.monotonic()
        server.notify("exit")
        assert server.proc.wait(30) == 0
        print(f"\nexit after shutdown: process gone in {time.monotonic() - started:.2f} s")
        assert time.monotonic() - started < STOP_BOUND_S
        assert not server.violations


def test_exit_without_shutdown_exits_1():
    with ServerProcess() as server:
        server.initialize()
        server.notify("exit")
        assert server.proc.wait(30) == 1


def test_exit_before_initialize_exits_1():
    with ServerProcess() as server:
        server.notify("exit")
        assert server.proc.wait(60) == 1  # includes the server's start (imports) on a loaded machine


def _stop(server: ServerProcess, how: str) -> float:
    started = time.monotonic()
    if how == "stdin":
        server.proc.stdin.close()
    else:
        server.proc.send_signal(signal.SIGTERM)
    server.proc.wait(10)
    return time.monotonic() - started


@pytest.mark.parametrize("how", ["stdin", "sigterm"])
def test_stdin_closing_or_sigterm_ends_the_process_within_2s_with_a_model_loaded(how, tiny_model_dir):
    with ServerProcess(["--model", str(tiny_model_dir), "--kv-budget", "32MB"]) as server:
        server.initialize({"maxTokens": 4})
        assert server.wait_model()["model"]["state"] == "ready"
        server.open(URI, "def f(x):\n    return x\n")
        reply = server.request("textDocument/inlineCompletion", inline_params(URI, 1, 4), timeout=60)
        assert "result" in reply, reply
        children = children_of(server.proc.pid)
        elapsed = _stop(server, how)
        print(f"\n{how} with a model loaded: process gone in {elapsed:.2f} s")
        assert elapsed < STOP_BOUND_S, f"took {elapsed:.2f} s; stderr:\n{server.stderr()[-2000:]}"
        assert server.proc.returncode == 1  # no shutdown was received
        assert not [pid for pid in children if alive(pid)], "child processes outlived the server"


@pytest.mark.parametrize("how", ["stdin", "sigterm"])
def test_stopping_while_the_model_is_still_loading_is_prompt(how, tiny_model_dir):
    """The model loads in a worker thread (importing torch takes seconds): exit must not wait for it."""
    with ServerProcess(["--model", str(tiny_model_dir)]) as server:
        server.initialize()
        assert server.result("efim/stats")["model"]["state"] in ("loading", "empty")
        elapsed = _stop(server, how)
        print(f"\n{how} while the model loads: process gone in {elapsed:.2f} s")
        assert elapsed < STOP_BOUND_S, f"took {elapsed:.2f} s; stderr:\n{server.stderr()[-2000:]}"
        assert server.proc.returncode == 1


def test_stdin_closing_after_shutdown_exits_0():
    with ServerProcess(["--model", NO_MODEL]) as server:
        server.initialize()
        server.result("shutdown")
        assert _stop(server, "stdin") < STOP_BOUND_S
        assert server.proc.returncode == 0


# --- faults ------------------------------------------------------------------------------


def test_an_exception_while_building_an_answer_is_an_empty_list_one_message_and_the_server_goes_on():
    """The fake-engine server (lsp_fake_server.py), whose answer building fails for "fault" URIs."""
    import sys
    from pathlib import Path

    from stdio_client import serve_env

    fake = [sys.executable, str(Path(__file__).resolve().parent / "lsp_fake_server.py")]
    with ServerProcess(command=fake, env=serve_env(EFIM_FAKE_FAULT="post")) as server:
        server.initialize()
        assert server.wait_model(30)["model"]["state"] == "ready"
        text = "def f(x):\n    \n"
        server.open("file:///work/fault.py", text)
        server.open("file:///work/fine.py", text)
        for _ in range(3):
            reply = server.request("textDocument/inlineCompletion", inline_params("file:///work/fault.py", 1, 4))
            assert reply.get("result") == {"items": []}, reply
        ok = server.result("textDocument/inlineCompletion", inline_params("file:///work/fine.py", 1, 4))
        assert ok["items"] and ok["items"][0]["insertText"]
        faults = [m for m in server.shown_messages() if "completion failed" in m]
        assert len(faults) == 1 and "ZeroDivisionError" in faults[0], server.shown_messages()
        assert "injected fault" in server.stderr()  # the traceback is in the log
        assert server.shutdown_and_exit() == 0


def test_a_trace_that_cannot_be_created_is_one_message_and_the_server_goes_on(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with ServerProcess(["--model", NO_MODEL, "--record", str(blocker / "traces")]) as server:
        server.initialize()
        server.open(URI, "x = 1\n")
        assert server.document_text(URI)["text"] == "x = 1\n"
        problems = [m for m in server.shown_messages() if "--record" in m]
        assert len(problems) == 1 and "not recorded" in problems[0], server.shown_messages()
        assert server.shutdown_and_exit() == 0


def test_a_recording_is_0600_in_a_0700_directory(tmp_path):
    import stat

    directory = tmp_path / "new" / "traces"
    with ServerProcess(["--model", NO_MODEL, "--record", str(directory)]) as server:
        server.initialize()
        server.open(URI, "secret = 1\n")
        assert server.document_text(URI)["text"] == "secret = 1\n"
        assert server.shutdown_and_exit() == 0
    (trace,) = directory.glob("*.jsonl")
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert stat.S_IMODE(trace.stat().st_mode) == 0o600
    assert "secret = 1" in trace.read_text()  # what is recorded: the documents' text, as the README says
