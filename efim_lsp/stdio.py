"""The server's stdio loop: LSP framing that survives a buggy client, and a prompt stop.

Reading without a thread hop per line. pygls' stdio reader runs every
`readline()` / `read(n)` in a worker thread, so between two messages the event
loop always runs whatever handlers are ready. For a completion server that is
the wrong order: in a burst of keystrokes, a request's handler would start
before the `didChange` already waiting in the pipe is read, and could answer
for a version the user has typed past. Reading the pipe with an asyncio
`StreamReader` serves everything already buffered without yielding, so all
pending input is applied before any handler runs. Stdin that is not a pipe (a
file, a terminal) falls back to pygls' threaded reader.

Framing (`Framer`), lenient where a client can be wrong and strict where the
protocol needs it:
- header names are case-insensitive and a bare `\\n` ends a header line too;
- a `Content-Length` header is found even at the end of a line of garbage (the
  tail of a body whose length was too short), so the stream re-synchronises on
  the next message instead of losing every message after a framing error;
- a body that is not JSON is answered ParseError (-32700, id null, as JSON-RPC asks)
  and re-read as header lines: a length that was too long
  swallowed the next message's header, which the line scan then finds; one that was
  too short leaves the rest of the body in front of the next header line;
- a body that stalls mid-way (no bytes for `STALL_SECONDS`) while it already
  contains the next message's header is cut there for the same reason;
- a length over `MAX_CONTENT_LENGTH` is refused (the header is ignored) rather
  than buffered.

Stopping (`serve`): the loop ends on `exit` (the protocol records the exit code:
0 after `shutdown`, 1 without), on stdin closing, and on SIGTERM; the last two
count as an exit without `shutdown` unless one was received.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import stat
import time
from typing import Any, BinaryIO, Callable

from pygls.io_ import StdinAsyncReader

from efim_lsp.redact import excerpt

log = logging.getLogger(__name__)

_LIMIT = 1 << 20  # StreamReader buffer limit; longer lines are read in pieces
MAX_CONTENT_LENGTH = 512 << 20  # a 50 MB file JSON-escaped fits many times over
STALL_SECONDS = 0.5
_TAIL = 256  # bytes of an over-long garbage line kept (a header may end it)
_HEADER = re.compile(rb"content-length[ \t]*:[ \t]*(\d{1,12})[ \t]*\r?\n\Z", re.IGNORECASE)
_HEADER_IN_BODY = re.compile(rb"content-length[ \t]*:[ \t]*\d{1,12}[ \t]*\r?\n\r?\n", re.IGNORECASE)


class _PipeReader:
    """An asyncio StreamReader over the stdin pipe."""

    def __init__(self, reader: asyncio.StreamReader):
        self._reader = reader

    async def readline(self) -> bytes:
        tail = b""
        while True:
            try:
                return tail + await self._reader.readuntil(b"\n")
            except asyncio.IncompleteReadError as exc:
                return tail + exc.partial  # EOF
            except asyncio.LimitOverrunError as exc:
                chunk = await self._reader.readexactly(exc.consumed)
                tail = (tail + chunk)[-_TAIL:]

    async def read_some(self, n: int, timeout: float | None) -> bytes | None:
        """Up to `n` bytes (b"" at EOF), or None when none came within `timeout`."""
        try:
            return await asyncio.wait_for(self._reader.read(n), timeout)
        except asyncio.TimeoutError:
            return None


class _ThreadedReader:
    """pygls' reader for stdin that is not a pipe (reads block in a thread; no stall detection)."""

    def __init__(self, stdin: BinaryIO, executor):
        self._inner = StdinAsyncReader(stdin, executor)

    async def readline(self) -> bytes:
        return await self._inner.readline()

    async def read_some(self, n: int, timeout: float | None) -> bytes | None:
        return await self._inner.readexactly(n)


async def open_reader(stdin: BinaryIO, executor=None):
    """An async reader over `stdin` (`readline()`, `read_some(n, timeout)`)."""
    try:
        mode = os.fstat(stdin.fileno()).st_mode
        if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
            loop = asyncio.get_running_loop()
            reader = asyncio.StreamReader(limit=_LIMIT)
            await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), stdin)
            return _PipeReader(reader)
    except (OSError, ValueError, AttributeError) as exc:
        log.debug("stdin is not an asyncio pipe (%s); using the threaded reader", exc)
    return _ThreadedReader(stdin, executor)


class Framer:
    """LSP message bodies from a byte stream (see the module docstring for the rules)."""

    def __init__(self, reader):
        self._reader = reader
        self._pending = b""  # bytes pushed back after a framing error
        self.framing_errors = 0

    async def _readline(self) -> bytes:
        if self._pending:
            cut = self._pending.find(b"\n")
            if cut >= 0:
                line, self._pending = self._pending[: cut + 1], self._pending[cut + 1 :]
                return line
            line, self._pending = self._pending, b""
            return line + await self._reader.readline()
        return await self._reader.readline()

    async def _read_body(self, length: int) -> bytes | None:
        """The body, or None at EOF. A stalled body holding a header is cut there (pushed back)."""
        parts = [self._pending[:length]]
        self._pending = self._pending[length:]
        have = len(parts[0])
        while have < length:
            chunk = await self._reader.read_some(min(length - have, 1 << 16), STALL_SECONDS)
            if chunk is None:  # stalled: a framing error if the next message is already inside
                so_far = b"".join(parts)
                if _HEADER_IN_BODY.search(so_far):
                    self._framing_error(f"a body of {length} bytes stalled after {have} with a message header inside it")
                    self._pending = so_far + self._pending  # re-read as header lines
                    return b""
                continue
            if not chunk:
                return None
            parts.append(chunk)
            have += len(chunk)
        return b"".join(parts)

    async def next_body(self) -> bytes | None:
        """The next message body (possibly not JSON), or None when the stream has ended."""
        length: int | None = None
        while True:
            line = await self._readline()
            if not line:
                return None
            if line in (b"\r\n", b"\n"):
                if length is None:
                    continue  # a blank line without a Content-Length: nothing to read
                body = await self._read_body(length)
                if body is None:
                    if length:
                        self._framing_error(f"the stream ended inside a body of {length} bytes")
                    return None
                return body
            match = _HEADER.search(line)
            if match is None:
                if b":" not in line or not line[:1].isalpha():
                    self._framing_error(f"ignored a line that is not a header: {excerpt(log, line, 80)}")
                continue  # another header (Content-Type) or garbage
            if match.start():
                self._framing_error(f"garbage before a header: {excerpt(log, line[: match.start()], 80)}")
            n = int(match.group(1))
            if n > MAX_CONTENT_LENGTH:
                self._framing_error(f"Content-Length {n} is over the {MAX_CONTENT_LENGTH}-byte limit; ignored")
                length = None
                continue
            length = n

    def resync(self, body: bytes) -> None:
        """`body` did not parse: read it again as header lines.

        Its length was wrong: too long, and the next message's header sits inside it (the
        line scan finds it); too short, and the rest of it runs into the next header line
        (found at the end of that line); or not a message at all, and its bytes are skipped.
        """
        if body:
            self._framing_error(f"re-reading a {len(body)}-byte body that did not parse as header lines")
            self._pending = body + self._pending

    def _framing_error(self, what: str) -> None:
        self.framing_errors += 1
        log.warning("LSP framing: %s", what)


def _first_line(exc: ValueError) -> str:
    """A JSON or UTF-8 decoding error without the document text some of them quote."""
    if isinstance(exc, UnicodeDecodeError):
        return f"invalid UTF-8 at byte {exc.start}"
    if isinstance(exc, json.JSONDecodeError):
        return f"{exc.msg} at character {exc.pos}"
    return type(exc).__name__


async def serve(reader, protocol, *, exit_code: Callable[[], int | None], on_error: Callable[[Exception], Any] | None = None) -> None:
    """Read and handle messages until EOF or until `exit_code()` is set (the `exit` notification)."""
    framer = Framer(reader)
    while exit_code() is None:
        body = await framer.next_body()
        if body is None:
            log.info("stdin closed; stopping")
            return
        try:
            message = json.loads(body)
        except ValueError as exc:  # not JSON, not UTF-8
            log.warning("a message body that is not JSON (%s): %s", _first_line(exc), excerpt(log, body))
            protocol.answer_parse_error(f"the message body is not JSON: {_first_line(exc)}")
            framer.resync(body)
            continue
        if isinstance(message, dict):  # only the top level is a message (nested dicts stay dicts)
            message = protocol.structure_message(message)
        try:
            protocol.handle_message(message)
        except (BrokenPipeError, SystemExit, KeyboardInterrupt):
            raise
        except Exception as exc:
            log.exception("handling a message failed; the server goes on")
            if on_error is not None:
                on_error(exc)


def run(stdin: BinaryIO, protocol, executor, *, exit_code: Callable[[], int | None], on_error=None, on_stop: Callable[[], None] | None = None) -> None:
    """Run `serve` on a fresh event loop until it ends (EOF, `exit`, SIGTERM).

    Leaves pending handlers cancelled and the loop closed; does not wait for worker
    threads (a model load in progress must not hold the exit up).
    """
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)

    async def main() -> None:
        reader = await open_reader(stdin, executor)
        task = asyncio.current_task()
        try:
            loop.add_signal_handler(signal.SIGTERM, task.cancel)
        except (NotImplementedError, RuntimeError, ValueError):
            pass  # not the main thread, or no signals here
        try:
            await serve(reader, protocol, exit_code=exit_code, on_error=on_error)
        except asyncio.CancelledError:
            log.info("SIGTERM: stopping")
        finally:
            if on_stop is not None:
                started = time.monotonic()
                on_stop()
                log.debug("on_stop took %.3f s", time.monotonic() - started)

    try:
        loop.run_until_complete(main())
        pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            loop.run_until_complete(asyncio.wait(pending, timeout=0.5))
    finally:
        try:
            loop.remove_signal_handler(signal.SIGTERM)
        except (NotImplementedError, RuntimeError, ValueError):
            pass
        asyncio.set_event_loop(None)
        loop.close()
