"""Two real `efim serve --daemon` processes over stdio (the tiny model), sharing one engine
daemon: the second window's suggestion on the same file reuses the first's KV; the daemon
SIGKILLed → each front shows one message, keeps its documents and serves again from a new
daemon; `--no-daemon` (the default) starts none."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from bench.process_memory import daemon_pids

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "lsp"))
from stdio_client import ServerProcess, inline_params, serve_env  # noqa: E402

from test_daemon import _wait, private_rundir  # noqa: E402

TEXT = "".join(f"def f{i}(a, b):\n    return a * {i} + b\n\n" for i in range(20)) + "def add(a, b):\n    return \n"
URI = "file:///work/shared.py"
LINE, COL = TEXT.count("\n") - 1, len("    return ")
OPTIONS = {"timeoutMs": 0, "firstWindowTokens": 0, "warmAhead": False}

pytestmark = pytest.mark.slow  # real servers and daemons: ~5 s a test


@pytest.fixture()
def rundir():
    with private_rundir() as base:
        yield base


def _serve(model: Path, rundir: Path, *flags: str, daemon_env: str | None = "0") -> ServerProcess:
    """`efim serve` on the tiny model; `daemon_env`: EFIM_DAEMON for it (None: unset, the user's default)."""
    args = ["--model", str(model), "--dtype", "fp32", "--kv-budget", "32M", "--no-kv-disk", *flags]
    env = serve_env(XDG_RUNTIME_DIR=str(rundir))
    env.pop("EFIM_DAEMON", None)
    if daemon_env is not None:
        env["EFIM_DAEMON"] = daemon_env
    return ServerProcess(args, env=env)


def _complete(server: ServerProcess) -> dict:
    return server.result("textDocument/inlineCompletion", inline_params(URI, LINE, COL), timeout=60)


def _engine_stats(server: ServerProcess) -> dict:
    return server.result("efim/stats")


def test_two_serve_fronts_share_one_daemon_and_survive_its_death(tiny_model_dir, rundir):
    with _serve(tiny_model_dir, rundir, "--daemon") as one, _serve(tiny_model_dir, rundir, "--daemon") as two:
        for server in (one, two):
            server.initialize(OPTIONS)
        stats = [server.wait_model() for server in (one, two)]
        assert [s["model"]["state"] for s in stats] == ["ready", "ready"], [one.stderr()[-2000:], two.stderr()[-2000:]]
        pid = stats[0]["engine"]["daemon"]["pid"]
        assert stats[1]["engine"]["daemon"]["pid"] == pid and daemon_pids(rundir) == [pid]
        for server in (one, two):
            server.open(URI, TEXT)
            server.result("efim/stats", {"reset": True})
        first = _complete(one)
        s1 = _engine_stats(one)
        assert s1["prefilledTokens"] > 100, s1
        second = _complete(two)
        s2 = _engine_stats(two)
        # Per front: the second window's prompt was the first's, computed already.
        assert s2["promptTokens"] == s1["promptTokens"] and s2["prefilledTokens"] <= 0.05 * s2["promptTokens"], (s1, s2)
        assert second["items"] == first["items"]
        assert len(s2["engine"]["daemon"]["fronts"]) == 2
        # Each front's engine time: a request's time is added when its stream's end is read,
        # which may come just after the answer (the answer stops reading at the suggestion's end).
        deadline = time.monotonic() + 5
        while not all(f["engineS"] > 0 for f in s2["engine"]["daemon"]["fronts"]) and time.monotonic() < deadline:
            time.sleep(0.1)
            s2 = _engine_stats(two)
        assert all(f["engineS"] > 0 for f in s2["engine"]["daemon"]["fronts"]), s2["engine"]["daemon"]["fronts"]

        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        for server in (one, two):  # the documents are the fronts'; nothing is lost
            assert server.document_text(URI)["text"] == TEXT

        def serving(server: ServerProcess) -> bool:
            engine = server.result("efim/stats")["engine"]
            return engine.get("state") == "running" and engine["daemon"]["pid"] not in (None, pid)

        _wait(lambda: serving(one) and serving(two), timeout=60, what="both fronts serving again")
        back = time.monotonic() - killed
        new_pid = _engine_stats(one)["engine"]["daemon"]["pid"]
        assert _engine_stats(two)["engine"]["daemon"]["pid"] == new_pid and daemon_pids(rundir) == [new_pid]
        for server in (one, two):
            before = _engine_stats(server)["served"]
            assert _complete(server)["items"]  # (the answer may differ: the session restarted on a cold cache)
            assert _engine_stats(server)["served"] == before + 1
            shown = [n for n in server.notifications if n.get("method") == "window/showMessage"
                     and "went away" in n["params"]["message"]]
            assert len(shown) == 1, server.notifications
        print(f"serving again {back:.2f} s after the SIGKILL")
        for server in (one, two):
            assert server.shutdown_and_exit() == 0


def test_without_a_flag_the_front_uses_the_daemon(tiny_model_dir, rundir):
    with _serve(tiny_model_dir, rundir, daemon_env=None) as server:
        server.initialize(OPTIONS)
        stats = server.wait_model()
        assert stats["model"]["state"] == "ready", server.stderr()[-2000:]
        pid = stats["engine"]["daemon"]["pid"]
        assert daemon_pids(rundir) == [pid]
        server.open(URI, TEXT)
        assert _complete(server)["items"]
        assert "libtorch" not in Path(f"/proc/{server.proc.pid}/maps").read_text()  # the model is the daemon's
        assert server.shutdown_and_exit() == 0


@pytest.mark.parametrize("how", ["--no-daemon", "EFIM_DAEMON=0"])
def test_no_daemon_starts_when_the_user_says_so(tiny_model_dir, rundir, how):
    flags, env = (["--no-daemon"], None) if how == "--no-daemon" else ([], "0")
    with _serve(tiny_model_dir, rundir, *flags, daemon_env=env) as server:
        server.initialize(OPTIONS)
        stats = server.wait_model()
        assert stats["model"]["state"] == "ready" and "daemon" not in stats["engine"]
        server.open(URI, TEXT)
        assert _complete(server)["items"]
        assert daemon_pids(rundir) == [] and not (rundir / "efim").exists()
        assert server.shutdown_and_exit() == 0


def test_a_default_daemon_that_cannot_be_had_leaves_the_engine_in_the_front(tiny_model_dir, rundir):
    (rundir / "efim").write_text("not a directory")  # the daemon directory's name, taken
    with _serve(tiny_model_dir, rundir, daemon_env=None) as server:
        server.initialize(OPTIONS)
        stats = server.wait_model()
        assert stats["model"]["state"] == "ready" and "daemon" not in stats["engine"]
        server.open(URI, TEXT)
        assert _complete(server)["items"]
        assert "the engine daemon is not available" in server.stderr() and "is not a directory" in server.stderr()
        assert server.shutdown_and_exit() == 0
    with _serve(tiny_model_dir, rundir, "--daemon") as server:  # asked for: the reason, no quiet fallback
        server.initialize(OPTIONS)
        stats = server.wait_model()
        assert stats["model"]["state"] == "failed" and "is not a directory" in stats["model"]["error"], stats["model"]
        assert server.shutdown_and_exit() == 0


def test_a_bad_model_switch_keeps_the_daemons_model_and_the_front_loads_no_torch(tiny_model_dir, rundir, tmp_path):
    with _serve(tiny_model_dir, rundir, "--daemon") as server:
        server.initialize(OPTIONS)
        assert server.wait_model()["model"]["state"] == "ready"
        pid = _engine_stats(server)["engine"]["daemon"]["pid"]
        server.notify("workspace/didChangeConfiguration", {"settings": {"efim": {"model": str(tmp_path / "missing")}}})
        _wait(lambda: _engine_stats(server)["model"]["error"], timeout=60, what="the failed check")
        stats = _engine_stats(server)
        assert stats["model"]["state"] == "ready" and "kept the previous model" in stats["model"]["error"]
        assert stats["engine"]["daemon"]["pid"] == pid
        server.open(URI, TEXT)
        assert _complete(server)["items"]
        maps = Path(f"/proc/{server.proc.pid}/maps").read_text()
        assert "libtorch" not in maps  # the check ran in a process of its own
        assert server.shutdown_and_exit() == 0


def test_a_switch_to_another_daemon_keeps_the_old_one_serving_until_the_new_one_answers(tiny_model_dir, rundir):
    """A setting that names another daemon configuration (here kvDiskBudget): the front keeps
    its connection to the old daemon, answering, until the new daemon's engine is ready —
    no "model loading" declines during the switch (the front frees no memory by closing first)."""
    with _serve(tiny_model_dir, rundir, daemon_env=None) as server:
        server.initialize(OPTIONS)
        old = server.wait_model()["engine"]["daemon"]["pid"]
        server.open(URI, TEXT)
        assert _complete(server)["items"]
        server.result("efim/stats", {"reset": True})
        server.notify("workspace/didChangeConfiguration", {"settings": {"efim": {"kvDiskBudget": "1G"}}})
        asked = 0
        deadline = time.monotonic() + 60
        while True:
            stats = _engine_stats(server)
            if stats["engine"].get("daemon", {}).get("pid") not in (None, old) and stats["model"]["state"] == "ready":
                break
            assert time.monotonic() < deadline, stats
            assert stats["model"]["state"] == "ready", stats["model"]  # never "loading" on the way
            _complete(server)
            asked += 1
        stats = _engine_stats(server)
        assert asked >= 1 and stats["declined"].get("modelLoading", 0) == 0, (asked, stats["declined"])
        assert _complete(server)["items"]  # the new daemon serves
        assert server.shutdown_and_exit() == 0
