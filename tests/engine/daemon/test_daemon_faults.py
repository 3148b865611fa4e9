"""The engine daemon killed at its two delicate moments (tiny random model, a private
XDG_RUNTIME_DIR and KV directory):

- while it loads its model (before it binds its socket): the front that started it sees it
  die (the reaper), starts another at once, and serves from it — on its first start and
  when it was reconnecting after the serving daemon died (one fault reported for the
  outage, not one per attempt); a daemon that *exits* while loading (a model that cannot
  load) still fails the front with its reason (test_daemon.py);
- while its KV disk tier writes a file (the write stopped halfway through, then SIGKILL):
  the half-written bytes stay in a temp file that nothing lists or loads; the front
  reconnects to a new daemon, which starts cold (no token loaded from disk), passes the
  integrity check, and later writes whole files of its own.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import msgspec
import pytest

from bench.process_memory import daemon_pids
from engine.daemon.config import DaemonConfig, engine_environment
from engine.daemon.launcher import daemon_command
from engine.daemon.place import Place
from engine.kv.disk_format import list_files, read_header

from test_daemon import REPO, _front, _request, _wait, config, rundir  # noqa: F401 - fixtures

pytestmark = pytest.mark.slow  # daemons started and killed: ~10 s a test


def _served(front) -> bool:
    return front.submit(_request()).result(60).finish_reason in ("length", "eos", "stop")


class _KillFirstNewDaemon:
    """Watches `rundir` for a daemon other than `spare` and SIGKILLs the first it sees: a
    new daemon is seen within milliseconds of its exec, long before its torch import and
    model load end, so it dies loading."""

    def __init__(self, rundir: Path, spare: int | None = None) -> None:
        self.rundir, self.spare = rundir, spare
        self.killed: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set() and self.killed is None:
            for pid in daemon_pids(self.rundir):
                if pid != self.spare:
                    os.kill(pid, signal.SIGKILL)
                    self.killed = pid
                    return
            time.sleep(0.002)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def _never_served(place: Place, pid: int) -> bool:
    """The daemon `pid` never bound its socket: no "serving" line of its in the log."""
    lines = [line for line in place.log.read_text(errors="replace").splitlines() if f"[{pid}]" in line]
    return not any(f"engine daemon {pid} serving" in line for line in lines)  # the server's line once bound


def test_a_daemon_killed_while_loading_on_the_first_start_is_started_again(rundir, config):
    killer = _KillFirstNewDaemon(rundir)
    try:
        front = _front(config)  # reach: spawn, the daemon killed mid-load, spawn again
    finally:
        killer.stop()
    try:
        assert killer.killed is not None and front.daemon_pid != killer.killed
        assert _never_served(Place.for_digest(config.digest()), killer.killed)
        assert daemon_pids(rundir) == [front.daemon_pid]
        assert _served(front)
        assert front.on_fault.seen == []  # nothing was lost: the front had not served yet
    finally:
        front.close()


def test_a_daemon_killed_while_loading_during_a_reconnection_is_started_again_and_reported_once(rundir, config):
    front, other = _front(config), _front(config)
    try:
        old = front.daemon_pid
        killer = _KillFirstNewDaemon(rundir, spare=old)
        os.kill(old, signal.SIGKILL)
        killed = time.monotonic()
        try:
            _wait(lambda: front.state == other.state == "running" and front.daemon_pid not in (old, killer.killed),
                  timeout=60, what="both fronts serving from a third daemon")
        finally:
            killer.stop()
        assert killer.killed is not None and _never_served(Place.for_digest(config.digest()), killer.killed)
        assert front.daemon_pid == other.daemon_pid and daemon_pids(rundir) == [front.daemon_pid]
        for engine in (front, other):
            assert [kind for kind, _, _ in engine.on_fault.seen] == ["engine-crash"]  # one report for the outage
            assert engine.on_fault.seen[0][2] - killed < 1.0  # noticed within a second
            assert _served(engine)
    finally:
        front.close()
        other.close()


STALLING_DAEMON = textwrap.dedent("""
    # `python -m engine.daemon` whose KV disk tier stops each file write halfway through (the
    # bytes written and synced), says so in the marker file, and waits to be killed.
    import os, sys, time
    from pathlib import Path
    from engine.kv import disk_format

    marker = Path(sys.argv[1])

    class HalfWriter:
        def __init__(self, f):
            self.f = f
        def __enter__(self):
            return self
        def __exit__(self, *exc):
            self.f.close()
        def write(self, data):
            self.f.write(bytes(data)[: len(data) // 2])
            self.f.flush()
            os.fsync(self.f.fileno())
            marker.write_text(str(len(data)))
            time.sleep(3600)
        def flush(self):
            self.f.flush()
        def fileno(self):
            return self.f.fileno()

    class OsWithHalfWrites:
        def __getattr__(self, name):
            return getattr(os, name)
        def fdopen(self, fd, mode="r", *args, **kwargs):
            return HalfWriter(os.fdopen(fd, mode, *args, **kwargs))

    disk_format.os = OsWithHalfWrites()  # only the disk format's file writes
    from engine.daemon.__main__ import main
    sys.exit(main(sys.argv[2:]))
""")


def test_a_daemon_killed_mid_kv_disk_write_leaves_no_file_that_is_ever_used(rundir, tiny_model_factory, tmp_path, monkeypatch):
    kv_dir = tmp_path / "kv"
    monkeypatch.setenv("EFIM_KV_DIR", str(kv_dir))  # the stalling daemon's and the next one's
    config = DaemonConfig.of(str(tiny_model_factory("llama")), dtype="fp32", kv_disk=True, check_integrity=True, step_tokens=32)
    place = Place.for_digest(config.digest())
    marker = tmp_path / "stalled"
    command = daemon_command(place, config, 32 << 20, 30.0)
    args = command[command.index("engine.daemon") + 1:]
    with open(place.log, "ab") as log:
        stalling = subprocess.Popen([sys.executable, "-c", STALLING_DAEMON, str(marker), *args], stdin=subprocess.DEVNULL,
                                    stdout=log, stderr=log, start_new_session=True,
                                    # no forked standby: a fork of this process would half-write its files too
                                    env=dict(os.environ, PYTHONPATH=str(REPO), EFIM_DAEMON_FORKED_STANDBY="0"))
    try:
        _wait(lambda: place.socket.exists(), timeout=60, what="the stalling daemon serving")
        front = _front(config)
        try:
            assert front.daemon_pid == stalling.pid
            first = front.submit(_request(max_tokens=4)).result(60)
            assert first.finish_reason in ("length", "eos", "stop")
            _wait(marker.exists, timeout=30, what="the disk tier's write stopped halfway")  # it writes ~2 s after idle
            torn = list(kv_dir.glob(".tmp-*"))
            assert len(torn) == 1 and 0 < torn[0].stat().st_size < int(marker.read_text())
            assert list_files(kv_dir) == []  # no file under a final name
            os.kill(stalling.pid, signal.SIGKILL)
            stalling.wait(10)
            _wait(lambda: front.state == "running" and front.daemon_pid != stalling.pid, timeout=60, what="a new daemon")
            assert [kind for kind, _, _ in front.on_fault.seen] == ["engine-crash"]
            again = front.submit(_request(max_tokens=4)).result(60)
            assert again.finish_reason in ("length", "eos", "stop")
            stats = front.stats()
            assert stats.kv_disk == "on" and stats.kv_disk_loaded_tokens == 0  # nothing came from the torn bytes
            assert again.stats.prefilled_tokens == again.stats.prompt_tokens
            front.check_integrity().result(30)
            assert torn[0].exists() and list_files(kv_dir) == []  # the temp file was never taken for a KV file
            # The new daemon writes whole files of its own once idle.
            _wait(lambda: list_files(kv_dir), timeout=30, what="the new daemon's own KV file")
            (written,) = list_files(kv_dir)
            header, declared = read_header(written.path)
            assert written.nbytes == declared and header["__metadata__"]["n_tokens"] == str(written.n_tokens)
        finally:
            front.close()
    finally:
        if stalling.poll() is None:
            stalling.kill()
            stalling.wait(10)


def _standby_ready(place: Place, pid: int) -> bool:
    return any(f"[{pid}]" in line and "standby daemon" in line and "ready" in line
               for line in place.log.read_text(errors="replace").splitlines())


def test_a_standby_daemon_takes_over_when_the_serving_one_is_killed_and_leaves_with_it(rundir, config, monkeypatch):
    monkeypatch.setenv("EFIM_DAEMON_STANDBY", "1")  # the front's environment: its daemons keep a standby
    config = msgspec.structs.replace(config, environment=engine_environment())  # the front's config, in that environment
    place = Place.for_digest(config.digest())
    front = _front(config, idle_timeout=1.0)
    try:
        active = front.daemon_pid
        _wait(lambda: len(daemon_pids(rundir)) == 2, timeout=30, what="the standby started")
        (standby,) = [pid for pid in daemon_pids(rundir) if pid != active]
        _wait(lambda: _standby_ready(place, standby), timeout=60, what="the standby's model loaded")
        assert _served(front)
        os.kill(active, signal.SIGKILL)
        _wait(lambda: front.state == "running" and front.daemon_pid != active, timeout=30, what="serving again")
        assert front.daemon_pid == standby, place.log.read_text()[-3000:]  # the standby took over; no daemon started for it
        assert [kind for kind, _, _ in front.on_fault.seen] == ["engine-crash"]
        assert _served(front)
        assert front.health()["daemon"]["startup"]["standby"] is True
        # The new serving daemon keeps a standby of its own.
        _wait(lambda: len(daemon_pids(rundir)) == 2, timeout=30, what="the next standby started")
    finally:
        front.close()
    # The last front gone: the serving daemon leaves on its idle timeout and stops its standby first.
    _wait(lambda: daemon_pids(rundir) == [], timeout=30, what="both daemons gone")
    assert not place.socket.exists()


def test_a_forked_standby_takes_over_when_the_daemon_is_killed_and_leaves_with_it(rundir, config):
    """The default standby: a fork of the daemon taken before its model load (sharing its
    pages), waiting on a pipe; the daemon SIGKILLed → the fork binds the socket after loading
    the model (no Python or torch start), forks a standby of its own, and both leave when the
    last front has gone."""
    place = Place.for_digest(config.digest())
    front = _front(config, idle_timeout=1.0)
    try:
        active = front.daemon_pid
        _wait(lambda: len(daemon_pids(rundir, forked_standbys=True)) == 2, timeout=30, what="the standby forked")
        (standby,) = [pid for pid in daemon_pids(rundir, forked_standbys=True) if pid != active]
        assert daemon_pids(rundir) == [active]  # a waiting standby is not counted as a daemon
        _wait(lambda: _standby_ready(place, standby), timeout=30, what="the standby waiting")
        assert _served(front)
        os.kill(active, signal.SIGKILL)
        _wait(lambda: front.state == "running" and front.daemon_pid != active, timeout=30, what="serving again")
        assert front.daemon_pid == standby, place.log.read_text()[-3000:]  # the fork took over; no daemon started
        assert [kind for kind, _, _ in front.on_fault.seen] == ["engine-crash"]
        assert _served(front)
        assert front.health()["daemon"]["startup"]["standby"] == "forked"
        _wait(lambda: len(daemon_pids(rundir, forked_standbys=True)) == 2, timeout=30, what="the next standby forked")
    finally:
        front.close()
    # The last front gone: the daemon leaves on its idle timeout and stops its standby first.
    _wait(lambda: daemon_pids(rundir, forked_standbys=True) == [], timeout=30, what="the daemon and its standby gone")
    assert not place.socket.exists()


def test_a_daemon_whose_model_fails_to_load_leaves_no_standby(rundir, tmp_path):
    config = DaemonConfig.of(str(tmp_path / "missing-model"), dtype="fp32")
    with pytest.raises(Exception, match="exited with code 2"):
        _front(config)
    _wait(lambda: daemon_pids(rundir, forked_standbys=True) == [], timeout=30, what="no daemon or standby left")


def test_a_standby_does_not_take_the_dying_daemons_listener_for_another_daemon(tmp_path):
    """A killed daemon's threads exit one by one: its standby can be reparented while the
    dead daemon's listening socket is still open. Such a listener (the pid the standby
    waited on) is asked again until it is gone; any other listener counts at once."""
    import socket as socket_module  # noqa: PLC0415

    from engine.daemon.standby import _someone_listens  # noqa: PLC0415

    path = tmp_path / "d.sock"
    assert not _someone_listens(path, besides=os.getpid(), until=time.monotonic() + 1)  # nobody: refused at once
    listener = socket_module.socket(socket_module.AF_UNIX, socket_module.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(8)
    closer = threading.Timer(0.2, listener.close)  # "the dying daemon" closes its files a moment later
    closer.start()
    t0 = time.monotonic()
    assert not _someone_listens(path, besides=os.getpid(), until=time.monotonic() + 5)
    assert 0.15 < time.monotonic() - t0 < 4  # it waited for the close, not for the deadline
    closer.join()
    other = socket_module.socket(socket_module.AF_UNIX, socket_module.SOCK_STREAM)
    path.unlink()
    other.bind(str(path))
    other.listen(8)
    try:
        assert _someone_listens(path, besides=os.getpid() + 1, until=time.monotonic() + 5)  # another daemon: at once
        assert _someone_listens(path, besides=os.getpid(), until=time.monotonic())  # past the deadline: it counts
    finally:
        other.close()
