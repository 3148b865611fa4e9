"""A standby daemon (opt-in: `EFIM_DAEMON_STANDBY=1` in the environment of the front that
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

import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from engine.daemon.launcher import SpawnLock, daemon_environment

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


def _someone_listens(path: Path) -> bool:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        sock.close()


def stand_by(socket_path: Path, lock_path: Path) -> SpawnLock | None:
    """In the standby, its model loaded: wait for the serving daemon to die (EOF on stdin)
    holding the spawn lock, then return the lock (held: release it once bound) when the
    socket is free to take; None when another daemon answers there (exit quietly)."""
    parent = os.getppid()
    lock = SpawnLock(lock_path, timeout=float("inf"))
    lock.__enter__()
    log.info("standby daemon %d ready: waiting for the serving daemon to end", os.getpid())
    try:
        while sys.stdin.buffer.read(65536):
            pass
    except OSError:
        pass
    # The pipe may close a moment before the dying daemon's listening socket does (the
    # kernel closes a dead process's files in order); once it is reparented away from it,
    # every file of the serving daemon is closed and a listener there is another daemon.
    end = time.monotonic() + 2.0
    while os.getppid() == parent and time.monotonic() < end:
        time.sleep(0.001)
    if _someone_listens(socket_path):
        lock.__exit__(None, None, None)
        log.info("standby daemon %d: another daemon serves %s; exiting", os.getpid(), socket_path)
        return None
    log.info("standby daemon %d: the serving daemon ended; taking over %s", os.getpid(), socket_path)
    return lock


__all__ = ["StandbyProcess", "stand_by", "standby_command"]
