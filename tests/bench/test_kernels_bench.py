"""`efim bench kernels` runs on a CPU, times every reference op, and says plainly that
Triton numbers need a GPU (no interpreter timing is ever printed as performance)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from kernels import OPS
from bench import kernel_bench as bench


def test_bench_on_cpu_times_references_and_states_triton_needs_a_gpu(capsys):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(
        ["--device", "cpu", "--context", "96", "--new-tokens", "16", "--batch", "2", "--hidden", "64", "--repeat", "1"]
    )
    assert bench.run_cli(args) == 0
    out = capsys.readouterr().out
    assert "Triton kernels need a GPU" in out
    rows = [line.split() for line in out.splitlines() if line.split() and line.split()[0] in OPS]
    timed = {row[0] for row in rows}
    assert timed == set(OPS) - {"select_top_rows"}  # top-k is torch.topk in both implementations
    assert all("reference" in row and "triton" not in row for row in rows)


def test_importing_the_bench_does_not_load_torch():
    """`efim --help` builds every subcommand's parser, which imports bench.kernel_bench."""
    code = "import sys, bench.kernel_bench; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])
