"""`efim bench next-edit`: how long a next-edit answer takes through `efim serve`, client side.

A real server (the default model unless `--model`), a standard-library module opened as a
document, and `--samples` edits drawn by `efim eval next-edit`'s sampler (`--category`:
renames by default, or call sites, parallel lines): each edit is typed key by key (a `didChange` per key, as an editor sends them), then
`textDocument/copilotInlineEdit` is asked at the edit and timed from the request written to
the answer read. Two phases in one run: `idle` (only the next-edit requests) and `typing`
(each key also asks `textDocument/inlineCompletion`, as a typing client does, and the
next-edit request goes out while the last completion is still being computed). Reports p50
/ p95 / p99 per phase and how many answers were the expected edit (the same text after it).

`--next-edit model` (with `--adapter`, an adapter trained on next-edit probes) asks the model
where the proposers without one are silent: `--category noise` (a number or a word changed)
is where it is asked about every candidate place. In `idle` nothing computed the document's
prompt before the request (a client that asks for next edits only); in `typing` the keys'
completions did, and the probes wait for the last one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from typing import Any

from bench.percentiles import percentile
from efim_lsp.positions import LineIndex
from efim_tools.evaluation.next_edit import module_path, samples
from efim_tools.trace.client import LspClient, measured_server_env
from efim_tools.trace.replay import client_capabilities, wait_ready


def _position(text: str, offset: int) -> dict[str, int]:
    """LSP position (UTF-16) of a code-point offset, as the server reads positions."""
    line, character = LineIndex(text).position(offset, "utf-16")
    return {"line": line, "character": character}


async def _phase(client: LspClient, name: str, uri: str, cases: list, typing: bool) -> dict[str, Any]:
    latencies, right, answered = [], 0, 0
    for k, case in enumerate(cases):
        version = 1
        doc_uri = f"{uri}?{name}-{k}"
        text = case.before
        await client.notify("textDocument/didOpen", {"textDocument": {"uri": doc_uri, "languageId": "python", "version": version, "text": text}})
        start, end, new = case.edit
        inflight = None
        for i, ch in enumerate(new or [""]):  # a deletion: one change
            lo, hi = (start, end) if i == 0 else (start + i, start + i)
            change = {"range": {"start": _position(text, lo), "end": _position(text, hi)}, "text": ch}
            text = text[:lo] + ch + text[hi:]
            version += 1
            await client.notify("textDocument/didChange", {"textDocument": {"uri": doc_uri, "version": version}, "contentChanges": [change]})
            if typing:
                inflight = await client.send_request("textDocument/inlineCompletion", {
                    "textDocument": {"uri": doc_uri}, "position": _position(text, start + len(ch) + i), "context": {"triggerKind": 2}})
        pending = await client.send_request("textDocument/copilotInlineEdit", {
            "textDocument": {"uri": doc_uri, "version": version}, "position": _position(text, start + len(new))})
        result = await client.result(pending)
        latencies.append(pending.latency_ms)
        edits = (result or {}).get("edits") or []
        if edits:
            answered += 1
            exp = case.expected
            edit = edits[0]
            index = LineIndex(text)
            a, b = (index.offset(edit["range"][k]["line"], edit["range"][k]["character"], "utf-16") for k in ("start", "end"))
            if text[:a] + edit["text"] + text[b:] == text[: exp.start] + exp.text + text[exp.end :]:
                right += 1  # the text the expected edit leaves
        if inflight is not None:
            try:
                await client.result(inflight)
            except Exception:  # a completion cut short is not this benchmark's business
                pass
        await client.notify("textDocument/didClose", {"textDocument": {"uri": doc_uri}})
    pct = lambda q: round(percentile(latencies, q), 2) if latencies else None  # noqa: E731
    return {"phase": name, "n": len(latencies), "answered": answered, "expected_edit": right,
            "p50_ms": pct(50), "p95_ms": pct(95), "p99_ms": pct(99), "max_ms": round(max(latencies), 2) if latencies else None}


async def run_bench(model: str, module: str, n: int, seed: int, ready_timeout_s: float, category: str = "rename-below",
                    next_edit: str = "baseline", adapter: str | None = None) -> dict[str, Any]:
    cases = [c for c in samples([module], seed=seed, per_category=n) if c.category == category][:n]
    if not cases:
        raise SystemExit(f"efim bench next-edit: no {category} samples in {module}")
    argv = [sys.executable, "-m", "efim_tools.cli", "serve", "--log-level", "warning"]
    if model != "default":
        argv += ["--model", model]
    if adapter:
        argv += ["--adapter", adapter]
    kv_dir = tempfile.mkdtemp(prefix="efim-next-edit-kv-")
    settings = {"maxTokens": 16, "nextEdit": next_edit}
    client = LspClient(argv, env=measured_server_env(None, kv_dir), settings=settings)
    await client.start()
    try:
        await client.request("initialize", {
            "processId": os.getpid(), "clientInfo": {"name": "efim bench next-edit", "version": "1"}, "rootUri": None,
            "capabilities": client_capabilities("utf-16"), "initializationOptions": settings})
        await client.notify("initialized", {})
        stats = await wait_ready(client, ready_timeout_s)
        uri = module_path(module).as_uri()
        phases = [await _phase(client, "idle", uri, cases, typing=False), await _phase(client, "typing", uri, cases, typing=True)]
        counts = (await client.request("efim/stats", {}))["nextEdit"]
        return {"model": model, "adapter": adapter, "next_edit": next_edit, "module": module, "category": category, "seed": seed,
                "state": (stats or {}).get("model", {}).get("state"),
                "phases": phases, "server_counts": counts}
    finally:
        await client.close()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default", help="'default' (the embedded model) or a model path")
    parser.add_argument("--file", default="csv", help="standard-library module the renames are drawn from (default csv)")
    parser.add_argument("--samples", type=int, default=60, help="edits per phase")
    parser.add_argument("--category", choices=("rename-below", "far", "rename-above", "call-site", "parallel", "noise"), default="rename-below",
                        help="which of efim eval next-edit's samples are typed (default: renames)")
    parser.add_argument("--next-edit", choices=("baseline", "model"), default="baseline", help="the server's nextEdit setting")
    parser.add_argument("--adapter", default=None, help="the server's --adapter (an adapter trained on next-edit probes for --next-edit model)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ready-timeout", type=float, default=600.0)
    parser.add_argument("--json", default=None, help="write the report here too")


def run_cli(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    report = asyncio.run(run_bench(args.model, args.file, args.samples, args.seed, args.ready_timeout, args.category,
                                   args.next_edit, args.adapter))
    print(f"next-edit through efim serve: model {report['model']} ({report['state']}), adapter {report['adapter'] or 'auto'}, "
          f"nextEdit {report['next_edit']}, {report['module']}, {report['category']}, seed {report['seed']}")
    print(f"{'phase':<8}{'n':>5}{'answered':>10}{'expected':>10}{'p50 ms':>9}{'p95 ms':>9}{'p99 ms':>9}{'max ms':>9}")
    for p in report["phases"]:
        print(f"{p['phase']:<8}{p['n']:>5}{p['answered']:>10}{p['expected_edit']:>10}{p['p50_ms']:>9}{p['p95_ms']:>9}{p['p99_ms']:>9}{p['max_ms']:>9}")
    print(f"server counts: {report['server_counts']}; {time.perf_counter() - t0:.0f} s")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(report, fh, indent=1)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run_cli(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
