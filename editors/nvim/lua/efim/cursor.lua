-- The cursor notification `efim/didMoveCursor`: tells the server where the user
-- is before the first key, so it can prefill the window a request there needs.
--
--   params = { textDocument = { uri, version? }, position = { line, character } }
--
-- Sent debounced (one timer for all buffers, `delay_ms` after the last event)
-- on CursorMoved, CursorMovedI and BufEnter of an attached buffer — on InsertEnter
-- at once (once the command that entered Insert mode has placed the cursor): a
-- completion request follows it within the client's own debounce, and the
-- server's head start is what is left of that — and
-- and once when a buffer is attached while it is the current one. Not for a
-- CursorMovedI that typing caused (the buffer's changedtick moved since the
-- previous cursor or TextChangedI event; Neovim runs CursorMovedI before
-- TextChangedI): `didChange` says where the edit is and the completion request
-- that follows carries the exact position. Normal-mode edits (`p`, `u`, `dd`)
-- are reported: no request follows them. Nor twice in a row for the same
-- document version and position.
-- Works on Neovim 0.7+ (vim.loop timers, nvim_create_autocmd).
local server = require("efim.server")
local text = require("efim.text")

local M = {}

M.METHOD = "efim/didMoveCursor"
M.delay_ms = 80

local uv = vim.uv or vim.loop
local timer = nil
local pending = nil -- bufnr whose cursor the timer will report
local seen_tick = {} -- bufnr -> changedtick at the previous cursor event
local last_sent = nil -- "uri|version|line|character" of the last notification
local clients = {} -- bufnr -> function() returning the client to notify, or nil
M.sent = 0 -- notifications sent since start (for status lines and tests)

--- The notification's params for the cursor of the current window on `bufnr` (nil when it is not shown there).
function M.params(bufnr, encoding)
  if vim.api.nvim_get_current_buf() ~= bufnr then
    return nil
  end
  local pos = vim.api.nvim_win_get_cursor(0)
  local row, col = pos[1] - 1, pos[2]
  local line = vim.api.nvim_buf_get_lines(bufnr, row, row + 1, false)[1] or ""
  local doc = { uri = vim.uri_from_bufnr(bufnr) }
  doc.version = server.version(bufnr)
  return {
    textDocument = doc,
    position = { line = row, character = text.byte_to_col(line, col, encoding or "utf-16") },
  }
end

local function send()
  local bufnr = pending
  pending = nil
  if not bufnr or not vim.api.nvim_buf_is_valid(bufnr) or not clients[bufnr] then
    return
  end
  local client = clients[bufnr]()
  if not client then
    return -- not started, not initialized or not attached yet: didOpen tells the server instead
  end
  local params = M.params(bufnr, client.offset_encoding)
  if not params then
    return -- the user left the buffer; its BufEnter successor reports the new one
  end
  local key = table.concat({ params.textDocument.uri, tostring(params.textDocument.version),
    params.position.line, params.position.character }, "|")
  if key == last_sent then
    return
  end
  last_sent = key
  M.sent = M.sent + 1
  server.notify(client, M.METHOD, params)
end

--- Arms the debounce timer for `bufnr` (a later event, for any buffer, restarts it).
function M.schedule(bufnr)
  pending = bufnr
  if not timer then
    timer = uv.new_timer()
  end
  timer:stop()
  timer:start(M.delay_ms, 0, vim.schedule_wrap(send))
end

local function on_event(args)
  local bufnr = args.buf
  local tick = vim.api.nvim_buf_get_changedtick(bufnr)
  local typed = seen_tick[bufnr] ~= nil and seen_tick[bufnr] ~= tick
  seen_tick[bufnr] = tick
  if args.event == "TextChangedI" then
    return -- an edit that did not move the cursor (e.g. <Del>): the next move is a move
  end
  if typed and args.event == "CursorMovedI" then
    if pending == bufnr then
      pending = nil -- the edit supersedes a move reported just before it
    end
    return
  end
  if args.event == "InsertEnter" then
    -- `A`, `o`, `i`: the cursor is placed after InsertEnter runs; report it on the next
    -- turn of the event loop rather than `delay_ms` later.
    pending = bufnr
    vim.schedule(function()
      if pending == bufnr then
        send()
      end
    end)
    return
  end
  M.schedule(bufnr)
end

--- Reports `bufnr`'s cursor moves to the client `get_client()` returns (nil: not now).
--- Idempotent: attaching again replaces the client getter.
function M.attach(bufnr, get_client)
  bufnr = (bufnr == nil or bufnr == 0) and vim.api.nvim_get_current_buf() or bufnr
  clients[bufnr] = get_client
  seen_tick[bufnr] = vim.api.nvim_buf_get_changedtick(bufnr)
  local group = vim.api.nvim_create_augroup("efim_cursor_" .. bufnr, { clear = true })
  vim.api.nvim_create_autocmd({ "CursorMoved", "CursorMovedI", "InsertEnter", "BufEnter", "TextChangedI" }, {
    group = group,
    buffer = bufnr,
    callback = on_event,
  })
  vim.api.nvim_create_autocmd({ "BufDelete", "BufWipeout" }, {
    group = group,
    buffer = bufnr,
    callback = function()
      M.detach(bufnr)
    end,
  })
  if vim.api.nvim_get_current_buf() == bufnr then
    M.schedule(bufnr) -- the document is the active one now
  end
end

function M.detach(bufnr)
  clients[bufnr] = nil
  seen_tick[bufnr] = nil
  if pending == bufnr then
    pending = nil
  end
  pcall(vim.api.nvim_del_augroup_by_name, "efim_cursor_" .. bufnr)
end

--- Forgets what was sent last (a new server must hear the position again).
function M.reset()
  last_sent = nil
end

return M
