"""Next edits in the Neovim plugin (editors/nvim/lua/efim/next_edit.lua) against the real
`efim serve`, on each installed Neovim (the `nvim` fixture: the system's 0.7.2 and 0.12).

A local name used three times is renamed key by key at its first use; the plugin asks
`textDocument/copilotInlineEdit` after the change (debounced), draws the proposed edit at the
second use (range highlighted, new text as virtual text), reports the show; `<M-n>` jumps
there, `<M-n>` again applies it and runs the accept command; the server then proposes the
third use, which an edit elsewhere clears. `<Esc>` dismisses an edit, and an edit that is
stale when the apply key comes is dropped, never applied. The server's `efim/stats`
"nextEdit" counts say what it heard.
"""

from __future__ import annotations



from embedded_nvim import EmbeddedNvim, open_with_plugin  # tests/editors is on sys.path (pytest rootdir-relative imports)

SRC = "def total(values):\n    n = 0\n    for v in values:\n        n += v\n    return n\n"

SETUP = """
local cmd, model = ...
require("efim").setup({
  cmd = cmd,
  settings = { model = model, maxTokens = 4, temperature = 0, multiline = "never" },
})
"""

# The edit on screen as the plugin holds it, and its extmarks as drawn.
SHOWN = """
local ne = require("efim.next_edit")
local marks = vim.api.nvim_buf_get_extmarks(0, ne.ns, 0, -1, { details = true })
local out = {}
for _, m in ipairs(marks) do
  local d = m[4] or {}
  local virt = {}
  for _, chunk in ipairs(d.virt_text or {}) do virt[#virt + 1] = chunk[1] end
  out[#out + 1] = { row = m[2], col = m[3], end_row = d.end_row, end_col = d.end_col, hl = d.hl_group,
                    virt = table.concat(virt), virt_hl = d.virt_text and d.virt_text[1][2] or nil, pos = d.virt_text_pos }
end
return { shown = ne.shown() or vim.NIL, marks = out }
"""


def _lines(nvim: EmbeddedNvim) -> list[str]:
    return nvim.lua("return vim.api.nvim_buf_get_lines(0, 0, -1, true)")


def _cursor(nvim: EmbeddedNvim) -> tuple[int, int]:
    row, col = nvim.lua("return vim.api.nvim_win_get_cursor(0)")
    return row - 1, col


def _server_stats(nvim: EmbeddedNvim) -> dict:
    return nvim.lua(
        """
        local done, out = false, nil
        require("efim").stats(function(err, result) done, out = true, result or { error = err } end)
        vim.wait(5000, function() return done end, 20)
        return out
        """
    )


def _wait_shown(nvim: EmbeddedNvim, row: int, col: int, new: str, what: str) -> dict:
    nvim.wait_for(
        f"local s = require('efim.next_edit').shown() return s and s.start[1] == {row} and s.start[2] == {col} and s.new == {new!r}",
        timeout=20, what=what)
    return nvim.lua(SHOWN)


def _type(nvim: EmbeddedNvim, keys: list[str]) -> None:
    """Insert-mode keys one at a time, each reaching the buffer before the next is sent."""
    for key in keys:
        tick = nvim.lua("return vim.api.nvim_buf_get_changedtick(0)")
        nvim.input(key)
        nvim.wait_for(f"return vim.api.nvim_buf_get_changedtick(0) > {tick}", timeout=5, what=f"the key {key!r}")


def _normal(nvim: EmbeddedNvim) -> None:
    nvim.input("<Esc>")
    nvim.wait_for("return vim.api.nvim_get_mode().mode == 'n'", timeout=5, what="normal mode")


def test_rename_proposes_the_next_use_jump_apply_accept_and_clear(nvim, efim_serve, tiny_model_dir, tmp_path):
    path = tmp_path / "totals.py"
    path.write_text(SRC)
    open_with_plugin(nvim, SETUP, efim_serve, tiny_model_dir, path)
    assert nvim.lua("return require('efim.next_edit').supported(vim.lsp.get_client_by_id(require('efim').status().client_id))")

    # Rename the first `n` to `count` key by key: after it, <BS>, then the new name; leave insert mode.
    nvim.lua("vim.api.nvim_win_set_cursor(0, {2, 4})")
    nvim.input("a")
    nvim.wait_for("return vim.api.nvim_get_mode().mode == 'i'", timeout=5, what="insert mode")
    _type(nvim, ["<BS>", "c", "o", "u", "n", "t"])
    _normal(nvim)

    # The edit is drawn at the second `n` (line 3, byte 8): the range highlighted, the new text after it.
    drawn = _wait_shown(nvim, 3, 8, "count", "the next edit at the second use")
    assert drawn["shown"]["old"] == "n" and drawn["shown"]["end"] == [3, 9]
    highlight = [m for m in drawn["marks"] if m.get("hl") == "EfimNextEdit"]
    assert [(m["row"], m["col"], m.get("end_row"), m.get("end_col")) for m in highlight] == [(3, 8, 3, 9)]
    text = [m for m in drawn["marks"] if m.get("virt")]
    assert len(text) == 1 and text[0].get("virt_hl") == "EfimNextEditText"
    if nvim.version >= (0, 10, 0):
        assert (text[0]["row"], text[0]["col"], text[0]["virt"], text[0]["pos"]) == (3, 9, "count", "inline")
    else:
        assert (text[0]["row"], text[0]["virt"], text[0].get("pos")) == (3, " → count", "eol")
    assert nvim.lua("return vim.fn.hlexists('EfimNextEdit') == 1 and vim.fn.hlexists('EfimNextEditText') == 1")
    before = _lines(nvim)
    assert before[3] == "        n += v"

    # First <M-n>: the cursor jumps to the edit, the text stays. Second: the edit is applied.
    nvim.input("<M-n>")
    nvim.wait_for("local p = vim.api.nvim_win_get_cursor(0) return p[1] == 4 and p[2] == 8", timeout=5, what="the jump")
    assert _lines(nvim) == before
    nvim.input("<M-n>")
    nvim.wait_for("return require('efim.next_edit').counters.applied == 1", timeout=5, what="the apply")
    assert _lines(nvim) == ["def total(values):", "    count = 0", "    for v in values:", "        count += v", "    return n"]
    assert _cursor(nvim) == (3, 12)  # normal mode: on the last character of the new text

    # The server heard the show and the accept command.
    nvim.wait_for("return not require('efim.next_edit').pending()", timeout=10, what="the request after the apply")
    counts = _server_stats(nvim)["nextEdit"]
    assert counts["shown"] >= 1 and counts["accepted"] == 1 and counts["staleAccepts"] == 0, counts

    # After the applied edit, the third use is proposed; an edit elsewhere (keys) clears it.
    _wait_shown(nvim, 4, 11, "count", "the next edit at the third use")
    nvim.input("G")
    nvim.input("o")
    nvim.wait_for("return vim.api.nvim_get_mode().mode == 'i'", timeout=5, what="insert mode")
    _type(nvim, ["#", " ", "d", "o", "n", "e"])
    _normal(nvim)
    cleared = nvim.lua(SHOWN)
    assert cleared == {"shown": None, "marks": []}
    nvim.wait_for("return not require('efim.next_edit').pending()", timeout=10, what="the request after the comment")
    assert nvim.lua(SHOWN) == {"shown": None, "marks": []}  # a comment typed proposes nothing
    assert nvim.lua("return require('efim.next_edit').jump_or_apply()") is False
    nvim.input("<M-n>")
    nvim.input("<M-n>")
    nvim.wait_for("return vim.api.nvim_get_mode().blocking == false", timeout=5, what="the keys handled")
    assert _lines(nvim)[4:] == ["    return n", "# done"]
    assert _server_stats(nvim)["nextEdit"]["accepted"] == 1

    # Rename `v` to `item`: the edit at its use below is shown; <Esc> in normal mode dismisses it.
    nvim.lua("vim.api.nvim_win_set_cursor(0, {3, 8})")
    nvim.input("a")
    nvim.wait_for("return vim.api.nvim_get_mode().mode == 'i'", timeout=5, what="insert mode")
    _type(nvim, ["<BS>", "i", "t", "e", "m"])
    _normal(nvim)
    _wait_shown(nvim, 3, 17, "item", "the next edit at v's use")
    nvim.input("<Esc>")
    nvim.wait_for("return require('efim.next_edit').shown() == nil", timeout=5, what="<Esc> to dismiss the edit")
    assert nvim.lua(SHOWN)["marks"] == []
    assert nvim.lua("return vim.fn.maparg('<Esc>', 'n')") == ""  # the dismiss key is mapped only while an edit is shown

    # Asked again, shown again; then a change elsewhere lands before the apply key: the edit is
    # stale (another buffer version) and dropped, never applied.
    nvim.lua("require('efim.next_edit').request()")
    _wait_shown(nvim, 3, 17, "item", "the same edit asked again")
    dropped = nvim.lua("return require('efim.next_edit').counters.dropped")
    applied = nvim.lua(
        """
        vim.api.nvim_buf_set_lines(0, 0, 0, true, { "# header" })
        vim.api.nvim_win_set_cursor(0, { 5, 17 })
        return require('efim.next_edit').apply()
        """
    )
    assert applied is False
    assert _lines(nvim)[4] == "        count += v"
    assert nvim.lua("return require('efim.next_edit').counters.dropped") == dropped + 1
    assert nvim.lua(SHOWN) == {"shown": None, "marks": []}
    assert _server_stats(nvim)["nextEdit"]["accepted"] == 1
    assert nvim.lua("return require('efim.next_edit').counters.errors") == 0
    messages = nvim.lua("return vim.fn.execute('messages')")
    assert "rror" not in messages and "deprecated" not in messages, messages
