"""Run an untrusted generated program in a child process and say whether it passed.

Limits: wall-clock timeout (the whole process group is killed), CPU seconds
(RLIMIT_CPU), address space (RLIMIT_AS), file size (RLIMIT_FSIZE), a fresh temporary
working directory, an environment without proxies or paths to user files, no network
(a new network namespace via `unshare -rn` when the kernel allows it, and the socket
module disabled in the child either way), and destructive functions (process control,
file removal, `shutil.rmtree`, `subprocess`, ...) replaced by stubs that raise before
the program runs. This is a guard against accidents in model output, not a security
boundary against a hostile author.

Contract: `run_program` never raises for anything the program does; a program that
hangs, crashes, exhausts memory or exits non-zero is a failure (`passed=False`).
"""

from __future__ import annotations

import functools
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Literal, NamedTuple

Status = Literal["passed", "failed", "timeout", "error"]

# Runs inside the child before the program: read the program from stdin, disable what
# must not run, execute it. Kept as source text so the child needs no project imports.
_GUARD = r'''
import builtins, os, shutil, subprocess, sys, socket, faulthandler
src = sys.stdin.read()
faulthandler.disable()
def _blocked(*a, **k):
    raise PermissionError("disabled in the evaluation sandbox")
class _NoSocket:
    def __init__(self, *a, **k):
        raise PermissionError("network is disabled in the evaluation sandbox")
socket.socket = _NoSocket
socket.create_connection = _blocked
for name in ("kill", "killpg", "system", "popen", "fork", "forkpty", "execv", "execve", "execvp", "execvpe", "execl", "execle", "execlp", "execlpe", "spawnl", "spawnv", "spawnve", "spawnvp", "remove", "unlink", "rmdir", "removedirs", "rename", "renames", "replace", "truncate", "ftruncate", "chmod", "fchmod", "chown", "fchown", "lchown", "chroot", "setuid", "putenv", "unsetenv", "symlink", "link", "mkfifo", "mknod", "fchdir", "chdir", "nice", "plock"):
    if hasattr(os, name):
        setattr(os, name, _blocked)
for name in ("rmtree", "move", "chown"):
    setattr(shutil, name, _blocked)
subprocess.Popen = _NoSocket
for name in ("run", "call", "check_call", "check_output", "getoutput", "getstatusoutput"):
    setattr(subprocess, name, _blocked)
builtins.exit = builtins.quit = _blocked
for mod in ("ipdb", "joblib", "resource", "psutil", "tkinter", "ctypes"):
    sys.modules[mod] = None
del builtins, os, shutil, subprocess, socket, faulthandler, name, mod
exec(compile(src, "<generated>", "exec"), {"__name__": "__main__"})
'''


class SandboxResult(NamedTuple):
    passed: bool
    status: Status
    returncode: int | None
    seconds: float
    stderr_tail: str


class Limits(NamedTuple):
    wall_seconds: float = 10.0
    cpu_seconds: int = 5
    memory_mb: int = 1024
    file_mb: int = 8


def _set_limits(limits: Limits) -> None:  # runs in the child between fork and exec
    resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_seconds, limits.cpu_seconds + 1))
    mem = limits.memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    fsize = limits.file_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


@functools.lru_cache(maxsize=1)
def _network_namespace_prefix() -> tuple[str, ...]:
    """`unshare -rn` puts the child in an empty network namespace (no interfaces but a
    down loopback), where available; otherwise only the in-process socket stub applies."""
    exe = shutil.which("unshare")
    if exe is None:
        return ()
    try:
        ok = subprocess.run([exe, "-rn", "true"], capture_output=True, timeout=5).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    return (exe, "-rn") if ok else ()


def run_program(source: str, limits: Limits = Limits()) -> SandboxResult:
    """Execute `source` as `__main__` under the limits; passed ⇔ exit status 0."""
    env = {"PATH": "/usr/bin:/bin", "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1", "LANG": "C.UTF-8"}
    cmd = [*_network_namespace_prefix(), sys.executable, "-I", "-S", "-c", _GUARD]
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="efim-sandbox-") as cwd:
        env["HOME"] = env["TMPDIR"] = cwd
        try:
            proc = subprocess.Popen(
                cmd,
                cwd=cwd,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                preexec_fn=functools.partial(_set_limits, limits),
                start_new_session=True,  # its own process group, killed as a whole on timeout
            )
        except OSError as exc:
            return SandboxResult(False, "error", None, time.monotonic() - start, f"could not start: {exc}")
        try:
            _, err = proc.communicate(source.encode("utf-8", "surrogatepass"), timeout=limits.wall_seconds)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            _, err = proc.communicate()
            return SandboxResult(False, "timeout", proc.returncode, time.monotonic() - start, _tail(err))
        finally:
            if proc.poll() is None:
                _kill_group(proc)
                proc.wait()
    rc = proc.returncode
    seconds = time.monotonic() - start
    if rc == 0:
        return SandboxResult(True, "passed", rc, seconds, _tail(err))
    # SIGXCPU / SIGKILL from the CPU limit are timeouts too.
    status: Status = "timeout" if rc in (-signal.SIGXCPU, -signal.SIGKILL) else "failed"
    return SandboxResult(False, status, rc, seconds, _tail(err))


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()


def _tail(err: bytes | None, n: int = 400) -> str:
    return (err or b"")[-n:].decode("utf-8", "replace")


__all__ = ["run_program", "SandboxResult", "Limits"]
