"""`efim bench restart`: the first suggestion after a server restart, cold vs warm from the
KV disk tier (engine.kv.disk_tier).

Through the engine API (`engine.local.load_engine`, the factory `efim serve` uses), each
phase in a fresh Python process, as a restart is:
1. cold: start an engine with the tier on an empty directory, one tiny first request
   (as `efim_lsp.engine_holder` does after a load), then the request at the place; close
   (the document's KV is written).
2. warm: a fresh process starts an engine on the same directory, waits for the tier's
   preload (timed: read + verify), the first request, then the same request.
Reported: first TTFT of each, prefilled tokens, bytes per document, disk read bandwidth
(file bytes / read-and-verify seconds). The file was just written, so it is read from the
OS page cache: the bandwidth is the tier's (read, checksum, tensors), not the drive's.

The document is a CPython stdlib module read at run time (never a committed copy).
Module top level imports only the stdlib (the CLI imports it to add arguments).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

DEFAULT_MODULE = "argparse.py"
PREFIX_CHARS, SUFFIX_CHARS = 6000, 2000  # about the server's 1536 + 512 token windows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default")
    parser.add_argument("--module", default=DEFAULT_MODULE, help="stdlib file the document is (default: %(default)s)")
    parser.add_argument("--dir", help="KV directory (default: a fresh temporary one, removed after)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--phase", choices=("cold", "warm"), help=argparse.SUPPRESS)  # one process's part
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def _request(module: str, max_tokens: int):
    from engine.api import InfillRequest  # noqa: PLC0415

    text = (Path(sysconfig.get_paths()["stdlib"]) / module).read_text(encoding="utf-8")
    at = text.index("\n    def ", len(text) // 2) + 5  # a method's start, mid-file
    return InfillRequest(
        key=f"file://{module}", prefix=text[max(0, at - PREFIX_CHARS) : at], suffix=text[at : at + SUFFIX_CHARS],
        max_tokens=max_tokens, format="efim",
    )


def _phase(args: argparse.Namespace) -> dict:
    from engine.api import InfillRequest  # noqa: PLC0415
    from engine.local import load_engine  # noqa: PLC0415

    t0 = time.perf_counter()
    engine = load_engine(args.model, threads=args.threads, kv_disk=args.dir)
    started = time.perf_counter()
    info = engine.info()
    assert engine.disk_tier is not None
    engine.disk_tier.wait_loaded(120)
    loaded = time.perf_counter()
    fmt = "efim" if info.supports_fim else "prefix"
    engine.submit(InfillRequest(key="warm-up", prefix="def f(", suffix="\n", max_tokens=1, cache=False, format=fmt)).result(120)
    req = _request(args.module, args.max_tokens)
    if not info.supports_fim:
        import msgspec  # noqa: PLC0415

        req = msgspec.structs.replace(req, format="prefix")
    done = engine.submit(req).result(300)
    tier = engine.disk_tier.stats()
    t_close = time.perf_counter()
    engine.close()
    closed = time.perf_counter()
    from engine.kv.disk_format import list_files  # noqa: PLC0415

    files = list_files(Path(args.dir))
    return {
        "phase": args.phase,
        "model": info.model,
        "load_engine_s": round(started - t0, 3),
        "preload_wait_ms": round((loaded - started) * 1e3, 1),
        "ttft_ms": round(done.stats.ttft_ms, 1),
        "prompt_tokens": done.stats.prompt_tokens,
        "prefilled_tokens": done.stats.prefilled_tokens,
        "reused_tokens": done.stats.reused_tokens,
        "text": done.text,
        "loaded_files": tier.loaded_files,
        "loaded_bytes": tier.loaded_bytes,
        "load_seconds": tier.load_seconds,
        "close_ms": round((closed - t_close) * 1e3, 1),
        "file_bytes": [f.nbytes for f in files],
    }


def run_cli(args: argparse.Namespace) -> int:
    if args.phase:
        from bench.torch_threads import torch_threads  # noqa: PLC0415

        with torch_threads(args.threads):
            print(json.dumps(_phase(args)))
        return 0
    own = args.dir is None
    directory = args.dir or tempfile.mkdtemp(prefix="efim-bench-kv-")
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    results = {}
    try:
        for phase in ("cold", "warm"):
            cmd = [sys.executable, "-m", "efim_tools.cli", "bench", "restart", "--phase", phase, "--dir", directory,
                   "--model", args.model, "--module", args.module, "--max-tokens", str(args.max_tokens)]
            if args.threads:
                cmd += ["--threads", str(args.threads)]
            out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
            results[phase] = json.loads(out.strip().splitlines()[-1])
    finally:
        if own:
            import shutil  # noqa: PLC0415

            shutil.rmtree(directory, ignore_errors=True)
    cold, warm = results["cold"], results["warm"]
    summary = {
        "model": cold["model"],
        "document": args.module,
        "prompt_tokens": cold["prompt_tokens"],
        "cold_ttft_ms": cold["ttft_ms"],
        "warm_ttft_ms": warm["ttft_ms"],
        "cold_prefilled": cold["prefilled_tokens"],
        "warm_prefilled": warm["prefilled_tokens"],
        "same_text": cold["text"] == warm["text"],
        "bytes_per_document": cold["file_bytes"][0] if cold["file_bytes"] else 0,
        "write_at_close_ms": cold["close_ms"],
        "load_ms": round(warm["load_seconds"] * 1e3, 1),
        "read_mb_s": round(warm["loaded_bytes"] / warm["load_seconds"] / 1e6, 1) if warm["load_seconds"] else 0.0,
        "preload_wait_ms": warm["preload_wait_ms"],
    }
    if args.json:
        print(json.dumps(summary))
        return 0
    print(f"model {summary['model']}, document {args.module} ({summary['prompt_tokens']} prompt tokens), engine API, fresh process per phase")
    print(f"first TTFT cold           {summary['cold_ttft_ms']:8.1f} ms  (prefilled {summary['cold_prefilled']} tokens)")
    print(f"first TTFT warm from disk {summary['warm_ttft_ms']:8.1f} ms  (prefilled {summary['warm_prefilled']} tokens)  same text: {summary['same_text']}")
    print(f"bytes per document {summary['bytes_per_document']:,}  written at close in {summary['write_at_close_ms']} ms")
    print(f"load (read + verify) {summary['load_ms']} ms = {summary['read_mb_s']} MB/s (page cache); preload done {summary['preload_wait_ms']} ms after the engine started")
    return 0
