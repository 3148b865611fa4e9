"""`efim replay TRACE...`: replay typing traces through a real `efim serve` and compare configurations."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "replay",
        help="replay typing traces through a real server; --compare runs fim-nocache, fim and efim side by side",
        description=(
            "Replay typing traces (files or directories of *.jsonl) through a real `efim serve` "
            "subprocess over stdio, and report time to first token, latency, prefilled tokens, "
            "reuse and throughput."
        ),
    )
    p.add_argument("traces", nargs="+", metavar="TRACE", help="trace files, or directories of *.jsonl traces")
    p.add_argument("--server", metavar="CMD", help="server command line (default: this Python's `efim serve`)")
    p.add_argument(
        "--config", action="append", default=[], metavar="JSON",
        help='settings merged into every configuration, e.g. \'{"fimTokens": "add"}\' (a JSON object or a file holding one; repeatable)',
    )
    p.add_argument(
        "--compare", nargs="?", const="standard", choices=("standard", "navigation", "clients", "adapters"), metavar="SET",
        help="replay under several configurations, each on a fresh server: `standard` (the default set: "
        "fim-nocache, fim, efim) or `navigation` (today, warm-ahead, document-kv, all: the navigation settings "
        "warmAhead/documentKv off and on, paced replay, TTFT of the first request after each jump) or `clients` "
        "(tours by client style — plain, editor, insert-enter, ours, from each trace's header — each style's traces on a "
        "fresh server with the same settings, paced: the first answer after a jump per style and jump pattern, "
        "client side and server TTFT) or `adapters` "
        "(base: the model without its FIM adapter, adapter: with it — characters saved is the number to read)",
    )
    p.add_argument(
        "--adapters", nargs="+", metavar="ADAPTER",
        help="with --compare adapters: the `adapter` settings to compare ('none', 'auto' or a folder; "
        "default: none auto), each a configuration named after it",
    )
    p.add_argument("--users", type=int, default=1, metavar="N", help="traces replayed concurrently on one server (default 1)")
    p.add_argument(
        "--speed", choices=("realtime", "max", "paced"), default=None,
        help="realtime: keep the recorded gaps (a key press cancels the running request); "
        "max: next key as soon as the answer arrives (default); paced: wait for each answer and keep every "
        "recorded pause (default of --compare navigation and clients)",
    )
    p.add_argument("--limit", type=int, metavar="N", help="only the first N completion requests of each trace")
    p.add_argument("--no-accept", dest="accept", action="store_false", help="never accept suggestions (type every key)")
    p.add_argument("--json", metavar="OUT", help="write the summary as JSON")
    p.add_argument("--plot", metavar="OUT.png", help="plot per-keystroke TTFT per configuration (needs the `plot` extra)")
    p.add_argument("--ready-timeout", type=float, default=900.0, metavar="S", help="seconds to wait for the model to load")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    p.set_defaults(func=run)


# Quality, not speed: the same model with and without its shipped FIM adapter; the
# replayed person accepts what matches the next typed text (characters saved).
ADAPTER_CONFIGS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("base", {"adapter": "none"}),
    ("adapter", {"adapter": "auto"}),
)


def _adapter_config(adapter: str) -> tuple[str, dict[str, Any]]:
    """A configuration for one `--adapters` value, named "base", "adapter" (the shipped one)
    or the folder's name."""
    if adapter in ("none", "auto"):
        return ("base" if adapter == "none" else "adapter", {"adapter": adapter})
    folder = Path(adapter).expanduser()
    if not (folder / "adapter_config.json").is_file():
        raise ValueError(f"--adapters {adapter}: not an adapter folder (no adapter_config.json)")
    return (folder.resolve().name if folder.name != "adapter" else folder.resolve().parent.name, {"adapter": str(folder.resolve())})


def parse_config(values: list[str]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for value in values:
        text = value
        if not value.lstrip().startswith("{") and Path(value).is_file():
            text = Path(value).read_text(encoding="utf-8")
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--config {value!r} is not JSON: {exc}") from None
        if not isinstance(obj, dict):
            raise ValueError(f"--config {value!r} must be a JSON object")
        merged.update(obj)
    return merged


class Progress:
    """One self-overwriting line on a terminal; a line every ~10 % otherwise."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self.label = ""
        self.total = 0
        self.start = time.perf_counter()
        self.last = 0.0
        self.last_tenth = -1

    def begin(self, label: str, total: int) -> None:
        self.label, self.total, self.start, self.last_tenth = label, total, time.perf_counter(), -1
        if self.enabled:
            print(f"[{label}] starting server, waiting for the model...", file=sys.stderr, flush=True)

    def update(self, done: int) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        total = max(self.total, done)
        if self.tty:
            if now - self.last < 0.1 and done < total:
                return
            self.last = now
            width = 30
            filled = int(width * done / total) if total else width
            print(f"\r[{self.label}] [{'#' * filled}{'.' * (width - filled)}] {done}/{total} requests", end="", file=sys.stderr, flush=True)
        else:
            tenth = int(10 * done / total) if total else 10
            if tenth > self.last_tenth:
                self.last_tenth = tenth
                print(f"[{self.label}] {done}/{total} requests", file=sys.stderr, flush=True)

    def end(self, message: str) -> None:
        if self.enabled:
            print(("\r\x1b[K" if self.tty else "") + f"[{self.label}] {message}", file=sys.stderr, flush=True)


def planned_requests(traces, users: int, limit: int | None) -> int:
    copies = max(len(traces), users)
    total = 0
    for k in range(copies):
        n = traces[k % len(traces)].completions
        total += min(n, limit) if limit is not None else n
    return total


def execute(args: argparse.Namespace, observer=None, out=None) -> int:
    """Run the replay described by parsed `efim replay` arguments; print the table to `out`
    (stdout by default, looked up at call time)."""
    out = out or sys.stdout
    import asyncio

    from efim_lsp.trace_format import read_traces
    from efim_tools.trace.replay import STANDARD_CONFIGS, Config, Observer, ReplayOptions, parse_server_command, replay_config
    from efim_tools.trace import clients, navigation, report

    if args.users < 1:
        raise ValueError("--users must be at least 1")
    if args.adapters and args.compare != "adapters":
        raise ValueError("--adapters goes with --compare adapters")
    chosen = ADAPTER_CONFIGS if not args.adapters else tuple(_adapter_config(a) for a in args.adapters)
    if args.limit is not None and args.limit < 1:
        raise ValueError("--limit must be at least 1")
    if args.plot:
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:  # say so before minutes of replay, not after
            raise ValueError("--plot needs matplotlib: pip install 'efim-lsp[plot]'")
    traces = read_traces(args.traces)
    if not traces:
        raise ValueError("no traces to replay")
    extra = parse_config(args.config)
    navigating = args.compare == "navigation"
    by_client = args.compare == "clients"
    speed = args.speed or ("paced" if navigating or by_client else "max")
    runs = None  # (configuration, its traces); None: every configuration replays every trace
    if by_client:  # one configuration per client style, named after it, on that style's traces
        runs = [(Config(style, dict(extra)), group) for style, group in clients.group_by_style(traces).items()]
        configs = [config for config, _ in runs]
    elif navigating:  # the configuration's own switches win over --config
        styles = [s for s in clients.group_by_style(traces) if s in clients.CLIENT_STYLES]
        if len(styles) > 1:  # one server replays every trace: a style replayed after another would find its documents warm
            raise ValueError(
                f"--compare navigation measures server settings on one client style; these traces hold {', '.join(styles)}: "
                "pass one style's traces (e.g. tours/*-ours.jsonl) or use --compare clients"
            )
        configs = [Config(name, {**extra, **settings}) for name, settings in navigation.NAVIGATION_CONFIGS]
    elif args.compare == "adapters":
        configs = [Config(name, {**extra, **settings}) for name, settings in chosen]
    elif args.compare:
        configs = [Config(name, {**settings, **extra}) for name, settings in STANDARD_CONFIGS]
    else:
        configs = [Config("replay", {**traces[0].header.settings, **extra})]
    options = ReplayOptions(
        server=parse_server_command(args.server),
        users=args.users,
        speed=speed,
        request_stats=navigating or by_client,
        limit=args.limit,
        accept=args.accept,
        ready_timeout_s=args.ready_timeout,
    )
    progress = Progress(not args.quiet)
    runs = runs or [(config, traces) for config in configs]
    base = observer or Observer()
    watch = Observer(base.on_answer, base.on_accept, lambda n: (progress.update(n), base.on_request and base.on_request(n)))

    async def run_all():
        results = []
        for config, replayed in runs:
            progress.begin(config.name, planned_requests(replayed, args.users, args.limit))
            result = await replay_config(config, replayed, options, watch)
            summary = report.summarize(result)
            progress.end(
                f"{summary.requests} requests in {result.wall_s:.1f} s"
                + (" — server crashed" if result.crashed else "")
            )
            results.append(result)
        return results

    results = asyncio.run(run_all())
    if navigating:
        nav = {r.name: navigation.summarize_navigation(r) for r in results}
        print(navigation.table(nav), file=out, flush=True)
    elif by_client:
        styles = {r.name: clients.summarize_clients(r) for r in results}
        print(clients.table(styles), file=out, flush=True)
    else:
        summaries = {r.name: report.summarize(r) for r in results}
        print(report.table(summaries), file=out, flush=True)
    crashed = [r for r in results if r.crashed]
    for r in crashed:
        print(f"\nefim: config {r.name}: {r.crashed}", file=sys.stderr)
    if args.json:
        meta = {
            "traces": [t.path for t in traces],
            "users": args.users,
            "speed": speed,
            "limit": args.limit,
            "accept": args.accept,
            "server": options.server,
            "settings": {c.name: c.settings for c in configs},
            "argv": sys.argv,
        }
        if navigating:
            data = navigation.to_json(nav, meta)
        elif by_client:
            data = clients.to_json(styles, meta | {"traces_by_style": {c.name: [t.path for t in group] for c, group in runs}})
        else:
            data = report.to_json(summaries, meta)
        Path(args.json).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    if args.plot:
        report.plot(results, args.plot)
    return 1 if crashed else 0


def run(args: argparse.Namespace) -> int:
    return execute(args)
