"""`efim bench blend [--json]`: CacheBlend quality and time to first token, in one run.

Prompts come from real multi-file code: a CPython standard-library package. For each
sample, a cursor in one of its modules gives the local window (the ~`--local-tokens`
tokens before the cursor, plus ~20 lines after it for FIM models), and
`efim_lsp.context.ContextGatherer` picks `--chunks` chunks of ~`--chunk-tokens` tokens
from the sibling modules, exactly as the server does. The prompt is rendered and
tokenized by the engine's own template code.

Quality, per blend ratio, against a full prefill of the same prompt:
- agreement: the full prefill's greedy continuation (`--gen` tokens) is fed after the
  prompt in one pass on both sides (teacher forcing); agreement is the fraction of
  steps at which the blended sequence's argmax equals the full prefill's;
- kl: KL(full || blended) of the first generated token's distribution.
Two settings: `ratios` — the chunks' KV from each chunk prefilled alone, the local
window uncached (the first request after the context changed); `ratios_reordered` —
in addition the local window's rows come from the previous request of the document,
which had the chunks in the opposite order (what the engine does on a reorder).

Speed (TTFT = prompt in, first token out; median of `--repeats`), for the first
sample's prompt when the chunk order changed since the previous request: `full`
prefills every token; `prefix` reuses the radix-cache prefix the previous request left
(it ends where the chunk order differs); `blend` takes the chunks from the blend store
and the local window from the previous request's sequence and recomputes
`--speed-ratio` of them (setup.speed also has the time with the local window uncached).

Module top level imports only the stdlib (the CLI imports it to add arguments).
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
from typing import Any, NamedTuple

log = logging.getLogger(__name__)

RATIOS = (0.0, 0.05, 0.15, 0.3, 1.0)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default", help="model folder, .gguf, or 'default' (SmolLM2-135M)")
    parser.add_argument("--dtype", default=None, help="bf16 | fp32 (default: bf16 where the CPU has it)")
    parser.add_argument("--package", default="asyncio", help="stdlib package the prompts come from (default: asyncio)")
    parser.add_argument("--samples", type=int, default=4, help="cursor positions for the quality part (default: 4)")
    parser.add_argument("--chunks", type=int, default=4, help="context chunks per prompt (default: 4)")
    parser.add_argument("--chunk-tokens", type=int, default=256, help="tokens per chunk (default: 256)")
    parser.add_argument("--local-tokens", type=int, default=1000, help="local window tokens (default: 1000)")
    parser.add_argument("--gen", type=int, default=32, help="greedy tokens compared (default: 32)")
    parser.add_argument("--repeats", type=int, default=3, help="TTFT repetitions, median reported (default: 3)")
    parser.add_argument("--speed-ratio", type=float, default=0.15, help="blend ratio for the TTFT part (default: 0.15)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--parts", default="quality,speed",
                        help="comma-separated parts to run: quality, speed (default: both)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


class BlendCase(NamedTuple):
    name: str  # module:line
    ids: list[int]
    units: list[tuple[int, int]]  # chunk rows
    local: list[tuple[int, int]]  # other text segments (prefix / suffix)
    chunk_texts: tuple[Any, ...]  # the ContextChunk objects, in prompt order


def _package_dir(name: str) -> Path:
    root = Path(sysconfig.get_paths()["stdlib"]) / name
    if not root.is_dir():
        raise ValueError(f"no standard-library package {name!r} under {root.parent}")
    return root


def _cursor_lines(text: str, count: int) -> list[int]:
    """Line numbers of indented, non-blank code lines spread over the second half of the file."""
    lines = text.splitlines()
    picks: list[int] = []
    for frac in [0.5 + 0.45 * i / max(1, count) for i in range(count)]:
        i = int(len(lines) * frac)
        while i < len(lines) and not (lines[i].startswith("    ") and lines[i].strip() and not lines[i].strip().startswith("#")):
            i += 1
        if i < len(lines) and i not in picks:
            picks.append(i)
    return picks


def build_samples(engine_parts: Any, args: argparse.Namespace) -> list[BlendCase]:
    """Prompts from the package: local window + gathered sibling chunks, rendered and
    tokenized as the engine does."""
    from efim_lsp.context import ContextGatherer  # noqa: PLC0415

    from engine.api import InfillRequest  # noqa: PLC0415
    from engine.cacheblend.blend import chunk_units  # noqa: PLC0415

    template, tok = engine_parts
    pkg = _package_dir(args.package)
    gatherer = ContextGatherer(count_tokens=tok.count, watch=False)
    gatherer.set_workspaces([pkg])
    gatherer.wait_idle(60)
    files = sorted(
        # Big enough that a cursor in its second half has a full local window before it.
        (p for p in pkg.glob("*.py") if p.stat().st_size > 8 * args.local_tokens), key=lambda p: p.name
    )
    if not files:
        raise ValueError(f"package {args.package!r} has no module large enough for a {args.local_tokens}-token window")
    samples: list[BlendCase] = []
    per_file = max(1, -(-args.samples // len(files)))
    for path in files:
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines(keepends=True)
        for line_no in _cursor_lines(text, per_file):
            if len(samples) >= args.samples:
                break
            indent = len(lines[line_no]) - len(lines[line_no].lstrip())
            cursor = sum(len(x) for x in lines[:line_no]) + indent
            # Local window: whole lines before the cursor, within the token budget.
            start_line = line_no
            while start_line > 0 and tok.count("".join(lines[start_line - 1 : line_no])) <= args.local_tokens:
                start_line -= 1
            prefix = text[sum(len(x) for x in lines[:start_line]) : cursor]
            chunks = gatherer.select(
                str(path), text, cursor,
                max_chunks=args.chunks, max_tokens=args.chunks * args.chunk_tokens,
                window=(cursor - len(prefix), cursor),
            )
            if not chunks:
                continue
            fmt = "efim" if template.supports_fim else "prefix"
            suffix = "".join(lines[line_no + 1 : line_no + 20]) if template.supports_fim else ""
            req = InfillRequest(key="bench", prefix=prefix, suffix=suffix, chunks=chunks, format=fmt)
            enc = tok.encode(template.render(req), heal=False)
            units = chunk_units(enc.spans)
            local = [(s.start, s.end) for s in enc.spans if s.role in ("prefix", "suffix")]
            samples.append(BlendCase(f"{path.name}:{line_no + 1}", list(enc.ids), units, local, chunks))
    gatherer.close()
    if not samples:
        raise ValueError(f"no prompt with context chunks could be built from {pkg}")
    return samples


def _reference(model, ids, n_gen):
    """Full prefill, greedy decode of `n_gen` tokens, then the same tokens fed again in
    one pass (teacher forcing, as the blended side is measured): (first-token logits [V],
    continuation, the argmax at each continuation step)."""
    import torch  # noqa: PLC0415

    n = len(ids)
    kv = model.new_kv(n + n_gen + 1)
    first = model.forward(torch.tensor(ids), kv, 0, "last")[0]
    cont = [int(first.argmax())]
    for j in range(n_gen - 1):
        cont.append(int(model.forward(torch.tensor([cont[-1]]), kv, n + j, "last")[0].argmax()))
    forced = model.forward(torch.tensor(cont[:-1]), kv, n, "all")  # [gen-1, V]
    return first, cont, [cont[0]] + forced.argmax(-1).tolist()


def _reordered(sample: BlendCase) -> list[int]:
    """The sample's prompt with its chunks in the opposite order (same local window)."""
    units = sample.units
    body = [sample.ids[s:e] for s, e in units]
    return sample.ids[: units[0][0]] + [t for chunk in reversed(body) for t in chunk] + sample.ids[units[-1][1] :]


def quality(model, cache, template, samples: list[BlendCase], ratios, n_gen: int) -> dict[str, dict]:
    """Agreement and KL per ratio in two settings: "fresh" (chunks prefilled alone, the
    local window uncached) and "reordered" (the previous request had the chunks in the
    opposite order: its local-window rows are reused too)."""
    import torch  # noqa: PLC0415
    import torch.nn.functional as F  # noqa: PLC0415

    from engine.cacheblend.blend import blend_prefill, plan_spans, previous_spans  # noqa: PLC0415
    from engine.kv.blend_store import BlendStore  # noqa: PLC0415

    store = BlendStore(cache, blend_store_share=0.5)
    settings = ("fresh", "reordered")
    agree = {(k, r): [] for k in settings for r in ratios}
    kls = {(k, r): [] for k in settings for r in ratios}
    for sample in samples:
        t0 = time.perf_counter()
        n = len(sample.ids)
        ref_logits, cont, ref_preds = _reference(model, sample.ids, n_gen)
        ref_logp = F.log_softmax(ref_logits.float(), -1)
        plan = plan_spans(model, store, sample.ids, sample.units, header=template.bos_ids)
        prev_ids = _reordered(sample)
        prev_kv = model.new_kv(n + 1)
        model.forward(torch.tensor(prev_ids), prev_kv, 0, "none")
        extra = previous_spans(prev_ids, prev_kv, sample.ids, sample.local)
        for setting, spans in (("fresh", plan.spans), ("reordered", plan.spans + extra)):
            for r in ratios:
                kv = model.new_kv(n + n_gen + 1)
                res = blend_prefill(model, torch.tensor(sample.ids), kv, spans, r)
                logp = F.log_softmax(res.logits[0].float(), -1)
                kls[setting, r].append(float((ref_logp.exp() * (ref_logp - logp)).sum()))
                forced = model.forward(torch.tensor(cont[:-1]), kv, n, "all")  # [gen-1, V]
                preds = [int(res.logits[0].argmax())] + forced.argmax(-1).tolist()
                agree[setting, r].append(sum(p == q for p, q in zip(preds, ref_preds)) / len(ref_preds))
        log.info("blend bench: %s (%d tokens, %d in chunks) in %.1f s", sample.name, n,
                 sum(e - s for s, e in sample.units), time.perf_counter() - t0)
    return {
        setting: {
            f"{r:g}": {"agreement": statistics.fmean(agree[setting, r]), "kl": statistics.fmean(kls[setting, r])}
            for r in ratios
        }
        for setting in settings
    }


def speed(model, cache_factory, template, sample: BlendCase, ratio: float, repeats: int) -> dict[str, Any]:
    """TTFT of the three paths for `sample` after a previous request of the same document
    with the chunk order reversed (chunk KV already in the store, as after that request).
    Each path runs the same functions the scheduler runs, without its thread hand-offs."""
    import torch  # noqa: PLC0415

    from engine.cacheblend.blend import blend_prefill, plan_spans, previous_spans  # noqa: PLC0415
    from engine.kv.blend_store import BlendStore  # noqa: PLC0415

    ids, units, local = sample.ids, sample.units, sample.local
    prev_ids = _reordered(sample)
    n = len(ids)
    cache = cache_factory()
    store = BlendStore(cache, blend_store_share=0.5)
    prev_kv = model.new_kv(n + 1)
    model.forward(torch.tensor(prev_ids), prev_kv, 0, "none")
    cache.commit(prev_ids, prev_kv, n, key="doc")
    plan_spans(model, store, ids, units, header=template.bos_ids)  # the chunks were seen before: stored

    def full() -> int:
        kv = model.new_kv(n + 1)
        return int(model.forward(torch.tensor(ids), kv, 0, "last").argmax())

    def prefix() -> int:
        m = cache.match(ids)
        reuse = min(m.n_tokens, n - 1)
        kv = model.new_kv(n + 1)
        cache.gather(m.slots[:reuse], kv, 0)
        return int(model.forward(torch.tensor(ids[reuse:]), kv, reuse, "last").argmax())

    def blend(with_previous: bool = True) -> int:
        m = cache.match(ids)
        reuse = min(m.n_tokens, n - 1)
        extra = previous_spans(prev_ids, prev_kv, ids, local, reuse) if with_previous else []
        kv = model.new_kv(n + 1)
        cache.gather(m.slots[:reuse], kv, 0)
        plan = plan_spans(model, store, ids, units, header=template.bos_ids, start=reuse, extra=extra)
        res = blend_prefill(model, torch.tensor(ids[reuse:]), kv, plan.spans, ratio, start=reuse)
        stats[with_previous] = int(res.recomputed.numel()), res.reused
        return int(res.logits.argmax())

    stats: dict[bool, tuple[int, int]] = {}
    paths = {"full": full, "prefix": prefix, "blend": blend, "blend_local_uncached": lambda: blend(False)}
    times: dict[str, list[float]] = {name: [] for name in paths}
    firsts: dict[str, int] = {}
    for _ in range(max(1, repeats)):
        for name, fn in paths.items():
            t0 = time.perf_counter()
            firsts[name] = fn()
            times[name].append((time.perf_counter() - t0) * 1e3)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "ttft_ms": {k: med[k] for k in ("full", "prefix", "blend")},
        "blend_local_uncached_ms": med["blend_local_uncached"],
        "prompt_tokens": n,
        "prefix_reused_tokens": min(cache.match(ids).n_tokens, n - 1),
        "blend_recomputed_rows": stats[True][0],
        "blend_reused_rows": stats[True][1],
        "blend_local_uncached_recomputed_rows": stats[False][0],
        "first_token_equal_full": {k: firsts[k] == firsts["full"] for k in paths if k != "full"},
    }


def run_cli(args: argparse.Namespace) -> int:
    from bench.torch_threads import torch_threads  # noqa: PLC0415

    with torch_threads(args.threads):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    import torch  # noqa: PLC0415

    from engine.kv.radix import RadixCache  # noqa: PLC0415
    from engine.model.loader import load_model  # noqa: PLC0415
    from engine.text.templates import detect_template  # noqa: PLC0415
    from engine.text.tokenize import SegmentTokenizer  # noqa: PLC0415

    t0 = time.perf_counter()
    loaded = load_model(args.model, dtype=args.dtype)
    model = loaded.model
    template = detect_template(loaded.tokenizer)
    tok = SegmentTokenizer(loaded.tokenizer)
    cfg = model.config

    def cache_factory() -> RadixCache:
        probe = model.new_kv(1)
        per_token = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * probe.k.element_size()
        return RadixCache(n_layers=cfg.n_layers, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                          dtype=probe.k.dtype, budget_bytes=per_token * 16384)

    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    if not parts or parts - {"quality", "speed"}:
        raise ValueError(f"--parts takes 'quality', 'speed' or both, not {args.parts!r}")
    if "quality" not in parts:
        args.samples = 1  # the speed part needs one prompt
    with torch.inference_mode():
        samples = build_samples((template, tok), args)
        qual = quality(model, cache_factory(), template, samples, RATIOS, args.gen) if "quality" in parts else None
        spd = speed(model, cache_factory, template, samples[0], args.speed_ratio, args.repeats) if "speed" in parts else None
    result = {
        "ratios": qual["fresh"] if qual else None,
        "ttft_ms": spd["ttft_ms"] if spd else None,
        "ratios_reordered": qual["reordered"] if qual else None,
        "setup": {
            "model": loaded.name,
            "dtype": str(model.dtype).removeprefix("torch."),
            "package": args.package,
            "samples": [s.name for s in samples],
            "prompt_tokens_mean": statistics.fmean(len(s.ids) for s in samples),
            "chunk_tokens_mean": statistics.fmean(sum(e - s for s, e in x.units) for x in samples),
            "speed": {k: v for k, v in spd.items() if k != "ttft_ms"} if spd else None,
            "speed_ratio": args.speed_ratio,
            "threads": torch.get_num_threads(),
            "seconds": round(time.perf_counter() - t0, 1),
        },
    }
    if args.json:
        print(json.dumps(result))
        return 0
    out = sys.stdout
    print(f"CacheBlend on {loaded.name} ({result['setup']['dtype']}), stdlib package {args.package!r}, "
          f"{len(samples)} prompts of ~{result['setup']['prompt_tokens_mean']:.0f} tokens "
          f"(~{result['setup']['chunk_tokens_mean']:.0f} in chunks)", file=out)
    if qual:
        print("quality vs full prefill: fresh = chunks prefilled alone, local window uncached; "
              "reordered = local window also reused from a request with the chunks in the opposite order", file=out)
        print(f"{'ratio':>6} {'agree fresh':>12} {'KL fresh':>9} {'agree reord':>12} {'KL reord':>9}", file=out)
        for r, q in qual["fresh"].items():
            q2 = qual["reordered"][r]
            print(f"{r:>6} {q['agreement']:>12.3f} {q['kl']:>9.4f} {q2['agreement']:>12.3f} {q2['kl']:>9.4f}", file=out)
    if not spd:
        return 0
    t = spd["ttft_ms"]
    print(f"TTFT, chunk order changed ({spd['prompt_tokens']} tokens, median of {args.repeats}): "
          f"full {t['full']:.0f} ms, prefix cache {t['prefix']:.0f} ms (reused {spd['prefix_reused_tokens']}), "
          f"blend@{args.speed_ratio:g} {t['blend']:.0f} ms (recomputed {spd['blend_recomputed_rows']} rows) "
          f"-> full/blend {t['full'] / t['blend']:.2f}x; local window uncached: "
          f"{spd['blend_local_uncached_ms']:.0f} ms ({spd['blend_local_uncached_recomputed_rows']} rows)", file=out)
    return 0


__all__ = ["add_arguments", "run_cli", "build_samples", "quality", "speed", "RATIOS"]
