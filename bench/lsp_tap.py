"""A stdio tap between an editor and a language server: `python lsp_tap.py LOG -- CMD...`.

Starts CMD and passes bytes through unchanged both ways (the server's stderr is
inherited), appending every JSON-RPC message to LOG as one JSON line
`{"t": <monotonic s>, "dir": "in" | "out", "message": {...}}` ("in": editor to
server), flushed as it is written. The editor tests read LOG to check what a
client sent (e.g. `efim/didMoveCursor`) and what the server answered, and
bench/nvim_first_suggestion.py times the requests and answers with it ("t" is
CLOCK_MONOTONIC, the clock of every process's `time.monotonic()` on Linux).
Standard library only: it runs as a script, by path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from typing import BinaryIO, TextIO


def frames(data: bytearray):
    """Pops complete `Content-Length` frames off the front of `data`; yields their bodies."""
    while True:
        end = data.find(b"\r\n\r\n")
        if end < 0:
            return
        length = None
        for line in bytes(data[:end]).split(b"\r\n"):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value.strip())
        if length is None:
            raise ValueError(f"LSP header without Content-Length: {bytes(data[:end])!r}")
        if len(data) < end + 4 + length:
            return
        body = bytes(data[end + 4 : end + 4 + length])
        del data[: end + 4 + length]
        yield body


class Log:
    def __init__(self, file: TextIO) -> None:
        self.file = file
        self.lock = threading.Lock()

    def write(self, direction: str, body: bytes) -> None:
        line = json.dumps({"t": time.monotonic(), "dir": direction, "message": json.loads(body)}) + "\n"
        with self.lock:
            self.file.write(line)
            self.file.flush()


def pump(source: int, sink: BinaryIO, log: Log, direction: str) -> None:
    """Copies `source` (a file descriptor) to `sink` until EOF, logging each whole message."""
    pending = bytearray()
    while True:
        chunk = os.read(source, 65536)
        if not chunk:
            return
        # Logged before it is passed on: whoever reads LOG after the other side saw a message
        # finds it there (an editor test reads the answer it was just shown).
        pending += chunk
        for body in frames(pending):
            log.write(direction, body)
        try:
            sink.write(chunk)
            sink.flush()
        except BrokenPipeError:
            return


def main(argv: list[str]) -> int:
    if len(argv) < 4 or argv[2] != "--":
        print("usage: lsp_tap.py LOG -- CMD...", file=sys.stderr)
        return 2
    log_path, cmd = argv[1], argv[3:]
    child = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    with open(log_path, "a", encoding="utf-8") as file:
        log = Log(file)
        answers = threading.Thread(target=pump, args=(child.stdout.fileno(), sys.stdout.buffer, log, "out"), daemon=True)
        answers.start()
        pump(sys.stdin.buffer.fileno(), child.stdin, log, "in")
        try:
            child.stdin.close()
        except BrokenPipeError:
            pass
        code = child.wait()
        answers.join(timeout=5)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv))
