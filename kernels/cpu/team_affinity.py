"""Which CPUs the threads of the calling thread's OpenMP team may run on.

torch's parallel work and the C kernels built with OpenMP run on one pool of threads per
thread that opens parallel regions (libgomp's; `kernels.cpu.build` links the kernels to torch's
own runtime). Pinning that team one thread per CPU keeps the kernel scheduler from stacking
two of its threads on one CPU while another CPU idles — on a 2-core VM that happened to about
a third of the server's first-window prefills, and such a step took 1.5-2.5x its time (a barrier
waits for the thread that is not running; docs/navigation.md "Two threads on one core").

Kernels know no engine: this sets affinities and says whether it could; when to pin is the
caller's choice (`engine.runtime.cpu_threads`).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from pathlib import Path

from kernels.cpu.build import library


class TeamAffinity:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self._set = lib.efim_team_affinity
        self._set.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
        self._set.restype = ctypes.c_int

    @classmethod
    def load(cls, cache_dir: Path | None = None) -> "TeamAffinity | None":
        """None where the C kernels are off, cannot be built, or are built without torch's
        OpenMP runtime (a region opened here would not reach torch's threads)."""
        lib = library("team_affinity", cache_dir, native=False, openmp=True)
        if lib is None:
            return None
        lib.efim_team_affinity_openmp.restype = ctypes.c_int
        return cls(lib) if lib.efim_team_affinity_openmp() else None

    def _apply(self, threads: int, per_thread: Sequence[Sequence[int]]) -> bool:
        width = len(per_thread[0])
        flat = [cpu for cpus in per_thread for cpu in cpus]
        return self._set(threads, width, (ctypes.c_int * len(flat))(*flat)) == threads

    def pin(self, cpus: Sequence[int]) -> bool:
        """Thread i of a team of len(cpus) threads (the caller is thread 0) on cpus[i] alone;
        True when every thread's affinity was set."""
        cpus = [int(c) for c in cpus]
        if not cpus or len(set(cpus)) != len(cpus) or min(cpus) < 0:
            raise ValueError(f"pin() takes distinct CPU numbers, got {cpus}")
        return self._apply(len(cpus), [[c] for c in cpus])

    def allow(self, threads: int, cpus: Sequence[int]) -> bool:
        """Every thread of a team of `threads` (the caller included) on any of `cpus`: what
        undoes `pin`; True when every thread's affinity was set."""
        cpus = sorted({int(c) for c in cpus})
        if threads < 1 or not cpus or cpus[0] < 0:
            raise ValueError(f"allow() takes threads >= 1 and CPU numbers, got {threads}, {cpus}")
        return self._apply(threads, [cpus] * threads)


__all__ = ["TeamAffinity"]
