"""`python -m engine.daemon`: run an engine daemon (what `efim serve --daemon` starts; see
`engine.daemon.server`). Exit codes: 0 after an idle timeout or SIGTERM, 2 when the model
cannot load (the reason is the log's last line, which the starting front reports)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
from pathlib import Path

import msgspec

MAIN_AT = time.monotonic()


def _interpreter_seconds() -> float | None:
    """Seconds from this process's exec to `main` (Python's start and the imports above),
    from /proc/self/stat's start time (Linux; None elsewhere)."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start time, ticks since boot
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - (time.monotonic() - MAIN_AT) - started)
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.daemon", description="the per-user efim engine daemon")
    parser.add_argument("--socket", type=Path, help="the Unix socket to serve on (its folder must be 0700)")
    parser.add_argument("--check", action="store_true",
                        help="only run the model's weight-free checks (engine.local.check_model) and exit: 0, or 2 with the reason")
    parser.add_argument("--config", required=True, help="the DaemonConfig as JSON (engine.daemon.config)")
    parser.add_argument("--kv-budget", help="ceiling for all KV (default: the engine's default)")
    parser.add_argument("--idle-timeout", type=float, default=60.0, help="seconds to stay up once the last front has gone")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    parser.add_argument("--keep-standby", action="store_true",
                        help="keep a standby daemon with the model loaded that takes over when this one dies (engine.daemon.standby)")
    parser.add_argument("--standby", action="store_true", help="be that standby (started by a serving daemon; stdin its pipe)")
    args = parser.parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s")

    interpreter_s = _interpreter_seconds()
    from engine.daemon.config import DaemonConfig
    from engine.daemon.server import EngineDaemon  # noqa: F401 - imported here, timed as the imports
    from engine.local import load_engine  # noqa: F401 - torch
    imported_at = time.monotonic()

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
    held = None
    standby = None
    took_over = False
    from engine.daemon.standby import DAEMON_NAME, fork_standby, forked_standby_wanted, set_process_name, stand_by

    if not args.standby:
        set_process_name(DAEMON_NAME)
    if not args.standby and not args.keep_standby:
        # Single-threaded here (no engine, no loop yet): fork the standby that takes over if
        # this daemon dies. A standby that takes over forks its own before loading the model.
        while forked_standby_wanted():
            got = fork_standby(held)
            if not isinstance(got, int):
                standby = got
                break
            held = stand_by(args.socket, args.socket.with_suffix(".lock"), pipe_fd=got)
            if held is None:
                return 0
            took_over = True
    try:
        return _serve(args, argv, config, kv_budget, held, standby, {
            "interpreterS": None if interpreter_s is None else round(interpreter_s, 3),
            "importsS": round(imported_at - MAIN_AT, 3), "standby": args.standby or ("forked" if took_over else False)})
    finally:  # an exit this process chose (an error included): its standby must not take over
        if standby is not None:
            standby.stop()


def _serve(args, argv, config, kv_budget, held, standby, startup: dict) -> int:
    """Load the model and serve until the idle timeout or SIGTERM: 0, or 2 when the model
    cannot load. `held`: the spawn lock a standby that took over holds until it is bound."""
    from engine.api import EngineError
    from engine.daemon.server import EngineDaemon
    from engine.daemon.standby import stand_by
    from engine.local import load_engine

    log = logging.getLogger("engine.daemon")
    log.info("loading %s for the engine daemon (config %s)", config.model, config.digest())
    began = time.monotonic()
    try:
        engine = load_engine(config.model, kv_budget=kv_budget, **config.load_arguments())
    except (EngineError, OSError, ValueError) as exc:
        log.error("the model failed to load: %s: %s", type(exc).__name__, exc)
        return 2
    startup["modelS"] = round(time.monotonic() - began, 3)
    if args.standby:
        held = stand_by(args.socket, args.socket.with_suffix(".lock"))
        if held is None:
            engine.close()
            return 0
    daemon = EngineDaemon(engine, args.socket, idle_timeout=args.idle_timeout, kv_budget=engine.kv_budget_bytes)
    daemon.startup = startup  # where a (re)start's seconds go (docs/daemon.md "Restart"); the fronts wait for all of it
    if held is not None:
        daemon.after_bind.append(lambda: held.__exit__(None, None, None))  # the fronts waiting for the lock connect
    if args.keep_standby:
        from engine.daemon.standby import StandbyProcess, standby_command

        daemon.standby = StandbyProcess(standby_command(sys.argv[1:] if argv is None else argv), args.socket.with_suffix(".log"))
    elif standby is not None:
        daemon.standby = standby
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
