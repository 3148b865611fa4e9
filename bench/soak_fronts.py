"""`efim bench soak --daemon`: several `efim serve --daemon` fronts typing through one engine daemon.

    .venv/bin/efim bench soak --daemon --fronts 4 --docs-per-front 2 --rate 10 --seconds 1800 \
        [--kv-budget 512MB] [--warmup 120] [--sample-s 10] [--switch '{"adapter": "none"}'] --out soak.json

What a person with several editor windows does for weeks, compressed: F fronts (each its
own `efim serve --daemon` over stdio, in a private XDG_RUNTIME_DIR, so they start and share
one fresh daemon) each type into D documents at K keys/s (`bench.soak`'s typists: a block cut
out and typed back, a request per key, the superseded request cancelled, full-text changes,
closes and reopens). In the middle, two things every front is told by
`workspace/didChangeConfiguration`:

- at `--settings-change-at` (a fraction of `--seconds`): a settings change that keeps the
  engine (`--settings-change`, default `{"maxTokens": 48}`);
- at `--switch-at`: a model switch (`--switch`, default `{"adapter": "none"}`: the same
  weights without the FIM adapter — another engine configuration, so another daemon;
  a model path works too). The fronts reach (one of them starts) the new configuration's
  daemon; the old one exits after its idle timeout (`--daemon-idle-timeout`, 10 s here).
  "Settled" is when every front serves from the new daemon and the old one has exited.

Every `--sample-s` seconds the RSS (and PSS, where /proc/PID/smaps_rollup is readable) of
every front and every daemon is sampled. Memory is *stable* in a phase when every sample
stays within 10 % of the phase's reference: before the switch, the first sample at or after
`--warmup` s; after it, the first sample `--warmup` s after it settled (the new daemon's
KV pool fills again), each phase up to its end (the switch; the end of typing).

At the end (after a drain): every front's `efim/debug/checkIntegrity`, every document's
`efim/documentText` against the text the client typed, the fronts alive, no "went away"
message (no daemon died), then shutdown/exit of every front (exit codes) and the daemon's
own exit after its idle timeout. `--out X.json` writes the result and `X.png`, the memory
curve (`bench.soak_plot`, matplotlib).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.process_memory import alive, daemon_pids, kill_daemons, memory_mb
from bench.soak_typing import Request, SoakResult, Typist, stdlib_documents, summarise

STABLE_WITHIN = 0.10  # the target: RSS within 10 % of its post-warm-up value


@dataclass
class FrontsSoakOptions:
    fronts: int = 4
    docs_per_front: int = 2
    rate: float = 10.0  # keys per second per document
    seconds: float = 1800.0
    model: str = "default"
    warmup_s: float = 120.0
    sample_s: float = 10.0
    settings_change_at: float = 0.4  # fraction of `seconds`
    switch_at: float = 0.5  # fraction of `seconds`; None-like (>= 1) skips the switch
    settings_change: dict[str, Any] = field(default_factory=lambda: {"maxTokens": 48})
    switch: dict[str, Any] = field(default_factory=lambda: {"adapter": "none"})
    idle_timeout_s: float = 10.0  # the daemons' --daemon-idle-timeout
    settle_timeout_s: float = 600.0
    hang_s: float = 2.0
    drain_s: float = 10.0
    seed: int = 0
    full_change_every: int = 60
    reopen_every: int = 150
    block_chars: tuple[int, int] = (200, 600)
    settings: dict[str, Any] = field(default_factory=dict)  # initializationOptions
    server_args: tuple[str, ...] = ()
    env: dict[str, str] | None = None
    ready_timeout_s: float = 600.0


@dataclass
class FrontsSoakResult(SoakResult):
    fronts: int = 0
    samples: list[dict[str, Any]] = field(default_factory=list)  # {t, rss_mb, pss_mb, processes: {label: rss}, engine_kv_mb}
    events: list[tuple[float, str]] = field(default_factory=list)  # (s since typing began, what)
    daemons: list[int] = field(default_factory=list)  # every daemon pid seen, in order
    switch_settled_s: float | None = None  # since typing began
    switch_took_s: float | None = None  # from the switch to settled
    memory: dict[str, Any] = field(default_factory=dict)  # per phase: reference, max deviation, stable
    documents_intact: bool = False
    document_mismatches: list[str] = field(default_factory=list)
    fronts_alive: list[bool] = field(default_factory=list)
    exit_codes: list[int | None] = field(default_factory=list)
    messages: list[list[str]] = field(default_factory=list)  # window/showMessage per front
    daemon_died: int = 0  # "went away" messages: a daemon lost while serving
    daemons_left: list[int] = field(default_factory=list)  # daemons still running idle_timeout + 10 s after the fronts exited
    declined: dict[str, int] = field(default_factory=dict)  # the fronts' efim/stats "declined", summed
    daemon_errors: list[str] = field(default_factory=list)  # the daemons' logged ERROR lines (the logs go with the run)
    log_tails: dict[str, str] = field(default_factory=dict)  # when something failed: the daemons' logs
    png: str | None = None

    @property
    def ok(self) -> bool:
        phases = self.memory.get("phases", [])
        return (super().ok and self.documents_intact and all(self.fronts_alive) and self.daemon_died == 0
                and not self.declined.get("engineError") and not self.daemon_errors
                and all(code == 0 for code in self.exit_codes) and not self.daemons_left
                and all(p.get("stable") for p in phases))


def _private_rundir() -> Path:
    """A short (socket paths have a 108-byte limit) private runtime directory."""
    path = Path(tempfile.mkdtemp(prefix="efs-"))
    os.chmod(path, 0o700)
    return path


async def _stats(client) -> dict:
    return await asyncio.wait_for(client.request("efim/stats", None), 30)


async def run_fronts_soak(options: FrontsSoakOptions) -> FrontsSoakResult:
    from efim_tools.trace.client import LspClient, ServerCrashed, measured_server_env  # noqa: PLC0415
    from efim_tools.trace.replay import ModelFailed, client_capabilities, wait_ready  # noqa: PLC0415

    result = FrontsSoakResult(options={k: v for k, v in asdict(options).items() if k != "env"}, fronts=options.fronts)
    rundir = _private_rundir()
    kv_dir = tempfile.mkdtemp(prefix="efim-soak-kv-")
    env = {**measured_server_env(options.env, kv_dir), "XDG_RUNTIME_DIR": str(rundir)}
    argv = [sys.executable, "-m", "efim_tools.cli", "serve", "--daemon", "--daemon-idle-timeout", str(options.idle_timeout_s),
            "--model", options.model, "--log-level", "warning", *options.server_args]
    clients = [LspClient(argv, env=env, settings=options.settings) for _ in range(options.fronts)]
    result.messages = [[] for _ in clients]
    for client, shown in zip(clients, result.messages):
        client.on_notification("window/showMessage", lambda params, s=shown: s.append(str((params or {}).get("message"))))
    requests: list[Request] = []
    typists: list[tuple[int, Typist]] = []
    t_start = time.perf_counter()
    t0 = t_start
    try:
        for client in clients:
            await client.start()
        for client in clients:
            await client.request("initialize", {
                "processId": os.getpid(), "clientInfo": {"name": "efim bench soak --daemon", "version": "1"}, "rootUri": None,
                "capabilities": client_capabilities("utf-16"), "initializationOptions": options.settings})
            await client.notify("initialized", {})
        await asyncio.gather(*(wait_ready(c, options.ready_timeout_s) for c in clients))
        result.ready_s = time.perf_counter() - t_start
        rng = random.Random(options.seed)
        documents = stdlib_documents(options.fronts * options.docs_per_front, options.seed)
        for i, client in enumerate(clients):
            for uri, text in documents[i * options.docs_per_front:(i + 1) * options.docs_per_front]:
                uri = uri.replace("file:///soak/", f"file:///soak/front{i + 1}/")
                typists.append((i, Typist(client, uri, text, options, random.Random(rng.random()), requests, result)))
        for _, typist in typists:
            await typist.open()
        t0 = time.perf_counter()
        stop_at = t0 + options.seconds
        done = asyncio.Event()

        def at() -> float:
            return round(time.perf_counter() - t0, 2)

        def sample(engine_kv: dict[str, Any] | None = None) -> None:
            processes: dict[str, float] = {}
            rss_total = pss_total = 0.0
            pss_known = True
            serving = set(daemon_pids(rundir))  # and their forked standbys, counted in the memory
            for label, pid in [*((f"front{i + 1}", c.proc.pid) for i, c in enumerate(clients)),
                               *((f"{'daemon' if pid in serving else 'standby'} {pid}", pid)
                                 for pid in daemon_pids(rundir, forked_standbys=True))]:
                rss, pss = memory_mb(pid)
                if math.isnan(rss):
                    continue
                if label.startswith("daemon") and pid not in result.daemons:
                    result.daemons.append(pid)
                processes[label] = round(rss, 1)
                rss_total += rss
                pss_known = pss_known and not math.isnan(pss)
                pss_total += 0.0 if math.isnan(pss) else pss
            result.samples.append({"t": at(), "rss_mb": round(rss_total, 1),
                                   "pss_mb": round(pss_total, 1) if pss_known else math.nan, "processes": processes,
                                   **({"engine_kv_mb": engine_kv} if engine_kv else {})})

        async def engine_kv() -> dict[str, Any] | None:
            """The engine's own KV counts beside the memory samples (the daemon's, through the
            first front's efim/stats): KV stored (pool rows in use + retained) and working KV."""
            try:
                stats = await asyncio.wait_for(clients[0].request("efim/stats", None), 5)
            except Exception:  # noqa: BLE001 - a sample without it
                return None
            return {"stored": round(stats.get("cacheBytes", 0) / 2**20, 1), "working": round(stats.get("workingKvBytes", 0) / 2**20, 1)}

        async def sampler() -> None:
            while not done.is_set():
                sample(await engine_kv())
                try:
                    await asyncio.wait_for(done.wait(), options.sample_s)
                except asyncio.TimeoutError:
                    pass

        async def tell_all(changes: dict[str, Any]) -> None:
            for client in clients:
                await client.notify("workspace/didChangeConfiguration", {"settings": {"efim": changes}})

        async def timeline() -> None:
            if 0 < options.settings_change_at < 1:
                await asyncio.sleep(max(0.0, t0 + options.seconds * options.settings_change_at - time.perf_counter()))
                await tell_all(options.settings_change)
                result.events.append((at(), "settings change"))
            if not 0 < options.switch_at < 1:
                return
            await asyncio.sleep(max(0.0, t0 + options.seconds * options.switch_at - time.perf_counter()))
            old = {(await _stats(c))["engine"].get("daemon", {}).get("pid") for c in clients}
            switched = time.perf_counter()
            await tell_all(options.switch)
            result.events.append((at(), "model switch"))
            end = switched + options.settle_timeout_s
            while time.perf_counter() < end:
                states = [await _stats(c) for c in clients]
                serving = all(s["model"]["state"] == "ready" and s["engine"].get("state") == "running"
                              and s["engine"].get("daemon", {}).get("pid") not in old | {None} for s in states)
                if serving and not any(pid and alive(pid) for pid in old):
                    result.switch_settled_s = at()
                    result.switch_took_s = round(time.perf_counter() - switched, 2)
                    result.events.append((result.switch_settled_s, "switch settled"))
                    return
                await asyncio.sleep(0.5)
            result.events.append((at(), "switch did not settle"))

        sampling = asyncio.create_task(sampler())
        timing = asyncio.create_task(timeline())
        period = 1.0 / (options.rate * max(1, len(typists)))
        await asyncio.gather(*(t.run(t0 + k * period, stop_at) for k, (_, t) in enumerate(typists)))
        drain_until = time.perf_counter() + options.drain_s
        while time.perf_counter() < drain_until and any(not r.pending.future.done() for r in requests):
            await asyncio.sleep(0.05)
        await timing
        done.set()
        await sampling
        sample()
        result.rss_mb = [(s["t"], s["rss_mb"]) for s in result.samples]
        result.rss_end_mb = result.samples[-1]["rss_mb"]
        checks = []
        for client in clients:
            checks.append(await asyncio.wait_for(client.request("efim/debug/checkIntegrity", None), 120))
        result.integrity = {"ok": all(bool(c and c.get("ok")) for c in checks), "fronts": checks}
        for i, typist in typists:
            got = await clients[i].request("efim/documentText", {"textDocument": {"uri": typist.uri}})
            if not isinstance(got, dict) or got.get("text") != typist.text:
                result.document_mismatches.append(typist.uri)
        result.documents_intact = not result.document_mismatches
        every = [await _stats(c) for c in clients]
        for stats in every:
            for reason, n in (stats.get("declined") or {}).items():
                result.declined[reason] = result.declined.get(reason, 0) + n
        result.server_stats = {k: v for k, v in (every[0] or {}).items() if k != "documents"}
        result.fronts_alive = [c.proc.returncode is None for c in clients]
        result.alive = all(result.fronts_alive)
    except (ServerCrashed, ModelFailed, TimeoutError, asyncio.TimeoutError) as exc:
        result.crashed = f"{type(exc).__name__}: {exc}"
        result.fronts_alive = [c.proc is not None and c.proc.returncode is None for c in clients]
        result.alive = False
    finally:
        result.exit_codes = list(await asyncio.gather(*(c.close() for c in clients)))
        result.exit_code = next((code for code in result.exit_codes if code != 0), 0)
        result.daemons_left = await _wait_daemons_exit(rundir, options.idle_timeout_s + 10)
        result.daemon_died = sum("went away" in m for shown in result.messages for m in shown)
        for log_path in sorted((rundir / "efim").glob("*.log")):
            for line in log_path.read_text(errors="replace").splitlines():
                if " ERROR " in line and len(result.daemon_errors) < 50:
                    result.daemon_errors.append(line[:300])
        if result.crashed or result.daemon_died or result.daemons_left:
            result.log_tails = {p.name: p.read_text(errors="replace")[-3000:] for p in (rundir / "efim").glob("*.log")}
        kill_daemons(rundir)  # only what this run started
        shutil.rmtree(rundir, ignore_errors=True)
        shutil.rmtree(kv_dir, ignore_errors=True)
    summarise(result, requests, options)
    result.memory = memory_phases(result, options)
    return result


async def _wait_daemons_exit(rundir: Path, timeout: float) -> list[int]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        left = daemon_pids(rundir, forked_standbys=True)  # a standby left behind counts
        if not left:
            return []
        await asyncio.sleep(0.2)
    return daemon_pids(rundir, forked_standbys=True)


def memory_phases(result: FrontsSoakResult, options: FrontsSoakOptions) -> dict[str, Any]:
    """Each phase's reference sample and the largest deviation from it (RSS of all processes)."""
    samples = result.samples
    typing_end = options.seconds
    switch = next((t for t, what in result.events if what == "model switch"), None)
    phases = []

    def phase(name: str, ref_from: float, until: float) -> None:
        inside = [s for s in samples if ref_from <= s["t"] <= until]
        if not inside:
            phases.append({"phase": name, "from_s": ref_from, "until_s": until, "stable": None, "samples": 0,
                           "note": "no sample in the phase (too short)"})
            return
        ref = inside[0]["rss_mb"]
        worst = max(inside, key=lambda s: abs(s["rss_mb"] / ref - 1))
        deviation = worst["rss_mb"] / ref - 1
        phases.append({"phase": name, "from_s": inside[0]["t"], "until_s": until, "samples": len(inside),
                       "reference_mb": ref, "end_mb": inside[-1]["rss_mb"], "max_mb": max(s["rss_mb"] for s in inside),
                       "min_mb": min(s["rss_mb"] for s in inside), "max_deviation": round(deviation, 4),
                       "stable": abs(deviation) <= STABLE_WITHIN})

    phase("before the switch", options.warmup_s, switch if switch is not None else typing_end)
    if switch is not None:
        if result.switch_settled_s is None:
            phases.append({"phase": "after the switch", "stable": False, "note": "the switch did not settle"})
        else:
            phase("after the switch", result.switch_settled_s + options.warmup_s, typing_end)
    return {"within": STABLE_WITHIN, "phases": phases}


def table(r: FrontsSoakResult) -> str:
    o = r.options
    rows = [
        ("workload", f"{o['fronts']} fronts × {o['docs_per_front']} documents × {o['rate']:g} keys/s × {o['seconds']:g} s through "
                     f"one daemon, model {o['model']}"),
        ("fronts ready after", f"{r.ready_s:.1f} s"),
        ("events (s)", ", ".join(f"{what} {t:.1f}" for t, what in r.events) or "none"),
        ("switch took", f"{r.switch_took_s} s" if r.switch_took_s is not None else "-"),
        ("daemons seen", ", ".join(map(str, r.daemons))),
        ("keys / full-text changes / reopens / blocks cut", f"{r.keys} / {r.full_changes} / {r.reopens} / {r.blocks}"),
        ("requests sent / answered (with a suggestion) / -32800", f"{r.sent} / {r.answered} ({r.with_items}) / {r.cancelled}"),
        ("other errors / never answered", f"{', '.join(f'{k}: {v}' for k, v in sorted(r.errors.items())) or '0'} / {r.unanswered}"),
        (f"hangs (no answer within {o['hang_s']:g} s)", f"{r.hangs} (longest wait {r.max_wait_ms:.0f} ms)"),
        ("latency of answered, p50 / p99", f"{r.latency_ms.get('p50', math.nan):.1f} / {r.latency_ms.get('p99', math.nan):.1f} ms"),
        ("$/cancelRequest → -32800, p50 / p99", f"{r.cancel_latency_ms.get('p50', math.nan):.1f} / {r.cancel_latency_ms.get('p99', math.nan):.1f} ms"),
        ("declined by the fronts (engineError: the engine failed a request)",
         ", ".join(f"{k} {v}" for k, v in sorted(r.declined.items())) or "none"),
        ("ERROR lines in the daemons' logs", f"{len(r.daemon_errors)}" + (f" (first: {r.daemon_errors[0][:160]})" if r.daemon_errors else "")),
    ]
    for p in r.memory.get("phases", []):
        if p.get("samples"):
            rows.append((f"RSS {p['phase']} (from {p['from_s']:.0f} s, {p['samples']} samples)",
                         f"{p['reference_mb']:.0f} → {p['end_mb']:.0f} MB (min {p['min_mb']:.0f}, max {p['max_mb']:.0f}); "
                         f"max deviation {100 * p['max_deviation']:+.1f} %: {'within' if p['stable'] else 'NOT within'} 10 %"))
        else:
            rows.append((f"RSS {p['phase']}", p.get("note", "?")))
    rows += [
        ("integrity / documents as typed", f"{'ok' if r.integrity.get('ok') else 'FAILED'} / "
                                           f"{'ok' if r.documents_intact else 'MISMATCH ' + ', '.join(r.document_mismatches)}"),
        ("fronts alive / exit codes", f"{r.fronts_alive} / {r.exit_codes}"),
        ("daemon lost while serving ('went away' shown)", str(r.daemon_died)),
        ("daemons left after the idle timeout", str(r.daemons_left or "none")),
    ]
    if r.png:
        rows.append(("memory curve", r.png))
    if r.crashed:
        rows.append(("crashed", r.crashed.splitlines()[0]))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows) + f"\nresult: {'OK' if r.ok else 'FAILED'}"


def write(result: FrontsSoakResult, out: Path, plot: bool = True) -> None:
    """`out` (JSON) and, next to it, the memory curve as `out` with the suffix .png."""
    out = Path(out)
    out.write_text(json.dumps({**asdict(result), "ok": result.ok}, indent=1, default=str))  # first: a long run's numbers
    if plot:
        from bench.soak_plot import plot_memory  # noqa: PLC0415

        bands = [(p["from_s"], p["until_s"], p["reference_mb"]) for p in result.memory.get("phases", []) if p.get("samples")]
        o = result.options
        title = (f"efim bench soak --daemon: {o['fronts']} fronts × {o['docs_per_front']} documents × {o['rate']:g} keys/s, "
                 f"{o['model']} (band: reference ±10 %)")
        try:
            result.png = str(plot_memory(result.samples, result.events, out.with_suffix(".png"), title, bands))
        except RuntimeError as exc:  # no matplotlib: the JSON stands
            print(f"no plot: {exc}", file=sys.stderr)
            return
        out.write_text(json.dumps({**asdict(result), "ok": result.ok}, indent=1, default=str))


__all__ = ["FrontsSoakOptions", "FrontsSoakResult", "run_fronts_soak", "memory_phases", "table", "write"]
