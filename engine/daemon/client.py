"""`DaemonEngine`: the `engine.api.Engine` protocol over a connection to the user's engine daemon.

What `efim serve --daemon` runs instead of a `LocalEngine`: it loads no model and imports
no torch; requests, calls and events cross the Unix socket (`engine.daemon.wire`). It is
built on the loader thread, which reaches the daemon (`engine.daemon.launcher.reach`:
connect, or start one under the spawn lock and wait for its model).

Threads (as `engine.remote.RemoteEngine`): one asyncio loop on a thread of its own
("efim-daemon-client") reads and writes the socket and pushes every event into its
handle. `submit`, `cancel`, `forget_*`, `keep_document_pieces` and `close` only hand work
to that loop (`call_soon_threadsafe`); they never wait on the socket. `stats` and
`count_tokens` wait for the daemon's answer (a round trip on the machine, bounded by
`call_timeout`); `info` is the daemon's hello's; `health` never waits (it answers with the
last health the daemon sent and asks for a newer one). Handles are `engine.handle.RequestHandle`.

Faults: when the connection drops (the daemon killed, crashed, or gone), every running
request ends at once with an "error" event, `on_fault("engine-crash", ...)` is called
from the loop (the server shows it once, as for a crashed engine thread), and the client
reaches the daemon again in the background — starting a new one when none answers. While
it does, `submit` answers with an "error" completion at once; the fronts own the
documents, so nothing of theirs is lost (the new daemon starts with an empty KV cache, or
warm from the KV disk tier).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

import msgspec

from engine.api import (
    MAX_ALTERNATIVES, Completion, EngineError, EngineInfo, EngineStats, InfillRequest, RequestStats, StreamEvent,
)
from engine.fault_reporting import FaultReporting
from engine.daemon.config import DaemonConfig
from engine.daemon.launcher import DEFAULT_IDLE_TIMEOUT_S, DaemonRefused, check_in_subprocess, reach
from engine.daemon.place import Place
from engine.daemon.wire import Call, Cancel, Event, Fault, Hello, ProtocolError, Reply, Submit, decode, frame, read_frame
from engine.handle import RequestHandle

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 5.0
# Reconnection backoff after the daemon went away (seconds, doubled per failed try).
RECONNECT_FIRST_S = 0.05
RECONNECT_MAX_S = 10.0


class _CancelOverSocket:
    __slots__ = ("_engine",)

    def __init__(self, engine: DaemonEngine) -> None:
        self._engine = engine

    def cancel(self, request_id: int) -> None:
        self._engine._on_loop(self._engine._send_cancel, request_id)


class DaemonEngine(FaultReporting):
    """An engine hosted by the user's engine daemon. See the module docstring."""

    model_in_this_process = False  # the daemon's (engine.api.Engine)

    def __init__(self, config: DaemonConfig, *, kv_budget: int | str | None = None,
                 idle_timeout: float = DEFAULT_IDLE_TIMEOUT_S, place: Place | None = None,
                 call_timeout: float = CALL_TIMEOUT_S) -> None:
        from engine.kv.budget import parse_bytes  # noqa: PLC0415  (no torch)

        self.config = config
        self.place = place or Place.for_digest(config.digest())
        self.kv_budget = parse_bytes(kv_budget) if kv_budget is not None else None
        self.idle_timeout = idle_timeout
        self.call_timeout = call_timeout
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._handles: dict[int, RequestHandle[int]] = {}
        self._replies: dict[int, tuple[Future, Callable[[Any], Any] | None]] = {}
        self._canceller = _CancelOverSocket(self)
        FaultReporting.__init__(self)
        self._writer: asyncio.StreamWriter | None = None
        self._reconnecting: asyncio.Task | None = None
        self._reader: asyncio.Task | None = None
        self._closed = False
        self.state = "connecting"  # "running" | "reconnecting" | "failed" | "closed"
        self.reconnects = 0
        self.last_fault: str | None = None
        self._lost_at: float | None = None
        self.last_outage_s: float | None = None  # the daemon lost → serving again, the last time
        self._last_stats = EngineStats()
        self._last_health: dict = {}
        sock, hello = reach(self.place, config, self.kv_budget, idle_timeout=idle_timeout)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="efim-daemon-client", daemon=True)
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self._attach(sock, hello), self._loop).result(10.0)
        except BaseException:
            sock.close()
            self._stop_loop()
            raise
        self._refresh_health()

    # ------------------------------------------------------------ loop plumbing
    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def _on_loop(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: the engine was closed
            pass

    def _stop_loop(self) -> None:
        try:
            self._loop.call_soon_threadsafe(self._loop.stop)
        except RuntimeError:
            pass
        if threading.current_thread() is not self._thread:
            self._thread.join(5.0)
        if not self._thread.is_alive():
            self._loop.close()

    async def _attach(self, sock: socket.socket, hello: Hello) -> None:
        reader, writer = await asyncio.open_unix_connection(sock=sock)
        self._writer = writer
        self.daemon_pid = hello.pid
        self.daemon_kv_budget = hello.kv_budget
        self._info = msgspec.convert(hello.info, EngineInfo)
        if self.kv_budget and hello.kv_budget and self.kv_budget > hello.kv_budget:
            log.warning("asked for a KV budget of %d bytes; the engine daemon (pid %d) could not raise its %d (see its log)",
                        self.kv_budget, hello.pid, hello.kv_budget)
        self.state = "running"
        self._reader = self._loop.create_task(self._read(reader, writer))
        log.info("connected to the engine daemon (pid %d, %s) on %s", hello.pid, self._info.model, self.place.socket)

    # ------------------------------------------------------------ reading (loop thread)
    async def _read(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        why = "the connection closed"
        try:
            while True:
                message = decode(await read_frame(reader))
                if isinstance(message, Event):
                    self._event(message)
                elif isinstance(message, Reply):
                    self._reply(message)
                elif isinstance(message, Fault):
                    self._report(message.kind, f"engine daemon: {message.message}")
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            why = "the connection closed" if isinstance(exc, asyncio.IncompleteReadError) else f"{type(exc).__name__}: {exc}"
        except ProtocolError as exc:
            why = str(exc)
        except Exception as exc:  # a bug here must not leave handles hanging
            log.exception("reading from the engine daemon failed")
            why = f"{type(exc).__name__}: {exc}"
        writer.close()
        if self._writer is writer:
            self._lost(why)

    def _event(self, message: Event) -> None:
        terminal = message.event.kind in ("done", "error")
        with self._lock:
            handle = self._handles.pop(message.id, None) if terminal else self._handles.get(message.id)
        if handle is None:
            return
        if terminal:
            handle.complete(message.event)
        else:
            handle.push(message.event)

    def _reply(self, message: Reply) -> None:
        with self._lock:
            entry = self._replies.pop(message.id, None)
        if entry is None:
            return
        future, convert = entry
        if future.done():
            return
        if message.error is not None:
            future.set_exception(_error_of(message.error))
            return
        try:
            future.set_result(convert(message.value) if convert is not None else message.value)
        except Exception as exc:  # a reply of the wrong shape
            future.set_exception(EngineError(f"the engine daemon answered {message.value!r}: {exc}"))

    def _lost(self, why: str) -> None:
        """The daemon is gone: end every request and call, tell the server once, reach it again."""
        self._writer = None
        self._lost_at = time.monotonic()
        failed = self._fail_all(f"the engine daemon (pid {self.daemon_pid}) went away ({why})")
        if self._closed:
            return
        self.state = "reconnecting"
        message = (f"the engine daemon (pid {self.daemon_pid}) went away ({why}); {failed} request(s) failed; "
                   "reconnecting (starting a new daemon if none answers)")
        self.last_fault = message
        log.error("%s", message)
        self._report("engine-crash", message)
        if self._reconnecting is None or self._reconnecting.done():
            self._reconnecting = self._loop.create_task(self._reconnect())

    def _fail_all(self, reason: str, finish: str = "error") -> int:
        with self._lock:
            handles, self._handles = self._handles, {}
            replies, self._replies = self._replies, {}
        for handle in handles.values():
            _end(handle, reason, finish)
        for future, _ in replies.values():
            if not future.done():
                future.set_exception(EngineError(reason) if finish == "error" else RuntimeError(reason))
        return len(handles)

    async def _reconnect(self) -> None:
        delay, failures = RECONNECT_FIRST_S, 0
        while not self._closed:
            try:
                sock, hello = await self._loop.run_in_executor(
                    None, lambda: reach(self.place, self.config, self.kv_budget, idle_timeout=self.idle_timeout))
            except DaemonRefused as exc:
                self.state, self.last_fault = "failed", str(exc)
                log.error("%s", exc)
                self._report("engine-failed", str(exc))
                return
            except Exception as exc:  # noqa: BLE001 - the daemon would not start: try again later
                failures += 1
                self.last_fault = f"{type(exc).__name__}: {exc}"
                log.warning("reaching the engine daemon failed (%s); again in %.1f s", exc, delay)
                if failures == 3:
                    self._report("engine-failed", f"the engine daemon does not start: {exc}; still trying")
                await asyncio.sleep(delay)
                delay = min(RECONNECT_MAX_S, delay * 2)
                continue
            if self._closed:
                sock.close()
                return
            await self._attach(sock, hello)
            self.reconnects += 1
            if self._lost_at is not None:
                self.last_outage_s = round(time.monotonic() - self._lost_at, 3)
                log.info("serving again %.2f s after the engine daemon was lost (now pid %d)", self.last_outage_s, hello.pid)
            self._refresh_health()
            return

    # ------------------------------------------------------------ sending (loop thread)
    def _send(self, message: msgspec.Struct) -> bool:
        writer = self._writer
        if writer is None or writer.is_closing():
            return False
        writer.write(frame(message))
        return True

    def _send_submit(self, request_id: int, request: InfillRequest) -> None:
        if not self._send(Submit(request_id, request)):
            with self._lock:
                handle = self._handles.pop(request_id, None)
            if handle is not None:
                why = "the engine is closed" if self._closed else f"the engine daemon is restarting ({self.last_fault or self.state})"
                _end(handle, why, "error")

    def _send_cancel(self, request_id: int) -> None:
        self._send(Cancel(request_id))

    def _send_call(self, call_id: int, method: str, args: tuple) -> None:
        if not self._send(Call(call_id, method, args)):
            with self._lock:
                entry = self._replies.pop(call_id, None)
            if entry is not None and not entry[0].done():
                entry[0].set_exception(EngineError(f"the engine daemon is not connected ({self.state})"))

    def _ask(self, method: str, *args: Any, convert: Callable[[Any], Any] | None = None) -> Future:
        future: Future = Future()
        if self._closed:
            future.set_exception(RuntimeError("engine is closed"))
            return future
        call_id = next(self._ids)
        with self._lock:
            self._replies[call_id] = (future, convert)
        self._on_loop(self._send_call, call_id, method, args)
        return future

    def _tell(self, method: str, *args: Any) -> None:
        """A call whose answer nobody waits for (the daemon's reply is dropped)."""
        if not self._closed:
            self._on_loop(self._send_call, next(self._ids), method, args)

    # ------------------------------------------------------------ Engine protocol
    def info(self) -> EngineInfo:
        return self._info

    def submit(self, request: InfillRequest) -> RequestHandle[int]:
        if not isinstance(request, InfillRequest):
            raise TypeError(f"submit() takes an InfillRequest, not {type(request).__name__}")
        if not 1 <= request.n <= MAX_ALTERNATIVES:
            raise ValueError(f"n must be in 1..{MAX_ALTERNATIVES}; got {request.n}")
        if self._closed:
            raise EngineError("engine is closed")
        handle: RequestHandle[int] = RequestHandle(next(self._ids), self._canceller)
        handle.work = handle.request_id
        with self._lock:
            self._handles[handle.request_id] = handle
        self._on_loop(self._send_submit, handle.request_id, request)
        return handle

    def stats(self) -> EngineStats:
        """The daemon's engine's stats (all fronts'); the last ones known while it cannot answer."""
        try:
            self._last_stats = self._ask("stats", convert=lambda v: msgspec.convert(v, EngineStats)).result(self.call_timeout)
        except Exception as exc:  # noqa: BLE001 - counters are informative
            log.debug("engine daemon stats: %s", exc)
        return self._last_stats

    def count_tokens(self, text: str) -> int:
        try:
            return int(self._ask("count_tokens", text).result(self.call_timeout))
        except TimeoutError:
            raise EngineError(f"the engine daemon did not count tokens within {self.call_timeout} s") from None

    def forget_context(self, path: str) -> None:
        self._tell("forget_context", path)

    def computing(self) -> bool:
        """False: the model computes in the daemon's process, whose GIL nothing here holds."""
        return False

    def keep_document_pieces(self, key: str, text: str, cursor: int) -> None:
        if not isinstance(text, str) or not isinstance(key, str):
            raise TypeError("keep_document_pieces(key: str, text: str, cursor: int)")
        self._tell("keep_document_pieces", key, text, int(cursor))

    def forget_document(self, key: str) -> None:
        if not isinstance(key, str):
            raise TypeError("forget_document(key: str)")
        self._tell("forget_document", key)

    def check_integrity(self) -> Future[None]:
        return self._ask("check_integrity")

    def wait_idle(self, timeout: float = 30.0) -> None:
        try:
            self._ask("wait_idle", timeout).result(timeout + self.call_timeout)
        except TimeoutError:
            raise TimeoutError("engine still busy") from None

    def _refresh_health(self) -> None:
        def keep(future: Future) -> None:
            if not future.cancelled() and future.exception() is None:
                self._last_health = future.result()

        self._ask("health").add_done_callback(keep)

    def health(self) -> dict:
        """The daemon's engine's health as last reported (and a newer report asked for),
        with this connection's state; never waits."""
        if self.state == "running":
            self._refresh_health()
        out = dict(self._last_health)
        daemon = dict(out.get("daemon") or {})
        daemon.update(pid=getattr(self, "daemon_pid", None), socket=str(self.place.socket), connection=self.state,
                      reconnects=self.reconnects, lastFault=self.last_fault, lastOutageS=self.last_outage_s)
        out["daemon"] = daemon
        if self.state != "running":
            out["state"] = "closed" if self.state == "closed" else "failed" if self.state == "failed" else "reconnecting"
        out.setdefault("state", "running")
        return out

    def close(self) -> None:
        """Disconnect (the daemon cancels this front's requests); running handles end
        "cancelled". Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.state = "closed"

        try:
            asyncio.run_coroutine_threadsafe(self._shut(), self._loop).result(5.0)
        except Exception as exc:  # noqa: BLE001 - the loop is gone already
            log.debug("closing the daemon connection: %s", exc)
        self._stop_loop()

    async def _shut(self) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()
        tasks = [t for t in (self._reader, self._reconnecting) if t is not None and not t.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._fail_all("engine closed", finish="cancelled")

    def __enter__(self) -> DaemonEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _end(handle: RequestHandle, reason: str, finish: str) -> None:
    if handle.done:
        return
    error = reason if finish == "error" else None
    completion = Completion(text="", finish_reason=finish, stats=RequestStats(), error=error)  # type: ignore[arg-type]
    handle.complete(StreamEvent(kind="error" if finish == "error" else "done", completion=completion, error=error))


def _error_of(text: str) -> Exception:
    """The exception a daemon's error reply stands for (check_integrity's AssertionError,
    wait_idle's TimeoutError); EngineError otherwise."""
    kinds = {"AssertionError": AssertionError, "TimeoutError": TimeoutError, "RuntimeError": RuntimeError,
             "ValueError": ValueError, "TypeError": TypeError}
    name, _, rest = text.partition(": ")
    kind = kinds.get(name)
    return kind(rest) if kind is not None else EngineError(text)


def check_daemon_model(model: str, **settings: Any) -> None:
    """`engine.local.check_model` for the daemon that `open_daemon_engine(model, **settings)`
    would reach, run in a short-lived process (the front loads no torch)."""
    check_in_subprocess(DaemonConfig.of(model, **settings))


def open_daemon_engine(model: str, *, kv_budget: int | str | None = None, idle_timeout: float = DEFAULT_IDLE_TIMEOUT_S,
                       **settings: Any) -> DaemonEngine:
    """`load_engine(model, kv_budget=..., **settings)`, hosted by the user's daemon for that
    configuration (reached or started): what `efim serve --daemon`'s engine factory calls."""
    started = time.monotonic()
    engine = DaemonEngine(DaemonConfig.of(model, **settings), kv_budget=kv_budget, idle_timeout=idle_timeout)
    log.info("engine daemon ready in %.2f s", time.monotonic() - started)
    return engine


__all__ = ["DaemonEngine", "open_daemon_engine", "check_daemon_model", "CALL_TIMEOUT_S"]
