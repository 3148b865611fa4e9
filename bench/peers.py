"""`efim bench peers`: the same typing traces through efim-lsp and through the peer people run
today, side by side in one run, on the same GGUF and the same 2 cores.

Configurations (each on its own fresh server process, one after the other):
  local      `efim serve` on the local engine (the product's defaults; the GGUF as its model)
  llama.cpp  `efim serve` with `backend: "llama.cpp"`: EFIM prompts as token ids to llama-server
  llama.vim  llama.vim / llama.vscode's own requests (`/infill`, current line behind the middle,
             `cache_prompt`) to the same llama-server, replayed by `efim_tools.peers.llama_vim`

Traces: one function body retyped (`efim trace synth`) and a navigation tour
(`efim trace synth --tour`), synthesised from CPython standard-library modules at run time;
`--users 1,4` replays them by one person, then by four at once (four files, four slots).

Printed per configuration and user count: keystroke TTFT p50/p95/p99 and mean (efim-lsp:
measured in its server, arrival → first generated token; llama.vim: client-side, request
sent → first streamed token, which counts loopback HTTP against the peer), the whole
suggestion's latency p50/p95 (client-side), prompt tokens reused per request, and decode
ms/token where the server reports it.

    efim bench peers                       # embedded model, both traces, 1 and 4 users
    efim bench peers --gguf model.gguf --users 1 --traces function
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import sysconfig
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Any

from bench.percentiles import percentile  # nearest rank, nan for none

FUNCTION_MODULES = ("textwrap", "shlex", "csv", "fractions", "difflib", "configparser", "calendar", "string")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gguf", type=Path, help="the model both sides serve (default: `efim export gguf` of the "
                        "default model with its adapter, made once into a temp dir; else the embedded GGUF)")
    parser.add_argument("--traces", default="function,tour", help="function, tour or both")
    parser.add_argument("--users", default="1,4", help="comma-separated concurrent users")
    parser.add_argument("--configs", default="local,llama.cpp,llama.vim")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--visits", type=int, default=8, help="tour stops")
    parser.add_argument("--limit", type=int, help="completion requests per trace (default: all)")
    parser.add_argument("--speed", choices=("paced", "max"), default="paced")
    parser.add_argument("--threads", type=int, default=2, help="llama-server threads (the local engine uses the machine's)")
    parser.add_argument("--json", type=Path, help="write all figures here")


def _synth(kind: str, out: Path, seed: int, visits: int) -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    modules = [stdlib / f"{m}.py" for m in FUNCTION_MODULES if (stdlib / f"{m}.py").is_file()]
    efim = [sys.executable, "-m", "efim_tools.cli", "trace", "synth"]
    folder = out / kind
    if kind == "function":
        cmd = [*efim, str(modules[seed % len(modules)]), "-o", str(folder), "--seed", str(seed)]
    else:
        picked = [str(m) for m in modules[seed % 3 : seed % 3 + 3]]
        cmd = [*efim, "--tour", *picked, "-o", str(folder), "--seed", str(seed), "--visits", str(visits),
               "--files", "3", "--client-styles", "ours", "--late-open-rate", "0"]  # one trace per tour, as before client styles
    subprocess.run(cmd, check=True)
    return sorted(folder.glob("*.jsonl"))


def _default_gguf(tmp: Path) -> tuple[Path, str]:
    """(GGUF, what it is): the default model exported with its adapter, else the embedded file."""
    out = tmp / "efim-default.gguf"
    done = subprocess.run([sys.executable, "-m", "efim_tools.cli", "export", "gguf", str(out)],
                          capture_output=True, text=True)
    if done.returncode == 0 and out.is_file():
        return out, "the default model with its FIM adapter merged (efim export gguf)"
    from engine.model.loader import default_model_path  # noqa: PLC0415

    print(f"efim export gguf unavailable ({done.stderr.strip()[-200:]}); serving the embedded GGUF without the adapter",
          file=sys.stderr)
    return default_model_path(), "the embedded SmolLM2-135M Q4_1 GGUF, no adapter"


def _suffix_first(gguf: Path) -> bool:
    """Does the file's FIM template put the suffix first (`<spm_*>` / `<fim_suffix>` before the prefix)?"""
    import gguf as gguf_pkg  # noqa: PLC0415

    reader = gguf_pkg.GGUFReader(str(gguf))
    field = reader.fields.get("tokenizer.ggml.tokens")
    tokens = set(field.contents()) if field is not None else set()
    return "<spm_suffix>" in tokens


def _lsp_figures(result: Any) -> dict[str, Any]:
    records = [r for r in result.records if r.outcome == "answered"]
    ttft = [r.ttft_ms for r in records if r.ttft_ms is not None]
    latency = [r.latency_ms for r in records if r.latency_ms is not None]
    before, after = result.stats_before or {}, result.stats_after or {}
    if ttft:  # per request (serial replays: the probe's stats segments)
        ttft_fig = {"ttft_p50": percentile(ttft, 50), "ttft_p95": percentile(ttft, 95),
                    "ttft_p99": percentile(ttft, 99), "ttft_mean": statistics.fmean(ttft)}
    else:  # concurrent users: the server's own series over the run (its warm-up request included)
        series = after.get("ttftMs") if isinstance(after.get("ttftMs"), dict) else {}
        ttft_fig = {f"ttft_{k}": float(series.get(k, float("nan"))) for k in ("p50", "p95", "p99", "mean")}

    def delta(key: str) -> float:
        a, b = after.get(key), before.get(key)
        return (a - b) if isinstance(a, (int, float)) and isinstance(b, (int, float)) else float("nan")

    requests = delta("requests")
    return {
        "requests": len(result.records), "answered": len(records), **ttft_fig,
        "latency_p50": percentile(latency, 50), "latency_p95": percentile(latency, 95),
        "prompt_per_request": delta("promptTokens") / requests if requests else float("nan"),
        "reused_per_request": delta("reusedTokens") / requests if requests else float("nan"),
        "reuse_share": delta("reusedTokens") / delta("promptTokens") if delta("promptTokens") else float("nan"),
        "decode_ms_per_token": (after.get("decodeMsPerToken") if isinstance(after.get("decodeMsPerToken"), (int, float))
                                else float("nan")),
        "crashed": result.crashed,
    }


def _peer_figures(records: list[Any]) -> dict[str, Any]:
    ok = [r for r in records if r.error is None]
    ttft = [r.ttft_ms for r in ok if r.ttft_ms is not None]
    latency = [r.latency_ms for r in ok]
    prompt = sum(r.prompt_tokens for r in ok)
    predicted = sum(r.predicted_tokens for r in ok)
    return {
        "requests": len(records), "answered": len(ok), "errors": len(records) - len(ok),
        "ttft_p50": percentile(ttft, 50), "ttft_p95": percentile(ttft, 95), "ttft_p99": percentile(ttft, 99),
        "ttft_mean": statistics.fmean(ttft) if ttft else float("nan"),
        "latency_p50": percentile(latency, 50), "latency_p95": percentile(latency, 95),
        "prompt_per_request": prompt / len(ok) if ok else float("nan"),
        "reused_per_request": sum(r.cached_tokens for r in ok) / len(ok) if ok else float("nan"),
        "reuse_share": sum(r.cached_tokens for r in ok) / prompt if prompt else float("nan"),
        "decode_ms_per_token": sum(r.predicted_ms for r in ok) / predicted if predicted else float("nan"),
        "server_prompt_ms_p50": percentile([r.server_prompt_ms for r in ok], 50),
    }


def _replay_lsp(name: str, settings: dict[str, Any], traces: list[Any], users: int, args: argparse.Namespace) -> dict[str, Any]:
    from efim_tools.trace.replay import Config, ReplayOptions, default_server_command, replay_config  # noqa: PLC0415

    options = ReplayOptions(server=default_server_command(), users=users, speed=args.speed, limit=args.limit,
                            accept=False, request_stats=users == 1)
    result = asyncio.run(replay_config(Config(name, settings), traces, options))
    return _lsp_figures(result)


def _replay_peer(url: str, traces: list[Any], users: int, args: argparse.Namespace) -> dict[str, Any]:
    import httpx  # noqa: PLC0415

    from efim_tools.peers.llama_vim import replay_users  # noqa: PLC0415

    tokenize = httpx.Client(timeout=30.0)

    @lru_cache(maxsize=65536)
    def count(text: str) -> int:
        if not text:
            return 0
        return len(tokenize.post(url + "/tokenize", json={"content": text}).json()["tokens"])

    try:
        records = asyncio.run(replay_users(url, traces, users, count=count, speed=args.speed, limit=args.limit))
    finally:
        tokenize.close()
    return _peer_figures(records)


def run_cli(args: argparse.Namespace) -> int:
    from efim_lsp.trace_format import read_trace  # noqa: PLC0415
    from efim_tools.peers.llama_cpp import LlamaServer  # noqa: PLC0415

    kinds = [k.strip() for k in args.traces.split(",") if k.strip()]
    if not kinds or set(kinds) - {"function", "tour"}:
        raise ValueError("--traces: function, tour or both")
    users_list = [int(u) for u in args.users.split(",") if u.strip()]
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if set(configs) - {"local", "llama.cpp", "llama.vim"}:
        raise ValueError("--configs: local, llama.cpp, llama.vim")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="efim-bench-peers-") as tmp_name:
        tmp = Path(tmp_name)
        gguf, what = (args.gguf, str(args.gguf)) if args.gguf else _default_gguf(tmp)
        print(f"model: {what}\n       {gguf}", flush=True)
        traces = {kind: [read_trace(p) for p in _synth(kind, tmp, args.seed, args.visits)] for kind in kinds}
        base = {"model": str(gguf), "adapter": "none"}
        # A suffix-first template (the shipped adapter) needs llama.cpp's SPM infill order for
        # /infill (the llama.vim row); /completion with token ids (the llama.cpp row) ignores it.
        extra = ("--spm-infill",) if _suffix_first(gguf) else ()
        with LlamaServer(gguf, slots=max(4, *users_list), ctx_per_slot=4096, threads=args.threads, extra=extra) as server:
            for kind, kind_traces in traces.items():
                for users in users_list:
                    for config in configs:
                        if config == "local":
                            fig = _replay_lsp("local", base, kind_traces, users, args)
                        elif config == "llama.cpp":
                            fig = _replay_lsp("llama.cpp", {**base, "backend": "llama.cpp", "endpoint": server.url},
                                              kind_traces, users, args)
                        else:
                            fig = _replay_peer(server.url, kind_traces, users, args)
                        row = {"trace": kind, "users": users, "config": config, **fig}
                        rows.append(row)
                        _print_row(row)
    if args.json:
        args.json.write_text(json.dumps({"model": what, "rows": rows}, indent=1))
    _print_ratios(rows)
    return 0


def _print_row(r: dict[str, Any]) -> None:
    print(
        f"{r['trace']:<8} users {r['users']}  {r['config']:<10} requests {r['requests']:>4}  "
        f"TTFT p50/p95/p99 {r['ttft_p50']:7.1f}/{r['ttft_p95']:7.1f}/{r['ttft_p99']:7.1f}  mean {r['ttft_mean']:7.1f}  "
        f"suggestion p50/p95 {r['latency_p50']:7.1f}/{r['latency_p95']:7.1f} ms  "
        f"reused {r['reused_per_request']:7.1f}/{r['prompt_per_request']:7.1f} tok ({r['reuse_share']:.3f})  "
        f"decode {r['decode_ms_per_token']:.2f} ms/tok",
        flush=True,
    )


def _print_ratios(rows: list[dict[str, Any]]) -> None:
    by = {(r["trace"], r["users"], r["config"]): r for r in rows}
    for (trace, users, config), r in by.items():
        peer = by.get((trace, users, "llama.vim"))
        if config != "local" or peer is None:
            continue
        print(f"{trace} users {users}: local / llama.vim TTFT p50 {r['ttft_p50'] / peer['ttft_p50']:.2f}x, "
              f"p99 {r['ttft_p99'] / peer['ttft_p99']:.2f}x, mean {r['ttft_mean'] / peer['ttft_mean']:.2f}x")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run_cli(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
