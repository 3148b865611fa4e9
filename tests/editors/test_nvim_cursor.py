"""The Neovim plugin's cursor notification, `efim/didMoveCursor` (docs/editors.md).

Neovim runs the plugin against the server code with the in-test fake engine,
behind lsp_tap.py, which logs every message the client sends; the tests move
the cursor with real keys (`nvim_input`) and read what went out. Each wait is
bounded; waits for "nothing more was sent" are the debounce plus a margin.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from embedded_nvim import EmbeddedNvim

METHOD = "efim/didMoveCursor"
# Line 3 has a character outside the BMP (4 UTF-8 bytes, 2 UTF-16 units) and a 2-byte "é" before
# "name": positions are counted in the encoding the client negotiated (Neovim 0.7 offers only
# UTF-16; 0.12 offers UTF-8 too, and the server takes it).
LINE3 = 'label = "\U0001F600\u00e9" + name'
FILE_A = f"import os\n\n{LINE3}\nvalue = compute(label)\n\n"
FILE_B = "def main():\n    pass\n"
QUIET_S = 0.5  # debounce (80 ms) plus a generous margin on a loaded machine

SETUP = """
local cmd = ...
require("efim").setup({ cmd = cmd, settings = { model = "fake", maxTokens = 8, multiline = "never" } })
"""


def client_messages(log: Path) -> list[dict]:
    """What the client sent, in order (lsp_tap.py's "in" direction)."""
    if not log.exists():
        return []
    entries = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    return [e["message"] for e in entries if e["dir"] == "in"]


def cursor_notes(log: Path) -> list[dict]:
    return [m["params"] for m in client_messages(log) if m.get("method") == METHOD]


def wait_for_note(log: Path, after: int, position: dict, *, timeout: float = 5.0) -> list[dict]:
    """Waits until a notification past index `after` is at `position`; returns those past `after`."""
    deadline = time.monotonic() + timeout
    while True:
        notes = cursor_notes(log)[after:]
        if notes and notes[-1]["position"] == position:
            return notes
        if time.monotonic() > deadline:
            raise AssertionError(f"no {METHOD} at {position} within {timeout} s; sent after #{after}: {notes}")
        time.sleep(0.03)


def last_version(log: Path, uri: str) -> int:
    """The document version the client last synced for `uri` (didOpen or didChange)."""
    version = None
    for m in client_messages(log):
        if m.get("method") in ("textDocument/didOpen", "textDocument/didChange") and m["params"]["textDocument"]["uri"] == uri:
            version = m["params"]["textDocument"]["version"]
    assert version is not None, f"{uri} was never synced"
    return version


def units(text: str, encoding: str) -> int:
    """Length of `text` in LSP position units."""
    if encoding == "utf-8":
        return len(text.encode())
    if encoding == "utf-32":
        return len(text)
    return len(text.encode("utf-16-le")) // 2


def open_with_plugin(nvim: EmbeddedNvim, cmd: list[str], path: Path) -> str:
    nvim.command("filetype on")
    nvim.lua(SETUP, cmd)
    nvim.command(f"edit {path}")
    nvim.wait_for("return require('efim').status().state == 'ready'", timeout=30, what="the server to be ready")
    return nvim.lua("return vim.uri_from_bufnr(0)")


def test_cursor_moves_are_reported_debounced_and_not_for_edits(nvim, tapped_fake_server, tmp_path):
    cmd, log = tapped_fake_server
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text(FILE_A)
    b.write_text(FILE_B)
    uri_a = open_with_plugin(nvim, cmd, a)
    assert uri_a == a.as_uri()
    encoding = nvim.lua("return vim.lsp.get_client_by_id(require('efim').status().client_id).offset_encoding")
    if nvim.version < (0, 10, 0):
        assert encoding == "utf-16"  # all that 0.7 offers

    def at(text_before: str) -> dict:
        return {"line": 2, "character": units(text_before, encoding)}

    # A normal-mode jump: line 3, then `fn` onto "name". Position in negotiated units, with the synced version.
    seen = len(cursor_notes(log))
    nvim.input("3G")
    nvim.input("fn")
    notes = wait_for_note(log, seen, at(LINE3[: LINE3.index("name")]))
    assert notes[-1]["textDocument"] == {"uri": uri_a, "version": last_version(log, uri_a)}
    assert nvim.lua("return vim.api.nvim_win_get_cursor(0)") == [3, len(LINE3[: LINE3.index("name")].encode())]

    # A burst of moves, faster than the debounce: one notification (two if the machine stalls), the last position.
    time.sleep(QUIET_S)
    seen = len(cursor_notes(log))
    for _ in range(6):
        nvim.input("h")
    on_emoji = at('label = "')  # six characters left of "name"
    notes = wait_for_note(log, seen, on_emoji)
    time.sleep(QUIET_S)
    notes = cursor_notes(log)[seen:]
    assert 1 <= len(notes) <= 2, notes
    assert notes[-1]["position"] == on_emoji

    # Entering insert mode is reported; the cursor moves that typing causes are not (the completion
    # requests carry those positions); a move without an edit in insert mode is, at the new version.
    seen = len(cursor_notes(log))
    nvim.input("A")
    wait_for_note(log, seen, at(LINE3))
    time.sleep(QUIET_S)
    # sent at once, where `A` put the cursor (not where InsertEnter found it), and once
    assert [n["position"] for n in cursor_notes(log)[seen:]] == [at(LINE3)]
    seen = len(cursor_notes(log))
    nvim.input("xy")
    nvim.wait_for("return vim.api.nvim_get_current_line():sub(-2) == 'xy'", timeout=5, what="the typed keys")
    time.sleep(QUIET_S)
    requests = [m["params"]["position"] for m in client_messages(log) if m.get("method") == "textDocument/inlineCompletion"]
    assert at(LINE3 + "xy") in requests, requests
    assert cursor_notes(log)[seen:] == []
    nvim.input("<Left>")
    notes = wait_for_note(log, seen, at(LINE3 + "x"))
    assert notes[-1]["textDocument"] == {"uri": uri_a, "version": last_version(log, uri_a)}
    assert notes[-1]["textDocument"]["version"] > cursor_notes(log)[0]["textDocument"]["version"]
    nvim.input("<Esc>")
    nvim.wait_for("return vim.api.nvim_get_mode().mode == 'n'", timeout=5, what="normal mode")

    # Switching buffers reports the buffer entered, after the client opened it.
    time.sleep(QUIET_S)
    seen = len(cursor_notes(log))
    nvim.command(f"edit {b}")
    notes = wait_for_note(log, seen, {"line": 0, "character": 0})
    uri_b = b.as_uri()
    assert notes[-1]["textDocument"]["uri"] == uri_b
    methods = [(m.get("method"), (m.get("params") or {}).get("textDocument", {}).get("uri")) for m in client_messages(log)]
    assert methods.index(("textDocument/didOpen", uri_b)) < methods.index((METHOD, uri_b))
    seen = len(cursor_notes(log))
    nvim.command("buffer a.py")
    notes = wait_for_note(log, seen, at(LINE3))  # where the cursor was left: on the "x" (<Esc> moved it back)
    assert notes[-1]["textDocument"]["uri"] == uri_a

    # A normal-mode edit that moves the cursor (undo of the typing) is reported: no request follows it.
    time.sleep(QUIET_S)
    seen = len(cursor_notes(log))
    nvim.input("u")
    nvim.wait_for("return vim.api.nvim_get_current_line():sub(-4) == 'name'", timeout=5, what="the undo")
    row, col = nvim.lua("return vim.api.nvim_win_get_cursor(0)")
    notes = wait_for_note(log, seen, {"line": row - 1, "character": units(FILE_A.split("\n")[row - 1].encode()[:col].decode(), encoding)})
    assert notes[-1]["textDocument"] == {"uri": uri_a, "version": last_version(log, uri_a)}

    # Completions toggled off: nothing is reported.
    time.sleep(QUIET_S)
    nvim.command("EfimToggle")
    seen = len(cursor_notes(log))
    nvim.input("gg")
    nvim.wait_for("return vim.api.nvim_win_get_cursor(0)[1] == 1", timeout=5, what="the jump to line 1")
    time.sleep(QUIET_S)
    assert cursor_notes(log)[seen:] == []
    assert nvim.lua("return require('efim').status().last_error") is None
