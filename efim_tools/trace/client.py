"""A small asyncio LSP client that drives a server subprocess over stdio.

Small on purpose: the replayer needs exact control over when each message leaves and
when each answer arrives, and the ability to fire a request, keep typing, and cancel it.

Contracts:
- `send_request` writes the message before it returns and stamps `Pending.sent` with
  `time.perf_counter()` taken just before the write; `Pending.received` is stamped by
  the reader the moment the answer is parsed.
- If the server exits, every pending and later request fails with `ServerCrashed`,
  which carries the exit code and the tail of the server's stderr.
- Requests the server makes of the client are answered at once (`null`, or the
  configured settings for `workspace/configuration`), so a server never waits on us.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import time
from typing import Any, Callable

import msgspec

log = logging.getLogger(__name__)

REQUEST_CANCELLED = -32800


def measured_server_env(base: dict[str, str] | None, kv_dir: str) -> dict[str, str]:
    """The environment of a server a benchmark or replay measures: `base` (default: this
    process's) with the KV disk tier pointed at `kv_dir`, an empty directory of its own —
    otherwise the server would preload KV that earlier runs on this machine wrote to the
    user's cache, and a "fresh server" would start warm. For the same reason its engine is
    its own (`EFIM_DAEMON=0`) unless `base` says otherwise or the server is started with
    `--daemon`: a shared engine daemon would carry one run's KV into the next."""
    return {"EFIM_DAEMON": "0", **(base if base is not None else os.environ), "EFIM_KV_DIR": kv_dir}


class ServerCrashed(RuntimeError):
    def __init__(self, returncode: int | None, stderr_tail: str) -> None:
        self.returncode = returncode
        self.stderr_tail = stderr_tail
        super().__init__(f"language server exited (code {returncode})" + (f"; stderr tail:\n{stderr_tail}" if stderr_tail else ""))


class ResponseError(RuntimeError):
    def __init__(self, code: int, message: str, data: Any = None) -> None:
        self.code = code
        self.data = data
        super().__init__(f"[{code}] {message}")

    @property
    def cancelled(self) -> bool:
        return self.code == REQUEST_CANCELLED


class Pending:
    """One request in flight: its id, when it left, when (and how) it was answered."""

    __slots__ = ("id", "method", "sent", "received", "future")

    def __init__(self, request_id: int, method: str, future: asyncio.Future) -> None:
        self.id = request_id
        self.method = method
        self.sent = 0.0
        self.received = 0.0
        self.future = future

    @property
    def latency_ms(self) -> float:
        return (self.received - self.sent) * 1000.0


class LspClient:
    def __init__(self, argv: list[str], *, env: dict[str, str] | None = None, settings: dict[str, Any] | None = None, stderr_lines: int = 60) -> None:
        self.argv = argv
        self.env = env
        self.settings = settings or {}
        self.proc: asyncio.subprocess.Process | None = None
        self._pending: dict[int, Pending] = {}
        self._next_id = 0
        self._stderr: collections.deque[str] = collections.deque(maxlen=stderr_lines)
        self._tasks: list[asyncio.Task] = []
        self._crash: ServerCrashed | None = None
        self._closing = False
        self._write_lock = asyncio.Lock()
        self._handlers: dict[str, list[Callable[[Any], None]]] = collections.defaultdict(list)
        self.progress_created: list[Any] = []
        self.progress_ended: set[Any] = set()
        self._progress_event = asyncio.Event()
        self._exited = asyncio.Event()

    # -- process -----------------------------------------------------------------------

    async def start(self) -> None:
        env = dict(os.environ, **(self.env or {}))
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            limit=1 << 24,
        )
        self._tasks = [
            asyncio.create_task(self._read_stdout(), name="lsp-stdout"),
            asyncio.create_task(self._read_stderr(), name="lsp-stderr"),
        ]

    def stderr_tail(self) -> str:
        return "\n".join(self._stderr)

    @property
    def crashed(self) -> ServerCrashed | None:
        return self._crash

    async def close(self, timeout: float = 15.0) -> int | None:
        """Polite shutdown/exit; terminate, then kill, the process if it does not leave."""
        proc = self.proc
        if proc is None:
            return None
        self._closing = True
        if self._crash is None and proc.returncode is None:
            try:
                await asyncio.wait_for(self.request("shutdown", None), timeout)
                await self.notify("exit", None)
            except (ServerCrashed, ResponseError, asyncio.TimeoutError, ConnectionError):
                pass
        try:
            await asyncio.wait_for(proc.wait(), timeout)
        except asyncio.TimeoutError:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 5.0)
            except asyncio.TimeoutError:
                proc.kill()
                await proc.wait()
        for task in self._tasks:
            try:
                await asyncio.wait_for(task, 5.0)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                task.cancel()
        return proc.returncode

    # -- messages ----------------------------------------------------------------------

    def on_notification(self, method: str, callback: Callable[[Any], None]) -> None:
        self._handlers[method].append(callback)

    async def _write(self, message: dict[str, Any]) -> None:
        if self._crash is not None:
            raise self._crash
        body = msgspec.json.encode(message)
        data = b"Content-Length: %d\r\n\r\n" % len(body) + body
        async with self._write_lock:
            try:
                self.proc.stdin.write(data)
                await self.proc.stdin.drain()
            except (BrokenPipeError, ConnectionResetError) as exc:
                await self._exited.wait()
                raise self._crash or ServerCrashed(self.proc.returncode, self.stderr_tail()) from exc

    async def send_request(self, method: str, params: Any) -> Pending:
        self._next_id += 1
        pending = Pending(self._next_id, method, asyncio.get_running_loop().create_future())
        # an answer nobody awaits any more (timed out, superseded) must not warn at exit
        pending.future.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._pending[pending.id] = pending
        pending.sent = time.perf_counter()
        await self._write({"jsonrpc": "2.0", "id": pending.id, "method": method, "params": params})
        return pending

    async def result(self, pending: Pending) -> Any:
        return await pending.future

    async def request(self, method: str, params: Any) -> Any:
        return await (await self.send_request(method, params)).future

    async def notify(self, method: str, params: Any) -> None:
        message: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
        if params is not None:
            message["params"] = params
        await self._write(message)

    async def cancel(self, pending: Pending) -> bool:
        """`$/cancelRequest` for a request still unanswered; False if it already was."""
        if pending.future.done():
            return False
        await self.notify("$/cancelRequest", {"id": pending.id})
        return True

    async def _read_stdout(self) -> None:
        reader = self.proc.stdout
        try:
            while True:
                length = None
                while True:
                    line = await reader.readline()
                    if not line:
                        raise EOFError
                    line = line.strip()
                    if not line:
                        break
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value.strip())
                if length is None:
                    raise ValueError("message without Content-Length")
                body = await reader.readexactly(length)
                received = time.perf_counter()
                await self._dispatch(msgspec.json.decode(body), received)
        except (EOFError, asyncio.IncompleteReadError, ConnectionError):
            pass
        except Exception as exc:  # a protocol violation ends the session as a crash
            self._stderr.append(f"[client] unreadable server output: {exc!r}")
        await self._on_exit()

    async def _on_exit(self) -> None:
        proc = self.proc
        try:
            await asyncio.wait_for(proc.wait(), 10.0)
        except asyncio.TimeoutError:
            pass
        # let the stderr reader drain what the server said on its way out
        if len(self._tasks) > 1:
            try:
                await asyncio.wait_for(asyncio.shield(self._tasks[1]), 2.0)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                pass
        self._crash = ServerCrashed(proc.returncode, self.stderr_tail())
        for pending in self._pending.values():
            if not pending.future.done():
                pending.future.set_exception(self._crash)
        self._pending.clear()
        self._exited.set()
        self._progress_event.set()
        if not self._closing:
            log.error("%s", self._crash)

    async def _read_stderr(self) -> None:
        while True:
            line = await self.proc.stderr.readline()
            if not line:
                return
            self._stderr.append(line.decode("utf-8", "replace").rstrip("\n"))

    async def _dispatch(self, message: dict[str, Any], received: float) -> None:
        if "method" not in message:  # a response
            pending = self._pending.pop(message.get("id"), None)
            if pending is None or pending.future.done():
                return
            pending.received = received
            if "error" in message and message["error"] is not None:
                err = message["error"]
                pending.future.set_exception(ResponseError(err.get("code", 0), err.get("message", ""), err.get("data")))
            else:
                pending.future.set_result(message.get("result"))
            return
        method = message["method"]
        params = message.get("params")
        if "id" in message:  # the server asks something of us
            await self._write({"jsonrpc": "2.0", "id": message["id"], "result": self._answer(method, params)})
            return
        if method == "$/progress" and isinstance(params, dict):
            value = params.get("value") or {}
            if value.get("kind") == "end":
                self.progress_ended.add(params.get("token"))
            self._progress_event.set()
        for callback in self._handlers.get(method, ()):
            callback(params)

    def _answer(self, method: str, params: Any) -> Any:
        if method == "window/workDoneProgress/create" and isinstance(params, dict):
            self.progress_created.append(params.get("token"))
            self._progress_event.set()
        if method == "workspace/configuration" and isinstance(params, dict):
            return [self.settings for _ in params.get("items", [])]
        return None

    async def wait_progress_change(self, timeout: float) -> None:
        self._progress_event.clear()
        try:
            await asyncio.wait_for(self._progress_event.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        if self._crash is not None:
            raise self._crash
