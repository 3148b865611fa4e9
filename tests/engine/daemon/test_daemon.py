"""The per-user engine daemon (engine.daemon): fronts (`DaemonEngine`s, and fronts in other
processes) sharing one daemon process on a tiny random model, in a temporary
XDG_RUNTIME_DIR of their own.

Covered: two fronts share one daemon and one radix cache (the second front's request on the
same prompt reuses the first's KV); fronts starting together start one daemon; a foreign
or older peer is refused before anything but the hello is sent; the daemon SIGKILLed
mid-request ends the requests with an error and calls `on_fault` within a second, then a
new daemon serves; a killed front's requests are cancelled; the daemon exits after its
idle timeout; the wire protocol and the config digest."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import msgspec
import pytest

from bench.process_memory import daemon_pids, kill_daemons
from engine.api import EngineError, EngineStats, InfillRequest, StreamEvent
from engine.daemon import wire
from engine.daemon.client import DaemonEngine
from engine.daemon.config import DaemonConfig, engine_environment
from engine.daemon.launcher import DaemonRefused
from engine.daemon.place import Place, runtime_dir

REPO = Path(__file__).resolve().parents[3]
PREFIX = "".join(f"def f{i}(a, b):\n    return a * {i} + b\n\n" for i in range(12)) + "def add(a, b):\n    "


@contextlib.contextmanager
def private_rundir():
    """A private runtime directory (short: socket paths have a 108-byte limit); every daemon
    started in it is killed afterwards."""
    base = Path(tempfile.mkdtemp(prefix="efr-"))
    os.chmod(base, 0o700)
    try:
        yield base
    finally:
        kill_daemons(base)
        shutil.rmtree(base, ignore_errors=True)


def _wait(predicate, timeout: float = 10.0, what: str = "condition") -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, f"{what} not reached within {timeout} s"
        time.sleep(0.02)


@pytest.fixture()
def rundir(monkeypatch):
    """A private XDG_RUNTIME_DIR for this process (see `private_rundir`)."""
    with private_rundir() as base:
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(base))
        yield base


@pytest.fixture()
def config(tiny_model_factory) -> DaemonConfig:
    return DaemonConfig.of(str(tiny_model_factory("llama")), dtype="fp32", kv_disk=False, check_integrity=True,
                           step_tokens=32)


class Faults:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str, float]] = []

    def __call__(self, kind: str, message: str) -> None:
        self.seen.append((kind, message, time.monotonic()))


def _front(config: DaemonConfig, **kw) -> DaemonEngine:
    kw.setdefault("kv_budget", "32M")
    kw.setdefault("idle_timeout", 30.0)
    engine = DaemonEngine(config, **kw)
    engine.on_fault = Faults()
    return engine


def _request(key: str = "file:///a.py", **kw) -> InfillRequest:
    kw.setdefault("max_tokens", 8)
    return InfillRequest(key=key, prefix=PREFIX, suffix="\n", **kw)


# ---------------------------------------------------------------- wire and config
def test_frames_carry_the_api_structs_and_hellos_of_other_versions_are_refused():
    request = _request(stop=("\n\n",), deadline=123.5, chunks=())
    for message in (wire.Submit(7, request), wire.Cancel(7), wire.Call(3, "count_tokens", ("abc",)),
                    wire.Event(7, StreamEvent(kind="token", text="x")), wire.Reply(3, value=5), wire.Fault("engine-crash", "m")):
        data = wire.frame(message)
        assert int.from_bytes(data[:4], "big") == len(data) - 4
        assert wire.decode(data[4:]) == message
    hello = wire.decode_hello(wire.frame(wire.Hello(uid=5, pid=9))[4:])
    assert (hello.uid, hello.pid, hello.protocol) == (5, 9, wire.PROTOCOL_VERSION)
    old = msgspec.msgpack.encode({"magic": wire.MAGIC, "protocol": wire.PROTOCOL_VERSION - 1, "uid": 0})
    with pytest.raises(wire.ProtocolError, match=f"protocol {wire.PROTOCOL_VERSION - 1}"):
        wire.decode_hello(old)
    with pytest.raises(wire.ProtocolError, match="not an efim engine daemon"):
        wire.decode_hello(msgspec.msgpack.encode({"hello": 1}))
    with pytest.raises(wire.ProtocolError):
        wire.decode(b"\x93garbage")
    with pytest.raises(wire.ProtocolError, match="bytes"):
        wire.frame_length((wire.MAX_FRAME_BYTES + 1).to_bytes(4, "big"))


def test_the_digest_follows_the_model_and_engine_shape_not_the_kv_budget(tmp_path):
    base = DaemonConfig.of("default", quant="mixed")
    assert base.digest() == DaemonConfig.of("default", quant="mixed", kv_budget="1G").digest()
    assert base.digest() != DaemonConfig.of("default", quant="int8").digest()
    assert base.digest() != DaemonConfig.of("default", quant="mixed", kv_dtype="int8").digest()
    assert base.digest() != DaemonConfig.of("default", quant="mixed", adapter="none").digest()
    assert base.digest() != DaemonConfig.of(str(tmp_path), quant="mixed").digest()
    here = os.getcwd()
    try:  # a relative model path names the same folder from anywhere
        os.chdir(tmp_path.parent)
        relative = DaemonConfig.of(tmp_path.name)
    finally:
        os.chdir(here)
    assert relative.model == str(tmp_path) and relative.digest() == DaemonConfig.of(str(tmp_path)).digest()
    assert DaemonConfig.of("m", check_integrity=True).load_arguments()["check_integrity"] is True


def test_a_fronts_engine_environment_is_part_of_the_config_and_is_what_its_daemon_runs_with(tmp_path, monkeypatch):
    from engine.daemon.launcher import daemon_command, daemon_environment  # noqa: PLC0415

    env = {"EFIM_KV_DIR": "/x/kv", "OMP_NUM_THREADS": "1", "GOMP_SPINCOUNT": "0", "HOME": "/h", "EFIM_DAEMON": "1",
           "EFIM_DAEMON_STANDBY": "1"}
    config = DaemonConfig.of("default", environment=env)
    # Only what the engine process reads; the rest (HOME, the front-side EFIM_DAEMON) is not the engine's.
    assert config.environment == {"EFIM_DAEMON_STANDBY": "1", "EFIM_KV_DIR": "/x/kv", "GOMP_SPINCOUNT": "0", "OMP_NUM_THREADS": "1"}
    assert config.digest() == DaemonConfig.of("default", environment={**env, "HOME": "/elsewhere"}).digest()
    for name, value in (("EFIM_KV_DIR", "/y/kv"), ("OMP_NUM_THREADS", "2"), ("EFIM_FAULT", "engine-crash"), ("EFIM_PIN_THREADS", "0")):
        assert DaemonConfig.of("default", environment={**env, name: value}).digest() != config.digest(), name
    # The daemon gets exactly the config's engine variables, whatever this process has now.
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    monkeypatch.setenv("EFIM_FAULT", "engine-crash")
    monkeypatch.setenv("PATH_MARKER", "kept")
    spawned = daemon_environment(config)
    assert spawned["OMP_NUM_THREADS"] == "1" and spawned["EFIM_KV_DIR"] == "/x/kv" and "EFIM_FAULT" not in spawned
    assert spawned["PATH_MARKER"] == "kept"
    monkeypatch.delenv("EFIM_DAEMON_STANDBY", raising=False)  # the standby follows the config, not this process
    assert "--keep-standby" in daemon_command(Place(tmp_path, config.digest()), config, None, 10.0)
    # The config travels to the daemon as JSON, environment included.
    assert msgspec.json.decode(msgspec.json.encode(config), type=DaemonConfig) == config


def test_the_runtime_dir_is_private_and_the_users_own(rundir):
    made = runtime_dir()
    assert made == rundir / "efim" and stat.S_IMODE(os.stat(made).st_mode) == 0o700
    os.chmod(made, 0o755)
    assert stat.S_IMODE(os.stat(runtime_dir()).st_mode) == 0o700  # narrowed
    if os.getuid() != 0:
        pytest.skip("changing a directory's owner needs root")
    os.chown(made, 65534, 65534)
    with pytest.raises(EngineError, match="belongs to uid 65534"):
        runtime_dir()


# ---------------------------------------------------------------- sharing
def test_two_fronts_share_one_daemon_and_the_second_reuses_the_firsts_kv(rundir, config):
    a = _front(config)
    b = _front(config)
    try:
        assert a.daemon_pid == b.daemon_pid and daemon_pids(rundir) == [a.daemon_pid]
        place = Place(rundir / "efim", config.digest())
        assert stat.S_IMODE(os.stat(place.socket).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(place.log).st_mode) == 0o600
        assert a.info().architecture == "llama" and a.info() == b.info()

        handle = a.submit(_request())
        events = list(handle.events(timeout=60))
        assert events[-1].kind == "done" and [e.kind for e in events[:-1]] == ["token"] * (len(events) - 1)
        first = events[-1].completion
        assert "".join(e.text for e in events[:-1]) == first.text
        assert first.stats.prefilled_tokens > 100
        # The same file in another window: same key, another front; its prompt's KV is the first's.
        second = b.submit(_request()).result(60)
        assert second.text == first.text
        assert second.stats.prompt_tokens == first.stats.prompt_tokens
        assert second.stats.prefilled_tokens <= 2 and second.stats.reused_tokens >= first.stats.prompt_tokens - 2
        stats = b.stats()
        assert isinstance(stats, EngineStats) and stats.completed >= 2 and stats == a.stats()
        assert a.count_tokens("def add(a, b):") == b.count_tokens("def add(a, b):") > 0
        a.check_integrity().result(30)
        health = b.health()
        assert health["state"] == "running" and health["daemon"]["pid"] == b.daemon_pid
        _wait(lambda: len(b.health()["daemon"].get("fronts", [])) == 2, what="two fronts in the daemon's health")
        # Keys are per front: b's request does not supersede a's running one on the same document.
        long_a = a.submit(_request(max_tokens=40))
        short_b = b.submit(_request(max_tokens=2))
        assert short_b.result(60).finish_reason in ("length", "eos", "stop")
        assert long_a.result(60).finish_reason != "cancelled"
        # ...while a newer request of the same front does (the Engine contract).
        older = a.submit(_request(key="file:///s.py", max_tokens=200, temperature=1.0, seed=1))
        newer = a.submit(_request(key="file:///s.py", max_tokens=2))
        assert newer.result(60).finish_reason in ("length", "eos", "stop")
        assert older.result(60).finish_reason in ("cancelled", "length", "eos")
        a.keep_document_pieces("file:///a.py", PREFIX, len(PREFIX))
        a.forget_document("file:///a.py")
        a.wait_idle(30)
        a.check_integrity().result(30)
        # Per-front counts (efim/stats `engine.daemon.fronts`): a sent 4 requests (one superseded), b 2.
        def counts():
            daemon = a.health()["daemon"]
            return {f["front"]: f for f in daemon.get("fronts", [])}, daemon["front"]
        def settled():  # health is the last one the daemon sent (a newer one is asked for)
            fronts, mine = counts()
            own = fronts.get(mine, {})
            return own.get("requests") == 4 and own.get("running") == 0 and sum(f["requests"] for f in fronts.values()) == 6
        _wait(settled, what="the daemon's health with a's 4 requests ended")
        fronts, mine = counts()
        own, other = fronts[mine], next(f for n, f in fronts.items() if n != mine)
        assert own["requests"] == 4 and own["served"] >= 3 and own["errors"] == 0
        assert own["served"] + own["cancelled"] == 4
        assert other["requests"] == 2 and other["served"] == 2 and other["cancelled"] == 0
    finally:
        a.close()
        b.close()


def test_the_daemons_kv_budget_is_the_largest_any_front_asked_for_raised_and_lowered_keeping_the_cache(rundir, config):
    a = _front(config, kv_budget="32M")
    try:
        first = a.submit(_request()).result(60)
        assert a.daemon_kv_budget == 32 << 20 and a.stats().cache_bytes_total == 32 << 20
        b = _front(config, kv_budget="48M")  # a window that asked for more: the daemon grows to it
        c = _front(config, kv_budget="16M")  # ... and one that asked for less changes nothing
        try:
            assert a.daemon_pid == b.daemon_pid == c.daemon_pid
            assert b.daemon_kv_budget == c.daemon_kv_budget == 48 << 20
            assert b.stats().cache_bytes_total == 48 << 20
            again = b.submit(_request()).result(60)  # the first front's KV survived the larger pool
            assert again.text == first.text and again.stats.prefilled_tokens <= 2
            b.check_integrity().result(30)
            _wait(lambda: len(b.health()["daemon"].get("fronts", [])) == 3, what="three fronts in the daemon's health")
            daemon = b.health()["daemon"]
            assert daemon["kvBudget"] == 48 << 20
            assert sorted(f["kvBudgetAsked"] for f in daemon["fronts"]) == [16 << 20, 32 << 20, 48 << 20]
            b.close()  # the front that asked for the most leaves: the budget comes down to the others' largest
            _wait(lambda: a.stats().cache_bytes_total == 32 << 20, what="the engine's budget lowered to 32M")
            again = a.submit(_request()).result(60)  # the rows that fit stayed through the smaller pool
            assert again.text == first.text and again.stats.prefilled_tokens <= 2
            a.check_integrity().result(30)
        finally:
            b.close()
            c.close()
    finally:
        a.close()


def test_the_daemon_makes_each_front_an_owner_of_its_requests(tmp_path):
    """Each front's requests reach the engine under its own key prefix and as its own owner
    (`InfillRequest.owner`), so the engine's scheduler takes turns across fronts
    (engine.scheduling.fairness; the ordering itself: tests/engine/test_scheduler_fairness.py)."""
    from engine.daemon.server import EngineDaemon, Front

    submitted = []

    class Handle:
        def events(self):
            return iter(())

        def cancel(self):
            pass

    class Engine:
        def submit(self, request):
            submitted.append(request)
            return Handle()

    class Writer:
        def is_closing(self):
            return False

        def write(self, data):
            pass

    daemon = EngineDaemon(Engine(), tmp_path / "d.sock")
    one, two = Front(1, 100, Writer()), Front(2, 200, Writer())
    daemon._submit(one, wire.Submit(1, _request(key="file:///a.py")))
    daemon._submit(two, wire.Submit(1, _request(key="file:///a.py", owner="spoofed")))
    daemon._pumps.shutdown(wait=True)
    assert [(r.key, r.owner) for r in submitted] == [("front1/file:///a.py", "front1"), ("front2/file:///a.py", "front2")]
    assert one.summary()["requests"] == two.summary()["requests"] == 1


def test_cancel_and_close_end_every_handle(rundir, config):
    front = _front(config)
    handle = front.submit(_request(max_tokens=400, temperature=1.0, seed=3))
    handle.cancel()
    assert handle.result(30).finish_reason in ("cancelled", "length", "eos")
    running = front.submit(_request(key="file:///b.py", max_tokens=400, temperature=1.0, seed=4))
    front.close()
    assert running.result(5).finish_reason in ("cancelled", "length", "eos")
    with pytest.raises(EngineError):
        front.submit(_request())
    bad = _front(config)
    try:  # a request the engine refuses ends with an error event, not an exception
        ended = bad.submit(_request(temperature=-1.0)).result(30)
        assert ended.finish_reason == "error" and "ValueError" in ended.error
    finally:
        bad.close()


SPAWN_ONE = textwrap.dedent("""
    import sys, time
    from engine.daemon.client import DaemonEngine
    from engine.daemon.config import DaemonConfig
    import msgspec
    config = msgspec.json.decode(sys.argv[1].encode(), type=DaemonConfig)
    sys.stdout.write("ready\\n"); sys.stdout.flush()
    sys.stdin.readline()  # go
    engine = DaemonEngine(config, kv_budget="32M", idle_timeout=30)
    print(engine.daemon_pid, flush=True)
    if len(sys.argv) > 2:  # keep requests running, then wait to be killed
        handles = [engine.submit(__import__("engine.api", fromlist=["x"]).InfillRequest(
            key=f"k{i}", prefix=sys.argv[2], max_tokens=600, temperature=1.0, seed=i)) for i in range(4)]
        next(handles[0].events(timeout=60))
        print("running", flush=True)
    time.sleep(600)
""")


def _front_process(config: DaemonConfig, *extra: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-c", SPAWN_ONE, msgspec.json.encode(config).decode(), *extra],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_fronts_starting_together_start_one_daemon(rundir, config):
    fronts = [_front_process(config) for _ in range(3)]
    try:
        for proc in fronts:  # go, all at once
            proc.stdin.write("\n")
            proc.stdin.flush()
        pids = {int(proc.stdout.readline()) for proc in fronts}
        assert len(pids) == 1 and daemon_pids(rundir) == list(pids)
    finally:
        for proc in fronts:
            proc.kill()
            proc.wait()


# ---------------------------------------------------------------- refusals
class _FakePeer:
    """A socket server at a daemon's socket path that answers the hello with `reply` and
    records what it received."""

    def __init__(self, path: Path, reply: bytes, *, uid: int | None = None) -> None:
        self.path, self.reply, self.received = path, reply, b""
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        self.listener.listen(4)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        with conn:
            conn.settimeout(2)
            try:
                self.received += conn.recv(65536)
                conn.sendall(self.reply)
                self.received += conn.recv(65536)
            except OSError:
                pass

    def close(self) -> None:
        self.listener.close()


@pytest.mark.parametrize("case", ["old-version", "other-uid-in-hello", "not-a-daemon"])
def test_an_older_or_foreign_peer_on_the_socket_is_refused(rundir, config, case):
    place = Place.for_digest(config.digest())
    reply = {
        "old-version": wire.frame(wire.Hello(protocol=0, uid=os.getuid(), pid=1)),
        "other-uid-in-hello": wire.frame(wire.Hello(uid=os.getuid() + 1, pid=1)),
        "not-a-daemon": b"HTTP/1.1 400 Bad Request\r\n\r\n",
    }[case]
    peer = _FakePeer(place.socket, reply)
    try:
        with pytest.raises(DaemonRefused) as refused:
            DaemonEngine(config, kv_budget="32M")
        message = str(refused.value)
        assert {"old-version": "protocol 0", "other-uid-in-hello": "not as you", "not-a-daemon": "does not answer as"}[case] in message
        peer.thread.join(3)
        hello = wire.decode_hello(peer.received[4:])  # all it was sent: our hello, no request
        assert hello.uid == os.getuid() and len(peer.received) == 4 + int.from_bytes(peer.received[:4], "big")
        assert daemon_pids(rundir) == []  # and no daemon was started over it
    finally:
        peer.close()


@pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() != 0, reason="needs root to act as another user")
def test_a_socket_of_another_user_or_a_peer_running_as_another_user_is_never_talked_to(rundir, config):
    place = Place.for_digest(config.digest())
    peer = _FakePeer(place.socket, wire.frame(wire.Hello(uid=os.getuid(), pid=1)))
    try:
        os.chown(place.socket, 65534, 65534)
        with pytest.raises(EngineError, match="belongs to uid 65534"):
            DaemonEngine(config, kv_budget="32M")
    finally:
        peer.close()
        os.unlink(place.socket)
    # A process of another user listening on a socket file that looks like ours (SO_PEERCRED).
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(place.socket))
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child
        try:
            os.setgid(65534)
            os.setuid(65534)
            listener.listen(1)  # the listening credentials are taken here
            os.write(write_end, b"l")
            conn, _ = listener.accept()
            conn.settimeout(3)
            got = conn.recv(65536)
            os.write(write_end, b"G" if got else b"N")
        finally:
            os._exit(0)
    try:
        assert os.read(read_end, 1) == b"l"
        with pytest.raises(DaemonRefused, match="runs as uid 65534"):
            DaemonEngine(config, kv_budget="32M")
        assert os.read(read_end, 1) == b"N"  # it received nothing, not even the hello
    finally:
        os.waitpid(child, 0)
        listener.close()


# ---------------------------------------------------------------- faults
def test_daemon_killed_mid_request_errors_within_a_second_reports_and_a_new_daemon_serves(rundir, config):
    front = _front(config)
    other = _front(config)
    try:
        handles = [front.submit(_request(key=f"file:///{i}.py", max_tokens=600, temperature=1.0, seed=i)) for i in range(4)]
        waiting = other.submit(_request(key="file:///o.py", max_tokens=600, temperature=1.0, seed=9))
        first = next(handles[0].events(timeout=60))
        assert first.kind == "token"
        live = [h for h in handles + [waiting] if not h.done]
        assert live, "every request finished before the kill"
        old_pid = front.daemon_pid
        os.kill(old_pid, signal.SIGKILL)
        killed = time.monotonic()
        ends = [h.result(2.0) for h in live]
        ended = time.monotonic() - killed
        assert ended < 1.0, ended
        assert all(c.finish_reason == "error" and "went away" in c.error for c in ends), ends
        for faults in (front.on_fault, other.on_fault):
            _wait(lambda f=faults: f.seen, timeout=1.0, what="on_fault")
            kind, message, when = faults.seen[0]
            assert kind == "engine-crash" and str(old_pid) in message and when - killed < 1.0
        # Reconnected: one new daemon for both fronts (they raced to start it).
        _wait(lambda: front.state == "running" and other.state == "running", timeout=60, what="reconnection")
        assert front.daemon_pid == other.daemon_pid != old_pid and daemon_pids(rundir) == [front.daemon_pid]
        again = front.submit(_request()).result(60)
        assert again.finish_reason in ("length", "eos", "stop") and again.text
        assert other.health()["daemon"]["reconnects"] == 1
        assert len(front.on_fault.seen) == 1  # one report for the outage
    finally:
        front.close()
        other.close()


def test_the_daemons_engine_faults_reach_every_front(rundir, config, monkeypatch):
    monkeypatch.setenv("EFIM_FAULT", "engine-crash")  # the daemon inherits it: its engine thread dies once
    config = msgspec.structs.replace(config, environment=engine_environment())  # the fronts' config, in that environment
    front, other = _front(config), _front(config)
    try:
        crashed = front.submit(_request(key="file:///fault.py")).result(30)
        assert crashed.finish_reason == "error" and "InjectedCrash" in crashed.error
        for engine in (front, other):
            _wait(lambda e=engine: e.on_fault.seen, timeout=5, what="the fault told")
            kind, message, _ = engine.on_fault.seen[0]
            assert kind == "engine-crash" and message.startswith("engine daemon: the engine thread crashed")
        # The daemon's engine restarted its thread; the connection never dropped.
        assert front.submit(_request()).result(60).finish_reason in ("length", "eos", "stop")
        assert front.state == other.state == "running" and front.reconnects == 0
        _wait(lambda: front.health().get("restarts") == 1, what="health saying the engine thread restarted")  # (health is the last report)
    finally:
        front.close()
        other.close()


def test_a_killed_front_has_its_requests_cancelled(rundir, config):
    watcher = _front(config)
    try:
        proc = _front_process(config, PREFIX)
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert int(proc.stdout.readline()) == watcher.daemon_pid
        assert proc.stdout.readline().strip() == "running"
        before = watcher.stats()
        assert before.working_kv_bytes > 0  # the killed front's requests hold KV of the shared budget
        proc.kill()
        proc.wait()
        watcher.wait_idle(5)  # the killed front's four 600-token requests stopped
        after = watcher.stats()
        assert after.cancelled - before.cancelled >= 1
        assert after.completed + after.cancelled >= before.requests
        # ... and their KV reservations went back to the budget: nothing runs, nothing is charged.
        assert after.working_kv_bytes == 0, after
        assert after.cache_bytes_free + after.cache_bytes_used == after.cache_bytes_total
        _wait(lambda: len(watcher.health()["daemon"].get("fronts", [])) == 1, what="the killed front released")
        assert watcher.health()["daemon"]["fronts"][0]["pid"] == os.getpid()
        watcher.check_integrity().result(30)
    finally:
        watcher.close()


def test_the_daemon_exits_after_its_idle_timeout_and_the_next_front_starts_another(rundir, config):
    front = _front(config, idle_timeout=1.0)
    pid = front.daemon_pid
    place = Place.for_digest(config.digest())
    assert front.submit(_request()).result(60).finish_reason in ("length", "eos", "stop")
    front.close()
    time.sleep(0.5)
    assert pid in daemon_pids(rundir)  # not before the timeout
    _wait(lambda: pid not in daemon_pids(rundir), timeout=10, what="idle exit")
    assert not place.socket.exists()
    again = _front(config, idle_timeout=1.0)
    try:
        assert again.daemon_pid != pid
    finally:
        again.close()


def test_the_model_check_runs_in_a_process_of_its_own(config, tmp_path):
    """`efim serve --daemon`'s preflight: the weight-free checks in a short-lived process, so
    the front never imports torch; a model that cannot load raises with the check's reason."""
    probe = textwrap.dedent(f"""
        import sys
        from engine.daemon import check_daemon_model
        check_daemon_model({config.model!r}, fim_tokens="auto", adapter="auto")
        print("torch" in sys.modules)
    """)
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr
    from engine.daemon import check_daemon_model

    with pytest.raises(EngineError, match="no-such-model"):
        check_daemon_model(str(tmp_path / "no-such-model"))


def test_a_model_that_cannot_load_fails_the_front_with_the_daemons_reason(rundir, tmp_path):
    config = DaemonConfig.of(str(tmp_path / "no-such-model"), kv_disk=False)
    started = time.monotonic()
    with pytest.raises(EngineError, match="exited with code 2.*failed to load"):
        DaemonEngine(config, kv_budget="32M")
    assert time.monotonic() - started < 60


def test_serve_without_unix_sockets_runs_the_engine_in_process_and_says_so(tiny_model_factory, rundir, monkeypatch, caplog):
    import argparse

    import engine.daemon
    from efim_lsp.serve import engine_factory
    from engine.local import LocalEngine

    monkeypatch.setattr(engine.daemon, "supported", lambda: False)
    args = argparse.Namespace(daemon=True, daemon_idle_timeout=5.0, dtype="fp32", quant=None, prefill=None, kv_budget="16M",
                              kv_dtype=None, threads=None)
    with caplog.at_level("WARNING"):
        in_process = engine_factory(args)(str(tiny_model_factory("llama")), kv_disk=False)
    try:
        assert isinstance(in_process, LocalEngine)
        assert any("no Unix sockets" in r.getMessage() for r in caplog.records)
        assert daemon_pids(rundir) == []
    finally:
        in_process.close()
    monkeypatch.setattr(engine.daemon, "supported", lambda: True)
    front = engine_factory(args)(str(tiny_model_factory("llama")), kv_disk=False)
    try:
        assert isinstance(front, DaemonEngine) and daemon_pids(rundir) == [front.daemon_pid]
    finally:
        front.close()


def test_a_spawn_lock_poll_that_raises_ends_the_wait_and_keeps_no_descriptor(tmp_path):
    """`SpawnLock(poll=…)` while another holds the lock: a value ends the wait without the
    lock; an exception (a refused peer) propagates, and neither leaves the lock file open."""
    import fcntl

    from engine.daemon.launcher import SpawnLock

    path = tmp_path / "x.lock"
    holder = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        before = len(os.listdir("/proc/self/fd"))
        with SpawnLock(path, timeout=5, poll=lambda: "answered") as lock:
            assert lock.found == "answered" and lock.fd is None
        assert len(os.listdir("/proc/self/fd")) == before

        def refuse():
            raise RuntimeError("refused")

        with pytest.raises(RuntimeError, match="refused"):
            SpawnLock(path, timeout=5, poll=refuse).__enter__()
        assert len(os.listdir("/proc/self/fd")) == before
    finally:
        os.close(holder)
