"""The engine thread's CPU thread count follows the other processes' load."""

from __future__ import annotations

import threading

import pytest
import torch

from engine.runtime import cpu_threads
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
