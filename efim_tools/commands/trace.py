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
    t = s.add_argument_group(
        "navigation tours (--tour)",
        "instead of retyping one body: open 2-3 files and jump between their functions, editing a little at each "
        "stop (delete a line's tail at once or Backspace by Backspace and retype it, Enter and a new line, paste, "
        "undo), with a person's pauses; each tour is written once per client style (what the client tells the "
        "server at a jump); the first completion request after each jump is marked in the header",
    )
    t.add_argument("--tour", action="store_true", help="synthesise navigation tours (one trace per tour and client style)")
    t.add_argument("--visits", type=int, default=12, metavar="N", help="stops per tour (default 12)")
    t.add_argument("--files", type=int, default=3, metavar="N", help="files open in one tour (default 3)")
    t.add_argument("--same-file-rate", type=float, default=0.5, metavar="R", help="chance a jump stays in the same file (default 0.5)")
    t.add_argument("--settle", type=float, default=0.0, metavar="S", help="seconds the files are open before the first jump (a person who had them open a while; default 0)")
    t.add_argument("--no-pause-rate", type=float, default=0.3, metavar="R", help="chance the first key follows a jump at once (default 0.3)")
    t.add_argument("--undo-rate", type=float, default=0.3, metavar="R", help="chance a new line or paste is undone (default 0.3)")
    t.add_argument(
        "--client-styles", metavar="S,S",
        help="client styles to write each tour in (default: all): plain (didChange and inlineCompletion only), "
        "editor (plain, plus a textDocument/documentHighlight request where the cursor settles, as VS Code, Zed, "
        "Sublime and Emacs ask for highlights), insert-enter (like Neovim 0.12: also a completion request at the jump, before any edit), ours "
        "(efim/didMoveCursor at each jump, as our editor clients send it); files tour-NNN-STYLE.jsonl "
        "(tour-NNN.jsonl for one style)",
    )
    t.add_argument(
        "--late-open-rate", type=float, default=0.5, metavar="R",
        help="chance a file but the first is opened only when the tour first switches to it, like a file opened by "
        "go-to-definition (default 0.5; 0: every file open from the start, as tours were before client styles)",
    )
    t.add_argument(
        "--edit-mix", metavar="P=W,P=W",
        help="relative weights of the stops' first edits by pattern (tail-deleted, backspaces, new-line, paste), "
        "e.g. all four =1 to measure each pattern on as many jumps (default: 0.18, 0.27, 0.30, 0.25)",
    )
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

    if args.tour:
        return run_tour(args)
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


def parse_edit_mix(spec: str) -> tuple[tuple[str, float], ...]:
    """`tail-deleted=1,backspaces=1,new-line=1,paste=1` as (pattern, weight) pairs."""
    mix = []
    for part in spec.split(","):
        name, _, weight = part.strip().partition("=")
        try:
            mix.append((name.strip(), float(weight)))  # float("") when there is no "="
        except ValueError:
            raise ValueError(f"--edit-mix: {part.strip()!r} is not PATTERN=WEIGHT (e.g. new-line=1)") from None
    return tuple(mix)


def run_tour(args: argparse.Namespace) -> int:
    from efim_lsp.trace_format import write_trace
    from efim_tools.trace.tour import CLIENT_STYLES, TourOptions, synthesize_tours

    options = TourOptions(
        seed=args.seed,
        sessions=args.sessions,
        visits=args.visits,
        files=args.files,
        same_file_rate=args.same_file_rate,
        no_pause_rate=args.no_pause_rate,
        settle_ms=args.settle * 1000.0,
        undo_rate=args.undo_rate,
        client_styles=tuple(s.strip() for s in args.client_styles.split(",")) if args.client_styles else CLIENT_STYLES,
        late_open_rate=args.late_open_rate,
        edit_mix=parse_edit_mix(args.edit_mix) if args.edit_mix else (),
    ).check()
    styles = options.client_styles
    if Path(args.output).suffix == ".jsonl" and len(styles) > 1:
        raise ValueError(f"-o {args.output}: a .jsonl file holds one trace; give a directory for {len(styles)} client styles, or --client-styles with one")
    paths = [
        path.with_name(f"{path.stem}-{style}.jsonl") if len(styles) > 1 else path
        for path in output_paths(args.output, args.sessions, stem="tour")
        for style in styles
    ]
    for path, tour in zip(paths, synthesize_tours(args.sources, options)):
        write_trace(path, tour.trace)
        meta = tour.trace.header.meta
        jumps = meta["jumps"]
        paused = sum(1 for j in jumps if j["pause_ms"] >= 500.0)
        print(
            f"{path}: {tour.style}, {', '.join(Path(f).name for f in meta['files'])} — {len(jumps)} jumps "
            f"({sum(1 for j in jumps if j['switch'])} switching files, {paused} after a pause >= 0.5 s; "
            + ", ".join(f"{n} {p}" for p, n in meta["patterns"].items())
            + f"), {tour.trace.completions} completion requests, {tour.trace.events[-1].t / 1000:.0f} s",
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
