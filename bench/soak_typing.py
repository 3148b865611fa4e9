"""The soak's typists and its request bookkeeping (`bench.soak`: one front; `bench.soak_fronts`:
several fronts through the engine daemon).

A `Typist` is one open document: it cuts a block of a stdlib module out and types it back
one character per key, one `textDocument/inlineCompletion` per key, a `$/cancelRequest` for
the document's previous request while it is unanswered, now and then a full-text change or a
close and reopen; `typist.text` is what the client typed, to compare with the server's copy.
Every request is a `Request` whose outcome `record` sets when its answer arrives;
`summarise` counts them into a `SoakResult` (answered, -32800, errors, never answered,
hangs, latency percentiles).
"""

from __future__ import annotations

import asyncio
import random
import sysconfig
import time
from dataclasses import dataclass, field
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


class Request:
    __slots__ = ("pending", "cancelled_at", "outcome", "answered_at")

    def __init__(self, pending) -> None:
        self.pending = pending
        self.cancelled_at: float | None = None
        self.outcome: str | None = None  # "result", "items", "cancelled", "error:<code>", "crash"
        self.answered_at: float | None = None


class Typist:
    """One document: cut a block, type it back key by key, one request per key."""

    def __init__(self, client, uri: str, text: str, options, rng: random.Random, requests: list[Request], result: SoakResult):
        self.client, self.uri, self.text, self.options, self.rng = client, uri, text, options, rng
        self.requests, self.result = requests, result
        self.version = 0
        self.cursor = 0
        self.todo = ""  # what is left to type back
        self.last: Request | None = None

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
        request = Request(pending)
        pending.future.add_done_callback(lambda f, r=request: record(r, f))
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


def record(request: Request, future: asyncio.Future) -> None:
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


def summarise(result: SoakResult, requests: list[Request], options) -> None:
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


__all__ = ["STDLIB_MODULES", "REQUEST_CANCELLED", "SoakResult", "stdlib_documents", "Request", "Typist", "record", "summarise"]
