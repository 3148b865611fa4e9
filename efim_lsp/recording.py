"""`efim serve --record DIR`: write the session's client traffic as a typing trace.

The server calls the recorder for every JSON-RPC message in and out
(`recorder(direction, message, monotonic_time)`, see `efim_lsp.protocol`). The
recorder keeps what a replay needs — documents opened, changed and closed, completion
requests and their cancellations, suggestions shown and accepted — as `format.Event`s
with the params exactly as the client sent them.

Privacy: recording is opt-in (traces contain source code). The directory is created
0700 if missing, each trace file 0600, and nothing leaves this machine: the recorder
only appends to its file. One trace per session (one server process over stdio).

Faults: a trace that cannot be created or written stops the recording (the session
goes on unrecorded); the problem is logged and reported once through `on_problem`
(the server shows it with `window/showMessage`), outside the recorder's lock.

Robustness: each event is flushed as it is written, so a server that dies mid-session
still leaves a readable trace; the header waits for the `initialize` answer because
the position encoding is negotiated there.
"""

from __future__ import annotations

import datetime as _dt
import logging
import os
import threading
from pathlib import Path
from typing import IO, Any, Callable

from efim_lsp.trace_format import DEFAULT_METHODS, Event, Header, encode_line, utc_now

log = logging.getLogger(__name__)

ACCEPT_COMMANDS = frozenset({"efim.accepted"})

# incoming method -> event kind
KINDS = {
    "textDocument/didOpen": "open",
    "textDocument/didChange": "change",
    "textDocument/inlineCompletion": "complete",
    "textDocument/completion": "complete",
    "$/cancelRequest": "cancel",
    "textDocument/didShowCompletion": "show",
    "textDocument/didPartiallyAcceptCompletion": "accept",
    "textDocument/didClose": "close",
    "efim/didMoveCursor": "cursor",
}


class Recorder:
    """Observer for `EfimProtocol.message_observer`; call `close()` when the server stops."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self.path: Path | None = None
        self._file: IO[bytes] | None = None
        self._lock = threading.Lock()
        self._t0: float | None = None
        self._initialize_id: Any = None
        self._init_params: dict[str, Any] | None = None
        self._backlog: list[Event] = []
        self.events_written = 0
        self.on_problem: Callable[[str], None] | None = None
        self._problems: list[str] = []

    # The protocol calls this for every message; it must never raise into the server.
    def __call__(self, direction: str, message: dict[str, Any], at: float) -> None:
        with self._lock:
            if direction == "in":
                self._incoming(message, at)
            elif direction == "out" and self._init_params is not None and self._file is None:
                if message.get("id") == self._initialize_id and "method" not in message:
                    self._begin(message.get("result") or {})
            problems, self._problems = self._problems, []
        for problem in problems:  # outside the lock: reporting sends a message, which comes back here
            if self.on_problem is not None:
                try:
                    self.on_problem(problem)
                except Exception:
                    log.exception("reporting a recording problem failed")

    def _incoming(self, message: dict[str, Any], at: float) -> None:
        method = message.get("method")
        if method == "initialize":
            self._close_file()
            self._t0 = at
            self._initialize_id = message.get("id")
            self._init_params = message.get("params") or {}
            return
        if method == "exit":
            self._close_file()
            return
        kind = KINDS.get(method or "")
        if kind is None and method == "workspace/executeCommand":
            if ((message.get("params") or {}).get("command")) in ACCEPT_COMMANDS:
                kind = "accept"
        if kind is None or self._t0 is None:
            return
        params = message.get("params")
        event = Event(
            t=round((at - self._t0) * 1000.0, 3),
            kind=kind,  # type: ignore[arg-type]
            params=params if isinstance(params, dict) else {},
            method=None if method == DEFAULT_METHODS[kind] else method,
            id=message.get("id") if kind == "complete" else None,
        )
        if self._file is None:
            self._backlog.append(event)  # before the initialize answer (a client that does not wait)
        else:
            self._write(event)

    def _begin(self, result: dict[str, Any]) -> None:
        params = self._init_params or {}
        settings = params.get("initializationOptions")
        settings = settings if isinstance(settings, dict) else {}
        encoding = ((result.get("capabilities") or {}).get("positionEncoding")) or "utf-16"
        header = Header(
            created=utc_now(),
            source="record",
            client=params.get("clientInfo") or {},
            model=settings.get("model") if isinstance(settings.get("model"), str) else None,
            settings=settings,
            position_encoding=str(encoding),
            meta={"server": (result.get("serverInfo") or {}), "pid": os.getpid()},
        )
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
            path = self.directory / f"efim-trace-{stamp}-{os.getpid()}.jsonl"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            self._problem(f"--record: cannot create a trace in {self.directory} ({exc}); this session is not recorded")
            self._init_params = None
            self._backlog.clear()
            return
        self._file = os.fdopen(fd, "wb")
        self.path = path
        log.info("recording this session to %s", path)
        self._file.write(encode_line(header))
        for event in self._backlog:
            self._write(event)
        self._backlog.clear()
        self._file.flush()

    def _write(self, event: Event) -> None:
        try:
            self._file.write(encode_line(event))
            self._file.flush()
            self.events_written += 1
        except OSError as exc:
            self._problem(f"--record: writing {self.path} failed ({exc}); recording stops, the session goes on")
            self._close_file()

    def _problem(self, message: str) -> None:
        log.error("%s", message)
        self._problems.append(message)

    def _close_file(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
            self._file = None
        self._init_params = None
        self._t0 = None
        self._backlog.clear()

    def close(self) -> None:
        with self._lock:
            self._close_file()


def make_recorder(directory: str | os.PathLike[str]) -> Recorder:
    """The observer `efim serve --record DIR` installs."""
    return Recorder(directory)
