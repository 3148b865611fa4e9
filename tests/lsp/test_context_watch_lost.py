"""A watched workspace folder that disappears is reported once (a log line and one
`on_problem` message, which the server shows with `window/showMessage`) and shows in
`efim/stats` ("context" → "watch"); the other folders are still watched."""

from __future__ import annotations

import shutil
import threading
import time

from efim_lsp.context import ContextGatherer
from efim_lsp.context.source import WorkspaceContext


def eventually(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


class _Host:
    """Collects what the server would show."""

    def __init__(self) -> None:
        self.shown: list[str] = []
        self.lock = threading.Lock()

    def show_from_thread(self, message: str) -> None:
        with self.lock:
            self.shown.append(message)


def test_a_deleted_workspace_folder_is_reported_once_and_the_others_stay_watched(tmp_path, caplog):
    kept, doomed = tmp_path / "kept", tmp_path / "doomed"
    for root in (kept, doomed):
        (root / "pkg").mkdir(parents=True)
        (root / "pkg" / "mod.py").write_text("def helper():\n    return 1\n")
    host = _Host()
    context = WorkspaceContext(ContextGatherer(watch=True, debounce_ms=50))
    context.on_watch_problem(host.show_from_thread)
    g = context.gatherer
    try:
        g.set_workspaces([kept, doomed])
        assert g.wait_idle(10) and g.wait_watching(10)
        assert g.status()["watch"] == {"state": "watching"}

        shutil.rmtree(doomed)
        assert eventually(lambda: host.shown), "no message for the lost folder"
        (kept / "pkg" / "mod.py").write_text("def helper():\n    return 2\n")  # more events afterwards
        (kept / "pkg" / "new.py").write_text("def other():\n    return 3\n")
        assert eventually(lambda: any(str(p).endswith("new.py") for p in g.index.paths()))  # still watched
        time.sleep(0.3)
        with host.lock:
            assert len(host.shown) == 1, host.shown
            assert str(doomed) in host.shown[0] and "disappeared" in host.shown[0]
        assert g.status()["watch"] == {"state": "lost", "lost": [str(doomed)]}
        assert sum("disappeared" in r.getMessage() for r in caplog.records) == 1
    finally:
        context.close()


def test_a_folder_that_comes_back_is_watched_again(tmp_path):
    root = tmp_path / "ws"
    root.mkdir()
    problems: list[str] = []
    g = ContextGatherer(watch=True, debounce_ms=50)
    g.on_watch_problem(problems.append)
    try:
        g.set_workspaces([root])
        assert g.wait_watching(10)
        shutil.rmtree(root)
        assert eventually(lambda: problems)
        assert g.status()["watch"]["state"] == "lost"
        root.mkdir()
        g.set_workspaces([])
        g.set_workspaces([root])
        assert g.wait_watching(10)
        assert g.status()["watch"] == {"state": "watching"}
        assert len(problems) == 1
    finally:
        g.close()


def test_through_efim_serve_one_show_message_and_the_state_in_stats(tmp_path, tiny_model_dir):
    import os

    from stdio_client import ServerProcess, inline_params

    root = tmp_path / "ws"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "mod.py").write_text("def helper():\n    return 1\n")
    with ServerProcess(["--model", str(tiny_model_dir), "--kv-budget", "32MB"]) as server:
        server.result("initialize", {"processId": os.getpid(), "rootUri": root.as_uri(),
                                     "capabilities": {"textDocument": {"inlineCompletion": {}}},
                                     "initializationOptions": {"context": "prefix", "maxTokens": 4}})
        server.notify("initialized", {})
        assert server.wait_model()["model"]["state"] == "ready"
        uri = (root / "main.py").as_uri()
        server.open(uri, "import pkg\n\nx = hel")
        assert "result" in server.request("textDocument/inlineCompletion", inline_params(uri, 2, 7), timeout=60)
        assert eventually(lambda: server.result("efim/stats")["context"]["watch"] == {"state": "watching"}, 20)
        shutil.rmtree(root)
        assert eventually(lambda: any("disappeared" in m for m in server.shown_messages()), 20), server.shown_messages()
        assert server.result("efim/stats")["context"]["watch"] == {"state": "lost", "lost": [str(root)]}
        server.open((tmp_path / "other.py").as_uri(), "y = 1\n")  # the server goes on
        time.sleep(0.5)

        assert sum("disappeared" in m for m in server.shown_messages()) == 1
        assert server.shutdown_and_exit() == 0
