"""`efim bench jump [--json]`: a prompt window assembled after a jump from the document's
stored KV (CacheBlend over its pieces), against a full prefill of the same prompt.

Configuration: `engine.local.load_engine` (default: the embedded model with its shipped
adapter, as `efim serve` starts it). Samples: cursors at the first non-space character of
one-line statements inside function bodies of several CPython standard-library modules,
read at run time and picked with `--seed`. For each sample the line's text is removed
from the document (the cursor's line keeps its indentation and newline, so the suffix
starts at the next line): the document as a user sees it after blanking a line.

The prompt is what the server would send there: windows cut by `efim_lsp.window.cut`
(a `TokenMeter` over the engine's tokenizer, `--prefix-tokens` / `--suffix-tokens`),
format "efim" (or "prefix" for a model without FIM tokens), increment "", rendered and
tokenized by the engine's `PromptBuilder`, which also gives the local segments CacheBlend
may fill. The document's pieces are those `Engine.keep_document_pieces` computes: its pass
(`engine.cacheblend.document_kv.DocumentPass`, nearest the cursor first, at most `--piece-tokens`
tokens) run to the end by `engine.scheduling.background.DocumentWork` into a `BlendStore`. The
blended side then runs what the scheduler runs at admission of a `document_kv` request:
`document_spans` over a `DocumentIndex` of the document's pieces, then `blend_prefill`.
The document's previous sequence is not used: this is a jump far from the last window.

Quality, per blend ratio, against the full prefill:
- agreement: the full prefill's greedy continuation (`--gen` tokens) fed on both sides
  (teacher forcing); the fraction of steps whose argmax agrees;
- kl: KL(full || blended) of the first token's distribution;
- exact: the held-out line generated greedily (stop "\\n", `--max-line-tokens`), stripped,
  equals the removed line's stripped text; `same_as_full`: it equals the full prefill's.

Speed (TTFT: prompt ids in, first token out; median over `--repeats` runs on each of the
first `--speed-samples` samples): `full` prefills every row; `blend@r` finds the spans
(the index built beforehand, as the scheduler keeps it) and blends at ratio r, for 0.15
and the recommended ratio: the cheapest whose held-out exact match is within
`--tolerance` of the full prefill's.

Module top level imports only the stdlib (the CLI imports it to add arguments).
"""

from __future__ import annotations

import argparse
import ast
import json
import logging
import random
import statistics
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any, NamedTuple

log = logging.getLogger(__name__)

RATIOS = (0.0, 0.05, 0.15, 0.3, 1.0)
SPEED_RATIO = 0.15
DEFAULT_MODULES = "argparse,difflib,inspect,shutil,tarfile,textwrap,typing,configparser"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default", help="model folder, .gguf, or 'default' (SmolLM2-135M)")
    parser.add_argument("--adapter", default="auto", help="auto (the shipped adapter of the default model), none, or a path")
    parser.add_argument("--dtype", default=None, help="bf16 | fp32 (default: bf16 where the CPU has it)")
    parser.add_argument("--modules", default=DEFAULT_MODULES,
                        help=f"comma-separated stdlib modules the samples come from (default: {DEFAULT_MODULES})")
    parser.add_argument("--samples", type=int, default=24, help="cursor positions (default: 24)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the cursor choice (default: 0)")
    parser.add_argument("--prefix-tokens", type=int, default=1536, help="prefix window budget (default: 1536)")
    parser.add_argument("--suffix-tokens", type=int, default=512, help="suffix window budget (default: 512)")
    parser.add_argument("--piece-tokens", type=int, default=3072,
                        help="most tokens of a document's pieces computed, nearest the cursor first (default: 3072)")
    parser.add_argument("--piece-header", choices=("template", "sentinel"), default="template",
                        help="what a piece is prefilled after: the template's header, as the engine does "
                             "(none for byte-level tokenizers: the piece's first token becomes an attention "
                             "sink), or the template's first FIM sentinel (an experiment)")
    parser.add_argument("--gen", type=int, default=32, help="greedy tokens compared by teacher forcing (default: 32)")
    parser.add_argument("--max-line-tokens", type=int, default=64, help="most tokens of a held-out line (default: 64)")
    parser.add_argument("--tolerance", type=float, default=0.02,
                        help="exact-match loss accepted for the recommended ratio (default: 0.02)")
    parser.add_argument("--repeats", type=int, default=3, help="TTFT repetitions per sample (default: 3)")
    parser.add_argument("--speed-samples", type=int, default=3, help="samples timed for TTFT (default: 3)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


class Cursor(NamedTuple):
    module: str
    path: Path
    line: int  # 0-based line of the held-out statement


class JumpCase(NamedTuple):
    name: str  # module:line (1-based)
    key: str  # the document key (one per module)
    text: str  # the document with the line's text removed
    cursor: int  # offset of the cursor in `text`
    truth: str  # the removed line, stripped
    ids: list[int]
    segments: tuple[tuple[int, int], ...]  # rows of the local segments (prefix, suffix)
    healing: Any  # token healing (engine.text.tokenize.HealingProgress), or None
    healed_bytes: int


def module_path(name: str) -> Path:
    """The source file of a standard-library module (`name.py` or `name/__init__.py`)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for candidate in (root / f"{name.replace('.', '/')}.py", root / name.replace(".", "/") / "__init__.py"):
        if candidate.is_file():
            return candidate
    raise ValueError(f"no standard-library module {name!r} under {root}")


def statement_lines(text: str, min_offset: int = 0) -> list[int]:
    """0-based lines holding a whole one-line statement inside a function body (not a
    docstring, at least 6 characters), starting at or after character `min_offset`."""
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))
    found: set[int] = set()
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        body = fn.body
        if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
            body = body[1:]  # the docstring
        todo = list(body)
        while todo:
            node = todo.pop()
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue  # its own body is visited as a function of its own
            for field in ("body", "orelse", "finalbody", "handlers"):
                todo.extend(x for x in getattr(node, field, []) if isinstance(x, (ast.stmt, ast.excepthandler)))
            if isinstance(node, ast.Try) or not isinstance(node, ast.stmt):
                continue
            if getattr(node, "body", None):  # a compound statement: its header line is not the whole statement
                continue
            i = node.lineno - 1
            if node.end_lineno != node.lineno or starts[i] < min_offset:
                continue
            line = lines[i]
            indent = len(line) - len(line.lstrip())
            if node.col_offset != indent or len(line.strip()) < 6 or ";" in line:
                continue
            found.add(i)
    return sorted(found)


def pick_cursors(modules: list[str], count: int, seed: int, min_offset: int) -> list[Cursor]:
    """`count` held-out lines, round-robin over `modules`, each module's lines shuffled by `seed`."""
    rng = random.Random(seed)
    pools: list[list[Cursor]] = []
    for name in modules:
        path = module_path(name)
        lines = statement_lines(path.read_text(encoding="utf-8"), min_offset)
        rng.shuffle(lines)
        pools.append([Cursor(name, path, i) for i in lines])
    picks: list[Cursor] = []
    while len(picks) < count and any(pools):
        for pool in pools:
            if pool and len(picks) < count:
                picks.append(pool.pop())
    if not picks:
        raise ValueError(f"no held-out line found in {modules}")
    # Grouped by module: one document's pieces serve its samples in turn.
    return sorted(picks, key=lambda c: (modules.index(c.module), c.line))


def build_sample(engine: Any, cursor: Cursor, args: argparse.Namespace) -> JumpCase | None:
    """The held-out document and the prompt the server would build at its cursor
    (None when the prompt was cut to fit the context: it would not blend)."""
    from efim_lsp.positions import LineIndex  # noqa: PLC0415
    from efim_lsp.window import TokenMeter, cut  # noqa: PLC0415

    from engine.api import InfillRequest  # noqa: PLC0415

    original = cursor.path.read_text(encoding="utf-8")
    lines = original.splitlines(keepends=True)
    line = lines[cursor.line]
    start = sum(len(x) for x in lines[: cursor.line])
    indent = len(line) - len(line.lstrip())
    at = start + indent
    eol = start + len(line.rstrip("\r\n"))
    text = original[:at] + original[eol:]
    window = cut(LineIndex(text), at, args.prefix_tokens, args.suffix_tokens, TokenMeter(engine.count_tokens))
    fmt = "efim" if engine.template.supports_fim else "prefix"
    req = InfillRequest(
        key=cursor.module, prefix=text[window.start : at], suffix=text[at : window.end] if fmt != "prefix" else "",
        format=fmt, stop=("\n",), max_tokens=args.max_line_tokens, document_kv=True,
    )
    built = engine.prompts.build(req, int(engine.model.config.max_position))
    blend = built.prompt.blend
    if blend is None:
        return None
    return JumpCase(
        f"{cursor.path.name}:{cursor.line + 1}", cursor.module, text, at, line.strip(),
        list(built.prompt.ids), tuple(blend.segments), built.prompt.healing, built.healed_bytes,
    )


class Documents:
    """The documents' pieces, computed as the engine's background work computes them."""

    def __init__(self, model: Any, tokenizer: Any, header: tuple[int, ...], piece_tokens: int) -> None:
        from engine.kv.blend_store import BlendStore  # noqa: PLC0415
        from engine.kv.radix import RadixCache  # noqa: PLC0415
        from engine.scheduling.background import DocumentWork  # noqa: PLC0415

        cfg = model.config
        probe = model.new_kv(1)
        per_token = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * probe.k.element_size()
        # Room for one document's pieces (the store keeps half the pool) and then some.
        cache = RadixCache(n_layers=cfg.n_layers, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                           dtype=probe.k.dtype, budget_bytes=per_token * 4 * (piece_tokens + 1024))
        self.store = BlendStore(cache, blend_store_share=0.5)
        self.work = DocumentWork(model, self.store, header, step_tokens=1 << 20)  # a whole piece per step
        self.tokenizer = tokenizer
        self.piece_tokens = piece_tokens
        self.current: str | None = None

    def compute(self, key: str, text: str, cursor: int) -> tuple[int, float]:
        """Run the document's pass to the end; (tokens prefilled, seconds)."""
        from engine.cacheblend.document_kv import DocumentPass  # noqa: PLC0415

        if self.current is not None and self.current != key:
            self.store.forget_origin(self.current)  # another document: the previous one's pieces go
        self.current = key
        tokens, seconds = self.work.tokens_prefilled, self.work.seconds
        self.work.plan(DocumentPass(key, text, cursor, self.tokenizer.encode_uncached, self.piece_tokens))
        while self.work.pending():
            self.work.step()
        return self.work.tokens_prefilled - tokens, self.work.seconds - seconds

    def spans(self, key: str, sample: JumpCase) -> tuple[list[Any], float]:
        """The spans the scheduler would reuse for `sample`, and the index build time (s)."""
        from engine.cacheblend.document_kv import DocumentIndex, document_spans  # noqa: PLC0415

        t0 = time.perf_counter()
        index = DocumentIndex(self.store, key)
        built = time.perf_counter() - t0
        return document_spans(self.store, index, sample.ids, sample.segments), built


def _line(engine: Any, kv: Any, n: int, given: list[int], sample: JumpCase, max_tokens: int) -> str:
    """The greedy completion at the prompt's end (rows 0..n-1 of `kv`) with the serving
    path's stop rules (end ids, stop "\\n"), where the first tokens `given` are already
    known to be the greedy choices and rows n..n+len(given)-2 of `kv` hold all but the
    last of them (the teacher-forced rows): decoding goes on from there only when the
    line has not ended within them."""
    import torch  # noqa: PLC0415

    from engine.text.sampler import StopRules  # noqa: PLC0415
    from engine.text.tokenize import StreamDecoder  # noqa: PLC0415

    rules = StopRules(end_ids=engine.end_ids, stop=("\n",), max_tokens=max_tokens)
    decoder = StreamDecoder(engine.tokenizer.vocab, sample.healed_bytes)
    pos = n
    for i, token in enumerate(given):
        check = rules.on_token(token, decoder.feed(token))
        if check.finish is not None:
            break
        if i == len(given) - 1:  # the line goes on past what is known: decode it
            while rules.before_step() is None and pos + 1 < kv.capacity:
                token = int(engine.model.forward(torch.tensor([token]), kv, pos, "last")[0].argmax())
                pos += 1
                check = rules.on_token(token, decoder.feed(token))
                if check.finish is not None:
                    break
        pos += 1
    if check.finish != "stop":
        rules.finish_text()
        return rules.text + decoder.flush()
    return rules.text


def _line_tokens(engine: Any, tokens: list[int], sample: JumpCase, max_tokens: int) -> int:
    """How many of `tokens` a greedy line takes (its stop included); len+1 when it has not ended."""
    from engine.text.sampler import StopRules  # noqa: PLC0415
    from engine.text.tokenize import StreamDecoder  # noqa: PLC0415

    rules = StopRules(end_ids=engine.end_ids, stop=("\n",), max_tokens=max_tokens)
    decoder = StreamDecoder(engine.tokenizer.vocab, sample.healed_bytes)
    for i, token in enumerate(tokens):
        if rules.on_token(token, decoder.feed(token)).finish is not None:
            return i + 1
    return len(tokens) + 1


class Scores(NamedTuple):
    agreement: float
    kl: float
    line: str


def quality(engine: Any, docs: Documents, samples: list[JumpCase], ratios, n_gen: int, max_line: int) -> dict[str, Any]:
    """Per sample: the pieces computed, then the full prefill and each ratio's blend scored."""
    import torch  # noqa: PLC0415
    import torch.nn.functional as F  # noqa: PLC0415

    from engine.cacheblend.blend import blend_prefill  # noqa: PLC0415
    from engine.cacheblend.document_kv import covered_rows  # noqa: PLC0415
    from engine.scheduling.admission import MIN_LOCAL_COVERAGE  # noqa: PLC0415

    model = engine.model
    rows: list[dict[str, Any]] = []
    for sample in samples:
        t0 = time.perf_counter()
        tokens, seconds = docs.compute(sample.key, sample.text, sample.cursor)
        spans, _ = docs.spans(sample.key, sample)
        n = len(sample.ids)
        cap = n + max(n_gen, max_line) + 2
        ids = torch.tensor(sample.ids, dtype=torch.int64)  # [n]
        kv = model.new_kv(cap)
        ref = model.forward(ids, kv, 0, "last")[0].float()  # [V]
        cont = [int(ref.argmax())]
        for j in range(n_gen - 1):
            cont.append(int(model.forward(torch.tensor([cont[-1]]), kv, n + j, "last")[0].argmax()))
        forced = model.forward(torch.tensor(cont[:-1]), kv, n, "all")  # [gen-1, V]
        ref_preds = [cont[0], *forced.argmax(-1).tolist()]
        ref_logp = F.log_softmax(ref, -1)
        if sample.healing is not None:
            raise ValueError("the held-out lines need prompts without token healing (increment \"\")")
        full_line = _line(engine, kv, n, cont, sample, max_line)
        line_len = _line_tokens(engine, cont, sample, max_line)
        scores: dict[str, Scores] = {}
        for r in ratios:
            kv = model.new_kv(cap)
            res = blend_prefill(model, ids, kv, spans, r)
            logits = res.logits[0].float()  # [V]
            kl = float((ref_logp.exp() * (ref_logp - F.log_softmax(logits, -1))).sum())
            forced = model.forward(torch.tensor(cont[:-1]), kv, n, "all")  # [gen-1, V]
            preds = [int(logits.argmax()), *forced.argmax(-1).tolist()]
            agree = sum(p == q for p, q in zip(preds, ref_preds)) / len(ref_preds)
            # Greedy decoding follows the full prefill's tokens up to the first step where
            # the teacher-forced argmax differs: the line is decoded from there on only.
            j = next((i for i, (p, q) in enumerate(zip(preds, cont)) if p != q), len(cont))
            given = cont if j == len(cont) else [*cont[:j], preds[j]]
            line = full_line if j >= line_len else _line(engine, kv, n, given, sample, max_line)
            scores[f"{r:g}"] = Scores(agree, kl, line)
        covered = covered_rows(spans)
        rows.append({
            "name": sample.name, "prompt_tokens": n, "covered_rows": covered,
            "scheduler_blends": covered >= MIN_LOCAL_COVERAGE * n,
            "piece_tokens_prefilled": tokens, "piece_seconds": round(seconds, 3),
            "truth": sample.truth, "full": full_line, "ratios": {k: s._asdict() for k, s in scores.items()},
        })
        log.info("jump bench: %s (%d tokens, %d covered, pieces %d tokens in %.1f s) in %.1f s",
                 sample.name, n, covered, tokens, seconds, time.perf_counter() - t0)
    return summarize(rows, ratios)


def summarize(rows: list[dict[str, Any]], ratios) -> dict[str, Any]:
    def exact(line: str, truth: str) -> bool:
        return line.strip() == truth

    per_ratio = {}
    for r in ratios:
        k = f"{r:g}"
        per_ratio[k] = {
            "agreement": statistics.fmean(x["ratios"][k]["agreement"] for x in rows),
            "kl": statistics.fmean(x["ratios"][k]["kl"] for x in rows),
            "exact": statistics.fmean(exact(x["ratios"][k]["line"], x["truth"]) for x in rows),
            "same_as_full": statistics.fmean(x["ratios"][k]["line"] == x["full"] for x in rows),
        }
    return {
        "full": {"exact": statistics.fmean(exact(x["full"], x["truth"]) for x in rows)},
        "ratios": per_ratio,
        "coverage": statistics.fmean(x["covered_rows"] / x["prompt_tokens"] for x in rows),
        "scheduler_blends": statistics.fmean(x["scheduler_blends"] for x in rows),
        "rows": rows,
    }


def recommend(qual: dict[str, Any], tolerance: float) -> float:
    """The cheapest ratio whose held-out exact match is within `tolerance` of full prefill's."""
    full = qual["full"]["exact"]
    ok = [float(k) for k, q in qual["ratios"].items() if q["exact"] >= full - tolerance - 1e-9]
    return min(ok) if ok else 1.0


def speed(engine: Any, docs: Documents, samples: list[JumpCase], ratios, repeats: int) -> dict[str, Any]:
    """TTFT of a full prefill and of the blend at each of `ratios` (median of all runs)."""
    import torch  # noqa: PLC0415

    from engine.cacheblend.blend import blend_prefill  # noqa: PLC0415
    from engine.cacheblend.document_kv import DocumentIndex, document_spans  # noqa: PLC0415

    model = engine.model
    times: dict[str, list[float]] = {"full": [], **{f"blend@{r:g}": [] for r in ratios}}
    index_ms: list[float] = []
    rows: dict[str, list[tuple[int, int]]] = {f"blend@{r:g}": [] for r in ratios}
    for sample in samples:
        docs.compute(sample.key, sample.text, sample.cursor)
        t0 = time.perf_counter()
        index = DocumentIndex(docs.store, sample.key)
        index_ms.append((time.perf_counter() - t0) * 1e3)
        n = len(sample.ids)
        for _ in range(max(1, repeats)):
            t0 = time.perf_counter()
            kv = model.new_kv(n + 1)
            int(model.forward(torch.tensor(sample.ids), kv, 0, "last").argmax())
            times["full"].append((time.perf_counter() - t0) * 1e3)
            for r in ratios:
                t0 = time.perf_counter()
                spans = document_spans(docs.store, index, sample.ids, sample.segments)
                kv = model.new_kv(n + 1)
                res = blend_prefill(model, torch.tensor(sample.ids), kv, spans, r)
                int(res.logits.argmax())
                times[f"blend@{r:g}"].append((time.perf_counter() - t0) * 1e3)
                rows[f"blend@{r:g}"].append((int(res.recomputed.numel()), res.reused))
    return {
        "ttft_ms": {k: statistics.median(v) for k, v in times.items()},
        "recomputed_rows": {k: statistics.fmean(a for a, _ in v) for k, v in rows.items()},
        "reused_rows": {k: statistics.fmean(b for _, b in v) for k, v in rows.items()},
        "prompt_tokens": statistics.fmean(len(s.ids) for s in samples),
        "index_build_ms": statistics.median(index_ms),
        "samples": [s.name for s in samples],
    }


def run_cli(args: argparse.Namespace) -> int:
    from bench.torch_threads import torch_threads  # noqa: PLC0415

    with torch_threads(args.threads):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    import torch  # noqa: PLC0415

    from engine.local import load_engine  # noqa: PLC0415

    if args.samples < 1 or args.gen < 1 or args.max_line_tokens < 1:
        raise ValueError("--samples, --gen and --max-line-tokens must be >= 1")
    t0 = time.perf_counter()
    engine = load_engine(args.model, dtype=args.dtype, adapter=args.adapter, kv_budget="16M")
    engine.close()  # its parts are used directly, on this thread
    modules = [m.strip() for m in args.modules.split(",") if m.strip()]
    # A cursor with a full prefix window before it (~3 characters a token is generous).
    cursors = pick_cursors(modules, args.samples, args.seed, min_offset=3 * args.prefix_tokens)
    with torch.inference_mode():
        samples = [s for s in (build_sample(engine, c, args) for c in cursors) if s is not None]
        if not samples:
            raise ValueError("no sample prompt fits the model's context")
        header = tuple(engine.template.bos_ids)
        if args.piece_header == "sentinel":
            tpl = engine.template
            header += ((tpl.suffix_id if tpl.suffix_first else tpl.prefix_id),) if tpl.supports_fim else ()
        docs = Documents(engine.model, engine.tokenizer, header, args.piece_tokens)
        qual = quality(engine, docs, samples, RATIOS, args.gen, args.max_line_tokens)
        best = recommend(qual, args.tolerance)
        speed_ratios = sorted({SPEED_RATIO, best})
        spd = speed(engine, docs, samples[: max(1, args.speed_samples)], speed_ratios, args.repeats)
    result = {
        "full": qual["full"],
        "ratios": qual["ratios"],
        "recommended_ratio": best,
        "ttft_ms": spd["ttft_ms"],
        "setup": {
            "model": engine.loaded.name,
            "template": engine.template.name,
            "dtype": str(engine.model.dtype).removeprefix("torch."),
            "threads": torch.get_num_threads(),
            "modules": modules,
            "seed": args.seed,
            "tolerance": args.tolerance,
            "repeats": args.repeats,
            "windows": [args.prefix_tokens, args.suffix_tokens],
            "piece_header": [args.piece_header, list(header)],
            "samples": len(samples),
            "prompt_tokens_mean": statistics.fmean(len(s.ids) for s in samples),
            "coverage_mean": qual["coverage"],
            "scheduler_blends": qual["scheduler_blends"],
            "piece_tokens_mean": statistics.fmean(x["piece_tokens_prefilled"] for x in qual["rows"]),
            "speed": {k: v for k, v in spd.items() if k != "ttft_ms"},
            "per_sample": qual["rows"],
            "seconds": round(time.perf_counter() - t0, 1),
        },
    }
    print(json.dumps(result) if args.json else format_table(result), file=sys.stdout)
    return 0


def format_table(result: dict[str, Any]) -> str:
    """The human-readable report of a result (`efim bench jump --json` prints the result)."""
    setup, sp, qual = result["setup"], result["setup"]["speed"], result
    lines = [
        f"Window after a jump from the document's KV, {setup['model']} ({setup['template']}, {setup['dtype']}, "
        f"{setup['threads']} threads): {setup['samples']} held-out lines from {', '.join(setup['modules'])}; "
        f"prompts of ~{setup['prompt_tokens_mean']:.0f} tokens, {setup['coverage_mean']:.0%} of their rows found "
        f"in the pieces (the scheduler would blend {setup['scheduler_blends']:.0%} of them)",
        f"{'ratio':>6} {'agreement':>10} {'KL':>8} {'exact':>7} {'= full':>7}",
        f"{'full':>6} {1.0:>10.3f} {0.0:>8.4f} {qual['full']['exact']:>7.1%} {1.0:>7.0%}",
    ]
    for r, q in qual["ratios"].items():
        lines.append(f"{r:>6} {q['agreement']:>10.3f} {q['kl']:>8.4f} {q['exact']:>7.1%} {q['same_as_full']:>7.0%}")
    lines.append(f"recommended ratio (exact within {setup['tolerance']:.0%} of full prefill, cheapest): "
                 f"{result['recommended_ratio']:g}")
    t = result["ttft_ms"]
    lines.append(
        f"TTFT (median, {setup['repeats']} runs x {len(sp['samples'])} prompts of ~{sp['prompt_tokens']:.0f} tokens): "
        f"full {t['full']:.0f} ms; "
        + "; ".join(f"{k} {v:.0f} ms ({sp['recomputed_rows'][k]:.0f} rows recomputed, {sp['reused_rows'][k]:.0f} reused)"
                    for k, v in t.items() if k != "full")
        + f"; index build {sp['index_build_ms']:.1f} ms")
    lines.append(f"wall time {setup['seconds']:.0f} s")
    return "\n".join(lines)


__all__ = ["add_arguments", "run_cli", "statement_lines", "pick_cursors", "quality", "speed", "recommend", "format_table", "RATIOS"]
