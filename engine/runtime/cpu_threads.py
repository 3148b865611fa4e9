"""How many CPU threads the engine's model work uses, chosen as the machine's load changes.

torch runs its CPU kernels on an OpenMP team (libgomp in the CPU wheels). Measured on a
2-core AVX512/AMX machine, prefill of the embedded 135M model, 256-token prefill steps (tok/s):

| threads, wait policy          | machine idle | one core busy with another process |
|-------------------------------|--------------|------------------------------------|
| 2, passive (workers sleep)    | 1,550        | 1,380                              |
| 2, spin 300,000 (the default) | 2,340        | 72                                 |
| 2, spin 5,000                 | 2,480        | 920                                |
| 1                             | 1,580        | 1,480                              |

So two threads that spin briefly between kernels are fastest while the machine is idle,
and one thread is fastest once something else wants a core (a team's barrier waits for a
descheduled thread). `ThreadGovernor` measures, from /proc, how many cores other processes
used lately and gives the engine thread all of its threads or fewer. The spin itself is set
before torch loads (`efim` sets `GOMP_SPINCOUNT`, see `efim_tools/cli.py`).

libgomp also shortens every team's spin to almost nothing once it manages more threads than
there are CPUs, so each thread that runs parallel torch work keeps a team alive for as long
as it lives: model loading runs on a thread that exits (`engine.local.load_engine`), and
only the engine thread computes afterwards.
"""

from __future__ import annotations

import math
import os
import threading
import time
from typing import Callable, TypeVar

T = TypeVar("T")

import torch

# Re-read the machine's load at most this often (two small /proc reads).
SAMPLE_SECONDS = 0.5
# Other processes' use below which the machine counts as idle. Measured as above with a
# process busy 30 % / 50 % / 70 % of the time on one core: 2 threads 1,380 / 1,120 / 1,030
# tok/s, 1 thread 1,510 / 1,480 / 1,530 — any steady load beyond a trickle favours fewer.
IDLE_CORES = 0.25


def _machine_busy_ticks() -> tuple[int, int] | None:
    """(busy, total) clock ticks of all CPUs since boot, from /proc/stat; None elsewhere."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    values = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
    idle = values[3] + values[4]
    return sum(values) - idle, sum(values)


def _own_ticks() -> int | None:
    """User + system clock ticks of this process (all its threads), from /proc/self/stat."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after the command name, which may hold spaces
    return int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of the line)


class ThreadGovernor:
    """Sets the calling thread's torch thread count from the other processes' CPU use.

    `most` threads while other processes use less than `IDLE_CORES` of the `cpus` this
    process may run on, fewer as they use more (never below 1). Call `apply()` from the
    thread that computes (the engine thread), before each unit of work. `others` (for
    tests) replaces the /proc reading with a function returning the other processes' cores.
    """

    def __init__(self, most: int, *, cpus: int | None = None, others: Callable[[], float | None] | None = None) -> None:
        if most < 1:
            raise ValueError("most must be >= 1")
        self.most = most
        if cpus is None:
            cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        self.cpus = cpus
        self._others = others or self._others_from_proc
        self._last: tuple[float, int, int, int] | None = None  # (wall, busy, total, own)
        self._next_sample = 0.0
        self.threads = most
        self.changes = 0

    def _others_from_proc(self) -> float | None:
        machine, own = _machine_busy_ticks(), _own_ticks()
        if machine is None or own is None:
            return None
        now = (time.monotonic(), machine[0], machine[1], own)
        last, self._last = self._last, now
        if last is None or now[2] <= last[2]:
            return None
        # Ticks of all CPUs over the interval, so busy/total is a share of the whole machine.
        share = ((now[1] - last[1]) - (now[3] - last[3])) / (now[2] - last[2])
        return max(0.0, share) * (os.cpu_count() or 1)

    def wanted(self, others: float) -> int:
        """Threads for the engine while other processes use `others` cores: one core fewer
        for each core they use beyond `IDLE_CORES`, rounded up (on 2 cores: two threads only
        while the rest of the machine is nearly idle)."""
        taken = math.ceil(max(0.0, others - IDLE_CORES))
        return max(1, min(self.most, self.cpus - taken))

    def apply(self) -> int:
        """Re-read the load when due, set torch's thread count for this thread if it
        changed, and return it."""
        now = time.monotonic()
        if now >= self._next_sample:
            self._next_sample = now + SAMPLE_SECONDS
            others = self._others()
            if others is not None:
                threads = self.wanted(others)
                if threads != self.threads:
                    self.threads = threads
                    self.changes += 1
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        return self.threads


__all__ = ["ThreadGovernor", "SAMPLE_SECONDS", "IDLE_CORES"]


def on_a_thread_that_ends(fn: Callable[[], T], name: str = "efim-once") -> T:
    """Run `fn` on a new thread, wait for it, return its result or raise its exception.

    torch work done here leaves no OpenMP team behind (libgomp keeps one per thread that ran
    a parallel region, for as long as that thread lives): the engine thread, started later,
    is then the only team on the machine's cores. Model loading runs here, and so do the
    benchmarks' main-thread measurements that come before an engine (measured on 2 cores: a
    decode step on a second thread took 35.5 ms while the first thread's team lived, 22.4 ms
    on the first thread alone)."""
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]
