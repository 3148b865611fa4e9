"""A remote backend through the real `efim serve` process, against the fault-injecting server
(tests/remote/fault_server.py): an outage gives ONE `window/showMessage` however many
keystrokes arrive during it, completions answer empty (never an error), `efim/stats`
"engine" shows the backend's state, the server reconnects by itself and the documents are
intact; a new remote engine that cannot be built keeps the old one serving."""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lsp"))
from fault_server import FaultServer  # noqa: E402
from stdio_client import ServerProcess, inline_params  # noqa: E402

URI = "file:///work/remote.py"
TEXT = "def add(a, b):\n    \n\nprint(add(1, 2))\n"


def _complete(server: ServerProcess, version: int) -> dict:
    reply = server.request("textDocument/inlineCompletion", inline_params(URI, 1, 4 + version), timeout=30)
    assert "result" in reply, reply
    return reply["result"]


def _type(server: ServerProcess, version: int, ch: str) -> None:
    server.notify("textDocument/didChange", {
        "textDocument": {"uri": URI, "version": version},
        "contentChanges": [{"range": {"start": {"line": 1, "character": 3 + version}, "end": {"line": 1, "character": 3 + version}},
                            "text": ch}],
    })


def _wait_state(server: ServerProcess, state: str, timeout: float = 15.0) -> dict:
    end = time.monotonic() + timeout
    while True:
        stats = server.result("efim/stats")
        if stats["engine"].get("state") == state:
            return stats
        assert time.monotonic() < end, stats["engine"]
        time.sleep(0.1)


def test_an_outage_is_told_once_and_the_server_recovers_with_its_documents(tiny_model_dir):
    backend = FaultServer(pieces=["return", " a", " +", " b"])  # down at start
    with ServerProcess(["--model", str(tiny_model_dir)]) as server:
        server.initialize({"backend": "llama.cpp", "endpoint": backend.url, "maxTokens": 8})
        stats = server.wait_model()
        assert stats["model"]["state"] == "ready", stats["model"]
        assert stats["engine"]["state"] == "unreachable" and stats["engine"]["endpoint"] == backend.url
        assert stats["model"]["info"]["dtype"] == "remote"
        server.open(URI, TEXT)
        typed = "ret"
        for i, ch in enumerate(typed):
            _type(server, i + 1, ch)
            assert _complete(server, i + 1) == {"items": []}
        shown = [m for m in server.shown_messages() if "unreachable" in m or "cannot reach" in m]
        assert len(shown) == 1, server.shown_messages()
        assert server.result("efim/stats")["declined"].get("engineError", 0) >= len(typed)

        backend.start()
        try:
            _wait_state(server, "connected")
            items = _complete(server, len(typed))["items"]
            assert [item["insertText"] for item in items] == ["return a + b"]  # what the backend streamed
            assert server.document_text(URI)["text"] == TEXT.replace("    \n", "    ret\n", 1)
            stats = server.result("efim/stats")
            assert stats["engine"]["reconnects"] == 1 and stats["engine"]["reuseReported"] >= 1
            body = backend.completions()[-1]
            assert isinstance(body["prompt"], list) and body["cache_prompt"] is True
        finally:
            backend.stop()
        # The second outage is told too (once).
        _type(server, len(typed) + 1, "u")
        assert _complete(server, len(typed) + 1) == {"items": []}
        _type(server, len(typed) + 2, "r")
        assert _complete(server, len(typed) + 2) == {"items": []}
        shown = [m for m in server.shown_messages() if "unreachable" in m or "cannot reach" in m or "dropped" in m]
        assert len(shown) == 2, server.shown_messages()
        assert not server.violations
        assert server.shutdown_and_exit() == 0


def test_a_remote_engine_that_cannot_start_keeps_the_old_one(tiny_model_dir):
    with FaultServer() as backend, ServerProcess(["--model", str(tiny_model_dir)]) as server:
        server.initialize({"backend": "llama.cpp", "endpoint": backend.url})
        assert server.wait_model()["model"]["state"] == "ready"
        server.open(URI, TEXT)
        assert _complete(server, 0)["items"]
        server.notify("workspace/didChangeConfiguration", {"settings": {"endpoint": "ftp://nowhere"}})
        end = time.monotonic() + 30
        while not any("kept the previous engine" in m for m in server.shown_messages()):
            assert time.monotonic() < end, server.shown_messages()
            time.sleep(0.05)
        stats = server.result("efim/stats")
        assert stats["model"]["state"] == "ready" and "http:// or https://" in stats["model"]["error"]
        assert stats["engine"]["endpoint"] == backend.url
        assert _complete(server, 0)["items"]  # still served by the old engine
        assert server.shutdown_and_exit() == 0


def test_the_command_line_flags_choose_the_backend(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("EFIM_TEST_SERVE_KEY", "sk-flag-test")
    with FaultServer(require_key="sk-flag-test") as backend, ServerProcess(
        ["--model", str(tiny_model_dir), "--backend", "llama.cpp", "--endpoint", backend.url, "--api-key-env", "EFIM_TEST_SERVE_KEY"]
    ) as server:
        server.initialize()
        stats = server.wait_model()
        assert stats["model"]["state"] == "ready" and stats["engine"]["backend"] == "llama.cpp"
        assert stats["engine"]["state"] == "connected" and stats["engine"]["endpoint"] == backend.url
        server.open(URI, TEXT)
        assert _complete(server, 0)["items"]
        assert backend.requests[-1][1]["Authorization"] == "Bearer sk-flag-test"
        assert "sk-flag-test" not in server.stderr() and "sk-flag-test" not in repr(server.notifications)
        assert server.shutdown_and_exit() == 0
