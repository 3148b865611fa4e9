"""A stdio tap between an editor and a language server: `python lsp_tap.py LOG -- CMD...`.

Starts CMD, passes the editor's stdin through to it unchanged (the server's
stdout and stderr are inherited, so its answers reach the editor untouched),
and appends every client -> server JSON-RPC message to LOG as one JSON line
`{"t": <monotonic seconds>, "message": {...}}`, flushed as it is written. The
editor tests read LOG to check what a client sent (e.g. `efim/didMoveCursor`)
whatever the server does with it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time


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


def main(argv: list[str]) -> int:
    if len(argv) < 4 or argv[2] != "--":
        print("usage: lsp_tap.py LOG -- CMD...", file=sys.stderr)
        return 2
    log_path, cmd = argv[1], argv[3:]
    child = subprocess.Popen(cmd, stdin=subprocess.PIPE)
    pending = bytearray()
    with open(log_path, "a", encoding="utf-8") as log:
        stdin = sys.stdin.buffer.fileno()
        while True:
            chunk = os.read(stdin, 65536)
            if not chunk:
                break
            try:
                child.stdin.write(chunk)
                child.stdin.flush()
            except BrokenPipeError:
                break
            pending += chunk
            for body in frames(pending):
                log.write(json.dumps({"t": time.monotonic(), "message": json.loads(body)}) + "\n")
                log.flush()
    try:
        child.stdin.close()
    except BrokenPipeError:
        pass
    return child.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
