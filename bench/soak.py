"""`efim bench soak`: load and cancellation soak through the real `efim serve` over stdio.

    .venv/bin/efim bench soak [--docs 8] [--rate 10] [--seconds 60] [--model default] [--json]
    .venv/bin/efim bench soak --daemon --fronts 4 --docs-per-front 2 [--seconds 1800] [--out soak.json]

(`--daemon`: several fronts through one engine daemon, with a settings change and a model
switch in the middle: `bench.soak_fronts`.)

N documents (CPython stdlib modules read from this machine at run time, never copied into
the repository) are open at once; each is typed into by its own typist at K keys/s: a
block of the module is cut out (one incremental delete) and typed back one character per
key, one `textDocument/inlineCompletion` request per key, and a `$/cancelRequest` for the
document's previous request if it is still unanswered (as editors do). Now and then a
document gets a full-text `didChange` (the text plus a comment line at its end), and now
and then it is closed and opened again. When a block is typed back a new one is cut.

Measured (client side, `time.perf_counter()` around the pipe):
- requests sent, answered with a result, answered with -32800 (RequestCancelled), answered
  with any other error, never answered (after a drain of `--drain` s at the end);
- hangs: requests with no answer within `--hang-s` (default 2 s) of being sent;
- latency p50/p99 of the requests answered with a result (sent → answer), and of the
  cancellations (`$/cancelRequest` sent → the -32800 answer);
- the server's RSS (VmRSS of /proc/<pid>/status) once a second: the curve, its value at
  the end of the warm-up (`--warmup` s) and at the end;
- at the end: `efim/debug/checkIntegrity` (engine KV stores + every edit session against its
  document), the server's `efim/stats`, whether the process is still alive, and its exit
  code after shutdown/exit.

The exit status is 0 when nothing hung, every request was answered (a result or -32800),
the integrity check passed and the server was alive at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.soak_typing import REQUEST_CANCELLED, STDLIB_MODULES, Request, SoakResult, Typist, stdlib_documents, summarise  # noqa: F401 - re-exported

@dataclass
class SoakOptions:
    docs: int = 8
    rate: float = 10.0  # keys per second per document
    seconds: float = 60.0
    model: str = "default"
    warmup_s: float = 10.0
    hang_s: float = 2.0
    drain_s: float = 10.0
    seed: int = 0
    full_change_every: int = 60  # keys per document between full-text didChange, on average
    reopen_every: int = 150  # keys per document between close + reopen, on average
    block_chars: tuple[int, int] = (200, 600)  # size of a cut-and-retyped block
    settings: dict[str, Any] = field(default_factory=dict)  # initializationOptions
    server_args: tuple[str, ...] = ()  # extra `efim serve` flags, e.g. ("--kv-budget", "64MB")
    env: dict[str, str] | None = None
    ready_timeout_s: float = 600.0


def rss_mb(pid: int) -> float:
    return _status(pid, "VmRSS:") / 1024


def _status(pid: int, field_name: str) -> float:
    """A number from /proc/<pid>/status (VmRSS in kB, Threads); NaN once the process is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field_name):
                return int(line.split()[1])
    except OSError:
        pass
    return float("nan")


async def run_soak(options: SoakOptions) -> SoakResult:
    from efim_tools.trace.client import LspClient, ServerCrashed, measured_server_env  # noqa: PLC0415
    from efim_tools.trace.replay import ModelFailed, client_capabilities, wait_ready  # noqa: PLC0415

    result = SoakResult(options={k: v for k, v in asdict(options).items() if k != "env"})
    argv = [sys.executable, "-m", "efim_tools.cli", "serve", "--model", options.model, "--log-level", "warning", *options.server_args]
    kv_dir = tempfile.mkdtemp(prefix="efim-soak-kv-")  # a fresh server: no KV from earlier runs
    client = LspClient(argv, env=measured_server_env(options.env, kv_dir), settings=options.settings)
    t_start = time.perf_counter()
    await client.start()
    pid = client.proc.pid
    requests: list[Request] = []
    try:
        await client.request("initialize", {
            "processId": os.getpid(), "clientInfo": {"name": "efim bench soak", "version": "1"}, "rootUri": None,
            "capabilities": client_capabilities("utf-16"), "initializationOptions": options.settings})
        await client.notify("initialized", {})
        await wait_ready(client, options.ready_timeout_s)
        result.ready_s = time.perf_counter() - t_start
        rng = random.Random(options.seed)
        typists = [Typist(client, uri, text, options, random.Random(rng.random()), requests, result)
                   for uri, text in stdlib_documents(options.docs, options.seed)]
        for typist in typists:
            await typist.open()
        t0 = time.perf_counter()
        stop_at = t0 + options.seconds
        sampling = asyncio.Event()

        async def sample_rss() -> None:
            while not sampling.is_set():
                at = round(time.perf_counter() - t0, 2)
                result.rss_mb.append((at, round(rss_mb(pid), 1)))
                result.threads.append((at, _status(pid, "Threads:")))
                try:
                    await asyncio.wait_for(sampling.wait(), 1.0)
                except asyncio.TimeoutError:
                    pass

        sampler = asyncio.create_task(sample_rss())
        # Each typist starts at its own phase inside one key period (keys of different
        # documents interleave rather than arriving in bursts).
        phases = [t0 + k / (options.rate * max(1, options.docs)) for k in range(len(typists))]
        await asyncio.gather(*(t.run(p, stop_at) for t, p in zip(typists, phases)))
        # Drain: the last request of each document is never superseded; wait for everything.
        drain_until = time.perf_counter() + options.drain_s
        while time.perf_counter() < drain_until and any(not r.pending.future.done() for r in requests):
            await asyncio.sleep(0.05)
        sampling.set()
        await sampler
        result.rss_end_mb = round(rss_mb(pid), 1)
        result.rss_mb.append((round(time.perf_counter() - t0, 2), result.rss_end_mb))
        after = [mb for t, mb in result.rss_mb if t >= options.warmup_s]
        result.rss_after_warmup_mb = after[0] if after else float("nan")
        result.integrity = await asyncio.wait_for(client.request("efim/debug/checkIntegrity", None), 120)
        stats = await client.request("efim/stats", None)
        result.server_stats = {k: v for k, v in (stats or {}).items() if k != "documents"}
        result.alive = client.proc.returncode is None
    except (ServerCrashed, ModelFailed, TimeoutError, asyncio.TimeoutError) as exc:
        result.crashed = f"{type(exc).__name__}: {exc}"
        result.alive = client.proc.returncode is None
    finally:
        result.exit_code = await client.close()
        shutil.rmtree(kv_dir, ignore_errors=True)
    summarise(result, requests, options)
    return result


def table(r: SoakResult) -> str:
    o = r.options
    rows = [
        ("workload", f"{o['docs']} documents × {o['rate']:g} keys/s × {o['seconds']:g} s, model {o['model']}"),
        ("model ready after", f"{r.ready_s:.1f} s"),
        ("keys / full-text changes / reopens / blocks cut", f"{r.keys} / {r.full_changes} / {r.reopens} / {r.blocks}"),
        ("requests sent", f"{r.sent}"),
        ("answered (with a suggestion)", f"{r.answered} ({r.with_items})"),
        ("cancelled (-32800)", f"{r.cancelled} ({r.cancels_sent} $/cancelRequest sent)"),
        ("other errors", ", ".join(f"{k}: {v}" for k, v in sorted(r.errors.items())) or "0"),
        ("never answered", f"{r.unanswered}"),
        (f"hangs (no answer within {o['hang_s']:g} s)", f"{r.hangs} (longest wait {r.max_wait_ms:.0f} ms)"),
        ("latency of answered, p50 / p99", f"{r.latency_ms.get('p50', float('nan')):.1f} / {r.latency_ms.get('p99', float('nan')):.1f} ms"),
        ("$/cancelRequest → -32800, p50 / p99", f"{r.cancel_latency_ms.get('p50', float('nan')):.1f} / {r.cancel_latency_ms.get('p99', float('nan')):.1f} ms"),
        (f"RSS after {o['warmup_s']:g} s / at the end / max", f"{r.rss_after_warmup_mb:.1f} / {r.rss_end_mb:.1f} / "
                                                             f"{max((mb for _, mb in r.rss_mb), default=float('nan')):.1f} MB"),
        ("integrity check", "ok" if r.integrity.get("ok") else f"FAILED {r.integrity}"),
        ("server alive at the end / exit code", f"{r.alive} / {r.exit_code}"),
    ]
    if r.crashed:
        rows.append(("crashed", r.crashed.splitlines()[0]))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows) + f"\nresult: {'OK' if r.ok else 'FAILED'}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--docs", type=int, default=8, help="documents open and typed into at once (default: 8)")
    parser.add_argument("--rate", type=float, default=10.0, help="keys per second per document (default: 10)")
    parser.add_argument("--seconds", type=float, default=60.0, help="how long to type (default: 60)")
    parser.add_argument("--model", default="default", help="model folder, .gguf, or 'default' (SmolLM2-135M)")
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds before the 'after warm-up' RSS sample (default: 10)")
    parser.add_argument("--hang-s", type=float, default=2.0, help="a request unanswered this long is a hang (default: 2)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the documents, blocks and events (default: 0)")
    parser.add_argument("--kv-budget", default=None, help="passed to efim serve (default: its own)")
    parser.add_argument("--serve-args", default="", help="more `efim serve` flags, one string, e.g. '--no-kv-disk'")
    parser.add_argument("--settings", default=None, help="initializationOptions as JSON, e.g. '{\"maxTokens\": 16}'")
    parser.add_argument("--json", action="store_true", help="print one JSON object (with the RSS curve)")
    fronts = parser.add_argument_group("several fronts through the engine daemon (bench.soak_fronts)")
    fronts.add_argument("--daemon", action="store_true",
                        help="run --fronts `efim serve --daemon` fronts sharing one engine daemon (--docs is then ignored)")
    fronts.add_argument("--fronts", type=int, default=4, help="with --daemon: fronts (default: 4)")
    fronts.add_argument("--docs-per-front", type=int, default=2, help="with --daemon: documents each front types into (default: 2)")
    fronts.add_argument("--sample-s", type=float, default=10.0, help="with --daemon: seconds between memory samples (default: 10)")
    fronts.add_argument("--settings-change", type=json.loads, default={"maxTokens": 48},
                        help='with --daemon: settings every front is sent at --settings-change-at (default: {"maxTokens": 48})')
    fronts.add_argument("--settings-change-at", type=float, default=0.4, help="with --daemon: when, as a fraction of --seconds (0: never)")
    fronts.add_argument("--switch", type=json.loads, default={"adapter": "none"},
                        help='with --daemon: the model switch every front is sent at --switch-at (default: {"adapter": "none"})')
    fronts.add_argument("--switch-at", type=float, default=0.5, help="with --daemon: when, as a fraction of --seconds (0: never)")
    fronts.add_argument("--daemon-idle-timeout", type=float, default=10.0, help="with --daemon: the daemons' idle timeout (default: 10)")
    parser.add_argument("--out", type=Path, help="write the result as JSON here and the memory curve next to it (.png; needs the plot extra)")


def run_cli(args: argparse.Namespace) -> int:
    if getattr(args, "daemon", False):
        return _run_fronts_cli(args)
    options = SoakOptions(
        docs=args.docs, rate=args.rate, seconds=args.seconds, model=args.model, warmup_s=args.warmup, hang_s=args.hang_s,
        seed=args.seed, settings=json.loads(args.settings) if args.settings else {},
        server_args=(*(("--kv-budget", args.kv_budget) if args.kv_budget else ()), *shlex.split(args.serve_args)),
    )
    result = asyncio.run(run_soak(options))
    if getattr(args, "out", None):
        from bench.soak_plot import plot_memory  # noqa: PLC0415

        samples = [{"t": t, "rss_mb": mb, "processes": {}} for t, mb in result.rss_mb]
        plot_memory(samples, [], args.out.with_suffix(".png"), f"efim bench soak: {options.docs} documents × {options.rate:g} keys/s, "
                    f"{options.model} (the server's RSS)", [(options.warmup_s, options.seconds, result.rss_after_warmup_mb)])
        args.out.write_text(json.dumps({**asdict(result), "ok": result.ok}, indent=1))
    if args.json:
        print(json.dumps({**asdict(result), "ok": result.ok}, indent=1))
    else:
        print(table(result))
    return 0 if result.ok else 1


def _run_fronts_cli(args: argparse.Namespace) -> int:
    from bench import soak_fronts  # noqa: PLC0415

    if args.fronts < 1 or args.docs_per_front < 1 or args.sample_s <= 0:
        raise SystemExit("--fronts and --docs-per-front must be at least 1, --sample-s above 0")
    for name in ("settings_change", "switch"):
        if not isinstance(getattr(args, name), dict):
            raise SystemExit(f"--{name.replace('_', '-')} must be a JSON object of settings")
    options = soak_fronts.FrontsSoakOptions(
        fronts=args.fronts, docs_per_front=args.docs_per_front, rate=args.rate, seconds=args.seconds, model=args.model,
        warmup_s=args.warmup, sample_s=args.sample_s, settings_change_at=args.settings_change_at, switch_at=args.switch_at,
        settings_change=args.settings_change, switch=args.switch, idle_timeout_s=args.daemon_idle_timeout, hang_s=args.hang_s,
        seed=args.seed, settings=json.loads(args.settings) if args.settings else {},
        server_args=(*(("--kv-budget", args.kv_budget) if args.kv_budget else ()), *shlex.split(args.serve_args)),
    )
    result = asyncio.run(soak_fronts.run_fronts_soak(options))
    if args.out:
        soak_fronts.write(result, args.out)
    if args.json:
        print(json.dumps({**asdict(result), "ok": result.ok}, indent=1, default=str))
    else:
        print(soak_fronts.table(result))
    return 0 if result.ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run_cli(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
