"""Keystroke latency through the real server: `efim serve` over stdio, a real stdlib module,
one function body blanked and typed back one request per keystroke — EFIM against FIM.

    .venv/bin/python bench/lsp_typing.py [--model default] [--module heapq.py] [--function _siftdown]
                                         [--formats efim,fim,served,served-torch] [--limit N] [--json]

Each prompt format runs on a fresh server with the same keystrokes: settings
`{"promptFormat": F, "fimTokens": "add", "adapter": "none", "multiline": "never", "maxTokens": 16}`
(the prefix-first layout with untrained sentinels: speed does not depend on what it learned,
and the shipped suffix-first adapter would make FIM append like EFIM). The
typist waits for each answer before the next key (no overlap, so latency is not queueing);
a newline arrives with the next line's indentation in the same edit, as editors auto-indent
(`efim_tools.trace.keys.key_presses`, the split the synthetic traces use).

Printed per format: the server's `efim/stats` (reuseRatio; ttftMs = request arrival → first
generated token, measured in the server) over the typed keystrokes only (the opening request,
a full prefill, is reported apart); the time to the whole single-line suggestion, both for the
requests the engine computed (server-measured) and for all requests (client-measured,
typing-through hits included). The last line compares EFIM's p50s with FIM's as ratios
(measured side by side, on the same keystrokes). `served` runs the server's defaults (the
shipped adapter, its template, the C kernels) and `served-torch` the same with
`EFIM_C_KERNELS=0`: what a user waits for, with and without the C decode kernels.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from bench.percentiles import percentile
from efim_tools.trace.client import measured_server_env
from efim_tools.trace.keys import key_presses

from lsprotocol import types as t
from pygls.lsp.client import LanguageClient


def plain(obj):
    if hasattr(obj, "_asdict"):
        return {k: plain(v) for k, v in obj._asdict().items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    return obj


def blank_function(module: str, function: str) -> tuple[str, int, str]:
    """(text with the body replaced by one indented blank line, offset of the cursor, the body)."""
    src = (Path(sysconfig.get_paths()["stdlib"]) / module).read_text()
    start = src.index(f"def {function}(")
    body_start = src.index("\n", start) + 1
    line_indent = len(src[body_start:]) - len(src[body_start:].lstrip(" "))
    end = body_start
    for line in src[body_start:].splitlines(keepends=True):
        if line.strip() and len(line) - len(line.lstrip(" ")) < line_indent:
            break
        end += len(line)
    body = src[body_start:end].rstrip("\n")
    indent = " " * line_indent
    text = src[:body_start] + indent + src[body_start + len(body) :]
    return text, body_start + line_indent, body[line_indent:]


def position(text: str, offset: int) -> t.Position:
    line = text.count("\n", 0, offset)
    col_start = text.rfind("\n", 0, offset) + 1
    return t.Position(line, len(text[col_start:offset].encode("utf-16-le")) // 2)


# "served": the default configuration, as `efim serve` runs for a user (the shipped adapter and
# its template, the C kernels where they build); "served-torch": the same with EFIM_C_KERNELS=0.
SERVED = ("served", "served-torch")


async def run_format(fmt: str, args, text: str, cursor: int, keys: list[str], kv_dir: str) -> dict:
    client = LanguageClient("lsp-typing-bench", "1")
    for method in (t.WINDOW_LOG_MESSAGE, t.WINDOW_SHOW_MESSAGE, t.PROGRESS):
        client.feature(method)(lambda *a: None)
    cmd = [sys.executable, "-m", "efim_tools.cli", "serve", "--log-level", args.server_log_level]
    if args.server_log:
        cmd += ["--log-file", f"{args.server_log}.{fmt}"]
    env = measured_server_env(None, kv_dir)
    if fmt == "served-torch":
        env = {**env, "EFIM_C_KERNELS": "0"}
    await client.start_io(*cmd, env=env)
    uri = f"file:///bench/{args.module}"
    if fmt in SERVED:  # the server's own defaults (the shipped adapter, its template), maxTokens aside
        options = {"model": args.model, "maxTokens": args.max_tokens}
    else:
        options = {"model": args.model, "promptFormat": fmt, "fimTokens": "add", "adapter": "none", "multiline": "never",
                   "maxTokens": args.max_tokens}
    options.update(json.loads(args.config) if args.config else {})
    await client.initialize_async(t.InitializeParams(capabilities=t.ClientCapabilities(), initialization_options=options))
    client.initialized(t.InitializedParams())
    t0 = time.monotonic()
    while True:
        stats = plain(await client.protocol.send_request_async("efim/stats", {}))
        if stats["model"]["state"] in ("ready", "failed"):
            break
        await asyncio.sleep(0.2)
    if stats["model"]["state"] != "ready":
        raise SystemExit(f"model failed to load: {stats['model']['error']}")
    load_s = time.monotonic() - t0

    async def ask(pos: t.Position) -> tuple[float, bool]:
        started = time.perf_counter()
        result = await client.text_document_inline_completion_async(
            t.InlineCompletionParams(
                text_document=t.TextDocumentIdentifier(uri=uri), position=pos,
                context=t.InlineCompletionContext(trigger_kind=t.InlineCompletionTriggerKind.Automatic),
            )
        )
        return (time.perf_counter() - started) * 1000, bool(result and result.items)

    client.text_document_did_open(t.DidOpenTextDocumentParams(t.TextDocumentItem(uri=uri, language_id="python", version=0, text=text)))
    opening_ms, _ = await ask(position(text, cursor))
    opening = plain(await client.protocol.send_request_async("efim/stats", {"reset": True}))

    latencies, answered = [], []
    for version, key in enumerate(keys, 1):
        pos = position(text, cursor)
        client.text_document_did_change(
            t.DidChangeTextDocumentParams(
                text_document=t.VersionedTextDocumentIdentifier(uri=uri, version=version),
                content_changes=[t.TextDocumentContentChangePartial(range=t.Range(pos, pos), text=key)],
            )
        )
        text = text[:cursor] + key + text[cursor:]
        cursor += len(key)
        ms, has_item = await ask(position(text, cursor))
        latencies.append(ms)
        if has_item:
            answered.append(ms)
        if args.progress and version % 50 == 0:
            print(f"  {fmt}: {version}/{len(keys)} keystrokes", file=sys.stderr)
    stats = plain(await client.protocol.send_request_async("efim/stats", {}))
    await client.shutdown_async(None)
    client.exit(None)
    await client.stop()
    return {
        "format": fmt,
        "keystrokes": len(keys),
        "model_load_s": round(load_s, 1),
        "opening_ms": round(opening_ms, 1),
        "opening_prompt_tokens": opening["promptTokens"],
        "reuse_ratio": stats["reuseRatio"],
        "prefilled_per_request": round(stats["prefilledTokens"] / max(1, stats["requests"]), 2),
        "ttft_ms": stats["ttftMs"],
        "server_latency_ms": stats["latencyMs"],
        "engine_latency_ms": stats["engineLatencyMs"],
        "suggestion_ms_p50": round(percentile(latencies, 50), 1),
        "suggestion_ms_p99": round(percentile(latencies, 99), 1),
        "answered": len(answered),
        "answered_ms_p50": round(percentile(answered, 50), 1),
        "typing_through_hits": stats["typingThroughHits"],
        "rebases": stats["sessions"]["rebases"],
        "background": {k: stats[k] for k in ("warmup", "nextEdit") if k in stats},
        "cpu_threads": {k: v for k, v in stats.get("engine", {}).items() if k.startswith("cpuThread")},
        "worst": sorted(((round(ms, 1), i, keys[i]) for i, ms in enumerate(latencies)), reverse=True)[:5],
    }


def _ratios(label: str, a: dict, b: dict) -> str:
    """One line of p50 ratios a / b of two formats measured side by side."""
    return (
        f"{label}: TTFT p50 {a['ttft_ms']['p50'] / b['ttft_ms']['p50']:.3f}, "
        f"engine-computed line p50 {a['engine_latency_ms']['p50'] / b['engine_latency_ms']['p50']:.3f}, "
        f"all-requests line p50 {a['suggestion_ms_p50'] / b['suggestion_ms_p50']:.3f}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--module", default="heapq.py")
    ap.add_argument("--function", default="_siftdown")
    ap.add_argument("--formats", default="efim,fim")
    ap.add_argument("--limit", type=int, default=0, help="type only the first N keystrokes (0: the whole body)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--config", help="settings (JSON) added to every format's, e.g. '{\"kvDisk\": false}'")
    ap.add_argument("--server-log", help="each server's log goes to SERVER_LOG.<format> (default: stderr)")
    ap.add_argument("--server-log-level", default="warning", help="the servers' --log-level (debug: one line per engine request)")
    ap.add_argument("--progress", action="store_true")
    args = ap.parse_args(argv)

    text, cursor, body = blank_function(args.module, args.function)
    keys = key_presses(body)
    if args.limit:
        keys = keys[: args.limit]
    results = {}
    for fmt in args.formats.split(","):
        with tempfile.TemporaryDirectory(prefix="efim-typing-kv-") as kv_dir:  # a fresh server: no KV from earlier runs
            results[fmt] = asyncio.run(run_format(fmt, args, text, cursor, keys, kv_dir))
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    newlines = sum(k.startswith("\n") for k in keys)
    print(f"{args.module}:{args.function} — {len(keys)} keystrokes ({newlines} newlines), model {args.model}, maxTokens "
          f"{args.max_tokens}; efim/fim: fimTokens add, adapter none, multiline never; served: the defaults")
    print(f"{'format':12} {'reuse':>6} {'prefill/req':>11} {'TTFT p50':>9} {'TTFT p99':>9} {'line p50 (engine)':>17} "
          f"{'line p50 (all)':>14} {'p99 (all)':>9} {'typed-thru':>10} {'opening':>8} {'rebases':>7}")
    for fmt, r in results.items():
        print(
            f"{fmt:12} {r['reuse_ratio']:6.3f} {r['prefilled_per_request']:11.1f} {r['ttft_ms']['p50']:7.1f}ms {r['ttft_ms']['p99']:7.1f}ms "
            f"{r['engine_latency_ms']['p50']:15.1f}ms {r['suggestion_ms_p50']:12.1f}ms {r['suggestion_ms_p99']:7.0f}ms "
            f"{r['typing_through_hits']:10d} {r['opening_ms']:6.0f}ms {r['rebases']:7d}"
        )
    for fmt, r in results.items():
        print(f"{fmt} slowest keystrokes (ms, index, key): {r['worst']}")
    for label, a, b in (("served C kernels / torch", "served", "served-torch"), ("efim/fim", "efim", "fim")):
        if a in results and b in results:
            print(_ratios(label, results[a], results[b]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
