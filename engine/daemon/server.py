"""The engine daemon: one `LocalEngine` served to every front of a user over a Unix socket.

`python -m engine.daemon --socket PATH --config JSON [--kv-budget N] [--idle-timeout S]`
loads the engine first and only then binds its socket (0600), so a front that finds the
socket answering finds the model loaded. It serves any number of fronts (connections):

- a front's request keys are its own: the daemon prefixes them with the front's number,
  so two windows with the same file open do not supersede each other's requests (the
  radix cache is keyed by tokens, so the second window's prompt still reuses the first's
  KV); `forget_context` (a file's chunks) is shared by all;
- each front is an owner of the engine's (`InfillRequest.owner` = `front<N>`): the engine's
  scheduler shares its time fairly across owners, so one window's burst does not starve
  another's keystrokes (`engine.scheduling.fairness`);
- a front that goes away (closed, killed) has its running requests cancelled and its
  documents forgotten (`Engine.forget_document`: their pieces and kept working KV go,
  their cached rows lose their place among documents' latest);
- its KV budget is the largest any front asked for: raised (the pool grows, every row
  stays) when a front asks for more, lowered when the front that asked for the most leaves
  (at the engine's next idle moment: the rows that fit stay, the pool shrinks and its memory
  goes back); a front that asked for none counts as the default;
- once the last front has gone the daemon exits after `--idle-timeout` seconds (a front
  arriving meanwhile keeps it), removing its socket (only if it is still its own);
- the engine's faults (`on_fault`) are told to every front.

Threads: the asyncio loop (main thread) reads and writes every connection and calls the
engine's non-blocking methods; the engine's own thread computes; one pump thread per
running request (`_Pumps`) forwards its handle's events to the loop. SIGTERM / SIGINT
close the engine (its disk tier writes what it kept) and exit.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec

from engine.api import Completion, RequestStats, StreamEvent
from engine.daemon.place import peer_uid
from engine.daemon.wire import (
    Call, Cancel, Event, Fault, Hello, ProtocolError, Reply, Submit, decode, decode_hello, frame, read_frame,
)
from engine.kv.budget import default_budget_bytes

log = logging.getLogger(__name__)

# Most request pumps at once (a front has a keystroke's request, a warm-up and a first
# window in flight; more wait for a pump while their events queue in the handle).
MAX_PUMPS = 64


class Front:
    """One connected `efim serve` (or any client engine)."""

    def __init__(self, number: int, pid: int, writer: asyncio.StreamWriter, *, kv_budget: int | None = None) -> None:
        self.number = number
        self.pid = pid
        self.kv_budget = kv_budget  # the --kv-budget it asked for (None: the default)
        self.writer = writer
        self.prefix = f"front{number}/"
        self.handles: dict[int, Any] = {}  # request id -> the engine's handle
        self.documents: set[str] = set()  # keys given pieces (`keep_document_pieces`)
        self.keys: set[str] = set()  # every key its requests used (forgotten when it leaves)
        self.requests = 0
        self.served = 0  # requests that ended with an answer (stop, length, eos, deadline)
        self.cancelled = 0  # ... superseded or cancelled
        self.errors = 0  # ... with an error
        self.connected = time.monotonic()

    def send(self, message: msgspec.Struct) -> None:
        if not self.writer.is_closing():
            self.writer.write(frame(message))

    def summary(self) -> dict:
        return {"front": self.number, "pid": self.pid, "requests": self.requests, "served": self.served,
                "cancelled": self.cancelled, "errors": self.errors, "running": len(self.handles),
                "documents": len(self.documents), "kvBudgetAsked": self.kv_budget,
                "connectedS": round(time.monotonic() - self.connected, 1)}

    def ended(self, event: StreamEvent) -> None:
        """Count a request's terminal event."""
        reason = event.completion.finish_reason if event.completion is not None else "error"
        if event.kind == "error" or reason == "error":
            self.errors += 1
        elif reason == "cancelled":
            self.cancelled += 1
        else:
            self.served += 1


class EngineDaemon:
    def __init__(self, engine, socket_path: Path, *, idle_timeout: float = 60.0, kv_budget: int | None = None) -> None:
        self.engine = engine
        self.socket_path = Path(socket_path)
        self.idle_timeout = idle_timeout
        self.kv_budget = kv_budget if kv_budget is not None else getattr(engine, "kv_budget_bytes", None)
        self.fronts: set[Front] = set()
        self._budget_tasks: set[asyncio.Task] = set()  # lowering the KV budget after a front left
        self._numbers = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._idle_timer: asyncio.TimerHandle | None = None
        self._inode: int | None = None
        self._pumps = ThreadPoolExecutor(MAX_PUMPS, thread_name_prefix="efim-daemon-pump")
        # Token counts (the fronts' window cuts: 2-4 ms of tokenizing a window's text each, ~3
        # per jump) on a thread of their own, not the loop's: another front's submit is read
        # meanwhile, and the tokenizer lets go of the GIL for the engine thread.
        self._counter = ThreadPoolExecutor(1, thread_name_prefix="efim-daemon-count")
        self.started = time.monotonic()
        self.startup: dict[str, float | None] = {}  # seconds per start-up phase (`python -m engine.daemon` sets it)
        self.after_bind: list = []  # callables run once the socket is bound (a standby releases the spawn lock)
        self.standby = None  # engine.daemon.standby.StandbyProcess: started once serving, stopped before exiting

    # ------------------------------------------------------------ lifecycle
    async def serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self.engine.on_fault = self._engine_fault
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._loop.add_signal_handler(sig, self._stop.set)
            except (NotImplementedError, RuntimeError):  # not the main thread (tests)
                pass
        try:
            os.unlink(self.socket_path)  # a dead daemon's (the front that started us holds the spawn lock)
        except FileNotFoundError:
            pass
        umask = os.umask(0o177)
        try:
            server = await asyncio.start_unix_server(self._connection, path=str(self.socket_path))
        finally:
            os.umask(umask)
        os.chmod(self.socket_path, 0o600)
        self._inode = os.stat(self.socket_path).st_ino
        self.startup["bindS"] = round(time.monotonic() - self.started, 3)
        log.info("engine daemon %d serving %s on %s (idle timeout %.0f s); startup %s", os.getpid(),
                 self.engine.info().model, self.socket_path, self.idle_timeout, json.dumps(self.startup))
        for hook in self.after_bind:
            hook()
        if self.standby is not None:
            self.standby.start()
        self._arm_idle_timer()
        try:
            await self._stop.wait()
        finally:
            if self.standby is not None:  # first: it must not take over from a daemon exiting on purpose
                await self._loop.run_in_executor(None, self.standby.stop)
            self._remove_socket()
            server.close()
            for front in list(self.fronts):
                front.writer.close()
            log.info("engine daemon %d stopping", os.getpid())

    def stop(self) -> None:
        """Any thread: end `serve`."""
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)

    def _remove_socket(self) -> None:
        """Unlink the socket first thing when stopping — unless a newer daemon's replaced it."""
        try:
            if os.stat(self.socket_path).st_ino == self._inode:
                os.unlink(self.socket_path)
        except FileNotFoundError:
            pass

    def _arm_idle_timer(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        self._idle_timer = self._loop.call_later(self.idle_timeout, self._idle_exit)

    def _idle_exit(self) -> None:
        if not self.fronts:
            log.info("no front for %.0f s: exiting", self.idle_timeout)
            self._remove_socket()  # a front arriving from now on starts a new daemon
            self._stop.set()

    def _engine_fault(self, kind: str, message: str) -> None:  # the engine thread
        try:
            self._loop.call_soon_threadsafe(self._broadcast, Fault(kind, message))
        except RuntimeError:
            pass

    def _broadcast(self, message: msgspec.Struct) -> None:
        for front in list(self.fronts):
            front.send(message)

    # ------------------------------------------------------------ connections
    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        uid = peer_uid(sock) if sock is not None else None
        me = os.getuid()
        try:
            if uid is not None and uid != me:
                log.warning("refused a connection from uid %d", uid)
                writer.write(frame(Hello(uid=me, pid=os.getpid(), refused=f"this daemon serves uid {me} only")))
                return
            try:
                hello = decode_hello(await asyncio.wait_for(read_frame(reader), 10.0))
            except ProtocolError as exc:
                log.warning("refused a front: %s", exc)
                writer.write(frame(Hello(uid=me, pid=os.getpid(), refused=str(exc))))
                return
            except (asyncio.IncompleteReadError, asyncio.TimeoutError, ConnectionError):
                return
            if hello.uid != me:
                writer.write(frame(Hello(uid=me, pid=os.getpid(), refused=f"this daemon serves uid {me} only")))
                return
            if hello.kv_budget and self.kv_budget and hello.kv_budget > self.kv_budget:
                await self._raise_budget(hello)
            self._numbers += 1
            front = Front(self._numbers, hello.pid, writer, kv_budget=hello.kv_budget)
            self.fronts.add(front)
            if self._idle_timer is not None:
                self._idle_timer.cancel()
                self._idle_timer = None
            front.send(Hello(uid=me, pid=os.getpid(), kv_budget=self.kv_budget,
                             info=msgspec.to_builtins(self.engine.info())))
            log.info("front %d (pid %d) connected; %d front(s)", front.number, front.pid, len(self.fronts))
            try:
                await self._serve_front(front, reader)
            finally:
                self._release(front)
        finally:
            writer.close()

    async def _raise_budget(self, hello: Hello) -> None:
        """A front asked for more KV than the daemon runs with: the budget becomes the largest
        any front asked for (the engine's pool grows while serving; nothing cached is lost).
        An engine that cannot grow keeps its budget, and says so in the log."""
        grow = getattr(self.engine, "grow_kv_budget", None)
        if grow is None:
            log.warning("front %d asked for a KV budget of %d bytes; this engine cannot raise its %d",
                        hello.pid, hello.kv_budget, self.kv_budget)
            return
        try:
            self.kv_budget = await asyncio.get_running_loop().run_in_executor(None, grow, hello.kv_budget)
        except Exception as exc:  # EngineError, or the allocation failed
            log.warning("front %d asked for a KV budget of %d bytes; keeping %d: %s", hello.pid, hello.kv_budget, self.kv_budget, exc)
        else:
            log.info("KV budget raised to %d bytes for front pid %d", self.kv_budget, hello.pid)

    def _budget_wanted(self) -> int | None:
        """The largest budget the fronts still here asked for (a front that asked for none
        counts as the default, `default_budget_bytes`); None with no fronts."""
        if not self.fronts:
            return None
        return max(f.kv_budget if f.kv_budget else default_budget_bytes() for f in self.fronts)

    async def _lower_budget(self) -> None:
        """A front left: when the largest budget the others asked for is below the one the
        daemon runs with, the engine takes it at its next idle moment — the cached rows that
        fit stay, the pool shrinks and its memory goes back (`LocalEngine.lower_kv_budget`).
        An engine that cannot lower keeps its budget."""
        wanted = self._budget_wanted()
        lower = getattr(self.engine, "lower_kv_budget", None)
        if wanted is None or self.kv_budget is None or wanted >= self.kv_budget or lower is None:
            return
        try:
            budget = await asyncio.get_running_loop().run_in_executor(None, lambda: lower(wanted, None))
        except Exception as exc:  # EngineError: closed, or a budget too small to hold a sequence
            log.warning("keeping the KV budget of %d bytes (the fronts left ask for %d): %s", self.kv_budget, wanted, exc)
            return
        wanted_now = self._budget_wanted()
        if budget < self.kv_budget:
            self.kv_budget = budget
            log.info("KV budget lowered to %d bytes: the front that asked for more left", budget)
        if wanted_now is not None and wanted_now > budget:  # a front that asks for more came meanwhile
            grow = getattr(self.engine, "grow_kv_budget", None)
            if grow is not None:
                self.kv_budget = await asyncio.get_running_loop().run_in_executor(None, grow, wanted_now)

    async def _serve_front(self, front: Front, reader: asyncio.StreamReader) -> None:
        while True:
            try:
                message = decode(await read_frame(reader))
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            except ProtocolError as exc:
                log.warning("front %d sent a bad frame (%s): closing its connection", front.number, exc)
                return
            if isinstance(message, Submit):
                self._submit(front, message)
            elif isinstance(message, Cancel):
                handle = front.handles.get(message.id)
                if handle is not None:
                    handle.cancel()
            elif isinstance(message, Call):
                self._call(front, message)
            else:
                log.warning("front %d sent a %s: ignored", front.number, type(message).__name__)

    def _release(self, front: Front) -> None:
        """The front went away: cancel its requests, forget its documents (their pieces, their
        kept working KV; their cached rows are no longer any document's latest, so they are
        evicted before the other fronts' — and first when the budget comes down)."""
        self.fronts.discard(front)
        for handle in list(front.handles.values()):
            handle.cancel()
        for key in front.documents | front.keys:
            self.engine.forget_document(front.prefix + key)
        log.info("front %d (pid %d) gone: %d request(s) cancelled; %d front(s) left", front.number, front.pid,
                 len(front.handles), len(self.fronts))
        if not self.fronts and self._stop is not None and not self._stop.is_set():
            self._arm_idle_timer()
        elif self.fronts and self._loop is not None:
            task = self._loop.create_task(self._lower_budget())
            self._budget_tasks.add(task)
            task.add_done_callback(self._budget_tasks.discard)

    # ------------------------------------------------------------ requests
    def _submit(self, front: Front, message: Submit) -> None:
        # The front's keys are its own; its requests take turns with other fronts' (owner).
        request = msgspec.structs.replace(message.request, key=front.prefix + message.request.key,
                                          owner=front.prefix.rstrip("/"))
        front.requests += 1
        front.keys.add(message.request.key)
        try:
            handle = self.engine.submit(request)
        except Exception as exc:  # a bad parameter, a failed engine: the request ends at once
            error = f"{type(exc).__name__}: {exc}"
            completion = Completion(text="", finish_reason="error", stats=RequestStats(), error=error)
            front.errors += 1
            front.send(Event(message.id, StreamEvent(kind="error", completion=completion, error=error)))
            return
        front.handles[message.id] = handle
        self._pumps.submit(self._pump, front, message.id, handle)

    def _pump(self, front: Front, request_id: int, handle) -> None:  # a pump thread
        try:
            for event in handle.events():
                self._loop.call_soon_threadsafe(self._deliver, front, request_id, event)
        except RuntimeError:  # the loop is closed: the daemon is stopping
            pass

    def _deliver(self, front: Front, request_id: int, event: StreamEvent) -> None:
        if event.kind in ("done", "error"):
            front.handles.pop(request_id, None)
            front.ended(event)
        front.send(Event(request_id, event))

    # ------------------------------------------------------------ other Engine methods
    def _call(self, front: Front, message: Call) -> None:
        if message.method in ("check_integrity", "wait_idle", "count_tokens"):  # these wait or compute: off the reading path
            asyncio.ensure_future(self._call_async(front, message))
            return
        try:
            value = self._invoke(front, message.method, message.args)
            reply = Reply(message.id, value=msgspec.to_builtins(value))
        except Exception as exc:
            reply = Reply(message.id, error=f"{type(exc).__name__}: {exc}")
        front.send(reply)

    async def _call_async(self, front: Front, message: Call) -> None:
        try:
            value = None
            if message.method == "check_integrity":
                await asyncio.wrap_future(self.engine.check_integrity())
            elif message.method == "count_tokens":
                text = str(message.args[0]) if message.args else ""
                value = await self._loop.run_in_executor(self._counter, self.engine.count_tokens, text)
            else:
                timeout = float(message.args[0]) if message.args else 30.0
                await self._loop.run_in_executor(None, self.engine.wait_idle, timeout)
            reply = Reply(message.id, value=value)
        except Exception as exc:
            reply = Reply(message.id, error=f"{type(exc).__name__}: {exc}")
        front.send(reply)

    def _invoke(self, front: Front, method: str, args: tuple) -> Any:
        engine = self.engine
        if method == "info":
            return engine.info()
        if method == "stats":
            return engine.stats()
        if method == "forget_context":
            return engine.forget_context(str(args[0]))
        if method == "keep_document_pieces":
            key, text, cursor = args
            if text:
                front.documents.add(key)
            return engine.keep_document_pieces(front.prefix + key, text, int(cursor))
        if method == "forget_document":
            front.documents.discard(args[0])
            front.keys.discard(args[0])
            return engine.forget_document(front.prefix + str(args[0]))
        if method == "health":
            return {**engine.health(), "daemon": self.health(front)}
        raise ValueError(f"unknown method {method!r}")

    def health(self, asking: Front | None = None) -> dict:
        """The daemon's state for the fronts' `efim/stats` (`engine.daemon`): start-up phases,
        budget, and per front its counts and `engineS`, the engine seconds its requests took
        (prefill steps, and its rows' share of the decode steps)."""
        spent = self.engine.engine_seconds_by_owner()
        return {"pid": os.getpid(), "socket": str(self.socket_path), "uptimeS": round(time.monotonic() - self.started, 1),
                "startup": self.startup,
                "kvBudget": self.kv_budget, "front": asking.number if asking else None,
                "fronts": [f.summary() | {"engineS": round(spent.get(f.prefix.rstrip("/"), 0.0), 3)}
                           for f in sorted(self.fronts, key=lambda f: f.number)]}


__all__ = ["EngineDaemon", "Front"]
