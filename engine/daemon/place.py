"""Where a user's engine daemons live, and the checks that keep them the user's.

The directory is `$XDG_RUNTIME_DIR/efim` (a per-user tmpfs that the login manager
creates 0700), else `/tmp/efim-<uid>`; it is created 0700 and must belong to the user —
a directory of another owner (someone squatting the name in /tmp) is refused, never
used. In it, per configuration digest: `<digest>.sock` (0600), `<digest>.lock` (the
spawn lock) and `<digest>.log` (0600, the daemon's stdout and stderr).

A peer is checked twice before anything is sent: the socket file must be the user's,
and the process on the other end must run as the user (SO_PEERCRED, where the platform
has it). `EngineError`s here say what is wrong and what to do.
"""

from __future__ import annotations

import os
import socket
import stat
import struct
import tempfile
from pathlib import Path

from engine.api import EngineError


def supported() -> bool:
    """Unix sockets and per-user file modes: what a daemon needs (not on Windows)."""
    return hasattr(socket, "AF_UNIX") and hasattr(os, "getuid")


def runtime_dir() -> Path:
    """The user's daemon directory, created 0700 if missing; EngineError when it exists but
    is not a directory of this user (its mode is narrowed to 0700 when it is)."""
    uid = os.getuid()
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and Path(xdg).is_dir():
        path = Path(xdg) / "efim"
    else:
        path = Path(tempfile.gettempdir()) / f"efim-{uid}"
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise EngineError(f"cannot create the engine daemon directory {path}: {exc}") from None
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise EngineError(f"{path} is not a directory; remove it so the engine daemon can use the name")
    if st.st_uid != uid:
        raise EngineError(f"the engine daemon directory {path} belongs to uid {st.st_uid}, not to you ({uid}): "
                          "refusing to use it (remove it, or set XDG_RUNTIME_DIR)")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)
    return path


class Place:
    """The files of one configuration's daemon."""

    def __init__(self, directory: Path, digest: str) -> None:
        self.directory = directory
        self.digest = digest
        self.socket = directory / f"{digest}.sock"
        self.lock = directory / f"{digest}.lock"
        self.log = directory / f"{digest}.log"

    @classmethod
    def for_digest(cls, digest: str) -> Place:
        return cls(runtime_dir(), digest)

    def check_socket(self) -> bool:
        """True when the socket file exists and is fit to connect to; False when there is
        none; EngineError when it is not a socket or not the user's."""
        try:
            st = os.lstat(self.socket)
        except FileNotFoundError:
            return False
        if not stat.S_ISSOCK(st.st_mode):
            raise EngineError(f"{self.socket} is not a socket; remove it")
        if st.st_uid != os.getuid():
            raise EngineError(f"the engine daemon socket {self.socket} belongs to uid {st.st_uid}, not to you "
                              f"({os.getuid()}): refusing to connect")
        return True

    def open_log(self) -> int:
        """The daemon's log file, created 0600 (appended to), as a file descriptor."""
        fd = os.open(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        if os.fstat(fd).st_uid == os.getuid():
            os.fchmod(fd, 0o600)
        return fd

    def log_tail(self, lines: int = 3) -> str:
        try:
            text = self.log.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        kept = [line for line in text.splitlines() if line.strip()]
        return " | ".join(kept[-lines:])


def _peer_credentials(sock: socket.socket) -> tuple[int, int, int] | None:
    """(pid, uid, gid) of the process at the other end of a Unix socket (Linux SO_PEERCRED),
    None where the platform has no such option."""
    option = getattr(socket, "SO_PEERCRED", None)
    if option is None:
        return None
    return struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, option, struct.calcsize("3i")))


def peer_uid(sock: socket.socket) -> int | None:
    """The uid of the process at the other end of a Unix socket (Linux SO_PEERCRED; None
    where the platform cannot tell)."""
    creds = _peer_credentials(sock)
    if creds is None:
        try:
            uid, _gid = sock.getpeereid()  # type: ignore[attr-defined]  # BSD / macOS, where present
            return uid
        except (AttributeError, OSError):
            return None
    return creds[1]


def peer_pid(sock: socket.socket) -> int | None:
    """The pid of the process at the other end of a connected Unix socket — for a listener,
    the process that called listen() (Linux SO_PEERCRED; None elsewhere)."""
    creds = _peer_credentials(sock)
    return None if creds is None else creds[0]


__all__ = ["supported", "runtime_dir", "Place", "peer_uid", "peer_pid"]
