"""Bundled workload: typing traces synthesised from CPython standard-library modules,
replayed with `efim replay --compare` (fim-nocache, fim, efim, each on a fresh server).

The stdlib sources are read from this machine at run time (never copied into the repo).

    python bench/stdlib_traces.py --limit 40                 # TTFT / prefill comparison
    python bench/stdlib_traces.py --limit 40 --users 4       # throughput with 4 people typing

Everything after `--` goes to `efim replay` unchanged (e.g. `-- --plot ttft.png`).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

MODULES = ("textwrap", "argparse", "json/decoder", "shlex", "string", "calendar", "difflib", "configparser", "csv", "fractions")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modules", nargs="+", default=list(MODULES), help="stdlib modules (paths relative to the stdlib, without .py)")
    parser.add_argument("--sessions", type=int, default=8, help="typing sessions to synthesise (default 8)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--limit", type=int, default=40, help="completion requests replayed per trace (default 40)")
    parser.add_argument("--users", type=int, default=1, help="concurrent people on one server (default 1)")
    parser.add_argument("--speed", choices=("max", "realtime"), default="max")
    parser.add_argument("--model", default="default", help='server model (default: the embedded SmolLM2-135M)')
    parser.add_argument("--config", action="append", default=[], help="extra settings JSON merged into every configuration")
    parser.add_argument(
        "--accept", action="store_true",
        help="let the simulated people accept matching suggestions (default: off, so every configuration "
        "replays exactly the same key presses and the comparison is like for like)",
    )
    parser.add_argument("--out", type=Path, help="keep the traces here (default: a temporary directory)")
    parser.add_argument("--json", type=Path, help="write the comparison as JSON")
    args, passthrough = parser.parse_known_args(argv)
    if passthrough and passthrough[0] == "--":
        passthrough = passthrough[1:]

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    sources = [str(stdlib / f"{m}.py") for m in args.modules if (stdlib / f"{m}.py").is_file()]
    if not sources:
        print(f"none of the modules {args.modules} exist under {stdlib}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="efim-stdlib-traces-") as tmp:
        out = args.out or Path(tmp)
        efim = [sys.executable, "-m", "efim_tools.cli"]
        synth = [*efim, "trace", "synth", *sources, "-o", str(out), "--sessions", str(args.sessions), "--seed", str(args.seed)]
        subprocess.run(synth, check=True)
        settings = {"fimTokens": "add", "adapter": "none", "model": args.model}  # prefix-first layout (see lsp_typing.py)
        for extra in args.config:
            settings.update(json.loads(extra))
        replay = [*efim, "replay", str(out), "--compare", "--limit", str(args.limit), "--users", str(args.users),
                  "--speed", args.speed, "--config", json.dumps(settings)]
        if not args.accept:
            replay.append("--no-accept")
        if args.json:
            replay += ["--json", str(args.json)]
        replay += passthrough
        print("$ " + shlex.join(synth), file=sys.stderr, flush=True)
        print("$ " + shlex.join(replay), file=sys.stderr, flush=True)
        return subprocess.run(replay).returncode


if __name__ == "__main__":
    sys.exit(main())
