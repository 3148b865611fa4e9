"""A small HTTP server that answers like llama.cpp's `/completion` or an OpenAI `/v1/completions`
— and breaks on request. Fault injection for the remote engine's tests, not a stand-in for
llama.cpp (tests/remote/test_llama_server.py runs the real one).

`FaultServer(mode=...)` serves on 127.0.0.1:<port> in a thread; `mode` is read per request:

    ok        stream `pieces` (one SSE event each), then the final event
    slow      like ok, `delay` seconds before each piece
    http500 / http401 / http400   an error status with a JSON error body
    garbage   a 200 whose body is an HTML page
    badjson   SSE events whose data is not JSON
    drop      two pieces, then the connection closes mid-stream (chunked body left unfinished)
    hang      accepts and never answers (until the client goes away)
    noend     pieces and then a clean end without the final event

`close_unanswered = N` (any mode): the next N completion requests are read and their connection
closed with no answer, as a server or proxy closes an idle kept-alive connection.

`requests` records (path, headers, json body) of every request; `stop()` closes the socket so
the port refuses connections (server down); `start()` again on the same port (back up).
TLS: pass `ssl_context` (a server-side `ssl.SSLContext`).
"""

from __future__ import annotations

import json
import re
import socket
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "_Http"

    def log_message(self, *args) -> None:  # quiet
        pass

    def setup(self) -> None:
        super().setup()
        # http.server writes headers and each chunk separately; with Nagle on, a chunk waits
        # for the ACK the client delays (~40 ms per request, measured). Servers built for
        # streaming (uvicorn, llama.cpp's) do not stall like that.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.server.owner.connections.add(self.connection)

    # ---------------------------------------------------------------- plumbing
    def _json(self, status: int, payload: object) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _start_stream(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

    def _chunk(self, text: str) -> None:
        data = text.encode()
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _event(self, payload: object) -> None:
        self._chunk(f"data: {json.dumps(payload)}\n\n")

    def _end_stream(self) -> None:
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    # ---------------------------------------------------------------- routes
    def do_GET(self) -> None:  # noqa: N802
        fs = self.server.owner
        fs.requests.append((self.path, dict(self.headers), None))
        if fs.require_key and self.headers.get("Authorization") != f"Bearer {fs.require_key}":
            return self._json(401, {"error": {"code": 401, "message": "Invalid API Key", "type": "authentication_error"}})
        if self.path in ("/props",):
            return self._json(200, {"total_slots": fs.slots, "default_generation_settings": {"n_ctx": fs.n_ctx},
                                    "model_path": "fault-model.gguf"})
        if self.path in ("/health",):
            return self._json(200, {"status": "ok"})
        if self.path.endswith("/models"):
            return self._json(200, {"object": "list", "data": [{"id": fs.model_name, "object": "model", "max_model_len": fs.n_ctx}]})
        self._json(404, {"error": {"code": 404, "message": "not found"}})

    def do_POST(self) -> None:  # noqa: N802
        fs = self.server.owner
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"null")
        fs.requests.append((self.path, dict(self.headers), body))
        if fs.require_key and self.headers.get("Authorization") != f"Bearer {fs.require_key}":
            return self._json(401, {"error": {"code": 401, "message": "Invalid API Key", "type": "authentication_error"}})
        if self.path == "/tokenize":
            if fs.tokenize is None:
                return self._json(404, {"error": {"code": 404, "message": "not found"}})
            return self._json(200, {"tokens": fs.tokenize(body["content"])})
        if self.path == "/completion":
            return self._complete(body, openai=False)
        if self.path.endswith("/v1/completions"):
            return self._complete(body, openai=True)
        self._json(404, {"error": {"code": 404, "message": "not found"}})

    def _complete(self, body: dict, *, openai: bool) -> None:
        fs = self.server.owner
        mode = fs.mode
        if fs.close_unanswered > 0:
            fs.close_unanswered -= 1
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        if mode.startswith("http"):
            status = int(mode[4:])
            return self._json(status, {"error": {"code": status, "message": f"injected HTTP {status}", "type": "server_error"}})
        if mode == "garbage":
            data = b"<html><body>502 Bad Gateway</body></html>"
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        if mode == "hang":
            fs.hanging.set()
            while not fs.released.wait(0.05):
                pass
            return
        prompt = body.get("prompt") or []
        cached = fs.cached_for(body.get("id_slot", 0), prompt)
        self._start_stream()
        if mode == "badjson":
            self._chunk("data: {not json\n\n")
            return self._end_stream()
        n_choices = int(body.get("n") or 1) if openai else 1
        pieces = fs.pieces if mode != "drop" else fs.pieces[:2]
        healed = _grammar_literal(body.get("grammar"))
        if healed:  # a grammar that starts with a literal (token healing): the answer starts with it, as llama.cpp's would
            pieces = (healed, *pieces)
        try:
            for i, piece in enumerate(pieces):
                if mode == "slow":
                    time.sleep(fs.delay)
                for choice in range(n_choices):
                    text = piece if choice == 0 else f"{piece}{choice}"
                    self._event(self._piece(openai, text, choice, prompt, cached, i + 1))
            if mode == "drop":
                self.wfile.flush()
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            if mode != "noend":
                for choice in range(n_choices):
                    self._event(self._final(openai, choice, prompt, cached, len(pieces)))
                if openai:
                    self._chunk("data: [DONE]\n\n")
            self._end_stream()
        except (BrokenPipeError, ConnectionResetError, ssl.SSLError, OSError):
            fs.disconnects += 1

    @staticmethod
    def _usage(prompt: list, cached: int, generated: int) -> dict:
        return {"prompt_tokens": len(prompt), "completion_tokens": generated, "total_tokens": len(prompt) + generated,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def _piece(self, openai: bool, text: str, choice: int, prompt: list, cached: int, generated: int) -> dict:
        if openai:
            return {"id": "cmpl-1", "object": "text_completion", "choices": [{"index": choice, "text": text, "finish_reason": None}],
                    "usage": self._usage(prompt, cached, generated)}
        return {"content": text, "stop": False, "id_slot": 0,
                "timings": {"cache_n": cached, "prompt_n": len(prompt) - cached, "prompt_ms": 1.5, "predicted_n": generated,
                            "predicted_per_token_ms": 2.0}}

    def _final(self, openai: bool, choice: int, prompt: list, cached: int, generated: int) -> dict:
        if openai:
            return {"id": "cmpl-1", "object": "text_completion", "choices": [{"index": choice, "text": "", "finish_reason": "stop"}],
                    "usage": self._usage(prompt, cached, generated)}
        return {"content": "", "stop": True, "stop_type": "eos", "tokens_cached": len(prompt) + generated,
                "timings": {"cache_n": cached, "prompt_n": len(prompt) - cached, "prompt_ms": 1.5, "predicted_n": generated,
                            "predicted_per_token_ms": 2.0}}


class _Http(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    owner: "FaultServer"


class FaultServer:
    def __init__(self, mode: str = "ok", *, pieces=("return", " a", " +", " b"), slots: int = 2, n_ctx: int = 2048,
                 delay: float = 0.05, ssl_context: ssl.SSLContext | None = None, require_key: str | None = None,
                 tokenize=None, model_name: str = "fault-model") -> None:
        self.mode = mode
        self.pieces = list(pieces)
        self.slots, self.n_ctx, self.delay = slots, n_ctx, delay
        self.ssl_context = ssl_context
        self.require_key = require_key
        self.tokenize = tokenize
        self.model_name = model_name
        self.requests: list[tuple[str, dict, object]] = []
        self.disconnects = 0
        self.close_unanswered = 0
        self.cached: list[int] = []  # what each completion reported as cached
        self.connections: set = set()
        self.hanging = threading.Event()
        self.released = threading.Event()
        self._last_prompt: dict[int, list] = {}
        self.port = _free_port()
        self._http: _Http | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"{'https' if self.ssl_context else 'http'}://127.0.0.1:{self.port}"

    def cached_for(self, slot: int, prompt: list) -> int:
        """Tokens of `prompt` the server slot's previous prompt shares (a prefix cache's answer)."""
        last = self._last_prompt.get(slot, [])
        n = 0
        for a, b in zip(last, prompt):
            if a != b:
                break
            n += 1
        self._last_prompt[slot] = list(prompt)
        self.cached.append(n)
        return n

    def completions(self) -> list[dict]:
        return [body for path, _, body in self.requests if path in ("/completion", "/v1/completions")]

    def start(self) -> "FaultServer":
        self.released.clear()
        self._http = _Http(("127.0.0.1", self.port), _Handler)
        self._http.owner = self
        if self.ssl_context is not None:
            self._http.socket = self.ssl_context.wrap_socket(self._http.socket, server_side=True)
        self._thread = threading.Thread(target=self._http.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.released.set()
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
        for conn in list(self.connections):  # kept-alive connections too: the server is down
            try:
                conn.shutdown(socket.SHUT_RDWR)
                conn.close()
            except OSError:
                pass
        self.connections.clear()

    def __enter__(self) -> "FaultServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


_LITERAL = re.compile(r'^root ::= "((?:[^"\\]|\\.)*)"')
_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", '"': '"', "\\": "\\"}


def _grammar_literal(grammar) -> str:
    """The text a GBNF grammar's root begins with as a string literal ("" if none)."""
    m = _LITERAL.match(grammar or "")
    if not m:
        return ""
    raw, out, i = m.group(1), [], 0
    while i < len(raw):
        if raw[i] == "\\":
            nxt = raw[i + 1]
            if nxt == "x":
                out.append(chr(int(raw[i + 2 : i + 4], 16)))
                i += 4
                continue
            out.append(_ESCAPES[nxt])
            i += 2
            continue
        out.append(raw[i])
        i += 1
    return "".join(out)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
