"""The sandbox fails — never hangs or raises — on looping, memory-hungry, destructive or
networked programs, and passes correct ones."""

from __future__ import annotations

import os

from efim_tools.evaluation.sandbox import Limits, run_program


def test_passing_and_failing_programs():
    assert run_program("assert sum(range(4)) == 6\n").passed
    res = run_program("assert 1 == 2\n")
    assert not res.passed and res.status == "failed" and "AssertionError" in res.stderr_tail


def test_infinite_loop_is_killed():
    res = run_program("while True:\n    pass\n", Limits(wall_seconds=2.0, cpu_seconds=1))
    assert not res.passed and res.status == "timeout"
    assert res.seconds < 10


def test_sleeping_program_hits_the_wall_clock():
    res = run_program("import time\ntime.sleep(60)\n", Limits(wall_seconds=1.0, cpu_seconds=5))
    assert res.status == "timeout" and res.seconds < 10


def test_memory_hog_is_stopped():
    res = run_program("block = bytearray(3 * 1024 ** 3)\nblock[-1] = 1\n", Limits(memory_mb=256))
    assert not res.passed
    assert "MemoryError" in res.stderr_tail or res.status == "timeout"


def test_destructive_calls_are_disabled(tmp_path):
    victim = tmp_path / "keep.txt"
    victim.write_text("precious")
    for src in (
        f"import os\nos.remove({str(victim)!r})\n",
        f"import shutil\nshutil.rmtree({str(tmp_path)!r})\n",
        "import subprocess\nsubprocess.run(['true'])\n",
        "import os\nos.system('true')\n",
        "import os\nos.kill(1, 9)\n",
    ):
        res = run_program(src)
        assert not res.passed and "PermissionError" in res.stderr_tail, src
    assert victim.read_text() == "precious"


def test_network_is_unavailable():
    res = run_program("import socket\ns = socket.socket()\ns.connect(('127.0.0.1', 80))\n")
    assert not res.passed


def test_runs_in_a_fresh_temporary_directory():
    here = os.getcwd()
    res = run_program(f"import os\nassert os.getcwd() != {here!r}\nassert os.listdir('.') == []\nopen('scratch', 'w').write('x')\n")
    assert res.passed, res.stderr_tail


def test_crash_is_a_failure_not_an_exception():
    res = run_program("import sys\nsys.setrecursionlimit(10**6)\ndef f(n):\n    return f(n + 1)\nf(0)\n", Limits(wall_seconds=3, memory_mb=256))
    assert not res.passed
