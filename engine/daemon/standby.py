"""Standbys: a process of the serving daemon's configuration that takes over its socket the
moment it dies, so the fronts do not wait for a new daemon's Python and torch.

**The forked standby (the default)**: right after its imports, before any thread of its own
or any torch op, a daemon forks. The child shares every page with it copy-on-write (the
imports' ~230 MB count once in PSS) and blocks on a pipe only the daemon holds, with the
spawn lock taken; when the daemon dies the child does what `stand_by` below describes, forks
its own standby and loads the model — a restart costs the model load (~2 s for the embedded
model), not Python + torch + the model. `EFIM_DAEMON_FORKED_STANDBY=0` turns it off.

**The loaded standby** (opt-in: `EFIM_DAEMON_STANDBY=1` in the environment of the front that
starts the daemon): a second process of the same configuration, its model loaded, that
takes over the socket the moment the serving daemon dies — so a daemon killed under its
fronts costs them the time to notice and reconnect, not a new daemon's start (Python,
torch, the model: seconds). The price is a second copy of the model in memory.

How (no polling):
- the serving daemon, once it serves, starts `python -m engine.daemon ... --standby` with a
  pipe as the standby's stdin whose write end only the serving daemon holds;
- the standby loads its model, then takes the configuration's spawn lock and blocks
  reading the pipe. Fronts that find nobody answering wait for that lock (as they wait for a
  front that is starting a daemon), so none starts a daemon of its own meanwhile;
- the serving daemon dies (any way): the kernel closes the pipe, the standby reads EOF,
  checks that nobody listens on the socket, binds it, serves, releases the lock and starts
  its own standby. The fronts waiting for the lock connect to it;
- the serving daemon stopping on purpose (idle timeout, SIGTERM) stops its standby first
  (SIGTERM, waited for), so the standby never outlives it.

A standby still loading when the serving daemon dies does not hold the lock yet: the
fronts start a daemon as without a standby; the standby, once loaded, finds it answering
and exits.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from engine.daemon.launcher import SpawnLock, daemon_environment
from engine.daemon.place import peer_pid

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 5.0


def standby_command(argv: list[str]) -> list[str]:
    """The serving daemon's own command line (`sys.argv[1:]`), as its standby's."""
    return [sys.executable, "-m", "engine.daemon", *[a for a in argv if a != "--standby"], "--standby"]


class StandbyProcess:
    """The serving daemon's handle on its standby."""

    def __init__(self, command: list[str], log_path: Path) -> None:
        self.command = command
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        fd = os.open(self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            self.proc = subprocess.Popen(self.command, stdin=subprocess.PIPE, stdout=fd, stderr=fd, start_new_session=True,
                                         close_fds=True, env=daemon_environment(), cwd="/")
        finally:
            os.close(fd)
        threading.Thread(target=self.proc.wait, name="efim-standby-reaper", daemon=True).start()
        log.info("started a standby daemon (pid %d)", self.proc.pid)

    def stop(self) -> None:
        """SIGTERM the standby and wait for it (SIGKILL after `STOP_TIMEOUT_S`), so it cannot
        take over from a daemon that is exiting on purpose."""
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        proc.terminate()
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(STOP_TIMEOUT_S)
        log.info("stopped the standby daemon (pid %d)", proc.pid)


def _someone_listens(path: Path, besides: int | None = None, until: float = 0.0) -> bool:
    """Whether a process listens on `path`. A listener of pid `besides` (a daemon that is
    dying: a killed process's threads exit one by one, and its children can be reparented
    before its last thread has closed its files) does not count: it is asked again until it
    is gone or `until` (time.monotonic()) has passed."""
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(str(path))
            if besides is None or peer_pid(sock) != besides or time.monotonic() >= until:
                return True
        except OSError:
            return False
        finally:
            sock.close()
        time.sleep(0.001)


FORKED_STANDBY_ENV = "EFIM_DAEMON_FORKED_STANDBY"
FORKED_STANDBY_NAME = "efim-standby"  # its process name (/proc/PID/comm) while it waits
DAEMON_NAME = "efim-daemon"  # a serving daemon's


def set_process_name(name: str) -> None:
    """The calling thread's name in /proc/PID/comm (Linux prctl PR_SET_NAME; nothing elsewhere)."""
    try:
        import ctypes  # noqa: PLC0415

        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass


def forked_standby_wanted() -> bool:
    """The forked standby, unless `EFIM_DAEMON_FORKED_STANDBY=0` or the platform is not Linux
    (macOS does not support a fork that goes on without exec once system frameworks are loaded)."""
    return sys.platform.startswith("linux") and os.environ.get(FORKED_STANDBY_ENV, "1").strip().lower() not in (
        "0", "false", "no", "off")


class ForkedStandby:
    """The serving daemon's handle on its forked standby (`fork_standby`): the pipe's write
    end (closed by the kernel when the daemon dies, however it dies) and the child's pid."""

    def __init__(self, pid: int, pipe_w: int) -> None:
        self.pid, self.pipe_w = pid, pipe_w
        self._reaped = threading.Event()
        threading.Thread(target=self._reap, name="efim-standby-reaper", daemon=True).start()

    def _reap(self) -> None:
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass
        self._reaped.set()

    def start(self) -> None:  # forked already (EngineDaemon calls this once it serves)
        log.info("forked standby (pid %d) waiting to take over", self.pid)

    def stop(self) -> None:
        """SIGTERM the standby and wait for it (SIGKILL after `STOP_TIMEOUT_S`), so it cannot
        take over from a daemon that is exiting on purpose."""
        if self._reaped.is_set():
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                return
            if self._reaped.wait(STOP_TIMEOUT_S):
                log.info("stopped the forked standby (pid %d)", self.pid)
                return


def fork_standby(held: SpawnLock | None = None) -> ForkedStandby | int:
    """Fork: in the daemon, the `ForkedStandby` handle; in the child, the pipe's read end to
    pass to `stand_by`. Call it while the process runs no other thread of its own (after the
    imports, before the model load and the event loop): only the forking thread goes on in
    the child. `held`: the spawn lock this process holds (a standby that took over); the
    child closes its copy of the descriptor (a flock lasts while any copy is open: the child
    would keep it after its parent died, and wait for it forever)."""
    # Every object so far out of the collector's reach: a collection in the daemon would
    # write to their headers, and each page it writes is copied, the standby keeping the old.
    gc.freeze()
    pipe_r, pipe_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(pipe_w)
        if held is not None and held.fd is not None:
            os.close(held.fd)  # not LOCK_UN: the description is shared with the parent, which holds the lock
            held.fd = None
        os.setsid()  # its own session: a signal to the daemon's process group leaves it
        set_process_name(FORKED_STANDBY_NAME)
        return pipe_r
    os.close(pipe_r)
    return ForkedStandby(pid, pipe_w)


def stand_by(socket_path: Path, lock_path: Path, pipe_fd: int | None = None) -> SpawnLock | None:
    """In a standby: wait for the serving daemon to die (EOF on its pipe: stdin, or `pipe_fd`
    for a forked standby) holding the spawn lock, then return the lock (held: release it once
    bound) when the socket is free to take; None when another daemon answers there (exit
    quietly)."""
    parent = os.getppid()
    lock = SpawnLock(lock_path, timeout=float("inf"))
    lock.__enter__()
    log.info("standby daemon %d ready: waiting for the serving daemon to end", os.getpid())
    fd = sys.stdin.fileno() if pipe_fd is None else pipe_fd
    try:
        while os.read(fd, 65536):
            pass
    except OSError:
        pass
    if pipe_fd is not None:
        os.close(pipe_fd)
    # The pipe may close a moment before the dying daemon's listening socket does (the
    # kernel closes a dead process's files in order); once it is reparented away from it,
    # every file of the serving daemon is closed and a listener there is another daemon.
    end = time.monotonic() + 2.0
    while os.getppid() == parent and time.monotonic() < end:
        time.sleep(0.001)
    if _someone_listens(socket_path, besides=parent, until=end):
        lock.__exit__(None, None, None)
        log.info("standby daemon %d: another daemon serves %s; exiting", os.getpid(), socket_path)
        return None
    log.info("standby daemon %d: the serving daemon ended; taking over %s", os.getpid(), socket_path)
    if pipe_fd is not None:
        set_process_name(DAEMON_NAME)  # no longer a waiting standby (bench.process_memory.daemon_pids)
    return lock


__all__ = ["DAEMON_NAME", "FORKED_STANDBY_NAME", "ForkedStandby", "StandbyProcess", "fork_standby", "forked_standby_wanted", "set_process_name", "stand_by", "standby_command"]
