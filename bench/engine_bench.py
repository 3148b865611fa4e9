"""`efim bench engine`: the engine's speed in one run, every figure next to what it is
compared with, on the same inputs (real CPython stdlib code) and the same threads.

Sections (each can be left out with a flag; `--quick` keeps a short version of each):
- decode ms/token per model shape (the embedded 135M; Qwen2.5-Coder-0.5B- and 1.5B-shaped
  models with random weights, `bench.model_shapes`) and weight format (bf16, int8, int4 —
  "n/a" where the engine lacks one), each next to its floor: (weight bytes + KV bytes read)
  / the read bandwidth measured just before, with the same threads (`bench.decode_formats`);
  plus a model-level prefill tok/s of each;
- llama.cpp's own `llama-bench -t 2 -p 512 -n 64` on the embedded GGUF (`bench.llama_cpp_figures`);
- end to end through the engine API on the embedded model: prefill tokens/s of a ~1K-token
  prompt (submit → first token, no cache) and decode ms/token, against `transformers`' own
  model in bf16 loaded from the same converted folder (one forward; a `past_key_values` loop);
- the per-step fixed cost: a decode step of a model of the embedded model's depth in the
  served layout with 64-wide layers (`bench.speed_probes.fixed_cost_ms`), with the layers in
  one C call and with a call per kernel;
- keystrokes: 20 keystrokes typed into a ~2,000-token window (prefix ~1500 + suffix ~500),
  as EFIM and (full run) as FIM with the prefix cache, StarCoder sentinels added and no
  adapter (there FIM re-prefills the suffix at every keystroke). Per keystroke: tokens
  prefilled and TTFT. Each series starts with one untimed request (the session's start);
- whole single-line suggestions at the same window with the shipped adapter, as `efim serve`
  sends them (stop at newline, max 64 tokens): TTFT and total latency p50, prompt-lookup
  speculation off and on (`bench.suggestion_latency`).

The machine may be shared: compare the numbers of one run with each other (ratios),
not with another run's.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sysconfig
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# Mirrors of bench.model_shapes.SHAPES / bench.decode_formats.FORMATS: the argument parser
# is built by `efim --help`, which must not import torch.
SHAPES = ("135m", "0.5b", "1.5b")
FORMATS = ("bf16", "int8", "int4", "mixed", "served")

_SOURCE = "argparse.py"  # long, ordinary Python: classes, methods, docstrings


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="'default', a Hugging Face folder or a .gguf file")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--dtype", default="bf16", help="engine dtype compared with transformers (default bf16)")
    p.add_argument("--prefill-tokens", type=int, default=1024)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--keystrokes", type=int, default=20)
    p.add_argument("--repeats", type=int, default=2, help="best of N for prefill/decode timings")
    p.add_argument("--prefill", choices=("bf16", "int8"), default=None,
                   help="the engine's prefill form for the end-to-end rows, as `efim serve --prefill` (default: int8 on a mixed model; docs/model.md \"int8 prefill\")")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    p.add_argument("--skip-transformers", action="store_true", help="leave out the transformers baseline")
    p.add_argument("--shapes", default=",".join(SHAPES),
                   help=f"model shapes for the decode table, comma-separated ({', '.join(SHAPES)}; '' for none)")
    p.add_argument("--formats", default=",".join(FORMATS),
                   help=f"weight formats for the decode table ({', '.join(FORMATS)})")
    p.add_argument("--decode-context", type=int, default=64,
                   help="context tokens before the timed decode steps of the decode table (llama-bench's tg starts at 0)")
    p.add_argument("--no-llama-cpp", action="store_true", help="leave out llama.cpp's llama-bench figures")
    p.add_argument("--llama-cpp-shapes", default="135m",
                   help="shapes llama-bench runs on: 135m (the embedded GGUF) and, with --qwen-vocab, 0.5b/1.5b "
                        "(a random Q4_1 GGUF of the shape, written for the run: ~30 s / ~100 s)")
    p.add_argument("--qwen-vocab", default=os.environ.get("EFIM_QWEN2_VOCAB_GGUF"),
                   help="a Qwen2 vocab GGUF for the random-shape GGUFs (llama.cpp's models/ggml-vocab-qwen2.gguf; "
                        "default $EFIM_QWEN2_VOCAB_GGUF)")
    p.add_argument("--no-lines", action="store_true", help="leave out the single-line suggestion latency")
    p.add_argument("--quick", action="store_true",
                   help="a short run: 135M only, fewer steps and keystrokes, no FIM series, one repeat")


# ---------------------------------------------------------------------------- inputs


def stdlib_text(name: str = _SOURCE) -> str:
    return (Path(sysconfig.get_paths()["stdlib"]) / name).read_text(encoding="utf-8")


def head_tokens(text: str, n: int, count) -> str:
    """The longest run of whole lines from the start of `text` within n tokens."""
    lines = text.splitlines(keepends=True)
    lo, hi = 0, len(lines)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count("".join(lines[:mid])) <= n:
            lo = mid
        else:
            hi = mid - 1
    return "".join(lines[:lo])


def keystroke_window(text: str, count, prefix_tokens: int = 1500, suffix_tokens: int = 500, typed: int = 20):
    """(prefix, line typed at the cursor, suffix): a line of at least `typed` characters
    about prefix_tokens into the file is blanked and retyped; the window around it holds
    ~prefix_tokens before and ~suffix_tokens after."""
    lines = text.splitlines(keepends=True)
    pos, acc = 0, ""
    for i, line in enumerate(lines):
        acc += line
        if i > 20 and len(line.strip()) >= typed and count(acc) >= prefix_tokens:
            pos = i
            break
    prefix = "".join(lines[:pos])
    # trim the prefix from the left to the budget
    while count(prefix) > prefix_tokens:
        prefix = prefix[prefix.index("\n") + 1 :]
    suffix = head_tokens("".join(lines[pos + 1 :]), suffix_tokens, count)
    return prefix, lines[pos].rstrip("\n"), suffix


# ---------------------------------------------------------------------------- measurements


def memory_bandwidth_gbs(size_mb: int = 512, repeats: int = 5) -> float:
    """Read bandwidth: bytes of a large fp32 tensor / time of its sum (best of repeats)."""
    from bench.speed_probes import memory_bandwidth_gbs as measure_bandwidth  # noqa: PLC0415 - torch loads here

    return measure_bandwidth(mib=size_mb, repeats=repeats)


def engine_prefill_decode(engine, prompt: str, decode_tokens: int, repeats: int) -> dict[str, float]:
    """Prefill tok/s (submit → first token, no cache) and decode ms/token (after the
    first), best of `repeats`, through the engine's public API."""
    from engine.api import InfillRequest  # noqa: PLC0415

    prefill, decode, generated = 0.0, float("inf"), 0
    warm = InfillRequest(key="bench-warm", prefix=prompt[:400], format="prefix", max_tokens=3, cache=False)
    engine.submit(warm).result()  # first-call costs (allocator, kernel selection) are not the engine's speed
    for i in range(repeats):
        req = InfillRequest(key=f"bench-{i}", prefix=prompt, format="prefix", max_tokens=decode_tokens + 1,
                            cache=False, heal=False)
        c = engine.submit(req).result()
        s = c.stats
        prefill = max(prefill, s.prompt_tokens / (s.ttft_ms / 1e3))
        if s.generated_tokens > 1:
            decode = min(decode, s.decode_ms_per_token)
            generated = max(generated, s.generated_tokens)
    if generated < decode_tokens + 1:
        log.warning("the engine stopped after %d tokens (EOS); decode timed over those", generated)
    return {"prefill_tok_s": prefill, "decode_ms": decode, "prompt_tokens": s.prompt_tokens}


def transformers_prefill_decode(folder: Path, ids: list[int], decode_tokens: int, repeats: int) -> dict[str, float]:
    """transformers' own model in bf16: one forward over the prompt; then a greedy loop
    with past_key_values, one token per forward (what `generate` does, without its
    extra bookkeeping)."""
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16)
    model.eval()
    inp = torch.tensor([ids])
    prefill, decode = 0.0, float("inf")
    with torch.inference_mode():
        out = model(input_ids=inp[:, :32], use_cache=True)  # warm-up, untimed
        model(input_ids=out.logits[:, -1].argmax(-1, keepdim=True), past_key_values=out.past_key_values, use_cache=True)
        for _ in range(repeats):
            t = time.perf_counter()
            out = model(input_ids=inp, use_cache=True, logits_to_keep=1)
            prefill = max(prefill, len(ids) / (time.perf_counter() - t))
            past = out.past_key_values
            tok = out.logits[:, -1].argmax(-1, keepdim=True)  # [1, 1]
            t = time.perf_counter()
            for _ in range(decode_tokens):
                out = model(input_ids=tok, past_key_values=past, use_cache=True)
                past = out.past_key_values
                tok = out.logits[:, -1].argmax(-1, keepdim=True)
            decode = min(decode, (time.perf_counter() - t) * 1e3 / decode_tokens)
    del model
    return {"prefill_tok_s": prefill, "decode_ms": decode}


def keystroke_series(engine, prefix: str, line: str, suffix: str, fmt: str, n: int) -> list[tuple[int, float]]:
    """(prefilled tokens, TTFT ms) per keystroke typing line[:1..n] at the cursor."""
    from engine.api import InfillRequest  # noqa: PLC0415

    key = f"keystrokes-{fmt}"

    def request(k: int):
        return InfillRequest(key=key, prefix=prefix, suffix=suffix, increment=line[:k], format=fmt, max_tokens=4)

    engine.submit(request(0)).result()  # the edit session starts: full prefill, not timed
    out = []
    for k in range(1, n + 1):
        s = engine.submit(request(k)).result().stats
        out.append((s.prefilled_tokens, s.ttft_ms))
    return out


# ---------------------------------------------------------------------------- driver


def _csv(value: str, allowed: tuple[str, ...], what: str) -> list[str]:
    items = [v.strip().lower() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in allowed]
    if bad:
        raise ValueError(f"unknown {what} {', '.join(map(repr, bad))}; expected some of {', '.join(allowed)}")
    return items


def _p50(xs):
    return statistics.median(xs) if xs else None


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch  # noqa: PLC0415

    from bench import decode_formats, llama_cpp_figures, speed_probes, suggestion_latency  # noqa: PLC0415
    from engine.local import load_engine  # noqa: PLC0415
    from engine.model.loader import default_model_path  # noqa: PLC0415
    from engine.runtime.cpu_threads import on_a_thread_that_ends  # noqa: PLC0415

    quick = args.quick
    shapes = ["135m"] if quick else _csv(args.shapes, SHAPES, "model shape")
    formats = _csv(args.formats, FORMATS, "weight format")
    keystrokes = min(args.keystrokes, 8) if quick else args.keystrokes
    repeats = 1 if quick else args.repeats
    decode_tokens = min(args.decode_tokens, 16) if quick else args.decode_tokens
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    text = stdlib_text()
    t_start = time.perf_counter()

    # llama.cpp first: a process of its own, before this one holds the large random models.
    llama, llama_shapes = None, {}
    if not args.no_llama_cpp:
        reps = 2 if quick else 3
        llama = llama_cpp_figures.measure(default_model_path(), threads=threads, reps=reps, depth=args.decode_context)
        for shape in _csv(args.llama_cpp_shapes, SHAPES, "model shape"):
            if shape != "135m" and not quick:
                llama_shapes[shape] = llama_cpp_figures.measure_random_shape(shape, args.qwen_vocab, threads=threads,
                                                                            reps=reps)

    # On a thread that ends: no OpenMP team of this thread competes with the engine's below.
    rows = on_a_thread_that_ends(lambda: decode_formats.measure(
        shapes, formats, context=args.decode_context, steps=decode_tokens, rounds=repeats + (0 if quick else 1),
        prefill_tokens=512))
    bw = on_a_thread_that_ends(memory_bandwidth_gbs)
    eng = load_engine(args.model, dtype=args.dtype, kv_budget="1G", prefill=args.prefill)
    try:
        prompt = head_tokens(text, args.prefill_tokens, eng.count_tokens)
        prompt_ids = eng.tokenizer.encode_text(prompt)
        weight_bytes = eng.model.weight_bytes()
        folder = eng.loaded.path
        prefill_form = eng.info().prefill or eng.info().dtype
        e2e = engine_prefill_decode(eng, prompt, decode_tokens, repeats)
        n_layers = eng.model.config.n_layers
    finally:
        eng.close()
    del eng
    # The per-step fixed cost at the model's depth, with the engine's thread gone.
    fixed = on_a_thread_that_ends(lambda: speed_probes.fixed_cost_ms(n_layers))
    hf = None
    if not args.skip_transformers:
        hf = transformers_prefill_decode(folder, list(prompt_ids), decode_tokens, repeats)

    # The prefix-first layout with StarCoder sentinels, adapter off: FIM there re-prefills the
    # suffix every keystroke, which is the comparison this bench is for. (The shipped
    # suffix-first adapter appends under FIM too; see engine/adapters/smollm2-efim.)
    eng = load_engine(args.model, dtype=args.dtype, fim_tokens="add", adapter="none", kv_budget="1G", prefill=args.prefill)
    try:
        P, line, S = keystroke_window(text, eng.count_tokens)
        window_tokens = eng.count_tokens(P) + eng.count_tokens(S)
        efim = keystroke_series(eng, P, line, S, "efim", keystrokes)
        fim = [] if quick else keystroke_series(eng, P, line, S, "fim", keystrokes)
    finally:
        eng.close()

    lines = None
    if not args.no_lines:
        got = suggestion_latency.measure(args.model, args.dtype, keystrokes, P, line, S)
        lines = {"window_tokens": got["window_tokens"], "plain": suggestion_latency.summary(got["plain"]),
                 "speculation": suggestion_latency.summary(got["speculation"])}

    res = {
        "decode": decode_formats.as_json(rows),
        "llama_cpp": None if llama is None else {**llama._asdict(), "tg_ms": llama.tg_ms},
        "llama_cpp_random_shapes": {k: {**v._asdict(), "tg_ms": v.tg_ms} for k, v in llama_shapes.items()},
        "prefill_tok_s": {"engine": e2e["prefill_tok_s"], "transformers": hf["prefill_tok_s"] if hf else None},
        "decode_ms": {"engine": e2e["decode_ms"], "transformers": hf["decode_ms"] if hf else None},
        "keystroke_ttft_ms_p50": {"fim": _p50([t for _, t in fim]), "efim": _p50([t for _, t in efim])},
        "keystroke_prefilled_p50": {"fim": _p50([p for p, _ in fim]), "efim": _p50([p for p, _ in efim])},
        "single_line": lines,
        "memory_bandwidth_gbs": bw,
        "decode_floor_ms": weight_bytes / (bw * 1e9) * 1e3,
        "fixed_cost_ms": fixed,
    }
    details = {
        "prefill_prompt_tokens": e2e["prompt_tokens"],
        "weight_bytes": weight_bytes,
        "window_tokens": window_tokens,
        "fim_series": fim,
        "efim_series": efim,
        "threads": threads,
        "prefill_form": prefill_form,  # what the engine ran: "int8" / "bf16" on a mixed model, else its dtype
        "decode_context": args.decode_context,
        "quick": quick,
        "seconds": time.perf_counter() - t_start,
    }
    return {"result": res, "details": details, "rows": rows}


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "n/a" if x is None else format(x, spec)


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "n/a"


def render_table(out: dict[str, Any]) -> str:
    from bench import decode_formats  # noqa: PLC0415

    r, d = out["result"], out["details"]
    llama = r["llama_cpp"]
    shapes = {"135m": llama, **r["llama_cpp_random_shapes"]} if llama else {}
    rows = decode_formats.render(out["rows"], d["decode_context"], {k: v["tg_ms"] for k, v in shapes.items()})
    for shape, fig in shapes.items():
        if fig["pp_tok_s"] is None:
            rows.append(f"  llama.cpp, {shape}: {fig['note']}")
        else:
            depth = fig.get("depth") or 0
            rows.append(f"  llama.cpp llama-bench -t {d['threads']} -p 512 -n 64{f' -d {depth}' if depth else ''} on "
                        f"{Path(fig['gguf']).name}: pp512 {fig['pp_tok_s']:.1f} tok/s, tg64 {fig['tg_tok_s']:.1f} tok/s "
                        f"({fig['tg_ms']:.2f} ms/token)")
    pf, dc = r["prefill_tok_s"], r["decode_ms"]
    rows += [
        "",
        f"{'end to end (engine API, embedded model)':<42}{'engine':>10}{'transformers':>14}{'ratio':>9}",
        f"{'  prefill tok/s (%d tokens)' % d['prefill_prompt_tokens']:<42}{_fmt(pf['engine']):>10}"
        f"{_fmt(pf['transformers']):>14}{_ratio(pf['engine'], pf['transformers']):>9}",
        f"{'  decode ms/token':<42}{_fmt(dc['engine']):>10}{_fmt(dc['transformers']):>14}"
        f"{_ratio(dc['transformers'], dc['engine']):>9}",
        f"  memory bandwidth {r['memory_bandwidth_gbs']:.1f} GB/s; bf16 weight floor {r['decode_floor_ms']:.1f} ms "
        f"({d['weight_bytes'] / 1e6:.0f} MB)",
        f"  per-step fixed cost (the same depth, 64-wide int4 layers): {_fmt(r['fixed_cost_ms'].get('one_call'), '.2f')} ms "
        f"with the layers in one C call, {_fmt(r['fixed_cost_ms'].get('calls'), '.2f')} ms with a call per kernel",
        "",
        f"keystrokes into a {d['window_tokens']}-token window   {'FIM+prefix cache':>18}{'EFIM':>10}",
        f"{'  prefilled tokens p50':<40}{_fmt(r['keystroke_prefilled_p50']['fim'], '.0f'):>18}"
        f"{_fmt(r['keystroke_prefilled_p50']['efim'], '.0f'):>10}",
        f"{'  TTFT ms p50':<40}{_fmt(r['keystroke_ttft_ms_p50']['fim']):>18}{_fmt(r['keystroke_ttft_ms_p50']['efim']):>10}",
    ]
    lines = r["single_line"]
    if lines:
        plain, spec = lines["plain"], lines["speculation"]
        rows += [
            "",
            f"single-line suggestions, {lines['window_tokens']}-token window, shipped adapter"
            f"   {'speculation off':>16}{'on':>8}",
            f"{'  TTFT ms p50':<62}{_fmt(plain['ttft_ms_p50']):>8}{_fmt(spec and spec['ttft_ms_p50']):>8}",
            f"{'  whole line ms p50':<62}{_fmt(plain['line_ms_p50']):>8}{_fmt(spec and spec['line_ms_p50']):>8}",
            f"{'  tokens generated p50':<62}{_fmt(plain['generated_p50'], '.0f'):>8}"
            f"{_fmt(spec and spec['generated_p50'], '.0f'):>8}",
            f"{'  tokens per decode step':<62}{_fmt(plain['tokens_per_step'], '.2f'):>8}"
            f"{_fmt(spec and spec['tokens_per_step'], '.2f'):>8}",
        ]
    rows += [
        "",
        "per keystroke (prefilled / TTFT ms):",
        "  FIM : " + (" ".join(f"{p}/{t:.0f}" for p, t in d["fim_series"]) or "(not run)"),
        "  EFIM: " + " ".join(f"{p}/{t:.0f}" for p, t in d["efim_series"]),
        f"(threads {d['threads']}; {d['seconds']:.0f} s; a shared machine moves absolute numbers: read the ratios)",
    ]
    return "\n".join(rows)


def run_cli(args: argparse.Namespace) -> int:
    out = measure(args)
    if args.json:
        print(json.dumps({**out["result"], "details": out["details"]}))
    else:
        print(render_table(out))
    return 0


__all__ = ["add_arguments", "run_cli", "measure", "memory_bandwidth_gbs", "keystroke_window", "render_table"]
