"""`python -m engine.daemon`: run an engine daemon (what `efim serve --daemon` starts; see
`engine.daemon.server`). Exit codes: 0 after an idle timeout or SIGTERM, 2 when the model
cannot load (the reason is the log's last line, which the starting front reports)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path

import msgspec


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.daemon", description="the per-user efim engine daemon")
    parser.add_argument("--socket", type=Path, help="the Unix socket to serve on (its folder must be 0700)")
    parser.add_argument("--check", action="store_true",
                        help="only run the model's weight-free checks (engine.local.check_model) and exit: 0, or 2 with the reason")
    parser.add_argument("--config", required=True, help="the DaemonConfig as JSON (engine.daemon.config)")
    parser.add_argument("--kv-budget", help="ceiling for all KV (default: the engine's default)")
    parser.add_argument("--idle-timeout", type=float, default=60.0, help="seconds to stay up once the last front has gone")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    args = parser.parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s")
    log = logging.getLogger("engine.daemon")

    from engine.api import EngineError
    from engine.daemon.config import DaemonConfig
    from engine.daemon.server import EngineDaemon
    from engine.local import load_engine

    config = msgspec.json.decode(args.config.encode(), type=DaemonConfig)
    if args.check:
        from engine.local import check_model

        try:
            check_model(config.model, quant=config.quant, fim_tokens=config.fim_tokens, adapter=config.adapter)
        except Exception as exc:  # noqa: BLE001 - told to the front as one line
            print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
            return 2
        return 0
    if args.socket is None:
        parser.error("--socket is required")
    kv_budget = int(args.kv_budget) if args.kv_budget and args.kv_budget.isdigit() else args.kv_budget
    log.info("loading %s for the engine daemon (config %s)", config.model, config.digest())
    try:
        engine = load_engine(config.model, kv_budget=kv_budget, **config.load_arguments())
    except (EngineError, OSError, ValueError) as exc:
        log.error("the model failed to load: %s: %s", type(exc).__name__, exc)
        return 2
    daemon = EngineDaemon(engine, args.socket, idle_timeout=args.idle_timeout, kv_budget=engine.kv_budget_bytes)
    try:
        asyncio.run(daemon.serve())
    finally:
        engine.close()
        logging.shutdown()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip the interpreter's teardown of torch (efim_lsp.serve has the measurements)
