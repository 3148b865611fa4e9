"""The Neovim plugin (editors/nvim) driven in a headless Neovim against the real `efim serve`,
on each installed Neovim (the `nvim` fixture in conftest.py: the system's 0.7.2 and 0.12).

Keys are sent with `nvim_input`, so insert-mode autocommands fire as for a
user; the ghost text is read back from the plugin's extmarks. Every wait is
bounded, and Neovim runs in its own process group that is killed afterwards.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest

from embedded_nvim import EmbeddedNvim, open_with_plugin  # tests/editors is on sys.path (pytest rootdir-relative imports)

INITIAL = 'import os\n\n\n\nif __name__ == "__main__":\n    main()\n'
# Typed on line 3 one key at a time until a suggestion appears.
BODY = "def total_size(paths):\n    size = 0\n    for path in paths:\n        size += os.path.getsize(path)\n    return size\n"


SETUP = """
local cmd, model = ...
require("efim").setup({
  cmd = cmd,
  settings = { model = model, maxTokens = 12, temperature = 0, multiline = "never" },
})
"""


def _key(ch: str) -> str:
    return {"\n": "<CR>", "<": "<lt>"}.get(ch, ch)


def _status(nvim: EmbeddedNvim) -> dict:
    return nvim.lua("return require('efim').status()")


def _buffer(nvim: EmbeddedNvim) -> tuple[str, int, int]:
    """Buffer text, and the cursor as (0-based row, byte column)."""
    lines, (row, col) = nvim.lua("return { vim.api.nvim_buf_get_lines(0, 0, -1, true), vim.api.nvim_win_get_cursor(0) }")
    return "\n".join(lines), row - 1, col


def _offset(text: str, row: int, col: int) -> int:
    """Byte offset of (row, byte col) in `text` (UTF-8)."""
    data = text.encode()
    start = 0
    for _ in range(row):
        start = data.index(b"\n", start) + 1
    return start + col


def _open_and_wait_ready(nvim: EmbeddedNvim, cmd: list[str], model: Path, path: Path) -> None:
    path.write_text(INITIAL)
    open_with_plugin(nvim, SETUP, cmd, model, path)


def _type_until_suggestion(nvim: EmbeddedNvim, *, min_words: int = 1, budget_s: float = 40.0) -> str:
    """Types BODY at line 3 key by key, waiting for each answer; returns the first suggestion drawn."""
    nvim.lua("vim.api.nvim_win_set_cursor(0, {3, 0})")
    nvim.input("i")
    nvim.wait_for("return vim.api.nvim_get_mode().mode == 'i'", timeout=5, what="insert mode")
    for ch in BODY:
        before = _status(nvim)["counters"]["requests"]
        nvim.input(_key(ch))
        nvim.wait_for(f"return require('efim').status().counters.requests > {before}", timeout=5, what=f"a request after typing {ch!r}")
        nvim.wait_for("return not require('efim').status().pending", timeout=15, what="the server's answer")
        suggestion = _status(nvim).get("suggestion")
        if suggestion and len(re.findall(r"\w+", suggestion)) >= min_words:
            return suggestion
    status = _status(nvim)
    pytest.fail(f"no suggestion while typing {len(BODY)} keys; client status: {status}")


def _server_stats(nvim: EmbeddedNvim) -> dict:
    return nvim.lua(
        """
        local done, out = false, nil
        require("efim").stats(function(err, result) done, out = true, result or { error = err } end)
        vim.wait(5000, function() return done end, 20)
        return out
        """
    )


def test_ghost_text_from_a_real_suggestion_and_accept_inserts_it(nvim, efim_serve, tiny_model_dir, tmp_path):
    _open_and_wait_ready(nvim, efim_serve, tiny_model_dir, tmp_path / "example.py")
    suggestion = _type_until_suggestion(nvim)

    # The ghost text drawn in the buffer is the suggestion, at the cursor.
    ghost, marks = nvim.lua("return { require('efim.ghost').read(0) }")
    text, row, col = _buffer(nvim)
    assert ghost == suggestion
    assert len(marks) == 1
    _, mark_row, mark_col, details = marks[0]
    assert (mark_row, mark_col) == (row, col)
    if "\n" not in suggestion or not suggestion.startswith("\n"):
        assert details["virt_text"][0][0] == suggestion.split("\n")[0]
        expected_pos = "inline" if nvim.version >= (0, 10, 0) else "overlay"  # typed at the end of the line
        assert details["virt_text_pos"] == expected_pos

    # Accept: the buffer becomes text + suggestion, the cursor lands after it.
    nvim.input("<Tab>")
    nvim.wait_for("return require('efim').status().counters.accepted == 1", timeout=5, what="the accept")
    after, new_row, new_col = _buffer(nvim)
    cut = _offset(text, row, col)
    expected = (text.encode()[:cut] + suggestion.encode() + text.encode()[cut:]).decode()
    assert after == expected
    assert _offset(after, new_row, new_col) == cut + len(suggestion.encode())

    # The show and the accept reached the server's counters.
    stats = _server_stats(nvim)
    assert stats["shown"] >= 1, stats
    assert stats["accepted"] == 1, stats
    assert stats["requests"] >= _status(nvim)["counters"]["requests"] - 1, stats
    assert _status(nvim).get("last_error") is None
    messages = nvim.lua("return vim.fn.execute('messages')")
    assert "rror" not in messages and "deprecated" not in messages, messages


def test_accept_word_escape_and_toggle(nvim, efim_serve, tiny_model_dir, tmp_path):
    _open_and_wait_ready(nvim, efim_serve, tiny_model_dir, tmp_path / "example.py")
    suggestion = _type_until_suggestion(nvim, min_words=2)
    text, row, col = _buffer(nvim)
    word = nvim.lua("return require('efim.text').next_word(...)", suggestion)
    assert word and len(word) < len(suggestion)

    # Accept one word: only it is inserted, and the server hears of a partial accept.
    nvim.input("<M-w>")
    nvim.wait_for("return require('efim').status().counters.partially_accepted == 1", timeout=5, what="the partial accept")
    after, _, _ = _buffer(nvim)
    cut = _offset(text, row, col)
    assert after == (text.encode()[:cut] + word.encode() + text.encode()[cut:]).decode()
    nvim.wait_for("return not require('efim').status().pending", timeout=15, what="the answer after the partial accept")
    assert _server_stats(nvim)["partiallyAccepted"] == 1

    # Leaving insert mode clears the ghost text.
    nvim.input("<Esc>")
    nvim.wait_for("return vim.api.nvim_get_mode().mode == 'n'", timeout=5, what="normal mode")
    assert nvim.lua("return require('efim.ghost').read(0)") == ""
    assert _status(nvim).get("suggestion") is None

    # Toggled off, typing asks the server nothing.
    nvim.command("EfimToggle")
    assert _status(nvim)["enabled"] is False
    before = _status(nvim)["counters"]["requests"]
    nvim.input("Ax")
    nvim.wait_for("return vim.api.nvim_get_current_line():sub(-1) == 'x'", timeout=5, what="the typed x")
    assert _status(nvim)["counters"]["requests"] == before
    assert nvim.lua("return require('efim.ghost').read(0)") == ""

    # Settings changes reach the server in its flat camelCase shape: a bad value comes back as a warning.
    assert nvim.lua("return require('efim').configure({ maxTokens = 0 })") is not False
    nvim.wait_for("return vim.fn.execute('messages'):find('maxTokens=0', 1, true) ~= nil", timeout=5, what="the server's warning")

    # :EfimRestart brings up a new server attached to the same buffer, and it answers.
    old_client = _status(nvim)["client_id"]
    nvim.input("<Esc>")
    nvim.command("EfimToggle")
    nvim.command("EfimRestart")
    nvim.wait_for(f"local s = require('efim').status() return s.client_id and s.client_id ~= {old_client} and s.state == 'ready'",
                  timeout=30, what="a restarted, ready server")
    before = _status(nvim)["counters"]["requests"]
    nvim.input("Ay")
    nvim.wait_for(f"return require('efim').status().counters.requests > {before}", timeout=5, what="a request to the new server")
    nvim.wait_for("return not require('efim').status().pending", timeout=15, what="the new server's answer")
    assert _status(nvim).get("last_error") is None


ALTERNATIVES_SETUP = """
local cmd, model = ...
require("efim").setup({
  cmd = cmd,
  settings = { model = model, maxTokens = 12, temperature = 0, multiline = "never", alternatives = 3 },
})
"""


def _tap_answer_items(log: Path) -> list[str]:
    """The insert texts of the server's answer to the last textDocument/inlineCompletion in the tap's log."""
    entries = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    asked = [e["message"]["id"] for e in entries if e["dir"] == "in" and e["message"].get("method") == "textDocument/inlineCompletion"]
    for e in entries:
        m = e["message"]
        if e["dir"] == "out" and "method" not in m and m.get("id") == asked[-1]:
            items = (m.get("result") or {}).get("items") or []
            return [i["insertText"] if isinstance(i["insertText"], str) else i["insertText"]["value"] for i in items]
    raise AssertionError(f"no answer to request {asked[-1]} in {log}")


def test_next_and_prev_cycle_the_alternatives_and_tab_accepts_the_one_shown(nvim, efim_serve, tiny_model_dir, tmp_path):
    log = tmp_path / "lsp.jsonl"
    cmd = [sys.executable, str(Path(__file__).with_name("lsp_tap.py")), str(log), "--", *efim_serve]
    path = tmp_path / "example.py"
    path.write_text(INITIAL)
    open_with_plugin(nvim, ALTERNATIVES_SETUP, cmd, tiny_model_dir, path)

    # Type until an answer with two items or more is drawn (the tiny random model's samples
    # may all shape to the first item's text at some keystrokes).
    nvim.lua("vim.api.nvim_win_set_cursor(0, {3, 0})")
    nvim.input("i")
    nvim.wait_for("return vim.api.nvim_get_mode().mode == 'i'", timeout=5, what="insert mode")
    for ch in BODY:
        before = _status(nvim)["counters"]["requests"]
        nvim.input(_key(ch))
        nvim.wait_for(f"return require('efim').status().counters.requests > {before}", timeout=5, what=f"a request after typing {ch!r}")
        nvim.wait_for("return not require('efim').status().pending", timeout=15, what="the server's answer")
        if (_status(nvim).get("item_count") or 0) >= 2:
            break
    else:
        pytest.fail(f"no answer with two items while typing {len(BODY)} keys; client status: {_status(nvim)}")
    texts = _tap_answer_items(log)
    status = _status(nvim)
    n = status["item_count"]
    assert n == len(texts) and 2 <= n <= 3 and len(set(texts)) == n, texts
    assert status["item_index"] == 1
    first = status["suggestion"]
    typed = texts[0][: len(texts[0]) - len(first)]
    assert texts[0] == typed + first and all(t.startswith(typed) for t in texts), (texts, first)
    text, row, col = _buffer(nvim)

    def shown(index: int) -> str:
        nvim.wait_for(f"return require('efim').status().item_index == {index}", timeout=5, what=f"item {index} drawn")
        suggestion = _status(nvim)["suggestion"]
        assert nvim.lua("return require('efim.ghost').read(0)") == suggestion
        assert _buffer(nvim) == (text, row, col)  # cycling changes only the ghost text
        return suggestion

    nvim.input("<M-[>")  # previous, from the first: wraps to the last
    assert shown(n) == texts[n - 1][len(typed):]
    nvim.input("<M-]>")  # next, from the last: wraps to the first
    assert shown(1) == first
    nvim.command("EfimNext")
    second = shown(2)
    assert second == texts[1][len(typed):] and second != first

    # Tab accepts the item on screen: the buffer gets the second item's text.
    nvim.input("<Tab>")
    nvim.wait_for("return require('efim').status().counters.accepted == 1", timeout=5, what="the accept")
    after, _, _ = _buffer(nvim)
    cut = _offset(text, row, col)
    assert after == (text.encode()[:cut] + second.encode() + text.encode()[cut:]).decode()
    deadline = time.monotonic() + 5
    while not (accepted := [e["message"] for e in map(json.loads, log.read_text().splitlines())
                            if e["dir"] == "in" and e["message"].get("method") == "workspace/executeCommand"]):
        assert time.monotonic() < deadline, "the accept command did not reach the server"
        time.sleep(0.05)
    assert [m["params"]["arguments"][0]["length"] for m in accepted] == [len(texts[1])]


TEXT_CASES = """
local t = require("efim.text")
local line = "a\\u{1F600}b\\u{E9}c"  -- a, 4-byte emoji (2 UTF-16 units), b, 2-byte é, c
return {
  utf16 = { t.byte_to_col(line, 5, "utf-16"), t.byte_to_col(line, 6, "utf-16"), t.byte_to_col(line, 8, "utf-16") },
  utf32 = { t.byte_to_col(line, 5, "utf-32"), t.byte_to_col(line, 8, "utf-32") },
  bytes = { t.col_to_byte(line, 3, "utf-16"), t.col_to_byte(line, 5, "utf-16"), t.col_to_byte(line, 99, "utf-16"),
            t.col_to_byte(line, 3, "utf-32"), t.col_to_byte(line, 4, "utf-8") },
  words = { t.next_word("foo(bar)"), t.next_word("  bar_2 = 1"), t.next_word("(x)"), t.next_word("\\n    y"), t.next_word("  ") },
  lines = { t.next_line("abc\\ndef"), t.next_line("\\n  def\\nghi") },
  split = t.lines("a\\n\\nb\\n"),
  units = t.units("\\u{1F600}\\u{E9}", "utf-16"),
}
"""


def test_text_arithmetic(nvim):
    """Column conversions (surrogate pairs, multibyte) and the pieces partial accepts take."""
    out = nvim.lua(TEXT_CASES) if nvim.version >= (0, 9, 0) else nvim.lua(_without_unicode_escapes(TEXT_CASES))
    assert out["utf16"] == [3, 4, 5]
    assert out["utf32"] == [2, 4]
    assert out["bytes"] == [5, 8, 9, 6, 4]
    assert out["words"] == ["foo", "  bar_2", "(", "\n    ", "  "]
    assert out["lines"] == ["abc", "\n  def"]
    assert out["split"] == ["a", "", "b", ""]
    assert out["units"] == 3


def _without_unicode_escapes(code: str) -> str:
    """LuaJIT 2.1-beta3 (Neovim 0.7) has no \\u{...} escapes: spell the UTF-8 bytes out."""
    return re.sub(r"\\u\{([0-9A-Fa-f]+)\}", lambda m: "".join(f"\\{b}" for b in chr(int(m.group(1), 16)).encode()), code)


GHOST_CASES = r"""
local ghost = require("efim.ghost")
local buf = vim.api.nvim_get_current_buf()
vim.api.nvim_buf_set_lines(buf, 0, -1, true, { "x = f(a)", "" })
ghost.draw(buf, 0, 6, "b, c\n    d", "Comment")    -- mid-line: text follows the cursor
local mid, marks = ghost.read(buf)
local details = marks[1][4]
ghost.draw(buf, 1, 0, "pass", "Comment")            -- an empty line: nothing follows
local eol_text, eol_marks = ghost.read(buf)
ghost.clear(buf)
local cleared = ghost.read(buf)
return { mid = mid, col = marks[1][3], pos = details.virt_text_pos, below = details.virt_lines,
         n = #marks, eol_text = eol_text, eol_pos = eol_marks[1][4].virt_text_pos, eol_n = #eol_marks, cleared = cleared }
"""


def test_ghost_rendering(nvim):
    """Where ghost text goes: inline from 0.10; before that at eol when text follows the cursor, else overlay."""
    out = nvim.lua(GHOST_CASES)
    inline = nvim.version >= (0, 10, 0)
    assert out["mid"] == "b, c\n    d"
    assert out["n"] == 1 and out["col"] == 6
    assert out["pos"] == ("inline" if inline else "eol")
    assert out["below"] == [[["    d", "Comment"]]]
    assert out["eol_text"] == "pass" and out["eol_n"] == 1  # drawing again replaces the earlier ghost
    assert out["eol_pos"] == ("inline" if inline else "overlay")
    assert out["cleared"] == ""
