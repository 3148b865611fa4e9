"""Server-sent events, as llama.cpp's `/completion` and OpenAI-style `/v1/completions`
stream them: `data: {json}` lines separated by blank lines, `data: [DONE]` at the end
(OpenAI), `: comment` keep-alives.

`sse_payloads(lines)` turns the response's text lines into JSON objects. Anything else is
a `GarbageAnswer` naming the first bytes it got (at most `SHOWN_CHARS`): a proxy's HTML
page, a truncated JSON line, a payload that is not an object. An `{"error": ...}` payload
is a `ServerError` with the server's own message.
"""

from __future__ import annotations

import json
from typing import AsyncIterator

SHOWN_CHARS = 120
# One SSE line this long is not a token event (llama.cpp's largest, with per-token
# timings and probabilities off, is a few hundred bytes).
MAX_LINE_CHARS = 1 << 20
ERROR_BODY_CHARS = 2000


class GarbageAnswer(Exception):
    """The server's answer is not what the dialect says it sends."""


class ServerError(Exception):
    """The server reported an error inside the stream (or as its JSON body)."""


def shown(text: str) -> str:
    text = text.strip().replace("\n", " ")
    return repr(text[:SHOWN_CHARS] + ("…" if len(text) > SHOWN_CHARS else ""))


def error_message(payload: object) -> str | None:
    """The message of an `{"error": ...}` object (llama.cpp: {"error": {"code", "message",
    "type"}}, OpenAI/vLLM: {"error": {...}} or {"object": "error", "message": ...}), else None."""
    if not isinstance(payload, dict):
        return None
    err = payload.get("error")
    if isinstance(err, dict):
        msg = err.get("message") or err.get("type") or json.dumps(err)[:SHOWN_CHARS]
        code = err.get("code")
        return f"{msg} ({code})" if code else str(msg)
    if isinstance(err, str):
        return err
    if payload.get("object") == "error":
        return str(payload.get("message") or "error")
    return None


async def sse_payloads(lines: AsyncIterator[str]) -> AsyncIterator[dict]:
    """The JSON objects of an SSE stream, in order; stops at `data: [DONE]` or the end."""
    async for raw in lines:
        line = raw.strip("\r\n")
        if not line or line.startswith(":"):
            continue
        if len(line) > MAX_LINE_CHARS:
            raise GarbageAnswer(f"a stream line of {len(line)} characters")
        field, sep, value = line.partition(":")
        if not sep:
            raise GarbageAnswer(f"not a server-sent event: {shown(line)}")
        value = value[1:] if value.startswith(" ") else value
        if field in ("event", "id", "retry"):
            continue
        if field == "error":  # llama.cpp writes `error: {json}` when a stream fails
            raise ServerError(_error_text(value))
        if field != "data":
            raise GarbageAnswer(f"not a server-sent event: {shown(line)}")
        if value.strip() == "[DONE]":
            return
        try:
            payload = json.loads(value)
        except ValueError:
            raise GarbageAnswer(f"a stream event that is not JSON: {shown(value)}") from None
        if not isinstance(payload, dict):
            raise GarbageAnswer(f"a stream event that is not a JSON object: {shown(value)}")
        message = error_message(payload)
        if message is not None:
            raise ServerError(message)
        yield payload


def _error_text(value: str) -> str:
    try:
        message = error_message(json.loads(value))
    except ValueError:
        message = None
    return message or value.strip()[:SHOWN_CHARS]


class HttpStatus(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(status, message)
        self.status, self.message = status, message


async def error_body(resp) -> str:
    """The server's error message (its JSON `error`, else the first bytes of the body)."""
    raw = b""
    async for part in resp.aiter_bytes():
        raw += part
        if len(raw) > ERROR_BODY_CHARS:
            break
    text = raw[:ERROR_BODY_CHARS].decode("utf-8", errors="replace")
    try:
        message = error_message(json.loads(text))
    except ValueError:
        message = None
    return message or shown(text) if text.strip() else (resp.reason_phrase or "no body")


def describe(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


__all__ = ["GarbageAnswer", "ServerError", "HttpStatus", "sse_payloads", "error_message", "error_body", "describe", "shown"]

