"""A stdlib-only LSP client for driving the real `efim serve` process over its pipes.

Unlike pytest-lsp's client it writes whatever bytes a test asks for (broken framing,
non-JSON bodies, lone surrogates) and reads the server's stdout strictly: every byte
must belong to a well-framed JSON-RPC message, or `violations` records it.

    with ServerProcess(["--model", "/nonexistent"]) as server:
        server.initialize()
        reply = server.request("efim/stats")
"""

from __future__ import annotations

import itertools
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

# A model path that cannot load: the server runs with `model.state == "failed"`
# (completions answer empty lists), which is all the protocol tests need.
NO_MODEL = "/nonexistent/efim-test-no-model"


def serve_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "efim_tools.cli", "serve", "--log-level", "warning", *args]


def serve_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra)
    return env


def inline_params(uri: str, line: int, character: int) -> dict:
    return {"textDocument": {"uri": uri}, "position": {"line": line, "character": character}, "context": {"triggerKind": 2}}


def frame(body: bytes) -> bytes:
    return b"Content-Length: %d\r\n\r\n" % len(body) + body


def encode(message: dict) -> bytes:
    """JSON with non-ASCII kept as UTF-8 (lone surrogates as \\u escapes, which JSON allows)."""
    return json.dumps(message, ensure_ascii=False).encode("utf-8", "backslashreplace")


class ServerProcess:
    def __init__(self, args: list[str] | tuple[str, ...] = ("--model", NO_MODEL), env: dict[str, str] | None = None,
                 command: list[str] | None = None):
        """`efim serve ARGS`, or `command` (another server script) as is."""
        self._stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            command or serve_command(*args),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env=env or serve_env(),
            cwd=REPO,
        )
        self.messages: queue.Queue[dict] = queue.Queue()
        self.notifications: list[dict] = []  # everything the server sent that was not a response
        self.violations: list[str] = []  # stdout bytes that were not well-framed JSON-RPC
        self._responses: dict[Any, dict] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name="stdio-client-reader", daemon=True)
        self._reader.start()

    # -- writing -----------------------------------------------------------
    def send_bytes(self, data: bytes) -> None:
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def send(self, message: dict) -> None:
        self.send_bytes(frame(encode(message)))

    def notify(self, method: str, params: Any = None) -> None:
        message: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
        if params is not None:
            message["params"] = params
        self.send(message)

    def request_async(self, method: str, params: Any = None, *, id: Any = None) -> Any:
        id = next(self._ids) if id is None else id
        message: dict[str, Any] = {"jsonrpc": "2.0", "id": id, "method": method}
        if params is not None:
            message["params"] = params
        self.send(message)
        return id

    def wait_response(self, id: Any, timeout: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                if _key(id) in self._responses:
                    return self._responses.pop(_key(id))
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no response to request {id!r} within {timeout} s; stderr:\n{self.stderr()[-3000:]}")
            if self.proc.poll() is not None and self.messages.empty():
                raise ConnectionError(f"server exited ({self.proc.returncode}) before answering {id!r}; stderr:\n{self.stderr()[-3000:]}")
            try:
                self.messages.get(timeout=min(remaining, 0.05))
            except queue.Empty:
                pass

    def request(self, method: str, params: Any = None, *, timeout: float = 30.0, id: Any = None) -> dict:
        """The whole response message (`result` or `error`)."""
        return self.wait_response(self.request_async(method, params, id=id), timeout)

    def result(self, method: str, params: Any = None, *, timeout: float = 30.0) -> Any:
        reply = self.request(method, params, timeout=timeout)
        assert "error" not in reply, reply
        return reply["result"]

    # -- lifecycle ---------------------------------------------------------
    def initialize(self, options: dict | None = None, *, encoding: str | None = None) -> dict:
        caps: dict[str, Any] = {"textDocument": {"inlineCompletion": {}}}
        if encoding:
            caps["general"] = {"positionEncodings": [encoding]}
        result = self.result("initialize", {"processId": os.getpid(), "rootUri": None, "capabilities": caps,
                                            "clientInfo": {"name": "stdio-test-client"}, "initializationOptions": options or {}})
        self.notify("initialized", {})
        return result

    def open(self, uri: str, text: str, version: int = 0, language: str = "python") -> None:
        self.notify("textDocument/didOpen", {"textDocument": {"uri": uri, "languageId": language, "version": version, "text": text}})

    def document_text(self, uri: str) -> dict:
        return self.result("efim/documentText", {"textDocument": {"uri": uri}})

    def wait_model(self, timeout: float = 120.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            stats = self.result("efim/stats")
            if stats["model"]["state"] in ("ready", "failed") or time.monotonic() > deadline:
                return stats
            time.sleep(0.05)

    def shutdown_and_exit(self, timeout: float = 10.0) -> int:
        self.result("shutdown", timeout=timeout)
        self.notify("exit")
        return self.proc.wait(timeout)

    def stderr(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read().decode("utf-8", "replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._reader.join(2)
        self._stderr.close()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- reading -----------------------------------------------------------
    def _read(self) -> None:
        out = self.proc.stdout
        while True:
            length = None
            while True:
                line = out.readline()
                if not line:
                    return
                if line == b"\r\n":
                    break
                name, _, value = line.decode("ascii", "replace").partition(":")
                if not line.endswith(b"\r\n") or not _:
                    self.violations.append(f"bad header line {line[:200]!r}")
                elif name.strip().lower() == "content-length":
                    length = int(value.strip())
            if length is None:
                self.violations.append("a message without Content-Length")
                continue
            body = out.read(length)
            try:
                message = json.loads(body)
            except ValueError:
                self.violations.append(f"non-JSON body {body[:200]!r}")
                continue
            if not isinstance(message, dict) or message.get("jsonrpc") != "2.0":
                self.violations.append(f"not JSON-RPC 2.0: {body[:200]!r}")
                continue
            if "method" in message and "id" in message:
                self._answer_server_request(message)
            if "method" in message:
                self.notifications.append(message)
            else:
                with self._lock:
                    self._responses[_key(message.get("id"))] = message
            self.messages.put(message)

    def _answer_server_request(self, message: dict) -> None:
        """The server asks for progress tokens and configuration; a plain client says null."""
        try:
            result: Any = None
            if message["method"] == "workspace/configuration":
                result = [None for _ in (message.get("params") or {}).get("items", [])]
            self.send({"jsonrpc": "2.0", "id": message["id"], "result": result})
        except OSError:
            pass

    def shown_messages(self) -> list[str]:
        return [m["params"]["message"] for m in self.notifications if m.get("method") == "window/showMessage"]


def _key(id: Any) -> str:
    """Responses are matched by id; a hostile test may use any JSON value as one."""
    return json.dumps(id, sort_keys=True)


def has_response(server: "ServerProcess", id: Any) -> bool:
    with server._lock:
        return _key(id) in server._responses


def children_of(pid: int) -> list[int]:
    """Processes whose parent is `pid` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        stat = (Path("/proc") / str(pid) / "stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
