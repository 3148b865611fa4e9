"""`efim eval humaneval-infilling|lines`: infilling quality (greedy pass@1; line exact match).

Parses arguments and calls `efim_tools.evaluation` (torch loads only when the command runs)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="'default' (embedded SmolLM2 GGUF), a .gguf file or a HF folder")
    p.add_argument("--adapter", default="auto", help="'auto' (the shipped adapter for --model default), 'none', or an adapter folder")
    p.add_argument("--format", choices=("fim", "efim", "prefix"), default="fim")
    p.add_argument("--heal", choices=("on", "off"), default="off", help="token healing of the increment's last token")
    p.add_argument("--limit", type=int, default=None, help="evaluate only this many cases (a fixed seeded subset)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--backend", choices=("transformers", "engine"), default="transformers",
                   help="generate with transformers' forward (default) or the product engine on a merged copy of the model")


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("eval", help="evaluate infilling quality")
    targets = parser.add_subparsers(dest="target", metavar="TARGET", required=True)
    h = targets.add_parser("humaneval-infilling", help="HumanEval infilling pass@1 (single-line, multi-line, random-span-light)")
    h.add_argument("--split", choices=("single-line", "multi-line", "random-span-light"), default="single-line")
    h.add_argument("--data", default=None, help="folder (or .jsonl.gz file) of the HumanEval infilling data")
    h.add_argument("--increment", choices=("auto", "cut", "none"), default="auto", help="auto: cut the middle into an increment for efim only")
    h.add_argument("--timeout", type=float, default=10.0, help="sandbox wall-clock seconds per program")
    h.add_argument("--verbose-results", action="store_true", help="also list every task's result (with --json)")
    _common(h)
    h.set_defaults(func=run_humaneval)
    t = targets.add_parser("table", help="the comparison table: base prefix-only, each adapter under FIM and EFIM (healing off/on)")
    t.add_argument("--model", default="default")
    t.add_argument("--adapters", nargs="*", default=[], help="adapter folders to compare (e.g. with and without fragment tokenization)")
    t.add_argument("--skip-base", action="store_true", help="leave out the base model's prefix-only rows")
    t.add_argument("--split", choices=("single-line", "multi-line", "random-span-light"), default="single-line")
    t.add_argument("--data", default=None)
    t.add_argument("--limit", type=int, default=30, help="HumanEval tasks per configuration")
    t.add_argument("--line-limit", type=int, default=0, help="held-out stdlib line completions per configuration (0 = skip)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--threads", type=int, default=0)
    t.add_argument("--jsonl", default=None, help="append every row (with per-task results) to this file")
    t.set_defaults(func=run_table)
    lines = targets.add_parser("lines", help="line completion exact match / edit similarity on held-out stdlib modules")
    _common(lines)
    lines.set_defaults(func=run_lines)


def _infiller(args: argparse.Namespace):
    import torch  # noqa: PLC0415

    from efim_tools.evaluation.infill import EngineInfiller, TransformersInfiller  # noqa: PLC0415
    from efim_tools.evaluation.model import export_merged, load_eval_model  # noqa: PLC0415

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.limit is not None and args.limit <= 0:
        raise ValueError("--limit must be positive")
    if args.backend == "engine":
        import tempfile  # noqa: PLC0415

        folder = export_merged(args.model, args.adapter, Path(tempfile.mkdtemp(prefix="efim-eval-merged-")))
        return EngineInfiller(folder, f"{args.model}+{args.adapter} (engine)", threads=args.threads or None)
    return TransformersInfiller(load_eval_model(args.model, args.adapter))


def run_humaneval(args: argparse.Namespace) -> int:
    from efim_tools.evaluation import humaneval  # noqa: PLC0415
    from efim_tools.evaluation.sandbox import Limits  # noqa: PLC0415

    tasks = humaneval.select(humaneval.load_tasks(args.split, args.data), args.limit, args.seed)
    infiller = _infiller(args)
    limits = Limits(wall_seconds=args.timeout, cpu_seconds=max(1, int(args.timeout)))
    res = humaneval.evaluate(infiller, tasks, args.split, args.format, heal=args.heal == "on", increment=args.increment, seed=args.seed, limits=limits)
    if args.json:
        doc = {"split": res.split, "format": res.format, "n": res.n, "pass_at_1": res.pass_at_1}
        if args.verbose_results:
            doc.update(model=_name(infiller), heal=res.heal, seconds=round(res.seconds, 1), results=[r._asdict() for r in res.results])
        print(json.dumps(doc))
    else:
        print(f"{_name(infiller)} {res.split} {res.format} heal={'on' if res.heal else 'off'}: pass@1 {res.pass_at_1:.3f} (n={res.n}, {res.seconds:.0f} s)")
    return 0


def run_lines(args: argparse.Namespace) -> int:
    from efim_tools.evaluation.linecompletion import evaluate_lines, line_cases  # noqa: PLC0415

    cases = line_cases(n=args.limit or 100, seed=args.seed)
    infiller = _infiller(args)
    score = evaluate_lines(infiller, cases, args.format, heal=args.heal == "on")
    if args.json:
        print(json.dumps({"task": "lines", "format": score.format, "heal": score.heal, "n": score.n, "exact_match": score.exact_match, "edit_similarity": score.edit_similarity}))
    else:
        print(f"{_name(infiller)} lines {score.format} heal={'on' if score.heal else 'off'}: exact {score.exact_match:.3f}, edit sim {score.edit_similarity:.3f} (n={score.n}, {score.seconds:.0f} s)")
    return 0


def run_table(args: argparse.Namespace) -> int:
    import torch  # noqa: PLC0415

    from efim_tools.evaluation.table import markdown, run_table  # noqa: PLC0415

    if args.threads:
        torch.set_num_threads(args.threads)
    rows = run_table(args.model, args.adapters, base=not args.skip_base, split=args.split, limit=args.limit, line_limit=args.line_limit, data=args.data, seed=args.seed, out_jsonl=args.jsonl)
    print(markdown(rows))
    return 0


def _name(infiller) -> str:
    return infiller.name
