"""Reach a configuration's daemon, starting it when none answers (blocking: a loader thread's work).

`reach(place, config, kv_budget)`: connect and exchange hellos; when nothing answers,
take the configuration's spawn lock (`fcntl.flock` on `<digest>.lock`), look again (a
front that held the lock may have started it meanwhile), and otherwise start
`python -m engine.daemon` detached (its own session, stdin closed, stdout and stderr to
the 0600 log) and wait until it answers — it binds its socket only once its model is
loaded, so an answer means ready. Fronts that start together therefore start one daemon.

A peer that is not this user's, or speaks another protocol version, is refused with
`DaemonRefused` before anything but the hello is sent to it.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from engine.api import EngineError
from engine.daemon.config import DaemonConfig, is_engine_variable
from engine.daemon.place import Place, peer_uid
from engine.daemon.wire import Hello, ProtocolError, decode_hello, frame, read_frame_blocking

log = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 10.0
# The longest a front waits for a daemon it started (the model load) or for the spawn lock.
START_TIMEOUT_S = 300.0
DEFAULT_IDLE_TIMEOUT_S = 60.0
# A daemon killed by a signal while it loads (not a model that cannot load: exit code 2) is
# started again this many times within one `reach`.
SIGNAL_RESPAWNS = 2
# A front's environment with this set to 1 starts daemons that keep a standby (engine.daemon.standby).
STANDBY_ENV = "EFIM_DAEMON_STANDBY"


class DaemonRefused(EngineError):
    """The socket's peer is not this user's daemon of this protocol version."""


def connect(place: Place, kv_budget: int | None, timeout: float = HELLO_TIMEOUT_S) -> tuple[socket.socket, Hello] | None:
    """A connected socket and the daemon's hello, or None when no daemon answers there (no
    socket, a stale one, a daemon closing). DaemonRefused for a foreign or older peer."""
    if not place.check_socket():
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(str(place.socket))
    except (ConnectionRefusedError, FileNotFoundError):
        sock.close()
        return None
    except OSError:
        sock.close()
        raise
    try:
        uid = peer_uid(sock)
        if uid is not None and uid != os.getuid():
            raise DaemonRefused(f"the process on {place.socket} runs as uid {uid}, not as you ({os.getuid()}): "
                                "refusing to talk to it")
        sock.sendall(frame(Hello(uid=os.getuid(), pid=os.getpid(), kv_budget=kv_budget)))
        try:
            hello = decode_hello(read_frame_blocking(sock, timeout))
        except ProtocolError as exc:
            raise DaemonRefused(f"{place.socket} does not answer as an efim engine daemon of this version ({exc}): "
                                "refusing to talk to it; stop that process (or remove the socket) so a current "
                                "daemon can start") from None
        except ConnectionError:
            sock.close()
            return None  # the daemon is going away (idle exit): start another
        except (TimeoutError, socket.timeout):
            raise EngineError(f"the engine daemon on {place.socket} did not answer within {timeout:.0f} s") from None
        if hello.refused:
            raise DaemonRefused(f"the engine daemon on {place.socket} refused this front: {hello.refused}")
        if hello.uid != os.getuid():
            raise DaemonRefused(f"the engine daemon on {place.socket} says it runs as uid {hello.uid}, not as you "
                                f"({os.getuid()}): refusing to talk to it")
        sock.settimeout(None)
        return sock, hello
    except BaseException:
        sock.close()
        raise


class SpawnLock:
    """An exclusive `flock` on the configuration's lock file, waited for at most `timeout` s.
    `poll`: called while the lock is busy; the first value it returns that is not None ends
    the wait without the lock (`found`) — a front waiting for the lock connects to a daemon
    that answers meanwhile, whoever holds the lock (a standby holds it for as long as its
    daemon lives)."""

    def __init__(self, path: Path, timeout: float = START_TIMEOUT_S, poll=None) -> None:
        self.path = path
        self.timeout = timeout
        self.poll = poll
        self.found = None
        self.fd: int | None = None

    def __enter__(self) -> SpawnLock:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        end = time.monotonic() + self.timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if self.poll is not None:
                    try:
                        self.found = self.poll()
                    except BaseException:  # a refusal (DaemonRefused) ends the wait: the file is not kept open
                        os.close(fd)
                        raise
                    if self.found is not None:
                        os.close(fd)
                        return self
                if time.monotonic() > end:
                    os.close(fd)
                    raise EngineError(f"another front held {self.path} for {self.timeout:.0f} s") from None
                time.sleep(0.05)
        self.fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def daemon_command(place: Place, config: DaemonConfig, kv_budget: int | None, idle_timeout: float) -> list[str]:
    """The daemon's command line; with `--keep-standby` when this front's environment asks
    for a standby (`EFIM_DAEMON_STANDBY=1`, engine.daemon.standby)."""
    import msgspec  # noqa: PLC0415

    command = [sys.executable, "-m", "engine.daemon", "--socket", str(place.socket),
               "--config", msgspec.json.encode(config).decode(), "--idle-timeout", str(idle_timeout)]
    if kv_budget is not None:
        command += ["--kv-budget", str(kv_budget)]
    if config.environment.get(STANDBY_ENV, "").strip().lower() in ("1", "true", "yes", "on"):
        command.append("--keep-standby")
    return command


def daemon_environment(config: DaemonConfig | None = None) -> dict[str, str]:
    """A daemon's environment: this process's — its engine variables replaced by
    `config.environment` when a config is given, so the daemon runs with exactly the
    environment its digest names — with the folder holding `engine` first on PYTHONPATH
    (a front run from a checkout starts the same code)."""
    env = dict(os.environ)
    if config is not None:
        env = {k: v for k, v in env.items() if not is_engine_variable(k)} | config.environment
    source_root = str(Path(__file__).resolve().parents[2])  # the folder holding `engine`
    env["PYTHONPATH"] = source_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def spawn(place: Place, config: DaemonConfig, kv_budget: int | None, idle_timeout: float) -> subprocess.Popen:
    """Start the daemon detached: a session of its own (a terminal's hangup or the front's
    death does not reach it), stdin closed, stdout and stderr appended to the 0600 log."""
    env = daemon_environment(config)
    log_fd = place.open_log()
    try:
        proc = subprocess.Popen(
            daemon_command(place, config, kv_budget, idle_timeout), stdin=subprocess.DEVNULL, stdout=log_fd,
            stderr=log_fd, start_new_session=True, close_fds=True, env=env, cwd="/",
        )
    finally:
        os.close(log_fd)
    # Reap it when it exits (idle timeout) so it does not linger as a zombie of this front.
    threading.Thread(target=proc.wait, name="efim-daemon-reaper", daemon=True).start()
    log.info("started the engine daemon (pid %d) for %s; log %s", proc.pid, config.model, place.log)
    return proc


def check_in_subprocess(config: DaemonConfig, timeout: float = 120.0) -> None:
    """The model's weight-free checks (`engine.local.check_model`) in a short-lived process
    (`python -m engine.daemon --check`), so a front keeps torch out of its own memory; raises
    EngineError with the check's message when the model cannot load."""
    import msgspec  # noqa: PLC0415

    env = daemon_environment(config)
    done = subprocess.run([sys.executable, "-m", "engine.daemon", "--check", "--config", msgspec.json.encode(config).decode()],
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout, env=env)
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        raise EngineError(lines[-1] if lines else f"the model check exited with code {done.returncode}")


def reach(place: Place, config: DaemonConfig, kv_budget: int | None, *, idle_timeout: float = DEFAULT_IDLE_TIMEOUT_S,
          start_timeout: float = START_TIMEOUT_S) -> tuple[socket.socket, Hello]:
    """Connect to the configuration's daemon, starting it (under the spawn lock) when none
    answers. A daemon that exits while starting fails it with the log's last lines — unless a signal ended it (killed mid-load): then another is started, at
    most `SIGNAL_RESPAWNS` times."""
    got = connect(place, kv_budget)
    if got is not None:
        return got
    with SpawnLock(place.lock, start_timeout, poll=lambda: connect(place, kv_budget)) as lock:
        got = lock.found or connect(place, kv_budget)
        if got is not None:
            return got
        end = time.monotonic() + start_timeout
        for attempt in range(1 + SIGNAL_RESPAWNS):
            proc = spawn(place, config, kv_budget, idle_timeout)
            delay = 0.02
            while True:
                got = connect(place, kv_budget)
                if got is not None:
                    return got
                code = proc.returncode  # set by the reaper thread once it exited
                if code is not None:
                    break
                if time.monotonic() > end:
                    raise EngineError(f"the engine daemon (pid {proc.pid}) did not answer within {start_timeout:.0f} s "
                                      f"(log: {place.log})")
                time.sleep(delay)
                delay = min(0.1, delay * 1.5)
            if code >= 0 or attempt == SIGNAL_RESPAWNS:
                raise EngineError(f"the engine daemon exited with code {code} while starting: {place.log_tail()} "
                                  f"(log: {place.log})")
            # Killed by a signal while loading (SIGKILL, the OOM killer): not the model's fault.
            log.warning("the engine daemon (pid %d) was killed by signal %d while starting; starting another",
                        proc.pid, -code)
        raise AssertionError("unreachable")


__all__ = ["DaemonRefused", "connect", "reach", "spawn", "SpawnLock", "check_in_subprocess", "DEFAULT_IDLE_TIMEOUT_S"]
