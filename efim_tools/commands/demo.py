"""`efim demo`: the main job in one command — a typing session replayed through `efim serve`.

1. Synthesise a short typing session from a CPython standard-library module on this
   machine (a function body blanked, then typed back like a person).
2. Replay it through a real `efim serve` subprocess on the embedded default model,
   printing each key press's line and the suggestion that came back for it.
3. Replay the first requests again under fim-nocache, fim and efim (each on a fresh
   server) and print the comparison table.

The default model gets its FIM sentinels from the shipped suffix-first adapter
(`adapter: "auto"`); `fimTokens: "add"` stays in the settings so that a model without any
sentinels (`--model` elsewhere) still shows FIM and EFIM (untrained: speed and reuse only).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import tempfile
from pathlib import Path

DIM, RESET = "\x1b[2m", "\x1b[0m"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="watch a typing session replayed through efim serve, then compare fim/efim")
    p.add_argument("--module", default="textwrap", help="standard-library module to retype a function of (default textwrap)")
    p.add_argument("--seed", type=int, default=1, help="which function, and how it is typed")
    p.add_argument("--model", default="default", help='model for the server (default: the embedded SmolLM2-135M)')
    p.add_argument("--limit", type=int, default=60, metavar="N", help="completion requests shown live (default 60)")
    p.add_argument("--compare-limit", type=int, default=10, metavar="N", help="requests per configuration in the comparison (default 10)")
    p.add_argument("--max-tokens", type=int, default=32, metavar="N", help="longest suggestion in tokens (default 32: snappy on a CPU)")
    p.add_argument("--no-compare", dest="compare", action="store_false", help="skip the comparison table")
    p.add_argument("--speed", choices=("max", "realtime"), default="max", help="max: next key when the answer arrives (default); realtime: a person's pace")
    p.add_argument("--server", metavar="CMD", help="server command line (default: this Python's `efim serve`)")
    p.set_defaults(func=run)


def module_path(name: str) -> Path:
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    for candidate in (root / (name.replace(".", "/") + ".py"), root / name.replace(".", "/") / "__init__.py"):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"no standard-library module {name!r} under {root}")


class LiveView:
    """Prints one line per answer: latency, the cursor's line, the suggestion after it."""

    def __init__(self, out=None) -> None:
        self.out = out or sys.stdout
        self.tty = self.out.isatty()
        self.width = shutil.get_terminal_size((100, 24)).columns

    def answer(self, moment) -> None:
        latency = f"{moment.latency_ms:7.0f} ms" if moment.latency_ms is not None else "      - ms"
        suggestion = moment.suggestion.replace("\r", "")
        first, _, rest = suggestion.partition("\n")
        if rest.strip():
            first += " ↵…"
        line = moment.line.replace("\t", "    ")
        room = max(20, self.width - len(latency) - 4 - min(len(first), self.width // 2))
        if len(line) > room:
            line = "…" + line[-(room - 1) :]
        shown = first[: max(0, self.width - len(latency) - 4 - len(line))]
        if self.tty:
            text = f"{latency}  {line}{DIM}{shown}{RESET}"
        else:
            text = f"{latency}  {line}│{shown}"
        print(text, file=self.out, flush=True)

    def accept(self, moment) -> None:
        print(f"{'':10}  ⇥ accepted {moment.accepted} characters of the suggestion", file=self.out, flush=True)


def run(args: argparse.Namespace) -> int:
    import asyncio

    from efim_tools.commands.replay import Progress
    from efim_tools.trace import report
    from efim_lsp.trace_format import write_trace
    from efim_tools.trace.replay import STANDARD_CONFIGS, Config, Observer, ReplayOptions, parse_server_command, replay_config
    from efim_tools.trace.synth import SynthOptions, synthesize

    source = module_path(args.module)
    (trace,) = synthesize([source], SynthOptions(seed=args.seed, sessions=1, min_chars=100, max_chars=260))
    folder = Path(tempfile.gettempdir()) / f"efim-demo-{os.getuid() if hasattr(os, 'getuid') else 'user'}"
    folder.mkdir(mode=0o700, exist_ok=True)
    trace_path = write_trace(folder / "demo-trace.jsonl", trace)
    meta = trace.header.meta
    settings = {"model": args.model, "fimTokens": "add", "maxTokens": args.max_tokens}
    out = sys.stdout
    print(
        f"efim demo: retyping {source.name}:{meta['function']} ({meta['body_chars']} characters, "
        f"{trace.completions} key presses at ~{meta['wpm'] * 5:.0f}/min, typos and all)\n"
        f"through `efim serve` (model {args.model}, promptFormat efim, fimTokens add, maxTokens {args.max_tokens}).\n"
        f"Trace: {trace_path}\n"
        f"Each line: answer time, the line up to the cursor, then the suggestion.\n",
        file=out,
        flush=True,
    )
    view = LiveView(out)
    server = parse_server_command(args.server)
    live = ReplayOptions(server=server, speed=args.speed, limit=args.limit)
    print("loading the model in the server...", file=sys.stderr, flush=True)
    first = asyncio.run(
        replay_config(Config("efim", {**settings, "promptFormat": "efim"}), [trace], live, Observer(view.answer, view.accept))
    )
    summary = report.summarize(first)
    if first.crashed:
        print(f"\nefim demo: the server stopped: {first.crashed}", file=sys.stderr)
        return 1
    print(
        f"\n{summary.requests} completion requests; answer time p50 {report.fmt_number(summary.latency_ms_p50, 0)} ms, "
        f"time to first token p50 {report.fmt_number(summary.ttft_ms_p50, 0)} ms (server); "
        f"reuse {report.fmt_number(summary.reuse_ratio, 3)}; {summary.accepts} suggestions accepted.",
        file=out,
        flush=True,
    )
    if not args.compare:
        return 0
    print(
        f"\nComparing configurations on the first {args.compare_limit} requests, each on a fresh server "
        f"(fim-nocache recomputes the whole prompt every key press)...",
        file=out,
        flush=True,
    )
    options = ReplayOptions(server=server, speed="max", limit=args.compare_limit)
    progress = Progress(True)
    results = []
    for name, config_settings in STANDARD_CONFIGS:
        config = Config(name, {**settings, **config_settings})
        progress.begin(name, min(trace.completions, args.compare_limit))
        result = asyncio.run(replay_config(config, [trace], options, Observer(on_request=progress.update)))
        progress.end(f"{len(result.records)} requests in {result.wall_s:.1f} s")
        results.append(result)
    print("\n" + report.table({r.name: report.summarize(r) for r in results}), file=out, flush=True)
    shown = {k: v for k, v in settings.items() if not (k == "model" and v == "default")}
    print(
        f"\nSame comparison from the command line:\n  efim replay {trace_path} --compare --limit {args.compare_limit} "
        f"--config {shlex.quote(json.dumps(shown))}",
        file=out,
        flush=True,
    )
    return 1 if any(r.crashed for r in results) else 0
