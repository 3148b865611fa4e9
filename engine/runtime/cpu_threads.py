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

While the engine's team fills every CPU this process may use (two threads on two cores), its
threads are pinned one per CPU (`kernels.cpu.team_affinity`): else the kernel scheduler, waking a
thread that slept at a barrier, often puts it on the CPU of the thread that woke it while the
other CPU idles, and the step runs at a third to a half of its speed until it is moved. Measured
on a 2-core VM, a 92-token prefill after a 0.2-0.6 s pause: p50 / p90 / max 27.3 / 40.6 / 69.3 ms
unpinned, 26.6 / 27.9 / 28.9 ms pinned. While other processes keep cores busy the team is
smaller than the machine and runs where the kernel puts it (pinned, a thread could not leave a
CPU that another process holds).

libgomp also shortens every team's spin to almost nothing once it manages more threads than
there are CPUs, so each thread that runs parallel torch work keeps a team alive for as long
as it lives: model loading runs on a thread that exits (`engine.local.load_engine`), and
only the engine thread computes afterwards.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from typing import TYPE_CHECKING, Callable, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)

import torch

if TYPE_CHECKING:
    from kernels.cpu.team_affinity import TeamAffinity

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
    With `team` (the OpenMP team's affinity, `kernels.cpu.team_affinity`), a team as large as
    the CPUs this process may use is pinned one thread per CPU (module docstring); `allowed`
    (for tests) replaces those CPUs' numbers.
    """

    def __init__(
        self, most: int, *, cpus: int | None = None, others: Callable[[], float | None] | None = None,
        team: "TeamAffinity | None" = None, allowed: list[int] | None = None,
    ) -> None:
        if most < 1:
            raise ValueError("most must be >= 1")
        self.most = most
        if allowed is None:
            allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
        self.allowed = allowed
        if cpus is None:
            cpus = len(allowed)
        self.cpus = cpus
        self.team = team
        self.pinned = 0  # threads of the team pinned one per CPU now (0: none)
        self._placed: int | None = None  # the team size the placement was last chosen for
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
        if self.team is not None and self._placed != self.threads:
            self._place()
        return self.threads

    def on_new_thread(self) -> None:
        """First thing on each new engine thread: a thread starts with its creator's affinity (a
        restarted engine thread is started by the dying one, pinned to one CPU) and with a new
        team, not placed yet; it gets back every allowed CPU and is placed at its first `apply`."""
        self._placed = None
        self.pinned = 0
        if self.team is not None:
            try:
                os.sched_setaffinity(0, self.allowed)
            except OSError as exc:
                log.warning("could not give the engine thread back its CPUs (%s)", exc)

    def _place(self) -> None:
        """Pin a team that fills the allowed CPUs one thread per CPU; else undo a pinning, on
        every thread that had one. A pinning that does not reach every thread is undone."""
        team, threads = self.team, self.threads
        assert team is not None
        self._placed = threads
        if 2 <= threads == len(self.allowed):
            if team.pin(self.allowed[:threads]):
                self.pinned = threads
                return
            log.warning("could not pin the engine's %d threads one per CPU; they run where the kernel puts them", threads)
            self.team = None  # not tried again
            team.allow(threads, self.allowed)
            self.pinned = 0
        elif self.pinned:
            team.allow(self.pinned, self.allowed)
            self.pinned = 0


def team_affinity() -> "TeamAffinity | None":
    """The OpenMP team's affinity setter for the engine's CPU work (`ThreadGovernor`'s `team`);
    None with `EFIM_PIN_THREADS=0` or where it cannot reach torch's threads (no C compiler,
    another OpenMP runtime, `EFIM_C_KERNELS=0`)."""
    if os.environ.get("EFIM_PIN_THREADS", "1").strip() == "0" or not hasattr(os, "sched_setaffinity"):
        return None
    from engine.paths import cache_root  # noqa: PLC0415
    from kernels.cpu.team_affinity import TeamAffinity  # noqa: PLC0415

    return TeamAffinity.load(cache_root() / "kernels")


__all__ = ["ThreadGovernor", "SAMPLE_SECONDS", "IDLE_CORES", "team_affinity"]


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
