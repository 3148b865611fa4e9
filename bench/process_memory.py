"""Memory of processes, as the benchmarks sample it: RSS and PSS from /proc.

`memory_mb(pid)`: (RSS, PSS) in MB from `/proc/PID/smaps_rollup` (PSS is NaN where that
file is not readable: an older kernel, another user's process; RSS then comes from
`/proc/PID/status`); (NaN, NaN) once the process is gone. `daemon_pids(directory)`: the
engine daemons serving a socket under `directory` (what a benchmark's fronts started in
their private runtime directory); `kill_daemons(directory)`: all of them, standbys first.
"""

from __future__ import annotations

import math
from pathlib import Path


def memory_mb(pid: int) -> tuple[float, float]:
    """(RSS, PSS) of a process in MB; NaN for what cannot be read."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return _status_rss_mb(pid), math.nan
    rss = pss = math.nan
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name == "Rss":
            rss = int(rest.split()[0]) / 1024
        elif name == "Pss":
            pss = int(rest.split()[0]) / 1024
    return rss, pss


def _status_rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return math.nan


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def daemon_pids(directory: Path, *, forked_standbys: bool = False) -> list[int]:
    """Live `python -m engine.daemon` processes whose command line names `directory` (their
    socket lives there), lowest pid first. Not zombies (a daemon killed or exited stays in
    /proc until its front's reaper thread waits for it) and not `--check` preflights (they
    load no weights and serve nothing). A daemon's forked standby (a fork of it, waiting to
    take over: `engine.daemon.standby`, named `efim-standby`) only with `forked_standbys`;
    a loaded standby (`--standby`) always. The daemon tests count their daemons with it too."""
    from engine.daemon.standby import FORKED_STANDBY_NAME  # noqa: PLC0415

    needle = str(directory).encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            comm = (entry / "comm").read_text().strip()
        except OSError:
            continue
        if b"engine.daemon" in cmdline and b"--check" not in cmdline and any(needle in part for part in cmdline):
            if (forked_standbys or comm != FORKED_STANDBY_NAME) and alive(int(entry.name)):
                pids.append(int(entry.name))
    return sorted(pids)


def kill_daemons(directory: Path, timeout: float = 10.0) -> None:
    """SIGKILL every daemon of `directory`, its forked standbys first (a standby left alive
    takes over from a killed daemon), until none is left or `timeout` passes."""
    import os  # noqa: PLC0415
    import signal  # noqa: PLC0415
    import time  # noqa: PLC0415

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        every = daemon_pids(directory, forked_standbys=True)
        if not every:
            return
        serving = set(daemon_pids(directory))
        for pid in sorted(every, key=lambda p: p in serving):  # standbys first
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


__all__ = ["memory_mb", "alive", "daemon_pids", "kill_daemons"]
