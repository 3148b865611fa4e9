"""KV byte budgets as the user writes them (`--kv-budget 2G`, `kvDiskBudget`) and the
default when none is given."""

from __future__ import annotations

import re

_GIB = 1 << 30


def parse_bytes(text: str | int) -> int:
    """'512M', '2G', '1.5GiB', '300000000' -> bytes (binary units)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]?)(i?[bB])?\s*", str(text))
    if not m:
        raise ValueError(f"cannot read {text!r} as a size; use e.g. '512M', '2G' or a number of bytes")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2).lower()]
    return int(float(m.group(1)) * scale)


def default_budget_bytes() -> int:
    """min(25 % of MemAvailable, 4 GiB); 1 GiB when /proc/meminfo is unreadable."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return min(int(line.split()[1]) * 1024 // 4, 4 * _GIB)
    except OSError:
        pass
    return _GIB


__all__ = ["parse_bytes", "default_budget_bytes"]
