"""Nearest-rank percentiles of the timings a benchmark measures on the client side.

Nearest rank, as `efim/stats` computes the server's own percentiles, so a client figure
and a server figure of the same requests compare like for like. No values give NaN: the
figure prints (and serialises) as "nan" instead of failing a table. Standard library
only, so the benchmarks that run beside a server on another machine can import it.
"""

from __future__ import annotations

import math


def percentile(values: list[float], q: float) -> float:
    """The `q`th (0-100) nearest-rank percentile of `values`; NaN when there are none."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q / 100 * len(ordered))) - 1]


def percentiles(values: list[float], qs: tuple[int, ...] = (50, 95, 99), digits: int = 1) -> dict[int, float]:
    """`{q: percentile(values, q)}` for each of `qs`, rounded to `digits`."""
    return {q: round(percentile(values, q), digits) for q in qs}


__all__ = ["percentile", "percentiles"]
