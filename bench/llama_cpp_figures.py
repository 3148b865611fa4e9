"""llama.cpp's own speed on the same GGUF, in the same run (part of `efim bench engine`):
`llama-bench -t THREADS -p 512 -n 64` from the build `efim_tools/peers/setup_llama_cpp.sh`
makes (the same build as the llama.cpp server of the remote backend).

Figures: pp512 (prompt tokens/s) and tg64 (generated tokens/s, also as ms/token). Where the
binaries are not built, the figures are None with the reason, never an error: the rest of
the bench still runs.

Random-shape models (`bench.model_shapes`' 0.5b / 1.5b) get a random-weight Q4_1 GGUF of
the same shape (`efim_tools.peers.random_gguf`, Qwen2's vocabulary copied from a vocab-only
GGUF such as llama.cpp's `models/ggml-vocab-qwen2.gguf`), written to a temporary folder
and removed after llama-bench ran; quantising it in numpy takes ~30 s for 0.5B and ~100 s
for 1.5B on 2 cores, so `efim bench engine` does it only when asked (`--llama-cpp-shapes`).

Benchmark code, outside the serving path.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import NamedTuple

log = logging.getLogger(__name__)


class LlamaFigures(NamedTuple):
    gguf: str
    pp_tok_s: float | None
    tg_tok_s: float | None
    note: str = ""
    depth: int = 0  # tokens of context before the timed prompt and generation (llama-bench -d)

    @property
    def tg_ms(self) -> float | None:
        return 1e3 / self.tg_tok_s if self.tg_tok_s else None


def figures_from_records(records: list[dict], prompt: int, gen: int) -> tuple[float | None, float | None]:
    """(pp tok/s, tg tok/s) from llama-bench's JSON records."""
    pp = tg = None
    for r in records:
        if int(r.get("n_prompt", 0)) == prompt and int(r.get("n_gen", 0)) == 0:
            pp = float(r["avg_ts"])
        elif int(r.get("n_gen", 0)) == gen and int(r.get("n_prompt", 0)) == 0:
            tg = float(r["avg_ts"])
    return pp, tg


def measure(gguf: str | Path, *, threads: int = 2, prompt: int = 512, gen: int = 64, reps: int = 3, depth: int = 0) -> LlamaFigures:
    from efim_tools.peers.llama_cpp import SETUP_SCRIPT, llama_bench, llama_cpp_bin  # noqa: PLC0415

    gguf = str(gguf)
    if llama_cpp_bin() is None:
        return LlamaFigures(gguf, None, None, f"n/a (llama.cpp not built: bash {SETUP_SCRIPT})")
    try:
        records = llama_bench(gguf, threads=threads, prompt=prompt, gen=gen, reps=reps, depth=depth)
    except (RuntimeError, OSError, ValueError) as exc:
        log.warning("llama-bench failed on %s: %s", gguf, exc)
        return LlamaFigures(gguf, None, None, f"n/a (llama-bench failed: {str(exc)[:200]})")
    pp, tg = figures_from_records(records, prompt, gen)
    return LlamaFigures(gguf, pp, tg, depth=depth)


# bench.model_shapes' names -> efim_tools.peers.random_gguf's
RANDOM_SHAPES = {"0.5b": "qwen2.5-coder-0.5b", "1.5b": "qwen2.5-coder-1.5b"}


def measure_random_shape(shape: str, vocab: str | Path | None, *, threads: int = 2, reps: int = 3,
                         qtype: str = "q4_1") -> LlamaFigures:
    """llama-bench on a random-weight `qtype` GGUF of `shape`, written for the occasion."""
    import tempfile  # noqa: PLC0415

    from efim_tools.peers.llama_cpp import llama_cpp_bin  # noqa: PLC0415
    from efim_tools.peers.random_gguf import SHAPES, write_random_gguf  # noqa: PLC0415

    if shape not in RANDOM_SHAPES:
        raise ValueError(f"no random GGUF shape for {shape!r}; expected one of {tuple(RANDOM_SHAPES)}")
    label = f"random {RANDOM_SHAPES[shape]} {qtype}"
    if vocab is None or not Path(vocab).is_file():
        return LlamaFigures(label, None, None, "n/a (needs --qwen-vocab: a Qwen2 vocab GGUF, e.g. llama.cpp's "
                                               "models/ggml-vocab-qwen2.gguf)")
    if llama_cpp_bin() is None:
        return measure(label, threads=threads, reps=reps)  # the "not built" note
    with tempfile.TemporaryDirectory(prefix="efim-random-gguf-") as d:
        path = write_random_gguf(Path(d) / f"{shape}.gguf", SHAPES[RANDOM_SHAPES[shape]], Path(vocab), qtype)
        got = measure(path, threads=threads, reps=reps)
    return got._replace(gguf=label)


__all__ = ["LlamaFigures", "RANDOM_SHAPES", "figures_from_records", "measure", "measure_random_shape"]
