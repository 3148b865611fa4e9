"""`efim` command line: a thin dispatcher over `efim_tools.commands.*`.

Each subcommand lives in its own module exposing `register(subparsers)`, which adds
its parser and sets `func` (called with the parsed args, returns an exit code).
Modules are imported lazily by name so `efim --help` stays fast and a broken optional
command never takes the others down.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

# Before torch loads: how long OpenMP's threads spin between kernels before they sleep.
# libgomp's default (300,000 spins) lets a team stall 10-50x when another process holds a
# core; sleeping at once (OMP_WAIT_POLICY=PASSIVE) costs 1.6x on an idle machine. A short
# spin keeps the idle speed, and the engine drops to one thread while the machine is busy
# (engine.runtime.cpu_threads has the measurements). A user's own setting wins.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "5000")

# Subcommands, each a module that adds its own parser. `serve` is the language server
# itself (`efim_lsp.serve`); every other command is an offline tool.
COMMAND_MODULES = {"serve": "efim_lsp.serve"}
COMMANDS = (
    "serve",
    "complete",
    "bench",
    "trace",
    "replay",
    "demo",
    "train",
    "eval",
    "cache",
    "export",
)

# Commands that start `efim serve` processes to measure or replay them (efim_lsp.serve.daemon_choice).
MEASURING_COMMANDS = ("bench", "replay", "eval", "demo")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="efim", description="EFIM code-completion language server and tools")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging on stderr")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        module = importlib.import_module(COMMAND_MODULES.get(name, f"efim_tools.commands.{name}"))
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        stream=sys.stderr,
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    if args.command in MEASURING_COMMANDS:
        # Each server these start has its own engine: a shared daemon would carry one run's
        # KV into the next configuration's. Those that measure the daemon pass --daemon.
        os.environ.setdefault("EFIM_DAEMON", "0")
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # a clear message, not a traceback, for user-facing errors
        from engine.api import EngineError

        if isinstance(exc, (EngineError, FileNotFoundError, ValueError)):
            print(f"efim: error: {exc}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
