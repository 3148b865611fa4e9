"""Whole single-line suggestions through the engine API (part of `efim bench engine`).

Typing a line into a ~2,000-token window of real code (CPython stdlib), one request per
keystroke as the server sends it in line mode: EFIM prompt, `stop=("\\n",)`, `max_tokens`
64, greedy. Per keystroke: TTFT (arrival -> first token) and the whole suggestion's
latency (arrival -> the line is complete), once with prompt-lookup speculation off and
once on at the server's default draft length (`InfillRequest.speculate`, where the
engine has it), each series on its own edit session that starts with one untimed
request. The default model with its shipped suffix-first adapter, i.e. what `efim serve`
runs.

Benchmark code, outside the serving path.
"""

from __future__ import annotations

import statistics
from typing import Any, NamedTuple

LINE_MAX_TOKENS = 64


class LineSeries(NamedTuple):
    speculate: int
    ttft_ms: list[float]
    total_ms: list[float]
    generated: list[int]
    prefilled: list[int]
    decode_steps: list[int]
    texts: list[str]

    def p50(self, field: str) -> float:
        return statistics.median(getattr(self, field))

    @property
    def tokens_per_step(self) -> float | None:
        steps = sum(self.decode_steps)
        return sum(max(g - 1, 0) for g in self.generated) / steps if steps else None


def has_speculation() -> bool:
    """Whether this engine's requests take a `speculate` knob (prompt-lookup speculation)."""
    from engine.api import InfillRequest  # noqa: PLC0415

    return "speculate" in InfillRequest.__struct_fields__


def default_speculate() -> int:
    """The draft length the server uses by default (what the 'on' series measures)."""
    import engine.api  # noqa: PLC0415

    return int(getattr(engine.api, "DEFAULT_SPECULATE", 8))


def line_series(engine: Any, prefix: str, line: str, suffix: str, n: int, speculate: int | None,
                key: str) -> LineSeries:
    """Type line[:1..n] at the cursor; one line-mode request per keystroke.
    `speculate` None: the request as the engine defaults it (an engine without the knob)."""
    from engine.api import InfillRequest  # noqa: PLC0415

    extra = {} if speculate is None else {"speculate": speculate}

    def request(k: int):
        return InfillRequest(key=key, prefix=prefix, suffix=suffix, increment=line[:k], format="efim",
                             max_tokens=LINE_MAX_TOKENS, stop=("\n",), **extra)

    engine.submit(request(0)).result()  # the edit session starts: full prefill, not timed
    out = LineSeries(speculate or 0, [], [], [], [], [], [])
    for k in range(1, n + 1):
        done = engine.submit(request(k)).result()
        s = done.stats
        out.texts.append(done.text)
        out.ttft_ms.append(s.ttft_ms)
        out.total_ms.append(s.total_ms)
        out.generated.append(s.generated_tokens)
        out.prefilled.append(s.prefilled_tokens)
        out.decode_steps.append(getattr(s, "decode_steps", 0))
    return out


def measure(model: str, dtype: str, keystrokes: int, prefix: str, line: str, suffix: str,
            quant: str | None = None) -> dict[str, Any]:
    """Both series (speculation off, then on where available) on one engine."""
    from engine.local import load_engine  # noqa: PLC0415

    eng = load_engine(model, dtype=dtype, quant=quant, kv_budget="1G")
    try:
        window = eng.count_tokens(prefix) + eng.count_tokens(suffix)
        spec = has_speculation()
        plain = line_series(eng, prefix, line, suffix, keystrokes, 0 if spec else None, "line-plain")
        specd = line_series(eng, prefix, line, suffix, keystrokes, default_speculate(), "line-spec") if spec else None
    finally:
        eng.close()
    return {"window_tokens": window, "plain": plain, "speculation": specd}


def summary(series: LineSeries | None) -> dict[str, Any] | None:
    if series is None:
        return None
    return {"ttft_ms_p50": series.p50("ttft_ms"), "line_ms_p50": series.p50("total_ms"),
            "line_ms_max": max(series.total_ms), "generated_p50": series.p50("generated"),
            "prefilled_p50": series.p50("prefilled"), "tokens_per_step": series.tokens_per_step}


__all__ = ["LineSeries", "has_speculation", "default_speculate", "line_series", "measure", "summary", "LINE_MAX_TOKENS"]
