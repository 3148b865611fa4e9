"""Navigation workload: a person touring CPython standard-library modules, replayed with
`efim replay --compare navigation` (today, warm-ahead, document-kv, all; each on a fresh
server with the default model settings otherwise).

The tour jumps between functions of the same module and across modules, retypes line
tails, adds lines, pastes and undoes, pausing like a person (0.3-2 s of reading after
most jumps, none after some; 80-250 ms between keys); the replay is paced (each answer
awaited, every pause kept), so warm-up during the pauses counts. The stdlib sources are
read from this machine at run time (never copied into the repo); the modules are drawn
from `--modules` by `--seed` among those with at least `--min-functions` functions.

    python bench/navigation_tour.py                          # 16 stops over 3 modules
    python bench/navigation_tour.py --visits 8 --limit 60    # a short check

Everything after `--` goes to `efim replay` unchanged (e.g. `-- --server "..."`).
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import shlex
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

MODULES = ("textwrap", "shlex", "csv", "calendar", "fractions", "configparser", "difflib", "string", "json/decoder", "argparse")


def function_count(path: Path) -> int:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return 0
    return sum(isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) for node in ast.walk(tree))


def pick_modules(stdlib: Path, names: list[str], count: int, min_functions: int, seed: int) -> list[Path]:
    usable = [stdlib / f"{m}.py" for m in names if (stdlib / f"{m}.py").is_file()]
    usable = [p for p in usable if function_count(p) >= min_functions]
    return random.Random(seed).sample(usable, min(count, len(usable)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modules", nargs="+", default=list(MODULES), help="stdlib modules to draw from (paths relative to the stdlib, without .py)")
    parser.add_argument("--files", type=int, default=3, help="modules in the tour (default 3)")
    parser.add_argument("--min-functions", type=int, default=6, help="only modules with at least this many functions (default 6)")
    parser.add_argument("--visits", type=int, default=16, help="stops in the tour (default 16)")
    parser.add_argument("--sessions", type=int, default=1, help="tours (default 1)")
    parser.add_argument("--settle", type=float, default=0.0, help="seconds the files are open before the first jump (default 0: a cold start)")
    parser.add_argument("--no-pause-rate", type=float, default=0.3, help="share of jumps typed into at once (default 0.3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--limit", type=int, help="completion requests replayed per tour (default: all)")
    parser.add_argument("--speed", choices=("paced", "max", "realtime"), default="paced")
    parser.add_argument("--model", default="default", help="server model (default: the embedded SmolLM2-135M with its adapter)")
    parser.add_argument("--config", action="append", default=[], help="extra settings JSON merged into every configuration")
    parser.add_argument("--out", type=Path, help="keep the tours here (default: a temporary directory)")
    parser.add_argument("--json", type=Path, help="write the comparison as JSON")
    args, passthrough = parser.parse_known_args(argv)
    if passthrough and passthrough[0] == "--":
        passthrough = passthrough[1:]

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    sources = pick_modules(stdlib, args.modules, args.files, args.min_functions, args.seed)
    if not sources:
        print(f"none of the modules {args.modules} under {stdlib} has {args.min_functions} functions", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="efim-navigation-tour-") as tmp:
        out = args.out or Path(tmp)
        efim = [sys.executable, "-m", "efim_tools.cli"]
        synth = [*efim, "trace", "synth", "--tour", *map(str, sources), "-o", str(out), "--files", str(args.files),
                 "--visits", str(args.visits), "--sessions", str(args.sessions), "--seed", str(args.seed),
                 "--no-pause-rate", str(args.no_pause_rate), "--settle", str(args.settle),
                 "--client-styles", "ours", "--late-open-rate", "0"]  # the tours of docs/navigation.md's tables
        print("$ " + shlex.join(synth), file=sys.stderr, flush=True)
        subprocess.run(synth, check=True)
        settings = {"model": args.model}  # the default configuration: the navigation switches are the only difference
        for extra in args.config:
            settings.update(json.loads(extra))
        # --no-accept: every configuration replays exactly the same key presses
        replay = [*efim, "replay", str(out), "--compare", "navigation", "--speed", args.speed, "--no-accept",
                  "--config", json.dumps(settings)]
        if args.limit:
            replay += ["--limit", str(args.limit)]
        if args.json:
            replay += ["--json", str(args.json)]
        replay += passthrough
        print("$ " + shlex.join(replay), file=sys.stderr, flush=True)
        return subprocess.run(replay).returncode


if __name__ == "__main__":
    sys.exit(main())
