"""Reading LSP messages from stdin without a thread hop per line.

pygls' stdio reader runs every `readline()` / `read(n)` in a worker thread, so
between two messages the event loop always runs whatever handlers are ready.
For a completion server that is the wrong order: in a burst of keystrokes, a
request's handler would start before the `didChange` already waiting in the
pipe is read, and could answer for a version the user has typed past. Reading
the pipe with an asyncio `StreamReader` serves everything already buffered
without yielding, so all pending input is applied before any handler runs,
and the per-message thread hops (milliseconds each on a loaded machine) go
away. Stdin that is not a pipe (a file, a terminal) falls back to pygls' reader.
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
from typing import BinaryIO

from pygls.io_ import StdinAsyncReader

log = logging.getLogger(__name__)

_LIMIT = 1 << 20  # readline limit: header lines are short; bodies use readexactly


class _PipeReader:
    def __init__(self, reader: asyncio.StreamReader):
        self._reader = reader

    async def readline(self) -> bytes:
        return await self._reader.readline()

    async def readexactly(self, n: int) -> bytes:
        try:
            return await self._reader.readexactly(n)
        except asyncio.IncompleteReadError as exc:
            return exc.partial  # EOF mid-message: pygls' loop stops on a short/empty body


async def open_reader(stdin: BinaryIO, executor=None):
    """An async reader over `stdin` for `pygls.io_.run_async`."""
    try:
        mode = os.fstat(stdin.fileno()).st_mode
        if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
            loop = asyncio.get_running_loop()
            reader = asyncio.StreamReader(limit=_LIMIT)
            await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), stdin)
            return _PipeReader(reader)
    except (OSError, ValueError, AttributeError) as exc:
        log.debug("stdin is not an asyncio pipe (%s); using the threaded reader", exc)
    return StdinAsyncReader(stdin, executor)
