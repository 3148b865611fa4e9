"""`efim eval humaneval-infilling|lines|blank-lines|crossfile|...`: infilling quality (greedy pass@1;
line exact match; the fresh-line rule on true-blank lines; lines that need another file of
their package, through the real server).

Parses arguments and calls `efim_tools.evaluation` (torch loads only when the command runs)."""

from __future__ import annotations

import argparse
import atexit
import json
import shutil
import tempfile
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
    p.add_argument("--backend", choices=("transformers", "engine", "llama.cpp"), default="transformers",
                   help="generate with transformers' forward (default), the product engine on a merged copy of the model (with --quant: on the model as `efim serve` loads it), or llama.cpp's llama-server on an exported GGUF through the remote engine")
    p.add_argument("--quant", choices=("none", "int8", "int4", "auto", "mixed"), default=None,
                   help="--backend engine: load the model as `efim serve --quant` does (the adapter merged at load, a GGUF's int4 groups kept) in this weight form, instead of a merged float copy (docs/model.md \"Formats\")")
    p.add_argument("--prefill", choices=("bf16", "int8"), default=None,
                   help="with --quant mixed: the prefill steps' form, as `efim serve --prefill` (docs/model.md \"int8 prefill\")")


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("eval", help="evaluate infilling quality")
    targets = parser.add_subparsers(dest="target", metavar="TARGET", required=True)
    h = targets.add_parser("humaneval-infilling", help="HumanEval infilling pass@1 (single-line, multi-line, random-span-light)")
    h.add_argument("--split", choices=("single-line", "multi-line", "random-span-light"), default="single-line")
    h.add_argument("--data", default=None, help="folder (or .jsonl.gz file) of the HumanEval infilling data")
    h.add_argument("--increment", choices=("auto", "cut", "none", "indent"), default="auto", help="auto: cut the middle into an increment for efim only; indent: the middle's leading indentation (an auto-indenting editor's fresh line)")
    h.add_argument("--timeout", type=float, default=10.0, help="sandbox wall-clock seconds per program")
    h.add_argument("--verbose-results", action="store_true", help="also list every task's result (with --json)")
    h.add_argument("--fresh-line", choices=("off", "rule", "both"), default="off",
                   help="the fresh-line rule: off, set where the language server would set it (rule), or both (one row each, same tasks)")
    h.add_argument("--fresh-line-guard", type=float, nargs="+", default=None, metavar="P",
                   help="the rule's confidence guard(s), each in (0, 1]: one row per value (default: the engine's)")
    h.add_argument("--beams", type=int, default=1, help="transformers backend, single-line split: beam search of this width instead of greedy (an experiment)")
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
    lines.add_argument("--windows", nargs="+", default=["1500:600"], metavar="P:S",
                       help="window sizes in characters before:after the line (cut at line starts), one row each on the "
                            "same cases and model (e.g. 4600:1500 ~ the server's full window, 1150:380 ~ its 512-token first window)")
    _common(lines)
    lines.set_defaults(func=run_lines)
    blank = targets.add_parser("blank-lines", help="true-blank cases (real blank lines of held-out modules, plain FIM): how many the fresh-line rule makes non-blank")
    blank.add_argument("--fresh-line-guard", type=float, nargs="+", default=None, metavar="P", help="the rule's confidence guard(s): one row per value")
    _common(blank)
    blank.set_defaults(func=run_blank_lines)
    ne = targets.add_parser("next-edit", help="next-edit suggestions on held-out stdlib modules: exact edit, location, edit similarity, silence on noise")
    ne.add_argument("--files", default=None, help="comma-separated stdlib modules to draw samples from (default: difflib,textwrap,shlex,statistics,fractions,calendar)")
    ne.add_argument("--packages", default=None, help="comma-separated stdlib packages for the other-file category "
                    "(default: email,logging,json,urllib,importlib; '' for none)")
    ne.add_argument("--per-category", type=int, default=100, help="samples per category (a seeded subset)")
    ne.add_argument("--seed", type=int, default=0)
    ne.add_argument("--proposer", choices=("baseline", "textual", "model", "rules+model"), default="baseline",
                    help="baseline: the server's proposers (rename, call sites, parallel lines), no model; textual: the last edit "
                    "again at the next textual occurrence (the naive non-model baseline); model: the model asked about each "
                    "candidate place (efim_lsp.next_edit.probe) through the product engine; rules+model: the model where the "
                    "server's proposers are silent")
    ne.add_argument("--model", default="default", help="with a model proposer: the model (as `efim serve --model`)")
    ne.add_argument("--adapter", default="auto", help="with a model proposer: 'auto' (the shipped adapter) or an adapter folder "
                    "(a run's `adapter/`)")
    ne.add_argument("--quant", choices=("none", "int8", "int4", "auto", "mixed"), default="auto", help="with a model proposer: the weight form")
    ne.add_argument("--json", action="store_true", help="print one JSON object")
    ne.set_defaults(func=run_next_edit)
    sh = targets.add_parser("shape", help="suggestions accepted at emptied statement lines of held-out modules: unparseable files, duplicated next lines")
    sh.add_argument("--modes", nargs="+", choices=("auto", "line"), default=["auto", "line"], help="auto: the server's line/block choice; line: one line forced")
    sh.add_argument("--show", type=int, default=0, help="print this many shown suggestions that break the file or duplicate the next line")
    _common(sh)
    sh.set_defaults(func=run_shape)
    cf = targets.add_parser("crossfile", help="repository-level: lines of real packages that need a name defined in another of their files, asked of `efim serve` under each context setting")
    cf.add_argument("--packages", default="email,json,asyncio,importlib",
                    help="comma-separated packages: import names (standard library, installed libraries) or folders")
    cf.add_argument("--configs", default="off,prefix,blend", help="comma-separated `context` settings, each on a fresh server per package; prefix/blend may name the selection: blend:imports, blend:bm25")
    cf.add_argument("--chunks", default=None, help="comma-separated contextChunks values: one configuration each (prefix/blend)")
    cf.add_argument("--context-tokens", default=None, help="comma-separated contextTokens values: one configuration each (prefix/blend)")
    cf.add_argument("--limit", type=int, default=50, help="targets per package (a seeded sample)")
    cf.add_argument("--seed", type=int, default=0)
    cf.add_argument("--max-tokens", type=int, default=16, help="maxTokens")
    cf.add_argument("--keystrokes", type=int, default=3, metavar="N",
                    help="after each first answer, type the expected text's first N characters, a request each (keystroke cost; 0: none)")
    cf.add_argument("--no-jump", action="store_true", help="skip the jump after the keystrokes (a new line 30 lines above, a request there)")
    cf.add_argument("--model", default="default", help="the server's `model` setting")
    cf.add_argument("--config", action="append", default=[], metavar="JSON",
                    help='settings merged into every configuration, e.g. \'{"firstWindowTokens": 256}\' (a JSON object or a file holding one; repeatable)')
    cf.add_argument("--server", metavar="CMD", help="server command line (default: this Python's `efim serve --log-level warning`)")
    cf.add_argument("--threads", type=int, default=0, help="`efim serve --threads` (0 = its default)")
    cf.add_argument("--ready-timeout", type=float, default=900.0, metavar="S", help="seconds to wait for the model to load")
    cf.add_argument("--json", metavar="OUT", help="write the table's rows and every target's record as JSON")
    cf.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    cf.set_defaults(func=run_crossfile)


def _infiller(args: argparse.Namespace):
    import torch  # noqa: PLC0415

    from efim_tools.evaluation.infill import EngineInfiller, TransformersInfiller  # noqa: PLC0415
    from efim_tools.evaluation.model import export_merged, load_eval_model  # noqa: PLC0415

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.limit is not None and args.limit <= 0:
        raise ValueError("--limit must be positive")
    beams = getattr(args, "beams", 1)  # humaneval-infilling only
    if beams != 1 and args.backend != "transformers":
        raise ValueError("--beams runs on the transformers backend only")
    if args.quant is not None and args.backend != "engine":
        raise ValueError("--quant is the product engine's weight form: use it with --backend engine")
    if getattr(args, "prefill", None) is not None and args.quant is None:
        raise ValueError("--prefill is the served model's prefill form: use it with --backend engine --quant mixed")
    if args.backend == "llama.cpp":
        return _llama_cpp_infiller(args)
    if args.backend == "engine" and args.quant is not None:
        infiller = EngineInfiller.as_served(args.model, args.adapter, args.quant, threads=args.threads or None,
                                            prefill=getattr(args, "prefill", None))
        atexit.register(infiller.close)
        return infiller
    if args.backend == "engine":
        scratch = Path(tempfile.mkdtemp(prefix="efim-eval-merged-"))
        atexit.register(shutil.rmtree, scratch, ignore_errors=True)  # a merged model is ~0.5 GB
        folder = export_merged(args.model, args.adapter, scratch)
        infiller = EngineInfiller(folder, f"{args.model}+{args.adapter} (engine)", threads=args.threads or None)
        atexit.register(infiller.close)  # the engine thread ends before the interpreter does (else: 'terminate called ...')
        return infiller
    if beams != 1 and getattr(args, "split", "single-line") != "single-line":
        raise ValueError("--beams searches single lines: use it with --split single-line")
    return TransformersInfiller(load_eval_model(args.model, args.adapter), beams=beams)


def _llama_cpp_infiller(args: argparse.Namespace):
    """The model with its adapter exported to a q8_0 GGUF and served by llama.cpp's own
    `llama-server` (efim_tools/peers), asked through the product's `RemoteEngine`: token
    healing and the fresh-line rule travel as the server's grammar."""
    from efim_tools.evaluation.infill import EngineInfiller  # noqa: PLC0415
    from efim_tools.export import export_gguf  # noqa: PLC0415
    from efim_tools.peers.llama_cpp import SETUP_SCRIPT, LlamaServer, llama_cpp_bin  # noqa: PLC0415
    from engine.remote import RemoteEngine  # noqa: PLC0415

    if llama_cpp_bin() is None:
        raise ValueError(f"llama.cpp's llama-server is not built (run `bash {SETUP_SCRIPT}` or set EFIM_LLAMA_CPP_BIN)")
    folder = Path(tempfile.mkdtemp(prefix="efim-eval-gguf-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)  # registered first: runs after the server stops
    adapter = None if args.adapter == "none" else args.adapter
    gguf = export_gguf(folder / "model-q8_0.gguf", model=args.model, adapter=adapter, export_type="q8_0").path
    server = LlamaServer(gguf, slots=1, ctx_per_slot=4096, threads=args.threads or 2).start()
    engine = RemoteEngine("llama.cpp", server.url, model=str(gguf))
    infiller = EngineInfiller(gguf, f"{args.model}+{args.adapter} (llama.cpp)", engine=engine)
    atexit.register(server.stop)
    atexit.register(engine.close)  # runs first: the engine goes before its server
    return infiller


def _guards(args: argparse.Namespace) -> list[float]:
    from engine.api import DEFAULT_FRESH_LINE_GUARD  # noqa: PLC0415

    guards = args.fresh_line_guard or [DEFAULT_FRESH_LINE_GUARD]
    bad = [g for g in guards if not 0.0 < g <= 1.0]
    if bad:
        raise ValueError(f"--fresh-line-guard values must be in (0, 1]; got {bad}")
    return guards


def run_humaneval(args: argparse.Namespace) -> int:
    from efim_tools.evaluation import humaneval  # noqa: PLC0415
    from efim_tools.evaluation.sandbox import Limits  # noqa: PLC0415

    guards = _guards(args)
    tasks = humaneval.select(humaneval.load_tasks(args.split, args.data), args.limit, args.seed)
    infiller = _infiller(args)
    limits = Limits(wall_seconds=args.timeout, cpu_seconds=max(1, int(args.timeout)))
    variants = ([("off", guards[0])] if args.fresh_line in ("off", "both") else []) + (
        [("rule", g) for g in guards] if args.fresh_line in ("rule", "both") else [])
    for mode, guard in variants:
        res = humaneval.evaluate(infiller, tasks, args.split, args.format, heal=args.heal == "on", increment=args.increment, seed=args.seed, limits=limits,
                                 fresh_line=mode, fresh_line_guard=guard)
        rule = "off" if mode == "off" else f"rule (guard {guard:g}, set on {res.fresh_line}/{res.n})"
        if args.json:
            doc = {"split": res.split, "format": res.format, "n": res.n, "pass_at_1": res.pass_at_1, "blank": res.blank, "blank_rate": res.blank_rate,
                   "fresh_line": mode, "fresh_line_guard": guard if mode == "rule" else None, "fresh_line_set": res.fresh_line}
            if args.verbose_results:
                doc.update(model=_name(infiller), heal=res.heal, seconds=round(res.seconds, 1), results=[r._asdict() for r in res.results])
            print(json.dumps(doc), flush=True)
        else:
            print(f"{_name(infiller)} {res.split} {res.format} heal={'on' if res.heal else 'off'} fresh-line {rule}: pass@1 {res.pass_at_1:.3f}, "
                  f"blank answers {res.blank_rate:.1%} ({res.blank}/{res.n}) ({res.seconds:.0f} s)", flush=True)
    return 0


def run_blank_lines(args: argparse.Namespace) -> int:
    from efim_tools.evaluation.linecompletion import blank_line_cases, evaluate_blank_lines  # noqa: PLC0415

    guards = _guards(args)
    cases = blank_line_cases(n=args.limit or 100, seed=args.seed)
    infiller = _infiller(args)
    for sc in evaluate_blank_lines(infiller, cases, guards, heal=args.heal == "on"):
        if args.json:
            print(json.dumps({"task": "blank-lines", **sc._asdict(), "made_rate": sc.made_rate}), flush=True)
        else:
            print(f"{_name(infiller)} blank-lines fim guard {sc.guard:g}: rule set on {sc.fired}/{sc.n}; answers with text: {sc.non_blank_off} off, "
                  f"{sc.non_blank_on} on; made non-blank {sc.made_non_blank}/{sc.n} = {sc.made_rate:.1%} ({sc.seconds:.0f} s)", flush=True)
    return 0


def run_next_edit(args: argparse.Namespace) -> int:
    from efim_tools.evaluation.next_edit import DEFAULT_FILES, DEFAULT_PACKAGES, evaluate, samples  # noqa: PLC0415

    files = [f.strip() for f in args.files.split(",") if f.strip()] if args.files else list(DEFAULT_FILES)
    packages = [p.strip() for p in args.packages.split(",") if p.strip()] if args.packages is not None else list(DEFAULT_PACKAGES)
    try:
        cases = samples(files, seed=args.seed, per_category=args.per_category, packages=packages)
    except FileNotFoundError as exc:
        raise SystemExit(f"efim eval next-edit: {exc}") from None
    model = None
    if args.proposer in ("model", "rules+model"):
        from efim_tools.evaluation.infill import EngineInfiller  # noqa: PLC0415
        from efim_tools.evaluation.next_edit_model import ModelProposer  # noqa: PLC0415

        try:
            infiller = EngineInfiller.as_served(args.model, args.adapter, args.quant)
        except (OSError, ValueError) as exc:
            raise SystemExit(f"efim eval next-edit: {exc}") from None
        model = ModelProposer(infiller.engine)
    try:
        scores, seconds = evaluate(cases, args.proposer, model)
    finally:
        if model is not None:
            infiller.close()
    latency = {}
    if model is not None and model.latencies_ms:
        ms = sorted(model.latencies_ms)
        latency = {"answers": len(ms), "probes": model.probes, "p50_ms": round(ms[len(ms) // 2], 1),
                   "p99_ms": round(ms[min(len(ms) - 1, int(len(ms) * 0.99))], 1)}
    if args.json:
        print(json.dumps({"task": "next-edit", "proposer": args.proposer, "files": files, "packages": packages, "seed": args.seed,
                          "adapter": args.adapter if model is not None else None,
                          "categories": {k: v._asdict() for k, v in scores.items()},
                          "ms_per_sample": round(1000 * seconds / max(1, len(cases)), 3), "model_latency": latency}))
        return 0
    print(f"next-edit, proposer {args.proposer}, files {', '.join(files)}, packages {', '.join(packages) or '-'}, seed {args.seed}"
          + (f", adapter {args.adapter}" if model is not None else ""))
    print(f"{'category':<14}{'n':>5}{'exact':>8}{'location':>10}{'edit sim':>10}{'silent':>8}")
    for category, s in scores.items():
        print(f"{category:<14}{s.n:>5}{s.exact:>8.3f}{s.location:>10.3f}{s.similarity:>10.3f}{s.silent:>8.3f}")
    print(f"{1000 * seconds / max(1, len(cases)):.2f} ms per sample" + (" (the proposer alone)" if model is None else ""))
    if latency:
        print(f"model answers: {latency['answers']} ({latency['probes']} probes), p50 {latency['p50_ms']} ms, p99 {latency['p99_ms']} ms "
              "(first probe to decision; the document's prompt resident)")
    return 0


def run_lines(args: argparse.Namespace) -> int:
    from efim_tools.evaluation.linecompletion import evaluate_lines, line_cases  # noqa: PLC0415

    windows = []
    for spec in args.windows:
        before, sep, after = spec.partition(":")
        if not sep or not before.isdigit() or not after.isdigit():
            raise SystemExit(f"--windows: {spec!r} is not BEFORE:AFTER in characters (e.g. 1500:600)")
        windows.append((int(before), int(after)))
    infiller = _infiller(args)
    for before, after in windows:
        cases = line_cases(n=args.limit or 100, seed=args.seed, prefix_chars=before, suffix_chars=after)
        score = evaluate_lines(infiller, cases, args.format, heal=args.heal == "on")
        window = f"{before}:{after}"
        if args.json:
            print(json.dumps({"task": "lines", "window": window, "format": score.format, "heal": score.heal, "n": score.n,
                              "exact_match": score.exact_match, "edit_similarity": score.edit_similarity}))
        else:
            print(f"{_name(infiller)} lines {score.format} heal={'on' if score.heal else 'off'} window {window}: exact "
                  f"{score.exact_match:.3f}, edit sim {score.edit_similarity:.3f} (n={score.n}, {score.seconds:.0f} s)", flush=True)
    return 0


def run_table(args: argparse.Namespace) -> int:
    import torch  # noqa: PLC0415

    from efim_tools.evaluation.table import markdown, run_table  # noqa: PLC0415

    if args.threads:
        torch.set_num_threads(args.threads)
    rows = run_table(args.model, args.adapters, base=not args.skip_base, split=args.split, limit=args.limit, line_limit=args.line_limit, data=args.data, seed=args.seed, out_jsonl=args.jsonl)
    print(markdown(rows))
    return 0


def run_shape(args: argparse.Namespace) -> int:
    from efim_tools.evaluation.shape import evaluate_shape, next_code_line, parses, shape_cases  # noqa: PLC0415

    if args.backend != "engine":
        raise ValueError("efim eval shape runs through the product engine: pass --backend engine")
    cases = shape_cases(n=args.limit or 200, seed=args.seed)
    infiller = _infiller(args)
    shown = []

    def keep(mode, case, text):
        accepted = case.before + case.indent + text + case.after
        if len(shown) < args.show and (not parses(accepted) or text.split("\n")[-1].strip() == next_code_line(case.after)):
            shown.append((mode, case, text))

    for sc in evaluate_shape(infiller.engine, cases, tuple(args.modes), on_case=keep):
        k = max(sc.shown, 1)
        if args.json:
            print(json.dumps({"task": "shape", **sc._asdict()}), flush=True)
        else:
            print(f"{_name(infiller)} shape mode={sc.mode} post-processing={'on' if sc.post else 'off'}: shown {sc.shown}/{sc.n} (multi-line {sc.multi_line}, fresh-line rule on {sc.fresh_line}); "
                  f"unparseable {sc.unparseable} ({sc.unparseable / k:.1%}), duplicates the next line {sc.duplicate} ({sc.duplicate / k:.1%}) ({sc.seconds:.0f} s)", flush=True)
    for mode, case, text in shown:
        print(f"--- {mode} {case.module}:{case.line_no} (was {case.original!r})\n{case.indent}{text}\n--- next: {next_code_line(case.after)!r}")
    return 0


def _name(infiller) -> str:
    return infiller.name


def _ints(option: str, value: str | None) -> list[int] | None:
    if value is None:
        return None
    try:
        return [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"efim eval crossfile: {option} {value!r}: comma-separated integers expected") from None


def run_crossfile(args: argparse.Namespace) -> int:
    import asyncio  # noqa: PLC0415
    import shlex  # noqa: PLC0415
    import sys  # noqa: PLC0415
    import time  # noqa: PLC0415

    from efim_tools.commands.replay import parse_config  # noqa: PLC0415
    from efim_tools.evaluation import crossfile as cf  # noqa: PLC0415
    from efim_tools.trace.client import ServerCrashed  # noqa: PLC0415
    from efim_tools.trace.replay import ModelFailed  # noqa: PLC0415

    if args.limit <= 0:
        raise SystemExit("efim eval crossfile: --limit must be positive")
    if args.keystrokes < 0:
        raise SystemExit("efim eval crossfile: --keystrokes must be 0 or more")
    try:
        extra = {"maxTokens": args.max_tokens, **({"model": args.model} if args.model != "default" else {}), **parse_config(args.config)}
        configs = cf.configurations([c.strip() for c in args.configs.split(",") if c.strip()],
                                    _ints("--chunks", args.chunks), _ints("--context-tokens", args.context_tokens), extra)
        packages = [cf.resolve_package(p.strip()) for p in args.packages.split(",") if p.strip()]
    except ValueError as exc:
        raise SystemExit(f"efim eval crossfile: {exc}") from None
    if not packages or not configs:
        raise SystemExit("efim eval crossfile: --packages and --configs must name at least one each")
    from efim_tools.training.crossfile import TRAINING_PACKAGES  # noqa: PLC0415

    trained = [p.name for p in packages if p.name in TRAINING_PACKAGES]
    if trained:  # the shipped adapter's cross-file round read their lines: not held out
        print(f"note: {', '.join(trained)} trained on by the adapter's cross-file round (not held out)", file=sys.stderr)
    server = shlex.split(args.server) if args.server else [sys.executable, "-m", "efim_tools.cli", "serve", "--log-level", "warning"]
    if args.threads:
        server += ["--threads", str(args.threads)]

    drawn = []
    for package in packages:
        targets = cf.find_targets(package, args.limit, args.seed)
        if not targets:
            print(f"efim eval crossfile: package {package.name} ({package.root}) has no targets (no line uses a name another of its "
                  f"{len(package.files)} modules defines before the name appears in its own file); skipped", file=sys.stderr)
        else:
            drawn.append((package, targets))
    if not drawn:
        raise SystemExit("efim eval crossfile: no package has targets")

    def progress(message: str) -> None:
        if not args.quiet:
            print(message, file=sys.stderr, flush=True)

    records, rows, indexes = [], [], {}
    for config in configs:
        mine = []
        for package, targets in drawn:
            progress(f"[{config.name} / {package.name}] {len(targets)} targets: starting the server...")
            start = time.perf_counter()
            try:
                got, index = asyncio.run(cf.run_package(package, targets, config, server, ready_timeout_s=args.ready_timeout,
                                                        keystrokes=args.keystrokes, jump=not args.no_jump))
            except (ServerCrashed, ModelFailed, TimeoutError) as exc:
                raise SystemExit(f"efim eval crossfile: [{config.name} / {package.name}] {exc}") from None
            indexes[f"{config.name}/{package.name}"] = index
            ready = f" (index and chunk KV ready after {index['readyS']} s)" if isinstance(index, dict) and "readyS" in index else ""
            progress(f"[{config.name} / {package.name}] done in {time.perf_counter() - start:.0f} s{ready}")
            rows.append(cf.summarize(config.name, package.name, got))
            mine += got
        if len(drawn) > 1:
            rows.append(cf.summarize(config.name, "all", mine))
        records += mine

    settings = {k: v for k, v in configs[0].settings.items() if k != "context"}
    print(f"efim eval crossfile: seed {args.seed}, {', '.join(f'{p.name} ({len(t)} targets of {p.root})' for p, t in drawn)}; "
          f"settings {json.dumps(settings, sort_keys=True)} (the server's defaults otherwise); a fresh server per package and configuration")
    print(cf.table(rows))
    if args.json:
        doc = {"task": "crossfile", "seed": args.seed, "limit": args.limit, "settings": settings,
               "packages": [{"name": p.name, "root": str(p.root), "modules": len(p.files), "targets": len(t)} for p, t in drawn],
               "configs": [c._asdict() for c in configs], "context_index": indexes,
               "rows": [r._asdict() for r in rows], "records": [r._asdict() for r in records]}
        Path(args.json).write_text(json.dumps(doc, indent=1), encoding="utf-8")
    return 0
