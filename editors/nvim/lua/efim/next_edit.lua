-- Next edits: after a change, the server may propose the next edit elsewhere in the
-- document (today: a rename repeated at the name's next occurrence), in the protocol
-- Copilot's language server speaks:
--
--   textDocument/copilotInlineEdit  { textDocument = { uri, version }, position }
--     -> { edits = { { text, textDocument = { uri, version }, range, command } } }
--   textDocument/didShowInlineEdit  { item = <the edit> }   once per edit drawn
--   workspace/executeCommand        the edit's command (efim.acceptInlineEdit) once applied
--
-- Asked `delay_ms` after the last change in insert or normal mode (one timer for all
-- buffers), only of a server that lists efim.acceptInlineEdit among its commands. An
-- answer is drawn only for the buffer version it was asked about: the range highlighted
-- (`EfimNextEdit`) and the new text as virtual text after it (`EfimNextEditText`), inline
-- from Neovim 0.10, at the end of the line before. Any change to the buffer, leaving it,
-- or `M.dismiss` clears it. `M.jump_or_apply` moves the cursor to the edit, and once the
-- cursor is there applies it — after checking that the buffer version is still the
-- answer's and the range still holds the text it held when drawn (else it is dropped).
-- Works on Neovim 0.7+.
local server = require("efim.server")
local text = require("efim.text")

local M = {}

M.METHOD = "textDocument/copilotInlineEdit"
M.SHOWN = "textDocument/didShowInlineEdit"
M.ACCEPT_COMMAND = "efim.acceptInlineEdit"
M.ns = vim.api.nvim_create_namespace("efim_next_edit")
M.delay_ms = 150
M.hl_range = "EfimNextEdit"
M.hl_text = "EfimNextEditText"
M.dismiss_key = "<Esc>" -- normal mode, mapped only while an edit is shown ("" or false: none)
-- Counted since start (status lines and tests): requests sent, edits drawn, applied, and
-- answers or edits dropped as stale (another buffer version, or the range's text changed).
M.counters = { requests = 0, shown = 0, applied = 0, dropped = 0, errors = 0 }

local uv = vim.uv or vim.loop
local has_inline = vim.fn.has("nvim-0.10") == 1
local timer = nil
local pending = nil -- bufnr the timer will ask for
local inflight = nil -- { client, id }
local clients = {} -- bufnr -> function() returning the client to ask, or nil
-- The edit on screen: bufnr, client, edit (as the server sent it), version and changedtick
-- it is for, its range in bytes (0-based rows), the text the range held when drawn (`old`),
-- and `mapped` (the dismiss key was mapped for it).
local current = nil

local function line_at(bufnr, row)
  return vim.api.nvim_buf_get_lines(bufnr, row, row + 1, false)[1] or ""
end

--- Whether `client` answers next-edit requests (it lists their accept command).
function M.supported(client)
  local caps = client and client.server_capabilities
  local provider = type(caps) == "table" and caps.executeCommandProvider
  local commands = type(provider) == "table" and provider.commands
  return type(commands) == "table" and vim.tbl_contains(commands, M.ACCEPT_COMMAND)
end

local function cancel()
  if inflight then
    server.cancel(inflight.client, inflight.id)
    inflight = nil
  end
end

local function unmap(cur)
  if cur.mapped and vim.api.nvim_buf_is_valid(cur.bufnr) then
    pcall(vim.keymap.del, "n", cur.mapped, { buffer = cur.bufnr })
  end
  cur.mapped = nil
end

--- Removes the edit on screen (nothing is sent to the server).
local function clear()
  if current then
    unmap(current)
    if vim.api.nvim_buf_is_valid(current.bufnr) then
      vim.api.nvim_buf_clear_namespace(current.bufnr, M.ns, 0, -1)
    end
  end
  current = nil
end

local function range_text(cur)
  local ok, lines = pcall(vim.api.nvim_buf_get_text, cur.bufnr, cur.srow, cur.scol, cur.erow, cur.ecol, {})
  return ok and table.concat(lines, "\n") or nil
end

local function draw(cur)
  local bufnr = cur.bufnr
  vim.api.nvim_buf_clear_namespace(bufnr, M.ns, 0, -1)
  if cur.srow ~= cur.erow or cur.scol ~= cur.ecol then
    vim.api.nvim_buf_set_extmark(bufnr, M.ns, cur.srow, cur.scol, {
      end_row = cur.erow, end_col = cur.ecol, hl_group = M.hl_range, priority = 1100,
    })
  end
  local lines = text.lines(cur.new)
  local opts = { hl_mode = "combine", priority = 1100 }
  if lines[1] ~= "" then
    if has_inline then
      opts.virt_text, opts.virt_text_pos = { { lines[1], M.hl_text } }, "inline"
    else
      opts.virt_text, opts.virt_text_pos = { { " → " .. lines[1], M.hl_text } }, "eol"
    end
  end
  if #lines > 1 then
    local below = {}
    for i = 2, #lines do
      below[#below + 1] = { { lines[i], M.hl_text } }
    end
    opts.virt_lines = below
  end
  if opts.virt_text or opts.virt_lines then
    vim.api.nvim_buf_set_extmark(bufnr, M.ns, cur.erow, cur.ecol, opts)
  end
end

local function same_edit(a, b)
  return a.range.start.line == b.range.start.line and a.range.start.character == b.range.start.character
    and a.range["end"].line == b.range["end"].line and a.range["end"].character == b.range["end"].character
    and a.text == b.text
end

--- Draws `edit` (for buffer `version`, changedtick `tick`); reports the show once per edit.
local function show(bufnr, client, edit, version, tick)
  local r = edit.range
  if type(r) ~= "table" or type(r.start) ~= "table" or type(r["end"]) ~= "table" or type(edit.text) ~= "string" then
    return false
  end
  local count = vim.api.nvim_buf_line_count(bufnr)
  local srow, erow = r.start.line, r["end"].line
  if type(srow) ~= "number" or type(erow) ~= "number" or srow < 0 or erow < srow or erow >= count then
    return false -- not a range of this text
  end
  local enc = client.offset_encoding or "utf-16"
  local scol = text.col_to_byte(line_at(bufnr, srow), r.start.character, enc)
  local ecol = text.col_to_byte(line_at(bufnr, erow), r["end"].character, enc)
  if (srow == erow and ecol < scol) or vim.api.nvim_get_current_buf() ~= bufnr then
    return false
  end
  if current and current.bufnr == bufnr and current.version == version and same_edit(current.edit, edit) then
    return true -- the same edit asked again: already drawn and reported
  end
  clear()
  local cur = { bufnr = bufnr, client = client, edit = edit, version = version, tick = tick,
    srow = srow, scol = scol, erow = erow, ecol = ecol, new = edit.text }
  cur.old = range_text(cur)
  if cur.old == nil or cur.old == cur.new then
    return false
  end
  current = cur
  draw(cur)
  local key = M.dismiss_key
  if key and key ~= "" and vim.fn.maparg(key, "n", false, true).buffer ~= 1 then
    vim.keymap.set("n", key, function()
      M.dismiss()
    end, { buffer = bufnr, silent = true, desc = "efim: dismiss the next edit" })
    cur.mapped = key
  end
  M.counters.shown = M.counters.shown + 1
  server.notify(client, M.SHOWN, { item = edit })
  return true
end

--- Asks the server for the next edit at the cursor of `bufnr` (the current buffer), now.
function M.request(bufnr)
  bufnr = (bufnr == nil or bufnr == 0) and vim.api.nvim_get_current_buf() or bufnr
  if vim.api.nvim_get_current_buf() ~= bufnr or not clients[bufnr] then
    return false
  end
  local client = clients[bufnr]()
  if not client or not M.supported(client) then
    return false
  end
  cancel()
  local pos = vim.api.nvim_win_get_cursor(0)
  local row, col = pos[1] - 1, pos[2]
  local enc = client.offset_encoding or "utf-16"
  local uri = vim.uri_from_bufnr(bufnr)
  local tick = vim.api.nvim_buf_get_changedtick(bufnr)
  local version = server.version(bufnr)
  local params = {
    textDocument = { uri = uri, version = version },
    position = { line = row, character = text.byte_to_col(line_at(bufnr, row), col, enc) },
  }
  local id
  id = server.request(client, M.METHOD, params, bufnr, function(err, result)
    if inflight and inflight.id == id then
      inflight = nil
    end
    if err then
      if err.code ~= -32800 then -- RequestCancelled: we asked for it
        M.counters.errors = M.counters.errors + 1
      end
      return
    end
    local edits = type(result) == "table" and result.edits or nil
    local edit = type(edits) == "table" and edits[1] or nil
    if type(edit) ~= "table" or not vim.api.nvim_buf_is_valid(bufnr) or not clients[bufnr] then
      return
    end
    local doc = type(edit.textDocument) == "table" and edit.textDocument or {}
    -- Only an edit for the buffer state it was asked about may be drawn.
    if (doc.uri ~= nil and doc.uri ~= uri) or (doc.version ~= nil and doc.version ~= version)
      or vim.api.nvim_buf_get_changedtick(bufnr) ~= tick or server.version(bufnr) ~= version then
      M.counters.dropped = M.counters.dropped + 1
      return
    end
    show(bufnr, client, edit, version, tick)
  end)
  if id then
    M.counters.requests = M.counters.requests + 1
    inflight = { client = client, id = id }
  end
  return id ~= nil
end

local function fire()
  local bufnr = pending
  pending = nil
  if bufnr and vim.api.nvim_buf_is_valid(bufnr) then
    M.request(bufnr)
  end
end

--- Arms the debounce timer for `bufnr` (a later change, in any buffer, restarts it).
function M.schedule(bufnr)
  pending = bufnr
  if not timer then
    timer = uv.new_timer()
  end
  timer:stop()
  timer:start(M.delay_ms, 0, vim.schedule_wrap(fire))
end

local function on_change(args)
  local bufnr = args.buf
  if current and current.bufnr == bufnr and vim.api.nvim_buf_get_changedtick(bufnr) ~= current.tick then
    clear() -- an edit anywhere makes the one on screen stale
  end
  cancel()
  M.schedule(bufnr)
end

local function in_range(cur, row, col)
  if row < cur.srow or row > cur.erow then
    return false
  end
  return not ((row == cur.srow and col < cur.scol) or (row == cur.erow and col > cur.ecol))
end

local function in_insert_mode()
  return vim.api.nvim_get_mode().mode:sub(1, 1) == "i"
end

--- Applies the edit on screen when it is still the buffer's (else drops it); moves the cursor
--- after the new text and runs the edit's command. Returns whether it applied anything.
function M.apply()
  local cur = current
  local bufnr = vim.api.nvim_get_current_buf()
  if not cur or cur.bufnr ~= bufnr then
    return false
  end
  if vim.api.nvim_buf_get_changedtick(bufnr) ~= cur.tick or server.version(bufnr) ~= cur.version
    or range_text(cur) ~= cur.old then
    clear() -- stale: never applied
    M.counters.dropped = M.counters.dropped + 1
    return false
  end
  clear()
  cancel()
  local lines = text.lines(cur.new)
  vim.api.nvim_buf_set_text(bufnr, cur.srow, cur.scol, cur.erow, cur.ecol, lines)
  local row = cur.srow + #lines - 1
  local col = (#lines == 1 and cur.scol or 0) + #lines[#lines]
  if not in_insert_mode() and col > 0 then
    col = col - 1 -- normal mode: on the last character of the new text
  end
  vim.api.nvim_win_set_cursor(0, { row + 1, col })
  M.counters.applied = M.counters.applied + 1
  local command = cur.edit.command
  if type(command) == "table" and command.command then
    server.request(cur.client, "workspace/executeCommand",
      { command = command.command, arguments = command.arguments or {} }, bufnr, function() end)
  end
  return true
end

--- Moves the cursor to the start of the edit on screen. Returns false when there is none
--- in the current buffer, or the cursor is on it already.
function M.jump()
  local cur = current
  if not cur or cur.bufnr ~= vim.api.nvim_get_current_buf() then
    return false
  end
  local pos = vim.api.nvim_win_get_cursor(0)
  if in_range(cur, pos[1] - 1, pos[2]) then
    return false
  end
  vim.api.nvim_win_set_cursor(0, { cur.srow + 1, cur.scol })
  return true
end

--- The next-edit key: jumps to the edit when the cursor is elsewhere, applies it when the
--- cursor is on it. Returns false (and changes nothing) when there is no edit on screen.
function M.jump_or_apply()
  return M.jump() or M.apply()
end

--- Hides the edit on screen and cancels the request in flight. Returns whether there was any.
function M.dismiss()
  local had = current ~= nil or inflight ~= nil
  if pending then
    pending = nil
    if timer then
      timer:stop()
    end
  end
  cancel()
  clear()
  return had
end

--- The edit on screen, as plain data (nil when none): 0-based byte range, old and new text, version.
function M.shown()
  local cur = current
  if not cur then
    return nil
  end
  return { bufnr = cur.bufnr, version = cur.version, start = { cur.srow, cur.scol }, ["end"] = { cur.erow, cur.ecol },
    old = cur.old, new = cur.new }
end

function M.pending()
  return inflight ~= nil or pending ~= nil
end

--- Asks `get_client()` (nil: not now) for next edits after `bufnr`'s changes. Idempotent.
function M.attach(bufnr, get_client)
  bufnr = (bufnr == nil or bufnr == 0) and vim.api.nvim_get_current_buf() or bufnr
  clients[bufnr] = get_client
  local group = vim.api.nvim_create_augroup("efim_next_edit_" .. bufnr, { clear = true })
  vim.api.nvim_create_autocmd({ "TextChanged", "TextChangedI" }, { group = group, buffer = bufnr, callback = on_change })
  vim.api.nvim_create_autocmd("BufLeave", {
    group = group,
    buffer = bufnr,
    callback = function()
      M.dismiss()
    end,
  })
  vim.api.nvim_create_autocmd({ "BufDelete", "BufWipeout" }, {
    group = group,
    buffer = bufnr,
    callback = function()
      M.detach(bufnr)
    end,
  })
end

function M.detach(bufnr)
  if current and current.bufnr == bufnr then
    M.dismiss()
  end
  clients[bufnr] = nil
  if pending == bufnr then
    pending = nil
  end
  pcall(vim.api.nvim_del_augroup_by_name, "efim_next_edit_" .. bufnr)
end

return M
