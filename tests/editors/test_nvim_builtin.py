"""Neovim 0.12 without the plugin: `lsp/efim.lua` + `vim.lsp.enable('efim')` +
`vim.lsp.inline_completion.enable()`, against the real `efim serve` on a tiny model.

Zero configuration inside Neovim: `efim` is found on PATH (a script in the
test's bin folder that runs this checkout's server, with `--model` pointing at
the tiny model, behind lsp_tap.py), exactly as `cmd = { 'efim', 'serve' }` in
lsp/efim.lua asks. Keys go through `nvim_input`; the ghost text is read from
the built-in client's extmarks; `vim.lsp.inline_completion.get()` accepts.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest

from bench.nvim_driver import GHOST_FN  # `efim_ghost()`: the built-in client's ghost text, read back from its extmarks
from embedded_nvim import EmbeddedNvim

REPO = Path(__file__).resolve().parents[2]
TAP = Path(__file__).with_name("lsp_tap.py")
INITIAL = 'import os\n\n\n\nif __name__ == "__main__":\n    main()\n'
BODY = "def total_size(paths):\n    size = 0\n    for path in paths:\n        size += os.path.getsize(path)\n    return size\n"


def log_entries(log: Path) -> list[dict]:
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def sent(log: Path, method: str) -> list[dict]:
    return [e["message"] for e in log_entries(log) if e["dir"] == "in" and e["message"].get("method") == method]


def answer(log: Path, request_id) -> dict | None:
    for e in log_entries(log):
        m = e["message"]
        if e["dir"] == "out" and "method" not in m and m.get("id") == request_id:
            return m
    return None


@pytest.fixture
def efim_on_path(nvim, tiny_model_dir, tmp_path) -> Path:
    """Puts an `efim` on Neovim's PATH that runs this checkout's server on the tiny model behind the tap; returns the log."""
    if nvim.version < (0, 12, 0):
        pytest.skip(f"Neovim {'.'.join(map(str, nvim.version))} has no vim.lsp.inline_completion (0.12 does); the plugin covers it")
    log = tmp_path / "lsp.jsonl"
    shim = nvim.bin_dir / "efim"
    shim.write_text(
        "#!/bin/sh\n"
        f'exec "{sys.executable}" "{TAP}" "{log}" -- "{sys.executable}" -m efim_tools.cli "$@" '
        f'--model "{tiny_model_dir}" --log-level warning\n'
    )
    shim.chmod(0o755)
    return log


def _type_until_ghost(nvim: EmbeddedNvim, log: Path, budget_s: float = 60.0) -> tuple[list[dict], dict]:
    """Types BODY at line 3 key by key; after each key waits for the built-in client's request
    (it debounces 200 ms) and the server's answer; returns the ghost extmarks and the item drawn."""
    nvim.lua("vim.api.nvim_win_set_cursor(0, {3, 0})")
    nvim.input("i")
    deadline = time.monotonic() + budget_s
    for ch in BODY:
        before = len(sent(log, "textDocument/inlineCompletion"))
        nvim.input({"\n": "<CR>", "<": "<lt>"}.get(ch, ch))
        while len(sent(log, "textDocument/inlineCompletion")) <= before:
            assert time.monotonic() < deadline, "the built-in client sent no textDocument/inlineCompletion"
            time.sleep(0.03)
        request = sent(log, "textDocument/inlineCompletion")[-1]
        while (reply := answer(log, request["id"])) is None:
            assert time.monotonic() < deadline, f"no answer to {request}"
            time.sleep(0.03)
        items = (reply.get("result") or {}).get("items") or []
        if items:
            ghost = nvim.wait_for("local g = efim_ghost() return #g > 0 and g", timeout=5, what="the ghost text")
            return ghost, items[0]
    pytest.fail(f"no suggestion while typing {len(BODY)} keys")


def as_drawn(text: str) -> str:
    """Text as Neovim stores it in virt_text: control characters in caret notation (a random model emits them)."""
    return re.sub(r"[\x00-\x08\x0b-\x1f\x7f]", lambda m: "^" + chr((ord(m.group()) + 64) % 128), text)


def test_builtin_inline_completion_with_zero_configuration(nvim, efim_on_path, tmp_path):
    log = efim_on_path
    path = tmp_path / "example.py"
    path.write_text(INITIAL)
    nvim.command("filetype on")
    nvim.command("set noautoindent nosmartindent")  # the typed text carries its own indentation
    nvim.lua(GHOST_FN)
    # The three lines a user writes (the first is the fixture's `set rtp^=editors/nvim`).
    nvim.lua("vim.lsp.enable('efim'); vim.lsp.inline_completion.enable()")
    nvim.command(f"edit {path}")
    client = nvim.wait_for(
        "local c = vim.lsp.get_clients({ name = 'efim', bufnr = 0 })[1] "
        "return c and c.initialized and { id = c.id, cmd = c.config.cmd, root = c.root_dir or vim.NIL, enc = c.offset_encoding }",
        timeout=20, what="the efim client from lsp/efim.lua to attach")
    assert client["cmd"] == ["efim", "serve"]
    init = sent(log, "initialize")[0]["params"]
    assert init["capabilities"]["textDocument"]["inlineCompletion"] is not None
    deadline = time.monotonic() + 20  # the client sends didOpen after it is initialized, and the tap logs it on its own time
    while not (open_ := sent(log, "textDocument/didOpen")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [m["params"]["textDocument"]["uri"] for m in open_] == [path.as_uri()]

    ghost, item = _type_until_ghost(nvim, log)
    assert len(ghost) == 1, ghost
    mark = ghost[0]
    lines, (row, col) = nvim.lua("return { vim.api.nvim_buf_get_lines(0, 0, -1, true), vim.api.nvim_win_get_cursor(0) }")
    line, before = lines[row - 1], "\n".join(lines)
    text = item["insertText"] if isinstance(item["insertText"], str) else item["insertText"]["value"]
    rng = item.get("range") or {"start": {"line": row - 1, "character": col}, "end": {"line": row - 1, "character": col}}
    assert rng["start"]["line"] == rng["end"]["line"] == row - 1, item
    assert client["enc"] == "utf-8" or line.isascii()  # columns below are bytes: the typed text is ASCII
    start, end = rng["start"]["character"], rng["end"]["character"]
    typed = line.encode()[start:col].decode()
    assert text.startswith(typed) and len(text) > len(typed), (item, line, col)
    # Drawn at the cursor: the part of the item not typed yet.
    assert (mark["row"], mark["col"]) == (row - 1, col)
    suggestion = mark["text"]
    assert suggestion == as_drawn(text[len(typed):])

    # This server answers one item: select() cycles through what there is — the same item, marked 1/1.
    nvim.lua("vim.lsp.inline_completion.select({ count = 1 })")
    cycled = nvim.wait_for("local g = efim_ghost() return g[1] and g[1].text:find('(1/1)', 1, true) and g",
                           timeout=5, what="the cycled ghost with its index")
    assert cycled[0]["text"] == suggestion + " (1/1)", cycled

    # Accept: the buffer becomes text + suggestion at the cursor, and the server hears of it.
    assert nvim.lua("return vim.lsp.inline_completion.get()") is True
    nvim.wait_for(f"return table.concat(vim.api.nvim_buf_get_lines(0, 0, -1, true), '\\n') ~= {json.dumps(before)}",
                  timeout=5, what="the accepted text in the buffer")
    after = nvim.lua("return vim.api.nvim_buf_get_lines(0, 0, -1, true)")
    edited = (line.encode()[:start] + text.encode() + line.encode()[end:]).decode()
    assert "\n".join(after) == "\n".join([*lines[: row - 1], edited, *lines[row:]])
    assert nvim.lua("return efim_ghost()") == []
    deadline = time.monotonic() + 5
    while not [m for m in sent(log, "workspace/executeCommand") if m["params"]["command"] == "efim.accepted"]:
        assert time.monotonic() < deadline, "the accept command did not reach the server"
        time.sleep(0.05)

    # lsp/efim.lua also wires the cursor notification: a jump in normal mode is reported.
    nvim.input("<Esc>gg0")
    deadline = time.monotonic() + 5
    while not any(m["params"]["position"] == {"line": 0, "character": 0} for m in sent(log, "efim/didMoveCursor")):
        assert time.monotonic() < deadline, f"no efim/didMoveCursor at 1:1; sent: {sent(log, 'efim/didMoveCursor')}"
        time.sleep(0.05)
    assert all(m["params"]["textDocument"]["uri"] == path.as_uri() for m in sent(log, "efim/didMoveCursor"))
    errors = [e["message"] for e in log_entries(log) if e["dir"] == "out" and e["message"].get("method") == "window/showMessage"
              and e["message"]["params"]["type"] == 1]
    assert errors == []


def test_builtin_client_cycles_the_alternatives_and_accepts_the_second(nvim, efim_on_path, tmp_path):
    """`alternatives = 3` in init_options: an answer with several items; `select()` shows the
    next one (marked 2/N) and `get()` inserts that one, not the first."""
    log = efim_on_path
    path = tmp_path / "example.py"
    path.write_text(INITIAL)
    nvim.command("filetype on")
    nvim.command("set noautoindent nosmartindent")
    nvim.lua(GHOST_FN)
    nvim.lua("vim.lsp.config('efim', { init_options = { alternatives = 3 } }); "
             "vim.lsp.enable('efim'); vim.lsp.inline_completion.enable()")
    nvim.command(f"edit {path}")
    nvim.wait_for("local c = vim.lsp.get_clients({ name = 'efim', bufnr = 0 })[1] return c and c.initialized",
                  timeout=20, what="the efim client to attach")
    assert sent(log, "initialize")[0]["params"]["initializationOptions"] == {"alternatives": 3}

    # Type until an answer holds two items or more (the tiny random model's samples may all
    # shape to the same text at some keystrokes).
    nvim.lua("vim.api.nvim_win_set_cursor(0, {3, 0})")
    nvim.input("i")
    deadline = time.monotonic() + 60
    items: list[dict] = []
    for ch in BODY:
        before = len(sent(log, "textDocument/inlineCompletion"))
        nvim.input({"\n": "<CR>", "<": "<lt>"}.get(ch, ch))
        while len(sent(log, "textDocument/inlineCompletion")) <= before:
            assert time.monotonic() < deadline, "the built-in client sent no textDocument/inlineCompletion"
            time.sleep(0.03)
        request = sent(log, "textDocument/inlineCompletion")[-1]
        while (reply := answer(log, request["id"])) is None:
            assert time.monotonic() < deadline, f"no answer to {request}"
            time.sleep(0.03)
        items = (reply.get("result") or {}).get("items") or []
        if len(items) >= 2:
            break
    else:
        pytest.fail(f"no answer with two items while typing {len(BODY)} keys")
    texts = [i["insertText"] if isinstance(i["insertText"], str) else i["insertText"]["value"] for i in items]
    assert len(set(texts)) == len(texts) <= 3, texts
    nvim.wait_for("local g = efim_ghost() return #g > 0 and g", timeout=5, what="the first item's ghost text")
    lines, (row, col) = nvim.lua("return { vim.api.nvim_buf_get_lines(0, 0, -1, true), vim.api.nvim_win_get_cursor(0) }")
    line = lines[row - 1]
    rng = items[1]["range"]
    start, end = rng["start"]["character"], rng["end"]["character"]
    typed = line.encode()[start:col].decode()
    assert all(t.startswith(typed) for t in texts), (texts, typed)

    # select(): the second item, marked with its index.
    nvim.lua("vim.lsp.inline_completion.select({ count = 1 })")
    mark = f"(2/{len(items)})"
    cycled = nvim.wait_for(f"local g = efim_ghost() return g[1] and g[1].text:find({json.dumps(mark)}, 1, true) and g",
                           timeout=5, what="the second item's ghost text")
    assert cycled[0]["text"] == as_drawn(texts[1][len(typed):]) + " " + mark, cycled

    # Accept: the buffer gets the second item's text.
    assert nvim.lua("return vim.lsp.inline_completion.get()") is True
    edited = (line.encode()[:start] + texts[1].encode() + line.encode()[end:]).decode()
    expected = "\n".join([*lines[: row - 1], edited, *lines[row:]])
    deadline = time.monotonic() + 5
    while (now := "\n".join(nvim.lua("return vim.api.nvim_buf_get_lines(0, 0, -1, true)"))) != expected:
        assert time.monotonic() < deadline, f"the buffer does not hold the second item: {now!r}"
        time.sleep(0.03)
    assert texts[1] != texts[0] and expected != "\n".join(lines)
    deadline = time.monotonic() + 5
    while not (accepted := [m for m in sent(log, "workspace/executeCommand") if m["params"]["command"] == "efim.accepted"]):
        assert time.monotonic() < deadline, "the accept command did not reach the server"
        time.sleep(0.05)
    assert accepted[-1]["params"]["arguments"][0]["length"] == len(texts[1])
