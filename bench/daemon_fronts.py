"""Fronts sharing the engine daemon (`efim serve --daemon`) against one engine per front
(`--no-daemon`): memory of all processes together, and keystroke latency through one front.

    .venv/bin/efim bench daemon [--model default] [--fronts 1,3] [--keys 60] [--fair 20 [--rounds 3]] [--kill 2] [--hop 150] [--json OUT]

Memory: N fronts (`efim serve`, stdio, started together) open the same stdlib module and
each asks for one suggestion at the same place, one after the other (`firstWindowTokens: 0`,
so each computes or reuses the whole window); 3 s later the RSS and
PSS of every process (the fronts, and the daemon with `--daemon`) are summed from
/proc/PID/smaps_rollup. Each configuration runs with a fresh XDG_RUNTIME_DIR (so a fresh
daemon) and a fresh, empty KV disk directory. The later fronts' prefilled share of their
prompt is reported too (in process they can only start from the first front's KV files).

Latency: one front types a blanked function body back, one key at a time, waiting for each
answer (`bench.lsp_typing`'s keystrokes); client-measured time to each inline-completion
answer, p50 / p95 / p99, in process and through the daemon (the extra hop: the front's
request crosses a Unix socket and every streamed token crosses back).

`--fair RATE`: those keys typed alone, then again while a second front asks for a
suggestion at a random place of another module RATE times a second (instead of the plain
typing comparison); `--rounds N` repeats that with fresh fronts and daemon and pools the
rounds' answer times (the p99 of 400 keys is the 5th slowest answer, and it moves a lot
between runs). `--kill N`: N fronts, the daemon SIGKILLed, time until each serves
again. `--hop N`: the engine alone, in process vs through the daemon (no server).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from lsprotocol import types as t
from pygls.lsp.client import LanguageClient

from bench.lsp_typing import blank_function, plain, position
from bench.percentiles import percentile, percentiles
from bench.process_memory import daemon_pids, kill_daemons, memory_mb
from efim_tools.trace.keys import key_presses

MODULE, FUNCTION = "heapq.py", "_siftup"


class Front:
    def __init__(self, client: LanguageClient, uri: str) -> None:
        self.client = client
        self.uri = uri

    @property
    def pid(self) -> int:
        return self.client._server.pid  # noqa: SLF001 - pygls keeps the process there

    async def stats(self, reset: bool = False) -> dict:
        return plain(await self.client.protocol.send_request_async("efim/stats", {"reset": True} if reset else {}))

    async def ask(self, pos: t.Position) -> tuple[float, bool]:
        return await self.ask_at(self.uri, pos)

    async def ask_at(self, uri: str, pos: t.Position) -> tuple[float, bool]:
        started = time.perf_counter()
        result = await self.client.text_document_inline_completion_async(t.InlineCompletionParams(
            text_document=t.TextDocumentIdentifier(uri=uri), position=pos,
            context=t.InlineCompletionContext(trigger_kind=t.InlineCompletionTriggerKind.Automatic)))
        return (time.perf_counter() - started) * 1000, bool(result and result.items)

    async def close(self) -> None:
        await self.client.shutdown_async(None)
        self.client.exit(None)
        await self.client.stop()


async def start_front(model: str, daemon: bool, env: dict, uri: str, options: dict | None = None, kv_budget: str | None = None) -> Front:
    client = LanguageClient("daemon-bench", "1")
    shown: list[str] = []
    for method in (t.WINDOW_LOG_MESSAGE, t.PROGRESS):
        client.feature(method)(lambda *a: None)
    client.feature(t.WINDOW_SHOW_MESSAGE)(lambda params: shown.append(params.message))
    cmd = [sys.executable, "-m", "efim_tools.cli", "serve", "--log-level", "warning", "--model", model,
           "--daemon" if daemon else "--no-daemon"] + (["--kv-budget", kv_budget] if kv_budget else [])
    await client.start_io(*cmd, env=env)
    await client.initialize_async(t.InitializeParams(capabilities=t.ClientCapabilities(), initialization_options=options or {}))
    client.initialized(t.InitializedParams())
    front = Front(client, uri)
    front.shown = shown
    return front


async def wait_ready(front: Front, timeout: float = 600) -> dict:
    end = time.monotonic() + timeout
    while True:
        stats = await front.stats()
        if stats["model"]["state"] == "ready":
            return stats
        if stats["model"]["state"] == "failed" or time.monotonic() > end:
            raise SystemExit(f"model not ready: {stats['model']}")
        await asyncio.sleep(0.2)


_CREATED: list[str] = []  # removed when the run ends


def environment(tag: str) -> tuple[dict, Path]:
    run = Path(tempfile.mkdtemp(prefix=f"efb-{tag}-"))
    os.chmod(run, 0o700)
    kv = tempfile.mkdtemp(prefix=f"efim-kv-bench-{tag}-")
    _CREATED.extend([str(run), kv])
    return {**os.environ, "XDG_RUNTIME_DIR": str(run), "EFIM_KV_DIR": kv}, run


async def memory_case(
    model: str, daemon: bool, fronts: int, text: str, cursor: int, options: dict | None = None, gap: float = 0.0
) -> dict:
    env, run = environment(f"mem{fronts}{'d' if daemon else 'p'}")
    uri = f"file:///bench/{MODULE}"
    started = time.monotonic()
    # The whole window at once (no first window of 128 tokens): the later fronts' reuse is of the full prompt.
    options = {"firstWindowTokens": 0, **(options or {})}
    group = await asyncio.gather(*(start_front(model, daemon, env, uri, options) for _ in range(fronts)))
    infos = await asyncio.gather(*(wait_ready(f) for f in group))
    ready_s = time.monotonic() - started
    daemon_pid = infos[0]["engine"].get("daemon", {}).get("pid") if daemon else None
    shares = []
    for i, front in enumerate(group):
        if i and gap:
            await asyncio.sleep(gap)  # the next window opens the file this long after the last one's answer
        front.client.text_document_did_open(t.DidOpenTextDocumentParams(
            t.TextDocumentItem(uri=uri, language_id="python", version=0, text=text)))
        await front.stats(reset=True)
        ms, _ = await front.ask(position(text, cursor))
        s = await front.stats()
        shares.append({"ms": round(ms, 1), "prompt": s["promptTokens"], "prefilled": s["prefilledTokens"]})
    if daemon and env.get("EFIM_DAEMON_STANDBY") == "1":
        await standby_ready(run)
    await asyncio.sleep(3.0)
    standbys = [pid for pid in daemon_pids(run, forked_standbys=True) if pid != daemon_pid]  # a standby counts too
    pids = [f.pid for f in group] + ([daemon_pid] if daemon_pid else []) + standbys
    per = {pid: memory_mb(pid) for pid in pids}
    out = {
        "mode": "daemon" if daemon else "in-process", "fronts": fronts, "ready_s": round(ready_s, 1),
        "rss_mb": round(sum(r for r, _ in per.values())), "pss_mb": round(sum(p for _, p in per.values())),
        "front_rss_mb": [round(per[f.pid][0]) for f in group],
        "daemon_rss_mb": round(per[daemon_pid][0]) if daemon_pid else None,
        "standby_rss_mb": [round(per[pid][0]) for pid in standbys],
        "first_suggestion": shares,
    }
    await asyncio.gather(*(f.close() for f in group))
    if daemon_pid:
        os.kill(daemon_pid, signal.SIGTERM)  # the daemon this case started
    return out


LEAVE_MODULES = ("argparse.py", "typing.py", "inspect.py", "pathlib.py", "tarfile.py", "subprocess.py", "ast.py", "enum.py")


async def leave_case(model: str, big: str, small: str, text: str, cursor: int) -> dict:
    """Front A (`--kv-budget small`) and front B (`--kv-budget big`) on one daemon; B fills
    the KV with windows of several stdlib modules; B closes. The daemon's RSS (and its KV
    budget) before and after, and A's next keystroke (what it reused after the move)."""
    env, run = environment("leave")
    uri = f"file:///bench/{MODULE}"
    a = await start_front(model, True, env, uri, {"firstWindowTokens": 0}, kv_budget=small)
    info = await wait_ready(a)
    daemon_pid = info["engine"].get("daemon", {}).get("pid")
    a.client.text_document_did_open(t.DidOpenTextDocumentParams(t.TextDocumentItem(uri=uri, language_id="python", version=0, text=text)))
    await a.ask(position(text, cursor))
    b = await start_front(model, True, env, uri, {"firstWindowTokens": 0}, kv_budget=big)
    await wait_ready(b)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in LEAVE_MODULES:  # windows in several places of each: the pool fills up
        other = (stdlib / name).read_text()
        other_uri = f"file:///bench/{name}"
        b.client.text_document_did_open(t.DidOpenTextDocumentParams(t.TextDocumentItem(uri=other_uri, language_id="python", version=0, text=other)))
        for frac in (0.2, 0.5, 0.8):
            await b.ask_at(other_uri, position(other, other.index("\n", int(len(other) * frac)) + 1))
    await asyncio.sleep(2.0)
    before = memory_mb(daemon_pid)[0]
    budget_before = await _daemon_budget(a)
    await b.close()
    deadline = time.monotonic() + 60
    budget_after = await _daemon_budget(a)
    while budget_after == budget_before and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        budget_after = await _daemon_budget(a)
    await asyncio.sleep(2.0)
    after = memory_mb(daemon_pid)[0]
    await a.stats(reset=True)  # A types a key: a request the engine answers after the move
    at = position(text, cursor)
    a.client.text_document_did_change(t.DidChangeTextDocumentParams(
        t.VersionedTextDocumentIdentifier(uri=uri, version=1),
        [t.TextDocumentContentChangePartial(range=t.Range(at, at), text="i")]))
    ms, _ = await a.ask(t.Position(at.line, at.character + 1))
    s = await a.stats()
    out = {"case": "leave", "big": big, "small": small, "daemon_rss_mb": [round(before), round(after)],
           "kv_budget": [budget_before, budget_after], "a_after": {"ms": round(ms, 1), "prompt": s["promptTokens"],
                                                                   "prefilled": s["prefilledTokens"]}}
    await a.close()
    if daemon_pid:
        os.kill(daemon_pid, signal.SIGTERM)
    return out


async def _daemon_budget(front: Front) -> int | None:
    for _ in range(3):  # the daemon's health is refreshed by each stats call: the second one is current
        stats = await front.stats()
        await asyncio.sleep(0.2)
    return stats.get("engine", {}).get("daemon", {}).get("kvBudget")


async def typing_case(model: str, daemon: bool, text: str, cursor: int, keys: list[str]) -> dict:
    env, _ = environment(f"typ{'d' if daemon else 'p'}")
    uri = f"file:///bench/{MODULE}"
    front = await start_front(model, daemon, env, uri)
    info = await wait_ready(front)
    daemon_pid = info["engine"].get("daemon", {}).get("pid") if daemon else None
    latencies = await type_keys(front, uri, text, cursor, keys, reset_stats=True)
    stats = await front.stats()
    await front.close()
    if daemon_pid:
        os.kill(daemon_pid, signal.SIGTERM)
    return {
        "mode": "daemon" if daemon else "in-process", "keystrokes": len(keys),
        "p50_ms": round(percentile(latencies, 50), 1), "p95_ms": round(percentile(latencies, 95), 1),
        "p99_ms": round(percentile(latencies, 99), 1), "mean_ms": round(sum(latencies) / len(latencies), 1),
        "server_ttft_ms": stats["ttftMs"], "server_latency_ms": stats["latencyMs"],
        "typing_through_hits": stats["typingThroughHits"],
    }


async def standby_ready(run: Path, timeout: float = 600) -> None:
    """Wait until a standby daemon of this run has its model loaded (its log says so)."""
    end = time.monotonic() + timeout
    while not any("ready: waiting for the serving daemon" in p.read_text(errors="replace") for p in (run / "efim").glob("*.log")):
        if time.monotonic() > end:
            raise SystemExit(f"the standby daemon did not get ready within {timeout:.0f} s")
        await asyncio.sleep(0.2)


async def kill_case(model: str, fronts: int, text: str, cursor: int) -> dict:
    """`fronts` fronts on one daemon, each with the file open and one suggestion shown; the
    daemon SIGKILLed: seconds until each front's engine is running again (a new daemon), and
    until its next suggestion arrives; the documents' text afterwards; messages shown."""
    env, run = environment("kill")
    uri = f"file:///bench/{MODULE}"
    group = await asyncio.gather(*(start_front(model, True, env, uri) for _ in range(fronts)))
    infos = await asyncio.gather(*(wait_ready(f) for f in group))
    old = infos[0]["engine"]["daemon"]["pid"]
    for front in group:
        front.client.text_document_did_open(t.DidOpenTextDocumentParams(
            t.TextDocumentItem(uri=uri, language_id="python", version=0, text=text)))
        await front.ask(position(text, cursor))
    standby = env.get("EFIM_DAEMON_STANDBY") == "1"
    if standby:  # the kill is of a daemon whose standby has its model loaded
        await standby_ready(run)
    os.kill(old, signal.SIGKILL)
    killed = time.monotonic()

    async def back(front: Front) -> tuple[float, float]:
        while True:
            engine = (await front.stats())["engine"]
            if engine.get("state") == "running" and engine["daemon"].get("pid") not in (None, old):
                break
            await asyncio.sleep(0.05)
        running = time.monotonic() - killed
        # A key typed after the restart, so the answer is computed (not the one shown before).
        pos = position(text, cursor)
        front.client.text_document_did_change(t.DidChangeTextDocumentParams(
            text_document=t.VersionedTextDocumentIdentifier(uri=uri, version=1),
            content_changes=[t.TextDocumentContentChangePartial(range=t.Range(pos, pos), text="x")]))
        _, answered = await front.ask(position(text[:cursor] + "x" + text[cursor:], cursor + 1))
        front.answered = answered
        return running, time.monotonic() - killed

    times = await asyncio.gather(*(back(f) for f in group))
    texts = [plain(await f.client.protocol.send_request_async("efim/documentText", {"textDocument": {"uri": uri}}))
             for f in group]
    daemons = [(await f.stats())["engine"]["daemon"] for f in group]
    new = daemons[0]["pid"]
    out = {"fronts": fronts, "standby": standby, "running_again_s": [round(a, 2) for a, _ in times],
           # Where the seconds went: the new daemon's start-up phases (exec → main, imports with torch,
           # the model load, binding) and each front's own loss → serving again.
           "new_daemon_startup_s": daemons[0].get("startup"),
           "front_outage_s": [d.get("lastOutageS") for d in daemons],
           "next_suggestion_s": [round(b, 2) for _, b in times],
           "answered": [f.answered for f in group],
           "documents_intact": all(d["text"] == text[:cursor] + "x" + text[cursor:] for d in texts),
           "messages_shown": [len([m for m in f.shown if "went away" in m]) for f in group]}
    await asyncio.gather(*(f.close() for f in group))
    os.kill(new, signal.SIGTERM)
    return out


async def open_at(front: Front, uri: str, text: str, cursor: int, settle: bool = False) -> None:
    """Open `uri` with `text` and ask once at `cursor` (a full prefill, not counted). With
    `settle`, then wait until the front has no warm-up in flight (its full window computed
    behind the first one): each phase of a comparison types from the same state."""
    front.client.text_document_did_open(t.DidOpenTextDocumentParams(
        t.TextDocumentItem(uri=uri, language_id="python", version=0, text=text)))
    await front.ask_at(uri, position(text, cursor))
    if settle:
        await warm_ups_done(front)


async def warm_ups_done(front: Front, timeout: float = 30.0) -> None:
    """Wait until every warm-up the front submitted has ended (`efim/stats` "warmup"), then a
    little more (the engine's idle work after it)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        warm = (await front.stats())["warmup"]
        if warm["submitted"] <= warm["completed"] + warm["cancelled"]:
            break
        await asyncio.sleep(0.1)
    else:
        raise SystemExit(f"the front's warm-ups did not end within {timeout:.0f} s")
    await asyncio.sleep(0.3)


async def type_keys(front: Front, uri: str, text: str, cursor: int, keys: list[str], reset_stats: bool = False,
                    opened: bool = False, settle: bool = False) -> list[float]:
    """Open `uri` with `text` and ask once there (`open_at`, unless `opened`; `settle` as
    there), zero the server's counters with `reset_stats`, then type `keys` one at a time,
    waiting for each answer; the client-measured latencies."""
    if not opened:
        await open_at(front, uri, text, cursor, settle)
    if reset_stats:
        await front.stats(reset=True)
    latencies = []
    for version, key in enumerate(keys, 1):
        pos = position(text, cursor)
        front.client.text_document_did_change(t.DidChangeTextDocumentParams(
            text_document=t.VersionedTextDocumentIdentifier(uri=uri, version=version),
            content_changes=[t.TextDocumentContentChangePartial(range=t.Range(pos, pos), text=key)]))
        text = text[:cursor] + key + text[cursor:]
        cursor += len(key)
        ms, _ = await front.ask_at(uri, position(text, cursor))
        latencies.append(ms)
    return latencies


async def fair_case(model: str, daemon: bool, text: str, cursor: int, keys: list[str], rate: float) -> tuple[dict, list[float], list[float]]:
    """Front A types `keys` alone, then the same keys in a copy of the file while front B asks
    for a suggestion at a random place of another module `rate` times a second (each request
    a jump: a new window to prefill, superseding B's previous one). The summary, and A's
    answer times alone and during the burst."""
    import random  # noqa: PLC0415
    import sysconfig  # noqa: PLC0415

    env, _ = environment(f"fair{'d' if daemon else 'p'}")
    a, b = await asyncio.gather(*(start_front(model, daemon, env, "file:///bench/a.py") for _ in range(2)))
    infos = await asyncio.gather(wait_ready(a), wait_ready(b))
    daemon_pid = infos[0]["engine"].get("daemon", {}).get("pid") if daemon else None
    # Both phases type from the same state: the document open, its first answer given and its
    # full window computed (else the burst phase, whose copy of the text reuses the solo phase's
    # KV, types in the full window from its first key while the solo phase typed its first
    # second or so in the first window: other prompts, other answers, other decode lengths).
    solo = await type_keys(a, "file:///bench/solo.py", text, cursor, keys, reset_stats=True, settle=True)
    solo_server = server_view(await a.stats())
    other = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text()
    b_uri = "file:///bench/burst.py"
    b.client.text_document_did_open(t.DidOpenTextDocumentParams(
        t.TextDocumentItem(uri=b_uri, language_id="python", version=0, text=other)))
    rng = random.Random(7)
    sent = 0
    stop = asyncio.Event()

    async def burst() -> None:
        nonlocal sent
        pending = set()
        while not stop.is_set():
            task = asyncio.ensure_future(b.ask_at(b_uri, position(other, rng.randrange(len(other)))))
            pending.add(task)
            task.add_done_callback(pending.discard)
            sent += 1
            await asyncio.sleep(1.0 / rate)
        await asyncio.gather(*pending, return_exceptions=True)  # (a cancelled pygls future logs noise)

    await open_at(a, "file:///bench/busy.py", text, cursor, settle=True)
    burster = asyncio.ensure_future(burst())
    started = time.monotonic()
    await asyncio.sleep(0.5)  # the burst under way
    busy = await type_keys(a, "file:///bench/busy.py", text, cursor, keys, reset_stats=True, opened=True)
    busy_server = server_view(await a.stats())
    stop.set()
    await asyncio.gather(burster, return_exceptions=True)
    elapsed = time.monotonic() - started
    await asyncio.gather(a.close(), b.close(), return_exceptions=True)
    if daemon_pid:
        os.kill(daemon_pid, signal.SIGTERM)
    case = {"mode": "daemon" if daemon else "in-process", "burst_per_s": round(sent / elapsed, 1), **fair_summary(solo, busy),
            # A's own server's view of the same requests (its latency: request in → answer out).
            "server_solo": solo_server, "server_with_burst": busy_server}
    return case, solo, busy


def fair_summary(solo: list[float], busy: list[float]) -> dict:
    """Front A's answer times alone and during the burst: percentiles, the p99 ratio, the slowest four."""
    return {"keystrokes": len(busy), "solo_ms": percentiles(solo), "with_burst_ms": percentiles(busy),
            "p99_ratio": round(percentile(busy, 99) / max(1e-9, percentile(solo, 99)), 2),
            "slowest_ms": {"solo": sorted(round(x) for x in solo)[-4:], "with_burst": sorted(round(x) for x in busy)[-4:]}}


def server_view(stats: dict) -> dict:
    """What a front's `efim/stats` says of its requests since its last reset."""
    return {"latency_ms": stats["latencyMs"], "ttft_ms": stats["ttftMs"], "deadline_cuts": stats["deadlineCuts"],
            "served": stats["served"], "engine_latency_ms": stats["engineLatencyMs"]}


def hop_case(model: str, daemon: bool, text: str, cursor: int, body: str, n: int) -> dict:
    """The hop alone, without the language server: `n` keystroke-shaped requests (the EFIM
    increment grows by one character each; one greedy token each) on one engine, submit to
    completion timed in this process — a `LocalEngine` here, or a `DaemonEngine` to a fresh
    daemon."""
    from engine.api import InfillRequest  # noqa: PLC0415

    env, _ = environment(f"hop{'d' if daemon else 'p'}")
    os.environ.update(XDG_RUNTIME_DIR=env["XDG_RUNTIME_DIR"], EFIM_KV_DIR=env["EFIM_KV_DIR"])
    if daemon:
        from engine.daemon import open_daemon_engine  # noqa: PLC0415

        engine = open_daemon_engine(model)
    else:
        from engine.local import load_engine  # noqa: PLC0415

        engine = load_engine(model)
    prefix, suffix = text[max(0, cursor - 3000):cursor], text[cursor:cursor + 1500]

    def one(i: int):
        started = time.perf_counter()
        done = engine.submit(InfillRequest(key="file:///hop.py", prefix=prefix, suffix=suffix, increment=body[:i],
                                           max_tokens=1, format="efim" if engine.info().supports_fim else "prefix")).result(120)
        return (time.perf_counter() - started) * 1000, done.stats

    one(0)  # the window's prefill, not counted
    times, ttft = [], []
    for i in range(1, n + 1):
        ms, stats = one(i)
        times.append(ms)
        ttft.append(stats.ttft_ms)
    pid = getattr(engine, "daemon_pid", None)
    engine.close()
    if pid:
        os.kill(pid, signal.SIGTERM)
    return {"mode": "daemon" if daemon else "in-process", "requests": n,
            "submit_to_result_ms": percentiles(times, digits=2),
            "engine_ttft_ms": percentiles(ttft, digits=2),
            "hop_p50_ms": round(percentile([a - b for a, b in zip(times, ttft)], 50), 2)}


async def run(args: argparse.Namespace) -> dict:
    if args.standby:
        os.environ["EFIM_DAEMON_STANDBY"] = "1"  # the fronts' environment (bench.daemon_fronts.environment copies it)
    text, cursor, body = blank_function(MODULE, FUNCTION)
    keys = key_presses(body)[: args.keys]
    results: dict = {"model": args.model, "module": MODULE, "function": FUNCTION, "memory": [], "typing": []}
    for fronts in args.fronts:
        for daemon in args.modes:
            case = await memory_case(args.model, daemon, fronts, text, cursor, args.options, args.gap)
            print(json.dumps(case), flush=True)
            results["memory"].append(case)
    if args.keys and not args.fair:
        for daemon in args.modes:
            case = await typing_case(args.model, daemon, text, cursor, keys)
            print(json.dumps(case), flush=True)
            results["typing"].append(case)
    if args.fair:
        for daemon in args.modes:
            solo_all: list[float] = []
            busy_all: list[float] = []
            for _ in range(args.rounds):
                case, solo, busy = await fair_case(args.model, daemon, text, cursor, keys, args.fair)
                print(json.dumps(case), flush=True)
                results.setdefault("fairness", []).append(case)
                solo_all += solo
                busy_all += busy
            if args.rounds > 1:
                pooled = {"mode": case["mode"], "rounds": args.rounds, **fair_summary(solo_all, busy_all),
                          "round_ratios": [c["p99_ratio"] for c in results["fairness"][-args.rounds:]]}
                print(json.dumps(pooled), flush=True)
                results.setdefault("fairness_pooled", []).append(pooled)
    if args.leave:
        big, small = args.leave.split(":")
        case = await leave_case(args.model, big, small, text, cursor)
        print(json.dumps(case), flush=True)
        results["leave"] = case
    if args.kill:
        case = await kill_case(args.model, args.kill, text, cursor)
        print(json.dumps(case), flush=True)
        results["kill"] = case
    for daemon in args.modes if args.hop else ():
        case = hop_case(args.model, daemon, text, cursor, body, args.hop)
        print(json.dumps(case), flush=True)
        results.setdefault("hop", []).append(case)
    return results


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default")
    parser.add_argument("--fronts", default="1,3", type=lambda s: [int(x) for x in s.split(",") if x])
    parser.add_argument("--keys", type=int, default=60, help="keystrokes typed for the latency comparison (0: skip it)")
    parser.add_argument("--fair", type=float, default=0, metavar="RATE",
                        help="also: a front types --keys keys alone, then while another front asks RATE times a second")
    parser.add_argument("--rounds", type=int, default=1, metavar="N",
                        help="--fair: N rounds, each with fresh fronts and daemon; with N > 1 also the p99s of all rounds' answers pooled")
    parser.add_argument("--kill", type=int, default=0, metavar="N", help="also: N fronts, the daemon SIGKILLed, time until each serves again")
    parser.add_argument("--leave", default=None, metavar="BIG:SMALL",
                        help="also: fronts asking --kv-budget SMALL and BIG on one daemon; BIG fills the KV and leaves: "
                             "the daemon's RSS and budget before and after")
    parser.add_argument("--standby", action="store_true",
                        help="the fronts' daemons keep a standby (EFIM_DAEMON_STANDBY=1); --kill waits for it to be ready")
    parser.add_argument("--hop", type=int, default=0, help="also time N keystroke-shaped requests on the engine alone (no server)")
    parser.add_argument("--modes", default=[False, True], type=lambda s: [m == "daemon" for m in s.split(",")],
                        help="in-process,daemon (default: both)")
    parser.add_argument("--gap", type=float, default=1.0, metavar="S",
                        help="memory case: seconds between one front's first answer and the next front's opening the file "
                             "(a person opening another window; 0: at once)")
    parser.add_argument("--options", type=json.loads, default=None, help="more initializationOptions for the memory case (JSON)")
    parser.add_argument("--json", type=Path, help="write the results here")


def run_cli(args: argparse.Namespace) -> int:
    import shutil  # noqa: PLC0415

    try:
        results = asyncio.run(run(args))
    finally:
        time.sleep(1.0)  # the daemons told to stop remove their sockets first
        for path in _CREATED:
            kill_daemons(path)  # any left (and their standbys)
            shutil.rmtree(path, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run_cli(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
