"""`efim trace synth|info`: make typing traces from real source files, and inspect traces."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("trace", help="synthesise typing traces from source files; inspect traces")
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)

    s = actions.add_parser(
        "synth",
        help="blank function bodies in real files and type them back like a person",
        description=(
            "Pick function bodies (Python via ast; other languages by braces or indentation), blank "
            "them, and write traces of a person typing them back: skewed per-key delays with bursts "
            "and pauses, typos fixed with backspace, the odd jump away and back, a completion request "
            "after every key press."
        ),
    )
    s.add_argument("sources", nargs="+", metavar="SRC", help="source files (or directories of them)")
    s.add_argument("-o", "--output", required=True, metavar="OUT", help="a .jsonl file (one session) or a directory")
    s.add_argument("--seed", type=int, default=0, help="random seed (same seed, same traces)")
    s.add_argument("--sessions", type=int, default=1, metavar="N", help="number of sessions (one trace each)")
    s.add_argument("--wpm", type=float, default=50.0, metavar="W", help="typing speed, words of 5 keys a minute (default 50 = 250 keys/min)")
    s.add_argument("--typo-rate", type=float, default=0.03, metavar="R", help="chance a letter or digit is mistyped (default 0.03)")
    s.add_argument("--jump-rate", type=float, default=0.01, metavar="J", help="chance per key press of jumping away and back (default 0.01)")
    s.add_argument("--max-chars", type=int, default=700, metavar="C", help="longest body to retype, in characters (default 700)")
    s.add_argument("--min-chars", type=int, default=80, metavar="C", help="shortest body to retype (default 80)")
    s.set_defaults(func=run_synth)

    i = actions.add_parser("info", help="summarise traces (header, events, duration)")
    i.add_argument("traces", nargs="+", metavar="TRACE")
    i.set_defaults(func=run_info)


def output_paths(output: str, count: int, stem: str = "session") -> list[Path]:
    out = Path(output)
    if out.suffix == ".jsonl":
        if count != 1:
            raise ValueError(f"-o {output}: a .jsonl file holds one session; give a directory for --sessions {count}")
        out.parent.mkdir(parents=True, exist_ok=True)
        return [out]
    out.mkdir(parents=True, exist_ok=True)
    return [out / f"{stem}-{k:03d}.jsonl" for k in range(count)]


def run_synth(args: argparse.Namespace) -> int:
    from efim_lsp.trace_format import write_trace
    from efim_tools.trace.synth import SynthOptions, synthesize
    from efim_tools.trace.typist import TypingStyle

    options = SynthOptions(
        seed=args.seed,
        sessions=args.sessions,
        style=TypingStyle(wpm=args.wpm, typo_rate=args.typo_rate, jump_rate=args.jump_rate),
        min_chars=args.min_chars,
        max_chars=args.max_chars,
    )
    paths = output_paths(args.output, args.sessions)
    traces = synthesize(args.sources, options)
    for path, trace in zip(paths, traces):
        write_trace(path, trace)
        meta = trace.header.meta
        print(
            f"{path}: {Path(meta['file']).name}:{meta['function']} — {meta['body_chars']} chars, "
            f"{trace.completions} completion requests, {trace.events[-1].t / 1000:.0f} s of typing",
            file=sys.stderr,
        )
    return 0


def run_info(args: argparse.Namespace) -> int:
    from collections import Counter

    from efim_lsp.trace_format import read_traces

    for trace in read_traces(args.traces):
        h = trace.header
        kinds = Counter(e.kind for e in trace.events)
        duration = trace.events[-1].t / 1000 if trace.events else 0.0
        print(f"{trace.path}: {h.source} v{h.version} created {h.created}, {duration:.1f} s, "
              + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())))
        if h.settings:
            print(f"  settings: {h.settings}")
        if h.meta:
            print(f"  meta: {h.meta}")
    return 0
