"""`efim bench engine`: this engine against `transformers` and against the memory floor,
and the keystroke reuse series FIM vs EFIM — all in one run, on the same inputs.

Measured (inputs are real CPython stdlib code):
- memory bandwidth: a large fp32 tensor summed (read-only, like decode's weight reads);
  the decode floor is the default (bf16) engine's weight bytes / that bandwidth;
- prefill tokens/s on a ~1K-token prompt: the engine end to end (submit → first token,
  no cache) and `transformers`' own model (one forward) in bf16, loaded from the same
  converted Hugging Face folder;
- decode ms/token: the engine in bf16 and in int8, `transformers` in bf16 (a
  `past_key_values` loop, one token per forward);
- reuse: 20 keystrokes typed into a ~2,000-token window (prefix ~1500 + suffix ~500
  tokens), once as FIM with the prefix cache and once as EFIM (FIM sentinels added with
  fim_tokens="add" when the model lacks them). Per keystroke: tokens prefilled and TTFT.
  Each series starts with one untimed request (the edit session's start).

The machine may be shared: compare the numbers of one run with each other (ratios),
not with another run's.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_SOURCE = "argparse.py"  # long, ordinary Python: classes, methods, docstrings


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="'default', a Hugging Face folder or a .gguf file")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--dtype", default="bf16", help="engine dtype compared with transformers (default bf16)")
    p.add_argument("--prefill-tokens", type=int, default=1024)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--keystrokes", type=int, default=20)
    p.add_argument("--repeats", type=int, default=2, help="best of N for prefill/decode timings")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    p.add_argument("--skip-transformers", action="store_true", help="leave out the transformers baseline")


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
            out = model(input_ids=inp, use_cache=True)
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


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch  # noqa: PLC0415

    from engine.local import load_engine  # noqa: PLC0415

    if args.threads:
        torch.set_num_threads(args.threads)
    text = stdlib_text()
    res: dict[str, Any] = {}

    bw = memory_bandwidth_gbs()
    eng = load_engine(args.model, dtype=args.dtype, kv_budget="1G")
    try:
        prompt = head_tokens(text, args.prefill_tokens, eng.count_tokens)
        prompt_ids = eng.tokenizer.encode_text(prompt)
        weight_bytes = eng.model.weight_bytes()
        folder = eng.loaded.path
        bf16 = engine_prefill_decode(eng, prompt, args.decode_tokens, args.repeats)
    finally:
        eng.close()
    del eng
    eng = load_engine(args.model, dtype=args.dtype, quant="int8", kv_budget="1G")
    try:
        int8 = engine_prefill_decode(eng, prompt, args.decode_tokens, args.repeats)
        int8_bytes = eng.model.weight_bytes()
    finally:
        eng.close()
    del eng
    hf = None
    if not args.skip_transformers:
        hf = transformers_prefill_decode(folder, list(prompt_ids), args.decode_tokens, args.repeats)

    # The prefix-first layout with StarCoder sentinels, adapter off: FIM there re-prefills the
    # suffix every keystroke, which is the comparison this bench is for. (The shipped
    # suffix-first adapter appends under FIM too; see engine/adapters/smollm2-efim.)
    eng = load_engine(args.model, dtype=args.dtype, fim_tokens="add", adapter="none", kv_budget="1G")
    try:
        P, line, S = keystroke_window(text, eng.count_tokens)
        window_tokens = eng.count_tokens(P) + eng.count_tokens(S)
        fim = keystroke_series(eng, P, line, S, "fim", args.keystrokes)
        efim = keystroke_series(eng, P, line, S, "efim", args.keystrokes)
    finally:
        eng.close()

    def p50(xs):
        return statistics.median(xs)

    res = {
        "prefill_tok_s": {"engine": bf16["prefill_tok_s"], "transformers": hf["prefill_tok_s"] if hf else None},
        "decode_ms": {"engine": bf16["decode_ms"], "engine_int8": int8["decode_ms"],
                      "transformers": hf["decode_ms"] if hf else None},
        "keystroke_ttft_ms_p50": {"fim": p50([t for _, t in fim]), "efim": p50([t for _, t in efim])},
        "keystroke_prefilled_p50": {"fim": p50([p for p, _ in fim]), "efim": p50([p for p, _ in efim])},
        "memory_bandwidth_gbs": bw,
        "decode_floor_ms": weight_bytes / (bw * 1e9) * 1e3,
    }
    details = {
        "prefill_prompt_tokens": bf16["prompt_tokens"],
        "weight_bytes": weight_bytes,
        "int8_weight_bytes": int8_bytes,
        "int8_floor_ms": int8_bytes / (bw * 1e9) * 1e3,
        "int8_prefill_tok_s": int8["prefill_tok_s"],
        "window_tokens": window_tokens,
        "fim_series": fim,
        "efim_series": efim,
        "threads": torch.get_num_threads(),
    }
    return {"result": res, "details": details}


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "n/a" if x is None else format(x, spec)


def render_table(out: dict[str, Any]) -> str:
    r, d = out["result"], out["details"]
    pf, dc = r["prefill_tok_s"], r["decode_ms"]
    ratio = lambda a, b: f"{a / b:.2f}x" if a and b else "n/a"  # noqa: E731
    rows = [
        f"{'measure':<38}{'engine':>12}{'engine int8':>13}{'transformers':>14}{'ratio':>9}",
        f"{'prefill tok/s (%d tokens)' % d['prefill_prompt_tokens']:<38}{_fmt(pf['engine']):>12}"
        f"{_fmt(d['int8_prefill_tok_s']):>13}{_fmt(pf['transformers']):>14}{ratio(pf['engine'], pf['transformers']):>9}",
        f"{'decode ms/token':<38}{_fmt(dc['engine']):>12}{_fmt(dc['engine_int8']):>13}{_fmt(dc['transformers']):>14}"
        f"{ratio(dc['transformers'], dc['engine']):>9}",
        "",
        f"memory bandwidth {r['memory_bandwidth_gbs']:.1f} GB/s; decode floor {r['decode_floor_ms']:.1f} ms "
        f"({d['weight_bytes'] / 1e6:.0f} MB bf16), int8 floor {d['int8_floor_ms']:.1f} ms "
        f"({d['int8_weight_bytes'] / 1e6:.0f} MB)",
        "",
        f"keystrokes into a {d['window_tokens']}-token window   {'FIM+prefix cache':>18}{'EFIM':>10}",
        f"{'  prefilled tokens p50':<40}{_fmt(r['keystroke_prefilled_p50']['fim'], '.0f'):>18}"
        f"{_fmt(r['keystroke_prefilled_p50']['efim'], '.0f'):>10}",
        f"{'  TTFT ms p50':<40}{_fmt(r['keystroke_ttft_ms_p50']['fim']):>18}{_fmt(r['keystroke_ttft_ms_p50']['efim']):>10}",
        "",
        "per keystroke (prefilled / TTFT ms):",
        "  FIM : " + " ".join(f"{p}/{t:.0f}" for p, t in d["fim_series"]),
        "  EFIM: " + " ".join(f"{p}/{t:.0f}" for p, t in d["efim_series"]),
        f"(threads {d['threads']}; a shared machine moves absolute numbers: read the ratios)",
    ]
    return "\n".join(rows)


def run_cli(args: argparse.Namespace) -> int:
    out = measure(args)
    if args.json:
        print(json.dumps(out["result"]))
    else:
        print(render_table(out))
    return 0


__all__ = ["add_arguments", "run_cli", "measure", "memory_bandwidth_gbs", "keystroke_window"]
