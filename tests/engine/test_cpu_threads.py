"""The engine thread's CPU thread count follows the other processes' load."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from engine.runtime import cpu_threads, faults
from engine.runtime.cpu_threads import ThreadGovernor


def test_threads_shrink_while_other_processes_hold_cores():
    gov = ThreadGovernor(2, cpus=2, others=lambda: 0.0)
    assert gov.wanted(0.0) == 2
    assert gov.wanted(0.2) == 2  # a trickle: all threads
    assert gov.wanted(0.4) == 1
    assert gov.wanted(3.0) == 1  # never below one
    assert ThreadGovernor(8, cpus=8).wanted(2.2) == 6
    assert ThreadGovernor(2, cpus=8).wanted(0.0) == 2  # never above the most
    with pytest.raises(ValueError):
        ThreadGovernor(0)


def test_apply_sets_torch_threads_on_the_calling_thread_and_samples_when_due(monkeypatch):
    load = [0.0]
    reads = []

    def others():
        reads.append(load[0])
        return load[0]

    before = torch.get_num_threads()
    try:
        gov = ThreadGovernor(2, cpus=2, others=others)
        assert gov.apply() == 2 and torch.get_num_threads() == 2
        load[0] = 1.0
        assert gov.apply() == 2, "re-read before SAMPLE_SECONDS"
        assert len(reads) == 1
        monkeypatch.setattr(cpu_threads, "SAMPLE_SECONDS", 0.0)
        gov._next_sample = 0.0
        assert gov.apply() == 1 and torch.get_num_threads() == 1
        assert gov.changes == 1
        load[0] = 0.0
        gov._next_sample = 0.0
        assert gov.apply() == 2 and gov.changes == 2
        gov._next_sample = 0.0
        gov._others = lambda: None  # no /proc: keep the last choice
        assert gov.apply() == 2
    finally:
        torch.set_num_threads(before)


def test_a_busy_process_counts_as_other_load():
    """/proc says how many cores other processes used since the last reading: a
    subprocess spinning for 0.6 s shows up as most of a core."""
    import subprocess
    import sys
    import time

    gov = ThreadGovernor(2)
    if cpu_threads._machine_busy_ticks() is None or cpu_threads._own_ticks() is None:
        pytest.skip("no /proc")
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.2)  # started and spinning
        assert gov._others_from_proc() is None  # the first reading has nothing to compare with
        time.sleep(0.6)
        others = gov._others_from_proc()
    finally:
        busy.kill()
        busy.wait()
    assert others is not None and others >= 0.6, others


def test_the_loading_thread_returns_the_result_or_raises_in_the_caller():
    from engine.runtime.cpu_threads import on_a_thread_that_ends

    names = []
    assert on_a_thread_that_ends(lambda: names.append(threading.current_thread().name) or 7, name="efim-load") == 7
    assert names == ["efim-load"]

    def fail():
        raise KeyError("model")

    with pytest.raises(KeyError):
        on_a_thread_that_ends(fail)


class FakeTeam:
    """Records what the governor asks of the team's affinity (kernels/cpu/team_affinity.py)."""

    def __init__(self, pins: bool = True) -> None:
        self.pins = pins
        self.calls: list[tuple] = []

    def pin(self, cpus):
        self.calls.append(("pin", list(cpus)))
        return self.pins

    def allow(self, threads, cpus):
        self.calls.append(("allow", threads, list(cpus)))
        return True


def test_a_team_that_fills_the_machine_is_pinned_and_unpinned_when_it_shrinks(monkeypatch):
    load = [0.0]
    team = FakeTeam()
    before = torch.get_num_threads()
    monkeypatch.setattr(cpu_threads, "SAMPLE_SECONDS", 0.0)
    try:
        gov = ThreadGovernor(2, others=lambda: load[0], team=team, allowed=[4, 6])
        assert gov.apply() == 2
        assert team.calls == [("pin", [4, 6])] and gov.pinned == 2
        assert gov.apply() == 2 and len(team.calls) == 1, "placed once per team size"
        load[0] = 1.0  # another process holds a core: one thread, free to go where the kernel puts it
        assert gov.apply() == 1
        assert team.calls[-1] == ("allow", 2, [4, 6]) and gov.pinned == 0, "undone on both threads that had it"
        load[0] = 0.0
        assert gov.apply() == 2 and team.calls[-1] == ("pin", [4, 6]) and gov.pinned == 2
        gov.on_new_thread()  # a restarted engine thread: a new team, placed again
        assert gov.pinned == 0 and gov.apply() == 2 and team.calls[-1] == ("pin", [4, 6]) and len(team.calls) == 4
    finally:
        torch.set_num_threads(before)


def test_no_pinning_for_a_team_smaller_than_the_machine_or_one_that_cannot_be_pinned():
    before = torch.get_num_threads()
    try:
        team = FakeTeam()
        gov = ThreadGovernor(2, others=lambda: 0.0, team=team, allowed=[0, 1, 2, 3])
        assert gov.apply() == 2 and team.calls == [] and gov.pinned == 0
        one = FakeTeam()
        assert ThreadGovernor(1, others=lambda: 0.0, team=one, allowed=[0]).apply() == 1 and one.calls == []
        refused = FakeTeam(pins=False)
        gov = ThreadGovernor(2, others=lambda: 0.0, team=refused, allowed=[0, 1])
        assert gov.apply() == 2
        assert refused.calls == [("pin", [0, 1]), ("allow", 2, [0, 1])], "a pinning that fails is undone"
        assert gov.pinned == 0 and gov.team is None, "and not tried again"
    finally:
        torch.set_num_threads(before)


def test_the_engine_pins_only_when_asked(monkeypatch):
    monkeypatch.setenv("EFIM_PIN_THREADS", "0")
    assert cpu_threads.team_affinity() is None


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) != 2, reason="a 2-CPU machine")
def test_an_engine_on_a_2_cpu_machine_pins_its_two_threads(tiny_model_factory, monkeypatch):
    from engine.api import InfillRequest
    from engine.local import load_engine

    monkeypatch.delenv("EFIM_PIN_THREADS", raising=False)
    monkeypatch.setattr(ThreadGovernor, "_others_from_proc", lambda self: 0.0)  # an idle machine
    if cpu_threads.team_affinity() is None:
        pytest.skip("no C compiler, or torch's OpenMP runtime is not the one the kernels link")
    allowed = sorted(os.sched_getaffinity(0))
    eng = load_engine(str(tiny_model_factory("llama")), dtype="fp32", kv_budget="32M", threads=2)
    try:
        eng.submit(InfillRequest(key="a", prefix="def f(x):\n    return x", max_tokens=2)).result()
        assert eng.health()["cpuThreads"] == 2 and eng.health()["cpuThreadsPinned"] == 2
        assert len(os.sched_getaffinity(eng._thread.native_id)) == 1, "the engine thread is thread 0 of its team"
        # A crash restarts the engine thread from the dying, pinned one: the new one and its
        # team are pinned one per CPU again, not all on the dying thread's CPU.
        step, old = eng.scheduler.step, eng._thread

        def crashing():
            eng.scheduler.step = step
            raise faults.InjectedCrash("boom")

        eng.scheduler.step = crashing
        eng.submit(InfillRequest(key="b", prefix="def g(y):\n    return y", max_tokens=2)).result(30)
        old.join(5)
        assert eng.health()["restarts"] == 1
        eng.submit(InfillRequest(key="c", prefix="def h(z):\n    return z", max_tokens=2)).result(30)
        assert eng.health()["cpuThreadsPinned"] == 2
        pinned = {tid: os.sched_getaffinity(int(tid)) for tid in os.listdir("/proc/self/task")}
        assert pinned[str(eng._thread.native_id)] == {allowed[0]}
        assert sum(1 for cpus in pinned.values() if cpus == {allowed[1]}) >= 1, "its worker on the other CPU"
    finally:
        eng.close()
    assert os.sched_getaffinity(0) == set(allowed), "the caller's own threads are not pinned"
