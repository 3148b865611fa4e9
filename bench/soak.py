"""`efim bench soak`: load and cancellation soak through the real `efim serve` over stdio.

    .venv/bin/efim bench soak [--docs 8] [--rate 10] [--seconds 60] [--model default] [--json]

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
import sysconfig
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.percentiles import percentile

# Moderately sized pure-Python modules present in every CPython install.
STDLIB_MODULES = (
    "textwrap.py", "shlex.py", "heapq.py", "fnmatch.py", "string.py", "copy.py", "bisect.py", "calendar.py",
    "difflib.py", "csv.py", "pprint.py", "dataclasses.py", "functools.py", "argparse.py", "configparser.py",
    "ftplib.py",
)
REQUEST_CANCELLED = -32800


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


@dataclass
class SoakResult:
    options: dict[str, Any]
    ready_s: float = 0.0
    sent: int = 0
    answered: int = 0  # with a result
    with_items: int = 0  # a result holding a suggestion
    cancelled: int = 0  # answered -32800
    errors: dict[str, int] = field(default_factory=dict)  # other error codes
    unanswered: int = 0  # no answer at all, after the drain
    hangs: int = 0  # no answer within hang_s of being sent
    cancels_sent: int = 0
    keys: int = 0
    full_changes: int = 0
    reopens: int = 0
    blocks: int = 0
    latency_ms: dict[str, float] = field(default_factory=dict)  # answered with a result
    cancel_latency_ms: dict[str, float] = field(default_factory=dict)  # $/cancelRequest → -32800
    max_wait_ms: float = 0.0
    rss_mb: list[tuple[float, float]] = field(default_factory=list)  # (s since typing began, MB)
    threads: list[tuple[float, float]] = field(default_factory=list)  # (s since typing began, server threads)
    rss_after_warmup_mb: float = float("nan")
    rss_end_mb: float = float("nan")
    integrity: dict[str, Any] = field(default_factory=dict)
    alive: bool = False
    exit_code: int | None = None
    server_stats: dict[str, Any] = field(default_factory=dict)
    crashed: str | None = None

    @property
    def ok(self) -> bool:
        return (self.crashed is None and self.alive and self.hangs == 0 and self.unanswered == 0 and not self.errors
                and self.answered + self.cancelled == self.sent and bool(self.integrity.get("ok")))


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


def stdlib_documents(n: int, seed: int) -> list[tuple[str, str]]:
    """(uri, text) of `n` documents built from stdlib modules at run time (cycled when n is
    larger than the list; copies get their own URI)."""
    from efim_tools.trace.synth import read_sources  # noqa: PLC0415

    root = Path(sysconfig.get_paths()["stdlib"])
    names = [m for m in STDLIB_MODULES if (root / m).is_file()]
    random.Random(seed).shuffle(names)
    sources = dict((p.name, text) for p, text in read_sources([root / m for m in names[: min(n, len(names))]]))
    out = []
    for i in range(n):
        name = names[i % len(names)]
        out.append((f"file:///soak/{i:02d}_{name}", sources[name].replace("\r\n", "\n").replace("\r", "\n")))
    return out


def _position(text: str, offset: int) -> dict[str, int]:
    """LSP position (UTF-16 code units) of a code-point offset."""
    line = text.count("\n", 0, offset)
    start = text.rfind("\n", 0, offset) + 1
    return {"line": line, "character": len(text[start:offset].encode("utf-16-le")) // 2}


class _Request:
    __slots__ = ("pending", "cancelled_at", "outcome", "answered_at")

    def __init__(self, pending) -> None:
        self.pending = pending
        self.cancelled_at: float | None = None
        self.outcome: str | None = None  # "result", "items", "cancelled", "error:<code>", "crash"
        self.answered_at: float | None = None


class _Typist:
    """One document: cut a block, type it back key by key, one request per key."""

    def __init__(self, client, uri: str, text: str, options: SoakOptions, rng: random.Random, requests: list[_Request], result: SoakResult):
        self.client, self.uri, self.text, self.options, self.rng = client, uri, text, options, rng
        self.requests, self.result = requests, result
        self.version = 0
        self.cursor = 0
        self.todo = ""  # what is left to type back
        self.last: _Request | None = None

    async def open(self) -> None:
        self.version = 0
        await self.client.notify("textDocument/didOpen", {"textDocument": {"uri": self.uri, "languageId": "python", "version": 0, "text": self.text}})

    async def _change(self, changes: list[dict]) -> None:
        self.version += 1
        await self.client.notify("textDocument/didChange", {"textDocument": {"uri": self.uri, "version": self.version}, "contentChanges": changes})

    async def _cut_block(self) -> None:
        lo, hi = self.options.block_chars
        n = len(self.text)
        start = self.text.find("\n", self.rng.randrange(n // 5, max(n // 5 + 1, 4 * n // 5))) + 1
        end = self.text.find("\n", min(n, start + self.rng.randrange(lo, hi))) + 1 or n
        if end <= start:
            start, end = 0, min(n, hi)
        self.todo = self.text[start:end]
        rng_ = {"start": _position(self.text, start), "end": _position(self.text, end)}
        self.text = self.text[:start] + self.text[end:]
        self.cursor = start
        self.result.blocks += 1
        await self._change([{"range": rng_, "text": ""}])

    async def _cancel_last(self) -> None:
        last = self.last
        if last is not None and not last.pending.future.done():
            last.cancelled_at = time.perf_counter()
            if await self.client.cancel(last.pending):
                self.result.cancels_sent += 1

    async def key(self) -> None:
        if not self.todo:
            await self._cut_block()
        ch, self.todo = self.todo[0], self.todo[1:]
        at = _position(self.text, self.cursor)
        self.text = self.text[: self.cursor] + ch + self.text[self.cursor :]
        self.cursor += 1
        await self._change([{"range": {"start": at, "end": at}, "text": ch}])
        self.result.keys += 1
        await self._cancel_last()
        pending = await self.client.send_request("textDocument/inlineCompletion", {
            "textDocument": {"uri": self.uri}, "position": _position(self.text, self.cursor), "context": {"triggerKind": 2}})
        request = _Request(pending)
        pending.future.add_done_callback(lambda f, r=request: _record(r, f))
        self.requests.append(request)
        self.last = request
        self.result.sent += 1

    async def full_change(self) -> None:
        self.text += f"# soak edit {self.version + 1}\n"
        await self._change([{"text": self.text}])
        self.result.full_changes += 1

    async def reopen(self) -> None:
        await self._cancel_last()
        await self.client.notify("textDocument/didClose", {"textDocument": {"uri": self.uri}})
        await self.open()
        self.result.reopens += 1

    async def run(self, t0: float, stop_at: float) -> None:
        period = 1.0 / self.options.rate
        i = 0
        while True:
            due = t0 + i * period
            now = time.perf_counter()
            if due >= stop_at:
                return
            if due > now:
                await asyncio.sleep(due - now)
            elif now - due > period:  # behind (a loaded client): skip keys rather than burst
                i = int((now - t0) / period) + 1
                continue
            i += 1
            roll = self.rng.random()
            if roll < 1.0 / self.options.reopen_every:
                await self.reopen()
            elif roll < 1.0 / self.options.reopen_every + 1.0 / self.options.full_change_every:
                await self.full_change()
            await self.key()


def _record(request: _Request, future: asyncio.Future) -> None:
    request.answered_at = request.pending.received or time.perf_counter()
    if future.cancelled():
        request.outcome = "crash"
        return
    exc = future.exception()
    if exc is None:
        items = (future.result() or {}).get("items") if isinstance(future.result(), dict) else None
        request.outcome = "items" if items else "result"
        return
    code = getattr(exc, "code", None)
    if code is None:
        request.outcome = "crash"
    else:
        request.outcome = "cancelled" if code == REQUEST_CANCELLED else f"error:{code}"


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
    requests: list[_Request] = []
    try:
        await client.request("initialize", {
            "processId": os.getpid(), "clientInfo": {"name": "efim bench soak", "version": "1"}, "rootUri": None,
            "capabilities": client_capabilities("utf-16"), "initializationOptions": options.settings})
        await client.notify("initialized", {})
        await wait_ready(client, options.ready_timeout_s)
        result.ready_s = time.perf_counter() - t_start
        rng = random.Random(options.seed)
        typists = [_Typist(client, uri, text, options, random.Random(rng.random()), requests, result)
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
    _summarise(result, requests, options)
    return result


def _summarise(result: SoakResult, requests: list[_Request], options: SoakOptions) -> None:
    latencies, cancel_latencies = [], []
    for r in requests:
        sent = r.pending.sent
        waited = ((r.answered_at if r.outcome is not None else time.perf_counter()) - sent) * 1000
        result.max_wait_ms = max(result.max_wait_ms, waited)
        if r.outcome is None or r.outcome == "crash":
            result.unanswered += 1
            result.hangs += 1
            continue
        if waited > options.hang_s * 1000:
            result.hangs += 1
        if r.outcome in ("result", "items"):
            result.answered += 1
            result.with_items += r.outcome == "items"
            latencies.append(waited)
        elif r.outcome == "cancelled":
            result.cancelled += 1
            if r.cancelled_at is not None:
                cancel_latencies.append((r.answered_at - r.cancelled_at) * 1000)
        else:
            result.errors[r.outcome] = result.errors.get(r.outcome, 0) + 1
    result.max_wait_ms = round(result.max_wait_ms, 1)
    result.latency_ms = {"p50": round(percentile(latencies, 50), 1), "p99": round(percentile(latencies, 99), 1), "n": len(latencies)}
    result.cancel_latency_ms = {"p50": round(percentile(cancel_latencies, 50), 1), "p99": round(percentile(cancel_latencies, 99), 1),
                                "n": len(cancel_latencies)}


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


def run_cli(args: argparse.Namespace) -> int:
    options = SoakOptions(
        docs=args.docs, rate=args.rate, seconds=args.seconds, model=args.model, warmup_s=args.warmup, hang_s=args.hang_s,
        seed=args.seed, settings=json.loads(args.settings) if args.settings else {},
        server_args=(*(("--kv-budget", args.kv_budget) if args.kv_budget else ()), *shlex.split(args.serve_args)),
    )
    result = asyncio.run(run_soak(options))
    if args.json:
        print(json.dumps({**asdict(result), "ok": result.ok}, indent=1))
    else:
        print(table(result))
    return 0 if result.ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run_cli(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
