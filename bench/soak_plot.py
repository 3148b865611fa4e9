"""The soak's memory curve as a PNG (matplotlib, Agg backend: no display needed).

`plot_memory(samples, events, path, title)`: total RSS (and PSS where sampled) of every
process over time, one thin line per process, the soak's events (settings change, model
switch, the switch settled) as vertical lines, and each phase's reference value ±10 % as a
band. Needs the `plot` extra (`pip install -e '.[plot]'`; `make setup` installs it);
without matplotlib `plot_memory` raises RuntimeError saying so.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any


def plot_memory(samples: list[dict[str, Any]], events: list[tuple[float, str]], path: Path, title: str,
                bands: list[tuple[float, float, float]] = ()) -> Path:
    """`samples`: [{"t": s, "rss_mb": total, "pss_mb": total or NaN, "processes": {label: rss_mb},
    optional "engine_kv_mb": {"stored": MB, "working": MB}}];
    `events`: [(s, label)]; `bands`: [(t_from, t_to, reference MB)] drawn ±10 %."""
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError as exc:
        raise RuntimeError("the RSS plot needs matplotlib: pip install -e '.[plot]' (make setup installs it)") from exc
    fig, ax = plt.subplots(figsize=(11, 5))
    try:
        ts = [s["t"] for s in samples]
        ax.plot(ts, [s["rss_mb"] for s in samples], color="black", linewidth=1.6, marker=".", label="RSS, all processes")
        pss = [s.get("pss_mb", math.nan) for s in samples]
        if any(not math.isnan(p) for p in pss):
            ax.plot(ts, pss, color="gray", linewidth=1.0, linestyle="--", label="PSS, all processes")
        labels = sorted({label for s in samples for label in s.get("processes", {})})
        for label in labels:
            points = [(s["t"], s["processes"][label]) for s in samples if label in s.get("processes", {})]
            ax.plot([t for t, _ in points], [mb for _, mb in points], linewidth=0.7, alpha=0.8, label=label)
        kv = [(s["t"], s["engine_kv_mb"]) for s in samples if s.get("engine_kv_mb")]
        if kv:  # the engine's own count of its KV (stored + working), beside the processes' memory
            ax.plot([t for t, _ in kv], [k["stored"] + k["working"] for _, k in kv], color="tab:purple", linewidth=1.0,
                    linestyle="-.", label="engine KV: stored + working")
        for t_from, t_to, ref in bands:
            ax.fill_between([t_from, t_to], [ref * 0.9] * 2, [ref * 1.1] * 2, color="tab:green", alpha=0.12)
            ax.hlines(ref, t_from, t_to, colors="tab:green", linewidth=0.8)
        for t, label in events:
            ax.axvline(t, color="tab:red", linewidth=0.8, linestyle=":")
            ax.annotate(label, (t, 1.0), xycoords=("data", "axes fraction"), rotation=90, va="top", ha="right", fontsize=8)
        ax.set_xlabel("seconds since typing began")
        ax.set_ylabel("MB")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right", ncol=2)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return Path(path)


__all__ = ["plot_memory"]
