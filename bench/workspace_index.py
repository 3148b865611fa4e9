"""A big workspace indexed while a person types: `efim serve` with cross-file context on a
workspace of N files synthesised from the standard library, against the same server and
keystrokes without context.

    .venv/bin/efim bench workspace [--files 10000] [--configs off,blend] [--kv-budget 1GB]
                                   [--module argparse.py] [--keys 400] [--json]

The workspace: copies of the standard library's `.py` tree (`copy0/`, `copy1/`, …, hard
links where the file system allows) until N files, plus a `node_modules/` folder the index
must prune. Each configuration runs on a fresh server with the workspace as its only
folder (indexing starts at `initialized`). The typist opens `copy0/<module>` with a stretch
of it removed and types it back, one request per key, each answer awaited, a key every
100 ms (10 keys/s) or as soon as the answer came when it took longer; typing goes on until
the index is built and, with `blend`, the chunk KV planned ahead is computed, and then
`--after` keys more (at most `--keys` in all).

Printed per configuration: keystroke client latency and server TTFT (p50 / p90 / p99) while
the workspace indexes, while chunk KV is computed ahead, and after; the index (files, chunks,
seconds to build); the server's RSS (from /proc, sampled every 0.5 s) at the first key, its
peak and at the end; its KV in use (`cacheBytes`) and the `--kv-budget`. The last lines
compare each phase with `off` as ratios, and the RSS each configuration added over `off`'s
with the KV it holds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.percentiles import percentile
from bench.process_memory import memory_mb
from efim_tools.trace.client import LspClient, measured_server_env
from efim_tools.trace.keys import key_presses
from efim_tools.trace.probe import RequestProbe
from efim_tools.trace.replay import client_capabilities, wait_ready

KEY_INTERVAL_S = 0.1
RSS_EVERY_S = 0.5
PHASES = ("indexing", "chunk KV", "after")


def synthesise_workspace(root: Path, n_files: int, source: Path | None = None) -> int:
    """Copies of the standard library's `.py` files under `root/copyK/` until `n_files`
    (hard links where possible), and a `node_modules/` folder of copies the index prunes.
    Returns the number of Python files written."""
    source = source or Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in source.rglob("*.py") if "site-packages" not in p.parts and p.is_file())
    if not files:
        raise ValueError(f"no .py files under {source}")
    written = 0
    copy = 0
    while written < n_files:
        for path in files:
            if written >= n_files:
                break
            dest = root / f"copy{copy}" / path.relative_to(source)
            dest.parent.mkdir(parents=True, exist_ok=True)
            _link_or_copy(path, dest)
            written += 1
        copy += 1
    vendored = root / "node_modules" / "lib"
    vendored.mkdir(parents=True, exist_ok=True)
    for path in files[:50]:
        _link_or_copy(path, vendored / path.name)
    return written


def _link_or_copy(src: Path, dest: Path) -> None:
    try:
        os.link(src, dest)
    except OSError:
        shutil.copyfile(src, dest)


def typing_task(text: str, span: int) -> tuple[str, int, str]:
    """(the document with `span` characters removed from a line start 40 % into it, the
    cursor offset, the text to type back)."""
    start = text.index("\n", int(len(text) * 0.4)) + 1
    end = min(len(text), start + span)
    end = text.rfind("\n", start, end) + 1 or end
    return text[:start] + text[end:], start, text[start:end]


def position(text: str, offset: int) -> dict[str, int]:
    line = text.count("\n", 0, offset)
    col_start = text.rfind("\n", 0, offset) + 1
    return {"line": line, "character": len(text[col_start:offset].encode("utf-16-le")) // 2}


async def run_config(config: str, args, workspace: Path, module: str) -> dict[str, Any]:
    kv_dir = tempfile.mkdtemp(prefix="efim-workspace-kv-")
    settings = {"context": config, "maxTokens": 16, "multiline": "never", "timeoutMs": 0}
    argv = [sys.executable, "-m", "efim_tools.cli", "serve"]
    argv += ["--log-level", "debug", "--log-file", f"{args.server_log}.{config}"] if args.server_log else ["--log-level", "warning"]
    if args.model != "default":
        argv += ["--model", args.model]
    if args.kv_budget:
        argv += ["--kv-budget", args.kv_budget]
    client = LspClient(argv, env=measured_server_env(None, kv_dir), settings=settings)
    samples: list[tuple[float, float]] = []  # (s since initialized, RSS MB)
    started = time.perf_counter()
    await client.start()
    pid = client.proc.pid

    async def sample_rss() -> None:
        while True:
            rss, _pss = memory_mb(pid)
            samples.append((time.perf_counter() - started, rss))
            await asyncio.sleep(RSS_EVERY_S)

    sampler = asyncio.create_task(sample_rss())
    try:
        root = workspace.as_uri()
        capabilities = client_capabilities("utf-16")
        capabilities["workspace"]["workspaceFolders"] = True
        await client.request("initialize", {
            "processId": os.getpid(), "clientInfo": {"name": "efim bench workspace", "version": "1"}, "rootUri": root,
            "workspaceFolders": [{"uri": root, "name": "ws"}], "capabilities": capabilities, "initializationOptions": settings})
        await client.notify("initialized", {})
        started = time.perf_counter()
        await wait_ready(client, 900)
        ready_s = time.perf_counter() - started
        path = workspace / "copy0" / module
        doc, cursor, typed = typing_task(path.read_text(), args.span)
        uri = path.as_uri()
        await client.notify("textDocument/didOpen", {"textDocument": {"uri": uri, "languageId": "python", "version": 1, "text": doc}})
        probe = RequestProbe(client)
        first = await _ask(client, uri, doc, cursor)
        seg = await probe.segment() or {}
        rss_first_key = memory_mb(pid)[0]
        keys: dict[str, list[tuple[float, float | None, int]]] = {p: [] for p in PHASES}
        version, after, index_s, kv_s = 1, 0, None, None
        last_context: dict[str, Any] = seg.get("context") or {}
        for key in key_presses(typed):
            if sum(map(len, keys.values())) >= args.keys or after >= args.after:
                break
            phase = _phase(config, last_context)
            if phase != "indexing" and index_s is None:
                index_s = time.perf_counter() - started
            if phase == "after" and kv_s is None:
                kv_s = time.perf_counter() - started
            t_key = time.perf_counter()
            version += 1
            at = position(doc, cursor)
            await client.notify("textDocument/didChange", {"textDocument": {"uri": uri, "version": version},
                                                           "contentChanges": [{"range": {"start": at, "end": at}, "text": key}]})
            doc, cursor = doc[:cursor] + key + doc[cursor:], cursor + len(key)
            ms = await _ask(client, uri, doc, cursor)
            seg = await probe.segment() or {}
            ttft = (seg.get("ttftMs") or {}).get("p50") if seg.get("requests") == 1 else None
            keys[phase].append((ms, ttft or None, int(seg.get("prefilledTokens") or 0)))
            after += phase == "after"
            last_context = seg.get("context") or last_context
            await asyncio.sleep(max(0.0, KEY_INTERVAL_S - (time.perf_counter() - t_key)))
        stats = await client.request("efim/stats", None) or {}
        rss_end = memory_mb(pid)[0]
    finally:
        sampler.cancel()
        await client.close()
        shutil.rmtree(kv_dir, ignore_errors=True)
    context = stats.get("context") or {}
    return {
        "config": config, "ready_s": round(ready_s, 1), "first_ms": round(first, 1),
        "index_s": round(index_s, 1) if index_s is not None else None, "kv_s": round(kv_s, 1) if kv_s is not None else None,
        "files": context.get("files"), "chunks": context.get("chunks"), "kv": context.get("kv"),
        "phases": {p: _summary(v) for p, v in keys.items()},
        "rss_first_key_mb": round(rss_first_key), "rss_peak_mb": round(max(r for _t, r in samples if r == r)),
        "rss_end_mb": round(rss_end), "cache_mb": round((stats.get("cacheBytes") or 0) / 2**20),
        "rss_curve": [(round(t, 1), round(r)) for t, r in samples],
    }


def _phase(config: str, context: dict[str, Any]) -> str:
    if config == "off":
        return "after"
    if not context.get("files") or context.get("indexing"):
        return "indexing"
    kv = context.get("kv") or {}
    if config == "blend" and (kv.get("queued") or kv.get("running")):
        return "chunk KV"
    return "after"


async def _ask(client: LspClient, uri: str, doc: str, cursor: int) -> float:
    pending = await client.send_request("textDocument/inlineCompletion", {
        "textDocument": {"uri": uri}, "position": position(doc, cursor), "context": {"triggerKind": 2}})
    await asyncio.wait_for(client.result(pending), 600)
    return pending.latency_ms


def _summary(samples: list[tuple[float, float | None, int]]) -> dict[str, Any]:
    client = [ms for ms, _t, _p in samples]
    ttft = [t for _ms, t, _p in samples if t is not None]
    prefilled = [p for _ms, t, p in samples if t is not None]
    return {
        "keys": len(samples), "engine": len(ttft),
        "prefilled_p50": round(percentile(prefilled, 50)) if prefilled else None,
        "client_ms": [round(percentile(client, q), 1) for q in (50, 90, 99)] if client else None,
        "ttft_ms": [round(percentile(ttft, q), 1) for q in (50, 90, 99)] if ttft else None,
    }


def _ratio(a: list[float] | None, b: list[float] | None) -> str:
    if not a or not b:
        return "n/a"
    return " / ".join(f"{x / y:.2f}x" if y else "n/a" for x, y in zip(a, b))


def report(results: list[dict[str, Any]], budget: str) -> None:
    for r in results:
        print(f"== context {r['config']}: model ready {r['ready_s']} s, first answer {r['first_ms']} ms; "
              f"index {r['files']} files, {r['chunks']} chunks, built {r['index_s']} s after initialized; "
              f"chunk KV ahead {r['kv']} (done {r['kv_s']} s)")
        for phase, s in r["phases"].items():
            if s["keys"]:
                print(f"   {phase:9s} {s['keys']:4d} keys ({s['engine']} to the engine): client p50/p90/p99 {s['client_ms']} ms, "
                      f"TTFT {s['ttft_ms']} ms, prefilled p50 {s['prefilled_p50']} tokens")
        print(f"   RSS at the first key {r['rss_first_key_mb']} MB, peak {r['rss_peak_mb']} MB, end {r['rss_end_mb']} MB; "
              f"KV in use {r['cache_mb']} MB (--kv-budget {budget or 'default'})")
    base = next((r for r in results if r["config"] == "off"), None)
    if base is None:
        return
    ref = base["phases"]["after"]
    for r in results:
        if r is base:
            continue
        for phase, s in r["phases"].items():
            if s["keys"]:
                print(f"{r['config']} {phase} / off: client p50/p90/p99 {_ratio(s['client_ms'], ref['client_ms'])}, "
                      f"TTFT {_ratio(s['ttft_ms'], ref['ttft_ms'])}")
        print(f"{r['config']} - off: RSS peak +{r['rss_peak_mb'] - base['rss_peak_mb']} MB, end +{r['rss_end_mb'] - base['rss_end_mb']} MB "
              f"(KV in use +{r['cache_mb'] - base['cache_mb']} MB)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--files", type=int, default=10_000, help="Python files in the synthesised workspace")
    parser.add_argument("--configs", default="off,blend", help="`context` settings, comma-separated (off first: the reference)")
    parser.add_argument("--model", default="default")
    parser.add_argument("--kv-budget", default=None, help="the servers' --kv-budget (default: the server's default)")
    parser.add_argument("--module", default="argparse.py", help="the stdlib module typed into (its copy in copy0/)")
    parser.add_argument("--span", type=int, default=20_000, help="characters removed and typed back")
    parser.add_argument("--keys", type=int, default=400, help="keys typed at most per configuration")
    parser.add_argument("--after", type=int, default=60, help="keys typed once the index and its chunk KV are done")
    parser.add_argument("--workspace", default=None, help="use (or build) the workspace here instead of a temporary folder")
    parser.add_argument("--server-log", default=None, help="each server's debug log goes to this path + .CONFIG")
    parser.add_argument("--json", action="store_true", help="also print the results (with the RSS curves) as JSON")


def run_cli(args: argparse.Namespace) -> int:
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in configs if c not in ("off", "prefix", "blend")]
    if bad:
        raise ValueError(f"unknown context setting(s) {', '.join(bad)}; expected off, prefix or blend")
    tmp = None
    if args.workspace:
        workspace = Path(args.workspace)
    else:
        tmp = tempfile.mkdtemp(prefix="efim-workspace-")
        workspace = Path(tmp)
    try:
        if not (workspace / "copy0").is_dir():
            t0 = time.perf_counter()
            n = synthesise_workspace(workspace, args.files)
            print(f"workspace {workspace}: {n} Python files (+ node_modules) in {time.perf_counter() - t0:.1f} s", flush=True)
        if not (workspace / "copy0" / args.module).is_file():
            raise ValueError(f"{args.module} is not in the workspace's copy0/")
        results = [asyncio.run(run_config(c, args, workspace, args.module)) for c in configs]
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    report(results, args.kv_budget)
    if args.json:
        print(json.dumps(results))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run_cli(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
