"""Pinning the calling thread's OpenMP team one thread per CPU (kernels/cpu/team_affinity.py):
it reaches the worker threads torch's own parallel work runs on, and `allow` undoes it."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from engine.runtime.cpu_threads import on_a_thread_that_ends  # a new thread: its OpenMP team is new and ends with it
from kernels.cpu import build
from kernels.cpu.team_affinity import TeamAffinity
from tests.kernels.threads import torch_threads

ALLOWED = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
pytestmark = [
    pytest.mark.skipif(build.compiler() is None, reason="no C compiler on this machine"),
    pytest.mark.skipif(len(ALLOWED) < 2, reason="needs two CPUs"),
]


def _tasks() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def _cpu_ns(tid: int) -> int:
    with open(f"/proc/self/task/{tid}/schedstat", encoding="ascii") as f:
        return int(f.read().split()[0])


def test_pin_reaches_the_team_torch_computes_on_and_allow_undoes_it(kernel_cache):
    team = TeamAffinity.load(kernel_cache)
    if team is None:
        pytest.skip("torch's OpenMP runtime is not the one the kernels link")
    a, b = ALLOWED[:2]
    x = torch.randn(4_000_000)

    def work():
        with torch_threads(2):
            before = _tasks()
            torch.exp(x)  # the team's first region: its worker is created now
            workers = _tasks() - before - {threading.get_native_id()}
            assert team.pin([a, b])
            me = os.sched_getaffinity(0)
            pinned = [t for t in workers if os.sched_getaffinity(t) == {b}]
            # torch's own parallel work runs on the pinned worker
            spent = {t: _cpu_ns(t) for t in pinned}
            end = time.perf_counter() + 0.3
            while time.perf_counter() < end:
                torch.exp(x)
            busy = [t for t in pinned if _cpu_ns(t) - spent[t] > 20_000_000]
            assert team.allow(2, ALLOWED)
            return me, pinned, busy, {t: os.sched_getaffinity(t) for t in pinned}, os.sched_getaffinity(0)

    me, pinned, busy, after, me_after = on_a_thread_that_ends(work)
    assert me == {a}, "the caller is thread 0 of its team"
    assert len(pinned) == 1, "one worker for a team of two, on the second CPU"
    assert busy == pinned, "torch's parallel work ran on the pinned worker"
    assert me_after == set(ALLOWED) and all(cpus == set(ALLOWED) for cpus in after.values())


def test_bad_cpu_lists_are_refused(kernel_cache):
    team = TeamAffinity.load(kernel_cache)
    if team is None:
        pytest.skip("torch's OpenMP runtime is not the one the kernels link")
    with pytest.raises(ValueError):
        team.pin([])
    with pytest.raises(ValueError):
        team.pin([0, 0])
    with pytest.raises(ValueError):
        team.allow(0, ALLOWED)
    assert not on_a_thread_that_ends(lambda: team.pin([ALLOWED[0], 5000])), "a CPU number past the set size pins nothing"
    assert os.sched_getaffinity(0) == set(ALLOWED)
