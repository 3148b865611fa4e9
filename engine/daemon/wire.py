"""The engine daemon's wire protocol: length-prefixed msgpack frames of `engine.api` structs.

A frame is a 4-byte big-endian length and that many bytes of msgpack (msgspec). The
first frame each way is a hello (`Hello`), decoded loosely (a plain map) so a peer of
another protocol version is told apart and refused by its `protocol` number, never
misread; every later frame is one `Message` (a tagged union):

front -> daemon: `Submit` (request id + `InfillRequest`), `Cancel` (request id), `Call`
(an Engine method by name, with its arguments and a call id);
daemon -> front: `Event` (request id + `StreamEvent`; each request ends with exactly one
terminal "done"/"error" event, as the Engine contract says), `Reply` (call id + value or
error), `Fault` (the daemon's engine reported `on_fault(kind, message)`).

Request and call ids are the front's own; the daemon keeps them per connection.
"""

from __future__ import annotations

import struct
from typing import Any, Union

import msgspec

from engine.api import InfillRequest, StreamEvent

# Bumped on every change of the messages below. It is also part of the socket's name
# (`engine.daemon.config.DaemonConfig.digest`), so fronts of a newer release start a daemon
# of their own instead of finding an older one; the hello check is the second line.
PROTOCOL_VERSION = 1
MAGIC = "efim-engine-daemon"
MAX_FRAME_BYTES = 64 << 20
_LENGTH = struct.Struct(">I")


class Hello(msgspec.Struct, kw_only=True):
    """The first frame each way. The front sends its uid, pid and the KV budget it asked
    for; the daemon answers with its own uid and pid, the budget it runs with and its
    engine's `EngineInfo` (as a map), or `refused` with the reason."""

    magic: str = MAGIC
    protocol: int = PROTOCOL_VERSION
    uid: int = -1
    pid: int = 0
    kv_budget: int | None = None
    info: dict | None = None
    refused: str | None = None


class Submit(msgspec.Struct, tag="submit"):
    id: int
    request: InfillRequest


class Cancel(msgspec.Struct, tag="cancel"):
    id: int


class Call(msgspec.Struct, tag="call"):
    """An Engine method other than submit: `info`, `stats`, `count_tokens`,
    `forget_context`, `keep_document_pieces`, `forget_document`, `check_integrity`,
    `health`, `wait_idle`."""

    id: int
    method: str
    args: tuple = ()


class Event(msgspec.Struct, tag="event"):
    id: int
    event: StreamEvent


class Reply(msgspec.Struct, tag="reply"):
    id: int
    value: Any = None
    error: str | None = None


class Fault(msgspec.Struct, tag="fault"):
    kind: str
    message: str


Message = Union[Submit, Cancel, Call, Event, Reply, Fault]

CALLS = frozenset({
    "info", "stats", "count_tokens", "forget_context", "keep_document_pieces", "forget_document",
    "check_integrity", "health", "wait_idle",
})

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


class ProtocolError(Exception):
    """A frame that is not this protocol (too long, not msgpack, an unknown message)."""


def frame(message: msgspec.Struct) -> bytes:
    body = _encoder.encode(message)
    return _LENGTH.pack(len(body)) + body


def frame_length(header: bytes) -> int:
    (n,) = _LENGTH.unpack(header)
    if n > MAX_FRAME_BYTES:
        raise ProtocolError(f"a frame of {n} bytes (most {MAX_FRAME_BYTES})")
    return n


HEADER_BYTES = _LENGTH.size


def decode(body: bytes) -> Message:
    try:
        return _decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"not a message of protocol {PROTOCOL_VERSION}: {exc}") from None


def decode_hello(body: bytes) -> Hello:
    """The peer's hello, read loosely: any map with our magic. ProtocolError for anything
    else, or a hello of another protocol version (saying which)."""
    try:
        raw = msgspec.msgpack.decode(body)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"the peer's first frame is not msgpack: {exc}") from None
    if not isinstance(raw, dict) or raw.get("magic") != MAGIC:
        raise ProtocolError("the peer is not an efim engine daemon (no hello)")
    if raw.get("protocol") != PROTOCOL_VERSION:
        raise ProtocolError(f"the peer speaks engine-daemon protocol {raw.get('protocol')!r}, this side {PROTOCOL_VERSION}")
    try:
        return msgspec.convert(raw, Hello)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"a malformed hello: {exc}") from None


def read_frame_blocking(sock, timeout: float) -> bytes:
    """One frame from a blocking socket (the hello exchange, before the stream is handed
    to an event loop). ConnectionError when the peer closes, TimeoutError past `timeout`."""
    sock.settimeout(timeout)
    header = _recv_exactly(sock, HEADER_BYTES)
    return _recv_exactly(sock, frame_length(header))


def _recv_exactly(sock, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(n - got)
        if not chunk:
            raise ConnectionError("the peer closed the connection")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


async def read_frame(reader) -> bytes:
    """One frame from an asyncio StreamReader (IncompleteReadError at EOF)."""
    header = await reader.readexactly(HEADER_BYTES)
    return await reader.readexactly(frame_length(header))


__all__ = [
    "PROTOCOL_VERSION", "MAGIC", "Hello", "Submit", "Cancel", "Call", "Event", "Reply", "Fault", "Message", "CALLS",
    "ProtocolError", "frame", "decode", "decode_hello", "read_frame", "read_frame_blocking",
]
