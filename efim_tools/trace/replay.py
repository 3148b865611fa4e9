"""Replaying typing traces through a real language-server subprocess.

One configuration = one fresh server process (`efim serve` unless told otherwise),
started with the configuration's settings as `initializationOptions`, waited on until
its model is ready, then fed the traces by `users` concurrent simulated people
(`person.Person`: what each does with each event is described there).

With `request_stats` (one user, answers awaited) each request also gets its own share
of the server's counters and its server-side TTFT (`probe.RequestProbe`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shlex
import shutil
import sys
import tempfile
import time
from typing import Any, Callable, Literal, NamedTuple

import msgspec

from efim_tools.trace.client import LspClient, ResponseError, ServerCrashed, measured_server_env
from efim_lsp.trace_format import Trace
from efim_tools.trace.person import Moment, Observer, Outcome, Person, RequestRecord, Stage
from efim_tools.trace.probe import RequestProbe

__all__ = [
    "STANDARD_CONFIGS", "Config", "ConfigResult", "ModelFailed", "Moment", "Observer", "Outcome",
    "ReplayOptions", "RequestRecord", "replay_config", "replay_configs", "wait_ready",
]

log = logging.getLogger(__name__)

Speed = Literal["realtime", "max", "paced"]

STANDARD_CONFIGS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("fim-nocache", {"promptFormat": "fim", "cache": False}),
    ("fim", {"promptFormat": "fim", "cache": True}),
    ("efim", {"promptFormat": "efim", "cache": True}),
)


class ModelFailed(RuntimeError):
    """The server reports that its model could not be loaded."""


def default_server_command() -> list[str]:
    return [sys.executable, "-m", "efim_tools.cli", "serve"]


def parse_server_command(command: str | None) -> list[str]:
    return shlex.split(command) if command else default_server_command()


class Config(NamedTuple):
    name: str
    settings: dict[str, Any]


class ReplayOptions(NamedTuple):
    server: list[str]
    users: int = 1
    speed: Speed = "max"
    limit: int | None = None
    accept: bool = True
    ready_timeout_s: float = 900.0
    request_timeout_s: float = 300.0
    env: dict[str, str] | None = None
    request_stats: bool = False  # per-request server numbers (serial replays only)


class ConfigResult(msgspec.Struct, kw_only=True):
    name: str
    settings: dict[str, Any]
    records: list[RequestRecord] = []
    wall_s: float = 0.0
    ready_s: float = 0.0
    stats_before: dict[str, Any] | None = None
    stats_after: dict[str, Any] | None = None
    accepts: int = 0
    accepted_chars: int = 0
    typed_chars: int = 0  # characters the replayed person typed by hand (accepted ones excluded)
    accepting: bool = True  # the person accepted matching suggestions (ReplayOptions.accept)
    cancels_sent: int = 0
    crashed: str | None = None  # exit message and stderr tail
    server_returncode: int | None = None
    # counter deltas over the traces' first requests (serial replays; see ColdStartProbe)
    first_requests: dict[str, float] | None = None
    # sha1 of each document's text as this client last held it, by "trace name:uri"
    # (lets tests check that accepted suggestions left the same text as typing would)
    final_digests: dict[str, str] = {}


def client_capabilities(encoding: str) -> dict[str, Any]:
    return {
        "general": {"positionEncodings": [encoding]},
        "textDocument": {
            "synchronization": {"dynamicRegistration": False, "didSave": False, "willSave": False},
            "inlineCompletion": {"dynamicRegistration": False},
            "completion": {"dynamicRegistration": False, "completionItem": {"snippetSupport": False}},
        },
        "window": {"workDoneProgress": True},
        "workspace": {"configuration": False, "workspaceFolders": False},
    }


async def wait_ready(client: LspClient, timeout_s: float) -> dict[str, Any] | None:
    """Block until the server's model is loaded; return its first `efim/stats` (if any).

    Ready means: `efim/stats` says `model.state == "ready"` (or `ready: true`), or every
    `$/progress` the server began has ended. A model that failed to load raises with the
    server's message. A server with neither stats nor progress is taken as ready at once."""
    deadline = time.perf_counter() + timeout_s
    has_stats = True
    while True:
        stats = None
        if has_stats:
            try:
                stats = await client.request("efim/stats", None)
            except ResponseError:
                has_stats = False
        model = stats.get("model") if isinstance(stats, dict) else None
        if isinstance(model, dict) and "state" in model:
            if model["state"] == "ready":
                return stats
            if model["state"] == "failed":
                raise ModelFailed(f"the server's model failed to load: {model.get('error')}\n{client.stderr_tail()}")
        elif isinstance(stats, dict) and "ready" in stats:
            if stats["ready"]:
                return stats
        elif client.progress_created:
            if all(t in client.progress_ended for t in client.progress_created):
                return stats
        elif not has_stats:
            return None
        if time.perf_counter() > deadline:
            raise TimeoutError(f"server not ready after {timeout_s:.0f} s; stderr tail:\n{client.stderr_tail()}")
        await client.wait_progress_change(0.25)


async def settled_stats(client: LspClient, timeout_s: float = 3.0) -> dict[str, Any] | None:
    """`efim/stats` once its token counters stop moving: a stream stopped early (the
    suggestion was complete, or it was cancelled) is accounted when the engine's
    terminal event arrives, a moment after the answer went out."""
    keys = ("promptTokens", "prefilledTokens", "reusedTokens", "cancelled")
    deadline = time.perf_counter() + timeout_s
    previous = None
    while True:
        try:
            stats = await client.request("efim/stats", None)
        except ResponseError:
            return None
        if not isinstance(stats, dict):
            return None
        snapshot = tuple(stats.get(k) for k in keys)
        if snapshot == previous or time.perf_counter() > deadline:
            return stats
        previous = snapshot
        await asyncio.sleep(0.15)


COUNTERS = ("requests", "promptTokens", "reusedTokens", "prefilledTokens")


class ColdStartProbe:
    """Counter deltas over each trace's first completion request (a document's cold start:
    nothing of it is cached yet, whatever the configuration)."""

    def __init__(self, client: LspClient) -> None:
        self.client = client
        self.first: dict[str, float] = {key: 0.0 for key in COUNTERS}
        self.paused_s = 0.0
        self._before: dict[str, Any] | None = None

    async def _snapshot(self) -> dict[str, Any] | None:
        t = time.perf_counter()
        stats = await settled_stats(self.client)
        self.paused_s += time.perf_counter() - t
        return stats

    async def before_first(self) -> None:
        self._before = await self._snapshot()

    async def after_first(self) -> None:
        after = await self._snapshot()
        if isinstance(after, dict) and isinstance(self._before, dict):
            for key in COUNTERS:
                if isinstance(after.get(key), (int, float)) and isinstance(self._before.get(key), (int, float)):
                    self.first[key] += after[key] - self._before[key]
        self.first["traces"] = self.first.get("traces", 0) + 1


async def replay_config(config: Config, traces: list[Trace], options: ReplayOptions, observer: Observer = Observer()) -> ConfigResult:
    """Replay `traces` on a fresh server under `config`; never raises for a server crash
    (the result says `crashed` and keeps the records gathered so far)."""
    result = ConfigResult(name=config.name, settings=config.settings, accepting=options.accept)
    encoding = traces[0].header.position_encoding if traces else "utf-16"
    kv_dir = tempfile.mkdtemp(prefix="efim-replay-kv-")
    client = LspClient(options.server, env=measured_server_env(options.env, kv_dir), settings=config.settings)
    t_start = time.perf_counter()
    await client.start()
    try:
        await client.request(
            "initialize",
            {
                "processId": os.getpid(),
                "clientInfo": {"name": "efim replay", "version": "1"},
                "rootUri": None,
                "capabilities": client_capabilities(encoding),
                "initializationOptions": config.settings,
            },
        )
        await client.notify("initialized", {})
        ready = await wait_ready(client, options.ready_timeout_s)
        if ready is not None:
            # Zero the server's counters and latency series (a server that cannot reset
            # leaves them; deltas against this snapshot still hold, and a TTFT series with
            # samples from before the replay is not reported as the replay's own).
            await client.request("efim/stats", {"reset": True})
            ready = await client.request("efim/stats", None)
        result.stats_before = ready
        result.ready_s = time.perf_counter() - t_start
        jobs: asyncio.Queue = asyncio.Queue()
        copies = max(len(traces), options.users)
        for k in range(copies):
            jobs.put_nowait((traces[k % len(traces)], k // len(traces)))
        counter = [0]
        clock0 = time.perf_counter()

        # A serial replay can bracket each trace's first request with counter snapshots
        # (the time they take is kept out of the wall clock).
        serial = options.users == 1 and options.speed in ("max", "paced")
        request_probe = RequestProbe(client) if serial and options.request_stats else None
        probe = ColdStartProbe(client) if serial and options.speed == "max" and request_probe is None else None
        stage = Stage(client, options, result, clock0, observer, counter, probe, request_probe)

        async def person(user: int) -> None:
            while not jobs.empty():
                trace, copy = jobs.get_nowait()
                await Person(stage, trace, user, copy).run()

        workers = [asyncio.create_task(person(u)) for u in range(min(options.users, copies))]
        try:
            await asyncio.gather(*workers)
        finally:
            for w in workers:
                w.cancel()
        result.wall_s = time.perf_counter() - clock0 - (probe.paused_s if probe else 0.0)
        if request_probe is not None:
            result.wall_s -= request_probe.paused_s
        if probe is not None:
            result.first_requests = probe.first
        if request_probe is not None and request_probe.enabled:
            result.stats_after = await request_probe.finish()  # the segments' sum: stats were reset after each
        else:
            result.stats_after = await settled_stats(client)
    except (ServerCrashed, TimeoutError, ModelFailed) as exc:
        result.crashed = str(exc) if not isinstance(exc, ServerCrashed) else _crash_text(exc)
        if not result.wall_s:
            result.wall_s = max(0.0, time.perf_counter() - t_start - result.ready_s)
    finally:
        result.server_returncode = await client.close()
        shutil.rmtree(kv_dir, ignore_errors=True)
    return result


def _crash_text(exc: ServerCrashed) -> str:
    return f"server exited with code {exc.returncode}" + (f"\n--- stderr tail ---\n{exc.stderr_tail}" if exc.stderr_tail else "")


async def replay_configs(configs: list[Config], traces: list[Trace], options: ReplayOptions, observer: Observer = Observer(), on_config: Callable[[Config], None] | None = None) -> list[ConfigResult]:
    """Each configuration on its own fresh server, one after the other (never side by side:
    they would share the machine's two cores and distort each other)."""
    results = []
    for config in configs:
        if on_config:
            on_config(config)
        results.append(await replay_config(config, traces, options, observer))
    return results
