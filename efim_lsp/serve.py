"""`efim serve`: the language server an editor starts (stdio).

stdout carries only the LSP protocol; logs go to stderr or `--log-file`.

Exit: 0 after `shutdown` + `exit`, 1 when the server stops without `shutdown`
(`exit` alone, stdin closed, SIGTERM). The process ends promptly after that:
worker threads still busy (a model load, a long prefill) are not waited for
beyond `EXIT_GRACE_SECONDS`, and the interpreter's teardown is skipped (see
`_exit_promptly`).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from pathlib import Path

EXIT_GRACE_SECONDS = 0.5


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the language server over stdio (what an editor starts)")
    p.add_argument("--model", help='"default" (embedded SmolLM2-135M) or a HF folder / GGUF path; initializationOptions may override it')
    p.add_argument("--prompt-format", choices=("efim", "fim"), help="default promptFormat (initializationOptions override it)")
    p.add_argument("--adapter", help="default adapter: auto (the shipped FIM adapter for the default model, when marked ready), none, or a LoRA path")
    p.add_argument("--fim-tokens", choices=("auto", "add"), help="default fimTokens (add: StarCoder sentinels for models without FIM; quality needs training)")
    p.add_argument("--backend", choices=("local", "llama.cpp", "openai"), help="default backend: local (in-process engine) or a remote server (docs/deploy.md)")
    p.add_argument("--endpoint", help="default endpoint: the remote server's base URL")
    p.add_argument("--remote-model", help="default remoteModel: the model name an openai backend is asked for")
    p.add_argument("--api-key-env", help="default apiKeyEnv: the NAME of an environment variable holding the API key")
    p.add_argument("--dtype", help="engine weight dtype (bf16, fp32, ...)")
    p.add_argument("--quant", choices=("none", "int8", "int4", "auto", "mixed"), help="engine weight format: none (bf16/fp32), int8, int4, auto (a GGUF keeps its own class), mixed (int4 decode steps, int8/bf16 prefill: --prefill); docs/model.md")
    p.add_argument("--prefill", choices=("bf16", "int8"), help="a mixed model's prefill steps: int8 GEMMs (the default) or its bf16 copies (docs/model.md \"int8 prefill\")")
    p.add_argument("--kv-dtype", choices=("auto", "bf16", "fp16", "fp32", "int8"), help="KV cache format: auto (the model dtype) or int8 (per token-head scales: about half the bytes, so --kv-budget holds ~2x the tokens; docs/model.md \"int8 KV cache\")")
    p.add_argument("--kv-budget", help="ceiling for all KV, e.g. 512MB (default: 25%% of available RAM, at most 4 GiB): 1/2 radix-cached pool, 1/2 the running requests' working KV and the per-document KV kept between keystrokes")
    p.add_argument("--kv-disk", action=argparse.BooleanOptionalAction, default=None, help="default kvDisk: keep documents' KV on disk so a restart starts with it (default on)")
    p.add_argument("--kv-disk-budget", help='default kvDiskBudget: most disk for KV files, e.g. "2G" (default)')
    p.add_argument("--threads", type=int, help="torch threads for the engine")
    p.add_argument("--daemon", action=argparse.BooleanOptionalAction, default=None,
                   help="run the local engine in the user's engine daemon, shared by every efim serve with the same "
                        "model and engine settings (started when none runs; docs/daemon.md). The default where the "
                        "platform has Unix sockets, unless EFIM_DAEMON=0; --no-daemon: in this process")
    p.add_argument("--daemon-idle-timeout", type=float, default=60.0, metavar="S",
                   help="seconds a daemon this front starts stays up after its last front has gone (default 60)")
    p.add_argument("--log-file", type=Path, help="write logs here instead of stderr")
    p.add_argument("--log-level", default=None, choices=("debug", "info", "warning", "error"))
    p.add_argument("--record", type=Path, metavar="DIR", help="record this session's LSP traffic as a trace in DIR (opt-in: traces contain source code)")
    p.set_defaults(func=run)


DAEMON_ENV = "EFIM_DAEMON"
_OFF, _ON = ("0", "false", "no", "off"), ("1", "true", "yes", "on")


def daemon_choice(args: argparse.Namespace) -> tuple[bool, bool]:
    """(use the engine daemon, the user asked for it): `--daemon` / `--no-daemon` first, then
    `EFIM_DAEMON` (0/1), else on. Off where the platform cannot host one (no Unix sockets or
    per-user file modes), saying so when it was asked for."""
    flag = getattr(args, "daemon", None)
    explicit = flag is not None
    if flag is None:
        value = os.environ.get(DAEMON_ENV, "").strip().lower()
        if value in _OFF + _ON:
            flag, explicit = value in _ON, True
        else:
            if value:
                logging.getLogger(__name__).warning("%s=%r: expected 0 or 1; using the engine daemon", DAEMON_ENV, value)
            flag = True
    if flag:
        from engine.daemon import supported  # noqa: PLC0415 - no torch in this process

        if not supported():
            log = logging.getLogger(__name__)
            (log.warning if explicit else log.info)(
                "this platform has no Unix sockets or per-user file modes: the engine runs in this process")
            return False, explicit
    return flag, explicit


def engine_factory(args: argparse.Namespace):
    """`factory(model, *, fim_tokens, adapter, kv_disk, kv_disk_budget[, backend, endpoint, remote_model,
    api_key_env]) -> Engine`: engine.local.load_engine with the CLI's engine flags; with
    `--daemon`, the same engine hosted by the user's engine daemon (engine.daemon.open_daemon_engine);
    for a remote backend, engine.remote.open_remote_engine (which loads the model's tokenizer only).
    `model_preflight(args)` builds the checks that go with it."""

    def load(model: str, *, fim_tokens: str = "auto", adapter: str = "auto", kv_disk: bool = True, kv_disk_budget: str = "2G",
             backend: str = "local", endpoint: str = "", remote_model: str = "", api_key_env: str = ""):
        if backend != "local":
            from engine.remote import open_remote_engine  # httpx and the tokenizer, no weights

            return open_remote_engine(backend, endpoint, model=model, remote_model=remote_model or None,
                                      api_key_env=api_key_env or None)
        kwargs = {}
        for name in ("dtype", "quant", "prefill", "kv_budget", "kv_dtype", "threads"):  # this parser's flags
            value = getattr(args, name)
            if value is not None:
                kwargs[name] = value
        daemon, asked = daemon_choice(args)
        if daemon:
            from engine.api import EngineError  # noqa: PLC0415
            from engine.daemon import open_daemon_engine  # no torch in this process

            try:
                return open_daemon_engine(model, fim_tokens=fim_tokens, adapter=adapter, kv_disk=kv_disk,
                                          kv_disk_budget=kv_disk_budget, idle_timeout=args.daemon_idle_timeout, **kwargs)
            except (EngineError, OSError) as exc:
                if asked:
                    raise
                # The default, not the user's choice: an editor still gets its suggestions.
                logging.getLogger(__name__).warning("the engine daemon is not available (%s): the engine runs in this process "
                                                    "(--no-daemon or EFIM_DAEMON=0 skips the daemon)", exc)
        from engine.local import load_engine  # torch loads here, in the server's loader thread

        return load_engine(model, fim_tokens=fim_tokens, adapter=adapter, kv_disk=kv_disk, kv_disk_budget=kv_disk_budget, **kwargs)

    return load


def model_preflight(args: argparse.Namespace):
    """`preflight(model, *, fim_tokens, adapter, **factory options)`: a new local model's
    weight-free checks (engine.local.check_model with the CLI's --quant); EngineHolder runs
    them while the old engine still serves, before giving it up."""

    def preflight(model: str, *, fim_tokens: str = "auto", adapter: str = "auto", **_ignored) -> None:
        if daemon_choice(args)[0]:  # the checks import torch: in a process of their own, so this front stays small
            from engine.daemon import check_daemon_model

            return check_daemon_model(model, quant=args.quant, fim_tokens=fim_tokens, adapter=adapter)
        from engine.local import check_model

        check_model(model, quant=args.quant, fim_tokens=fim_tokens, adapter=adapter)

    return preflight


def _private_file(path: str) -> None:
    """Create `path` readable by the user alone (0600), or narrow an existing one the user
    owns: a log names files and, at DEBUG, quotes code."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        if os.fstat(fd).st_uid == os.getuid():
            os.fchmod(fd, 0o600)
    finally:
        os.close(fd)


def _configure_logging(args: argparse.Namespace) -> None:
    level = getattr(logging, (args.log_level or ("debug" if getattr(args, "verbose", False) else "info")).upper())
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    handler: logging.Handler
    if args.log_file:
        _private_file(args.log_file)
        handler = logging.FileHandler(args.log_file, encoding="utf-8")
    else:
        handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel(level)
    # pygls logs every message body at INFO ("Sending data: ..."), documents included.
    logging.getLogger("pygls").setLevel(logging.DEBUG if level <= logging.DEBUG and args.log_level == "debug" else logging.WARNING)


def _recorder(directory: Path):
    """The opt-in trace recorder: an observer `(direction, message, t)` with `close()`."""
    from efim_lsp import recording

    return recording.make_recorder(directory)


def _claim_stdout():
    """Keep file descriptor 1 for the protocol alone.

    A stray print — ours, a library's, or C code's — must not corrupt the LSP
    stream: the protocol gets a private duplicate of stdout, and fd 1 and
    `sys.stdout` are pointed at stderr.
    """
    sys.stdout.flush()
    protocol_fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return os.fdopen(protocol_fd, "wb")


def run(args: argparse.Namespace) -> int:
    _configure_logging(args)
    from efim_lsp.server import build_server

    defaults = {}
    if args.model:
        defaults["model"] = args.model
    if args.prompt_format:
        defaults["promptFormat"] = args.prompt_format
    if args.fim_tokens:
        defaults["fimTokens"] = args.fim_tokens
    if args.adapter:
        defaults["adapter"] = args.adapter
    for flag, key in (("backend", "backend"), ("endpoint", "endpoint"), ("remote_model", "remoteModel"), ("api_key_env", "apiKeyEnv")):
        if getattr(args, flag):
            defaults[key] = getattr(args, flag)
    if args.kv_disk is not None:
        defaults["kvDisk"] = args.kv_disk
    if args.kv_disk_budget:
        defaults["kvDiskBudget"] = args.kv_disk_budget
    observer = _recorder(args.record) if args.record else None
    from efim_lsp.context.source import WorkspaceContext  # cross-file context; idle while `context` is off

    context = WorkspaceContext()
    server = build_server(
        engine_factory(args), preflight=model_preflight(args), message_observer=observer, defaults=defaults, context_source=context
    )
    if observer is not None:
        from lsprotocol import types

        observer.on_problem = lambda message: server.show(message, types.MessageType.Error)
    protocol_out = _claim_stdout()
    code = 1
    log = logging.getLogger(__name__)
    try:
        code = server.start_io(sys.stdin.buffer, protocol_out)
    finally:
        stopping = time.monotonic()
        server.close()
        context.close()
        if observer is not None:
            observer.close()
        log.debug("stopped the server's parts in %.3f s", time.monotonic() - stopping)
    _exit_promptly(code)
    return code  # not reached


def _exit_promptly(code: int) -> None:
    """End the process now that the server's parts are closed, without the interpreter's teardown.

    The interpreter's own exit joins every non-daemon thread (a model load in progress
    would hold it up for as long as it runs) and then tears down torch and every module
    (measured: 2-3 s on a loaded 2-core machine, after the server had stopped in 3 ms).
    Worker threads get `EXIT_GRACE_SECONDS` to finish; logs and stdio are flushed; then
    `os._exit`. Everything that must reach disk (the trace, the log file) is closed by now.
    """
    log = logging.getLogger(__name__)
    deadline = time.monotonic() + EXIT_GRACE_SECONDS
    main = threading.main_thread()
    for thread in threading.enumerate():
        if thread is not main and not thread.daemon:
            thread.join(max(0.0, deadline - time.monotonic()))
    stuck = [t.name for t in threading.enumerate() if t is not main and not t.daemon and t.is_alive()]
    if stuck:
        log.warning("exiting with busy threads (%s): not waiting for them", ", ".join(stuck))
    log.debug("exiting with code %d", code)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
