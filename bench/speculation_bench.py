"""`efim bench speculation`: prompt-lookup speculation (engine.scheduling.speculation) on real code —
accepted tokens per step, and whole single-line suggestion latency with and without it.

Through the engine API (`engine.local.load_engine`, the factory `efim serve` uses), on the
embedded default model unless `--model` says otherwise. Places are synthesised at run time
from CPython stdlib modules (never committed copies): a code line is cut after its first
few characters, as if the user were typing it again; the request is the server's
single-line one (`stop=("\\n",)`, `max_tokens` 48, EFIM with the model's template: the
typed part of the line is the increment, the text after the line the suffix). At each
place the prompt is first computed by a one-token request, so every measured suggestion
starts as a keystroke does (its prompt cached but the last token); each configuration then
runs under its own key (no previous suggestion of the same document to look up in), the
configurations interleaved place by place so that a load change on a shared machine hits
them alike.

Reported per configuration (`--speculate 0 3 6 10`: draft lengths, 0 = plain decoding):
whole-suggestion latency p50/p95 (submit to answer), decode ms/token (median over
requests of RequestStats.decode_ms_per_token), tokens per decode step (generated after
the first / decode steps), accepted drafts per verify step, acceptance rate, and how many
suggestions equal plain decoding's text.

Module top level imports only the stdlib (the CLI imports it to add arguments).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sysconfig
import time
from pathlib import Path

MODULES = ("argparse.py", "textwrap.py", "ast.py", "subprocess.py", "json/encoder.py", "collections/__init__.py",
           "logging/__init__.py", "dataclasses.py")
PREFIX_CHARS, SUFFIX_CHARS = 6000, 2000  # about the server's 1536 + 512 token windows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default")
    parser.add_argument("--places", type=int, default=24, help="cursor places (default: %(default)s)")
    parser.add_argument("--speculate", type=int, nargs="+", default=[0, 3, 6, 10],
                        help="draft lengths to compare, 0 = plain (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--dtype", default=None, help="bf16 | fp32 (default: the engine's choice for this CPU)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def places(n: int, seed: int = 0) -> list[tuple[str, str, str, str]]:
    """`n` (module, prefix, increment, suffix): a code line of a stdlib module retyped up to
    a few characters past its indentation; the rest of the line is what to predict."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts = {m: (root / m).read_text(encoding="utf-8") for m in MODULES if (root / m).is_file()}
    rng = random.Random(seed)
    out = []
    names = sorted(texts)
    while len(out) < n:
        name = names[len(out) % len(names)]
        text = texts[name]
        lines = text.splitlines(keepends=True)
        i = rng.randrange(len(lines) // 4, len(lines) - 2)  # far enough in for a full prefix window
        line = lines[i]
        body = line.strip()
        if len(body) < 16 or body.startswith(("#", '"', "'")):
            continue
        start = sum(len(x) for x in lines[:i])
        indent = len(line) - len(line.lstrip())
        cut = indent + rng.randint(1, min(8, len(body) // 2))
        prefix = text[max(0, start - PREFIX_CHARS) : start]
        suffix = text[start + len(line) - 1 : start + len(line) - 1 + SUFFIX_CHARS]  # from the line's "\n"
        out.append((name, prefix, line[:cut], suffix))
    return out


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def run(model: str = "default", n_places: int = 24, speculate=(0, 3, 6, 10), max_tokens: int = 48, seed: int = 0,
        threads: int | None = None, dtype: str | None = None) -> dict:
    """Compare draft lengths `speculate` on `n_places` stdlib places; returns the summary dict."""
    from bench.torch_threads import torch_threads  # noqa: PLC0415
    from engine.api import InfillRequest  # noqa: PLC0415
    from engine.local import load_engine  # noqa: PLC0415

    configs = list(dict.fromkeys(int(k) for k in speculate))
    if 0 not in configs:
        configs.insert(0, 0)  # plain decoding is the reference
    with torch_threads(threads):
        engine = load_engine(model, kv_disk=False, dtype=dtype)
        try:
            info = engine.info()
            fmt = "efim" if info.supports_fim else "prefix"
            engine.submit(InfillRequest(key="warm-up", prefix="def f(", suffix="\n", max_tokens=4, format=fmt,
                                        cache=False)).result(120)
            rows: dict[int, list] = {k: [] for k in configs}
            for p, (name, prefix, increment, suffix) in enumerate(places(n_places, seed)):
                base = dict(prefix=prefix, increment=increment, suffix=suffix, format=fmt, stop=("\n",))
                engine.submit(InfillRequest(key=f"prompt-{p}", max_tokens=1, speculate=0, **base)).result(300)
                order = configs if p % 2 == 0 else configs[::-1]  # neither always first after the prefill
                for k in order:
                    t0 = time.perf_counter()
                    done = engine.submit(
                        InfillRequest(key=f"s{k}-{p}", max_tokens=max_tokens, speculate=k, **base)
                    ).result(300)
                    rows[k].append((time.perf_counter() - t0, done, name))
            stats = engine.stats()
        finally:
            engine.close()
    plain_text = [d.text for _, d, _ in rows[0]]
    summary = {"model": info.model, "dtype": info.dtype, "format": fmt, "places": n_places, "max_tokens": max_tokens,
               "configs": {}}
    for k in configs:
        lat = [s * 1e3 for s, _, _ in rows[k]]
        st = [d.stats for _, d, _ in rows[k]]
        steps = sum(s.decode_steps for s in st)
        verifies = sum(s.verify_steps for s in st)
        drafts, accepted = sum(s.draft_tokens for s in st), sum(s.accepted_tokens for s in st)
        after_first = sum(max(0, s.generated_tokens - 1) for s in st)
        summary["configs"][str(k)] = {
            "speculate": k,
            "latency_p50_ms": round(_pct(lat, 0.5), 1),
            "latency_p95_ms": round(_pct(lat, 0.95), 1),
            "ttft_p50_ms": round(_pct([s.ttft_ms for s in st], 0.5), 1),
            "decode_ms_per_token_p50": round(_pct([s.decode_ms_per_token for s in st if s.generated_tokens > 1], 0.5), 2),
            "generated_tokens_mean": round(statistics.mean(s.generated_tokens for s in st), 1),
            "tokens_per_step": round(after_first / steps, 2) if steps else 0.0,
            "accepted_per_verify": round(accepted / verifies, 2) if verifies else 0.0,
            "acceptance": round(accepted / drafts, 3) if drafts else 0.0,
            "verify_share": round(verifies / steps, 3) if steps else 0.0,
            "same_text_as_plain": sum(d.text == t for (_, d, _), t in zip(rows[k], plain_text)),
        }
    summary["engine_totals"] = {"decode_steps": stats.decode_steps, "verify_steps": stats.verify_steps,
                                "draft_tokens": stats.draft_tokens, "accepted_tokens": stats.accepted_tokens}
    return summary


def run_cli(args: argparse.Namespace) -> int:
    summary = run(args.model, args.places, args.speculate, args.max_tokens, args.seed, args.threads, args.dtype)
    if args.json:
        print(json.dumps(summary))
        return 0
    print(f"model {summary['model']} ({summary['dtype']}, {summary['format']}), {summary['places']} single-line "
          f"suggestions in stdlib code (stop at newline, max {summary['max_tokens']} tokens), prompt cached but "
          "the last token")
    head = f"{'speculate':>9} {'p50 ms':>8} {'p95 ms':>8} {'TTFT p50':>9} {'ms/token':>9} {'tok/step':>9} " \
           f"{'acc/verify':>10} {'accept':>7} {'tokens':>7} {'same':>5}"
    print(head)
    for c in summary["configs"].values():
        print(f"{c['speculate']:>9} {c['latency_p50_ms']:>8} {c['latency_p95_ms']:>8} {c['ttft_p50_ms']:>9} "
              f"{c['decode_ms_per_token_p50']:>9} {c['tokens_per_step']:>9} {c['accepted_per_verify']:>10} "
              f"{c['acceptance']:>7} {c['generated_tokens_mean']:>7} {c['same_text_as_plain']:>5}")
    return 0
