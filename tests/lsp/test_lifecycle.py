"""The LSP lifecycle of the real `efim serve` process, over its pipes (stdlib client):
initialize / shutdown / exit by the spec, and a prompt, clean end on stdin closing or SIGTERM."""

from __future__ import annotations

import signal
import time

import pytest

from stdio_client import NO_MODEL, ServerProcess, alive, children_of, inline_params

URI = "file:///work/life.py"


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
        assert server.proc.wait(5) == 0
        assert time.monotonic() - started < 2.0
        assert not server.violations


def test_exit_without_shutdown_exits_1():
    with ServerProcess() as server:
        server.initialize()
        server.notify("exit")
        assert server.proc.wait(5) == 1


def test_exit_before_initialize_exits_1():
    with ServerProcess() as server:
        server.notify("exit")
        assert server.proc.wait(5) == 1


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
        assert elapsed < 2.0, f"took {elapsed:.2f} s; stderr:\n{server.stderr()[-2000:]}"
        assert server.proc.returncode == 1  # no shutdown was received
        assert not [pid for pid in children if alive(pid)], "child processes outlived the server"


@pytest.mark.parametrize("how", ["stdin", "sigterm"])
def test_stopping_while_the_model_is_still_loading_is_prompt(how, tiny_model_dir):
    """The model loads in a worker thread (importing torch takes seconds): exit must not wait for it."""
    with ServerProcess(["--model", str(tiny_model_dir)]) as server:
        server.initialize()
        assert server.result("efim/stats")["model"]["state"] in ("loading", "empty")
        elapsed = _stop(server, how)
        assert elapsed < 2.0, f"took {elapsed:.2f} s; stderr:\n{server.stderr()[-2000:]}"
        assert server.proc.returncode == 1


def test_stdin_closing_after_shutdown_exits_0():
    with ServerProcess(["--model", NO_MODEL]) as server:
        server.initialize()
        server.result("shutdown")
        assert _stop(server, "stdin") < 2.0
        assert server.proc.returncode == 0
