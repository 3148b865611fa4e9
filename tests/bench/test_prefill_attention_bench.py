"""`efim bench prefill-attention`: one row per shape with both kernels timed, or a clear word
where the C kernel is not there."""

from __future__ import annotations

import argparse

from bench import prefill_attention_bench as bench
from kernels.cpu.prefill_attention import PrefillAttention


def test_prints_a_row_per_shape_with_both_timings(capsys):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--repeat", "1"])
    rc = bench.run_cli(args)
    out = capsys.readouterr().out
    if PrefillAttention.load() is None:
        assert rc == 1 and "nothing to compare" in out
        return
    assert rc == 0
    rows = [line.split() for line in out.splitlines() if "|" in line and line.split("|")[0].split()[0].isdigit()]
    assert [(int(r[0]), int(r[1])) for r in rows] == list(bench.SHAPES)
    for r in rows:
        torch_us, c_us, ratio = float(r[3]), float(r[4]), float(r[5])
        assert torch_us > 0 and c_us > 0 and abs(ratio - torch_us / c_us) < 0.05 * ratio + 0.02
