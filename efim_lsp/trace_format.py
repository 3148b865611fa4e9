"""The typing-trace file format: JSON Lines, one header line then one line per event.

    {"format": "efim-trace", "version": 1, "created": "...", "source": "synth", ...}
    {"t": 0.0, "kind": "open", "method": "textDocument/didOpen", "params": {...}}
    {"t": 241.3, "kind": "change", "method": "textDocument/didChange", "params": {...}}
    {"t": 242.3, "kind": "complete", "method": "textDocument/inlineCompletion", "id": 7, "params": {...}}

`t` is milliseconds since the session started; `params` are the LSP params exactly as
the client sent them (a document's initial text travels inline in its `open` event), so
a trace replays through any server without the files it came from. Positions inside
`params` count in `Header.position_encoding` units (UTF-16 unless negotiated otherwise).

Contracts:
- `read_trace` refuses a file whose header names another format or a version this code
  does not know, before looking at any event.
- A line that does not decode is reported as `TraceError` carrying its 1-based line number.
- `write_trace` then `read_trace` gives back equal `Header` and `Event` values.
"""

from __future__ import annotations

import datetime as _dt
import os
from pathlib import Path
from typing import Any, Iterable, Iterator, Literal

import msgspec

FORMAT_NAME = "efim-trace"
FORMAT_VERSION = 1
SUPPORTED_VERSIONS = (1,)

EventKind = Literal["open", "change", "complete", "cancel", "show", "accept", "close", "cursor"]
EVENT_KINDS: tuple[str, ...] = ("open", "change", "complete", "cancel", "show", "accept", "close", "cursor")

# The LSP method each kind is sent with when an event names none.
DEFAULT_METHODS: dict[str, str] = {
    "open": "textDocument/didOpen",
    "change": "textDocument/didChange",
    "complete": "textDocument/inlineCompletion",
    "cancel": "$/cancelRequest",
    "show": "textDocument/didShowCompletion",
    "accept": "textDocument/didPartiallyAcceptCompletion",
    "close": "textDocument/didClose",
    # Our clients' cursor notification (docs/design.md, "After a jump"): where the user is
    # before the first key, so the server can warm the window there.
    "cursor": "efim/didMoveCursor",
}


class TraceError(ValueError):
    """A trace that cannot be read: unknown version, malformed line (with its number)."""


class Header(msgspec.Struct, kw_only=True):
    """First line of a trace: what produced it and under which settings."""

    format: str = FORMAT_NAME
    version: int = FORMAT_VERSION
    created: str = ""  # ISO 8601, UTC
    source: Literal["record", "synth"] = "synth"
    client: dict[str, Any] = {}  # LSP clientInfo ({name, version}) of the recorded editor
    model: str | None = None
    settings: dict[str, Any] = {}  # initializationOptions as the client sent them
    position_encoding: str = "utf-16"
    meta: dict[str, Any] = {}  # free-form provenance (synthesis parameters, file, function)


class Event(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One client→server message of the session.

    `id` is the JSON-RPC id a `complete` request was sent with (a `cancel` event's
    params name it), so a replayer can map recorded ids onto its own."""

    t: float
    kind: EventKind
    params: dict[str, Any]
    method: str | None = None
    id: int | str | None = None

    @property
    def lsp_method(self) -> str:
        return self.method or DEFAULT_METHODS[self.kind]

    @property
    def uri(self) -> str | None:
        doc = self.params.get("textDocument")
        return doc.get("uri") if isinstance(doc, dict) else None


class Trace(msgspec.Struct, kw_only=True):
    header: Header
    events: list[Event]
    path: str | None = None  # where it was read from (not serialised)

    @property
    def completions(self) -> int:
        return sum(1 for e in self.events if e.kind == "complete")

    @property
    def name(self) -> str:
        return Path(self.path).name if self.path else "trace"


_encoder = msgspec.json.Encoder()
_event_decoder = msgspec.json.Decoder(Event)
_header_decoder = msgspec.json.Decoder(Header)


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds")


def encode_line(item: Header | Event) -> bytes:
    return _encoder.encode(item) + b"\n"


def write_trace(path: str | os.PathLike[str], trace: Trace, *, mode: int = 0o600) -> Path:
    """Write `trace` to `path` (created with permissions `mode`: traces hold source code)."""
    path = Path(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as fh:
        fh.write(encode_line(trace.header))
        for event in trace.events:
            fh.write(encode_line(event))
    return path


def decode_header(line: bytes, *, where: str = "trace") -> Header:
    """Check format and version first (a clear refusal), then decode the full header."""
    try:
        raw = msgspec.json.decode(line)
    except msgspec.DecodeError as exc:
        raise TraceError(f"{where}:1: not a trace header ({exc})") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT_NAME:
        raise TraceError(f"{where}:1: not an {FORMAT_NAME} file (first line must be its header)")
    version = raw.get("version")
    if version not in SUPPORTED_VERSIONS:
        known = ", ".join(str(v) for v in SUPPORTED_VERSIONS)
        raise TraceError(
            f"{where}: trace format version {version!r} is not supported by this efim "
            f"(it reads version {known}); upgrade efim-lsp or re-create the trace"
        )
    try:
        return _header_decoder.decode(line)
    except msgspec.ValidationError as exc:
        raise TraceError(f"{where}:1: bad trace header: {exc}") from None


def iter_events(lines: Iterable[bytes], *, where: str = "trace", first_line: int = 2) -> Iterator[Event]:
    for number, line in enumerate(lines, start=first_line):
        if not line.strip():
            continue
        try:
            yield _event_decoder.decode(line)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise TraceError(f"{where}:{number}: malformed trace event: {exc}") from None


def read_trace(path: str | os.PathLike[str]) -> Trace:
    path = Path(path)
    with path.open("rb") as fh:
        first = fh.readline()
        if not first.strip():
            raise TraceError(f"{path}:1: empty file, expected an {FORMAT_NAME} header")
        header = decode_header(first, where=str(path))
        events = list(iter_events(fh, where=str(path)))
    return Trace(header=header, events=events, path=str(path))


def expand_paths(paths: Iterable[str | os.PathLike[str]]) -> list[Path]:
    """Files as given; a directory stands for its `*.jsonl` files in name order."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(p.glob("*.jsonl"))
            if not found:
                raise TraceError(f"{p}: directory holds no *.jsonl traces")
            out.extend(found)
        elif p.exists():
            out.append(p)
        else:
            raise FileNotFoundError(f"{p}: no such trace file")
    return out


def read_traces(paths: Iterable[str | os.PathLike[str]]) -> list[Trace]:
    return [read_trace(p) for p in expand_paths(paths)]
