-- efim for Neovim: inline completions from `efim serve` as ghost text.
--
--   require("efim").setup{
--     cmd = { "efim", "serve" },            -- the server command
--     filetypes = nil,                      -- nil: every file type not in exclude_filetypes
--     keymaps = { accept = "<Tab>", accept_word = "<M-w>", accept_line = "<M-l>", dismiss = "<C-]>",
--                 next = "<M-]>", prev = "<M-[>",   -- next/prev: cycle the answer's items (`alternatives`)
--                 next_edit = "<M-n>",               -- insert and normal mode: jump to the proposed next
--                                                    -- edit; pressed on it, apply it
--                 next_edit_dismiss = "<Esc>" },     -- normal mode, mapped only while a next edit is shown
--     settings = { model = "default" },     -- flat camelCase server settings (initializationOptions),
--                                           -- e.g. alternatives = 3 for items to cycle through
--     cursor_notify = true,                 -- send `efim/didMoveCursor` (debounced) so the server warms ahead
--     cursor_debounce_ms = 80,
--     next_edit = true,                     -- ask for next edits after changes (when the server offers them);
--     next_edit_debounce_ms = 150,          -- drawn with EfimNextEdit (the range) and EfimNextEditText (new text)
--   }
--
-- Works on Neovim 0.7+. The plugin asks for `textDocument/inlineCompletion` on
-- every keystroke in insert mode, cancels the request in flight when the user
-- types on, draws the answer as ghost text and reports shows and accepts.
-- After a change it also asks for the next edit elsewhere (efim.next_edit).
local moves = require("efim.cursor") -- the cursor notification
local ghost = require("efim.ghost")
local next_edit = require("efim.next_edit")
local server = require("efim.server")
local text = require("efim.text")

local M = {}

local METHOD = "textDocument/inlineCompletion"
local TRIGGER_AUTOMATIC = 2

local defaults = {
  cmd = { "efim", "serve" },
  filetypes = nil,
  exclude_filetypes = { "help", "gitcommit", "gitrebase", "netrw", "qf", "TelescopePrompt" },
  root_dir = nil, -- function(bufnr) -> path; default: the current directory
  keymaps = {
    accept = "<Tab>", accept_word = "<M-w>", accept_line = "<M-l>", dismiss = "<C-]>", next = "<M-]>", prev = "<M-[>",
    next_edit = "<M-n>", next_edit_dismiss = "<Esc>",
  },
  settings = { model = "default" },
  hl_group = "EfimSuggestion",
  cursor_notify = true,
  cursor_debounce_ms = 80,
  next_edit = true,
  next_edit_debounce_ms = 150,
}

local cfg = vim.deepcopy(defaults)
local enabled = true
-- The suggestion on screen: buffer, cursor it was drawn at (0-based row, byte
-- col), the item, its full text, how many bytes of it are in the buffer
-- already, and how many bytes after the cursor a full accept replaces; `items` (the
-- answer's items) and `index` (the one drawn) for cycling with M.next / M.prev.
local current = nil
local inflight = nil -- { client, id }
local last_key = nil
local counters = { requests = 0, shown = 0, accepted = 0, partially_accepted = 0, errors = 0 }
local last_error = nil

local function cursor()
  local pos = vim.api.nvim_win_get_cursor(0)
  return pos[1] - 1, pos[2]
end

local function line_at(bufnr, row)
  return vim.api.nvim_buf_get_lines(bufnr, row, row + 1, false)[1] or ""
end

local function in_insert_mode()
  return vim.api.nvim_get_mode().mode:sub(1, 1) == "i"
end

local function cancel()
  if inflight then
    server.cancel(inflight.client, inflight.id)
    inflight = nil
  end
end

local function clear()
  if current then
    ghost.clear(current.bufnr)
  end
  current = nil
end

local function remainder()
  return current and current.text:sub(current.taken + 1) or ""
end

local function item_text(item)
  return type(item.insertText) == "table" and item.insertText.value or item.insertText or ""
end

--- Draws `item` for the cursor at (row, col) if it fits there; reports the show.
local function show(bufnr, client, row, col, item)
  local ins = item_text(item)
  local line = line_at(bufnr, row)
  local enc = client.offset_encoding or "utf-16"
  local start, stop = col, col
  if item.range then
    if item.range.start.line ~= row or item.range["end"].line ~= row then
      return false -- the spec keeps a range on one line; anything else is not for this cursor
    end
    start = text.col_to_byte(line, item.range.start.character, enc)
    stop = text.col_to_byte(line, item.range["end"].character, enc)
  end
  if start > col or stop < col then
    return false
  end
  local typed = line:sub(start + 1, col)
  if ins:sub(1, #typed) ~= typed or #ins <= #typed then
    return false -- rewrites what is typed, or adds nothing: not drawable as ghost text
  end
  clear()
  current = { bufnr = bufnr, client = client, row = row, col = col, item = item, text = ins, taken = #typed, tail = stop - col }
  ghost.draw(bufnr, row, col, remainder(), cfg.hl_group)
  counters.shown = counters.shown + 1
  server.notify(client, "textDocument/didShowCompletion", { item = item })
  return true
end

--- Keeps the ghost when the user typed exactly its next characters (no flicker
--- while the server's typing-through answer comes back); clears it otherwise.
local function follow_typing(bufnr, row, col)
  if not current then
    return
  end
  if current.bufnr ~= bufnr or current.row ~= row or col < current.col then
    return clear()
  end
  local typed = line_at(bufnr, row):sub(current.col + 1, col)
  if typed == "" then
    return
  end
  if remainder():sub(1, #typed) ~= typed or #typed == #remainder() then
    return clear()
  end
  current.taken = current.taken + #typed
  current.col = col
  ghost.draw(bufnr, row, col, remainder(), cfg.hl_group)
end

--- Asks the server for a suggestion at the cursor, superseding any request in flight.
function M.trigger()
  local bufnr = vim.api.nvim_get_current_buf()
  if not enabled or not in_insert_mode() then
    return
  end
  local client = server.client(bufnr)
  if not client then
    return
  end
  local row, col = cursor()
  local tick = vim.api.nvim_buf_get_changedtick(bufnr)
  local key = table.concat({ bufnr, tick, row, col }, ":")
  if key == last_key then
    return -- TextChangedI and CursorMovedI both fire for one keystroke
  end
  last_key = key
  follow_typing(bufnr, row, col)
  cancel()
  local enc = client.offset_encoding or "utf-16"
  local params = {
    textDocument = { uri = vim.uri_from_bufnr(bufnr) },
    position = { line = row, character = text.byte_to_col(line_at(bufnr, row), col, enc) },
    context = { triggerKind = TRIGGER_AUTOMATIC },
  }
  local id
  id = server.request(client, METHOD, params, bufnr, function(err, result)
    if inflight and inflight.id == id then
      inflight = nil
    end
    if err then
      if err.code ~= -32800 then -- RequestCancelled: we asked for it
        counters.errors = counters.errors + 1
        last_error = err.message or vim.inspect(err)
      end
      return
    end
    -- Only an answer for the buffer state it was asked for may be drawn.
    local now_row, now_col = cursor()
    if vim.api.nvim_get_current_buf() ~= bufnr or vim.api.nvim_buf_get_changedtick(bufnr) ~= tick
      or now_row ~= row or now_col ~= col or not in_insert_mode() or not enabled then
      return
    end
    local is_list = vim.islist or vim.tbl_islist
    local items = type(result) == "table" and (result.items or (is_list(result) and result)) or {}
    for i, item in ipairs(items) do
      if show(bufnr, client, row, col, item) then
        current.items, current.index = items, i
        server.served()
        return
      end
    end
    clear() -- the server has nothing (or nothing drawable) for this position
  end)
  if id then
    counters.requests = counters.requests + 1
    inflight = { client = client, id = id }
  end
end

local function insert_at_cursor(bufnr, row, col, replace_bytes, piece)
  local lines = text.lines(piece)
  vim.api.nvim_buf_set_text(bufnr, row, col, row, col + replace_bytes, lines)
  local new_row = row + #lines - 1
  local new_col = (#lines == 1) and (col + #lines[1]) or #lines[#lines]
  vim.api.nvim_win_set_cursor(0, { new_row + 1, new_col })
  return new_row, new_col
end

--- Accepts the suggestion on screen: `kind` is "all", "word" or "line".
--- Returns false (and changes nothing) when there is none at the cursor.
function M.accept(kind)
  local bufnr = vim.api.nvim_get_current_buf()
  local row, col = cursor()
  if not current or current.bufnr ~= bufnr or current.row ~= row or current.col ~= col then
    return false
  end
  cancel()
  local cur = current
  local rest = remainder()
  local piece = (kind == "word" and text.next_word(rest)) or (kind == "line" and text.next_line(rest)) or rest
  local enc = cur.client.offset_encoding or "utf-16"
  if piece == rest then
    -- Whole: also replace what the item's range covers after the cursor.
    clear()
    insert_at_cursor(bufnr, row, col, cur.tail, piece)
    counters.accepted = counters.accepted + 1
    local command = cur.item.command
    if command then
      server.request(cur.client, "workspace/executeCommand", { command = command.command, arguments = command.arguments },
        bufnr, function() end)
    else
      server.notify(cur.client, "textDocument/didPartiallyAcceptCompletion",
        { item = cur.item, acceptedLength = text.units(cur.text, enc) })
    end
    return true
  end
  local new_row, new_col = insert_at_cursor(bufnr, row, col, 0, piece)
  cur.taken = cur.taken + #piece
  cur.row, cur.col = new_row, new_col
  ghost.draw(bufnr, new_row, new_col, remainder(), cfg.hl_group)
  counters.partially_accepted = counters.partially_accepted + 1
  server.notify(cur.client, "textDocument/didPartiallyAcceptCompletion",
    { item = cur.item, acceptedLength = text.units(cur.text:sub(1, cur.taken), enc) })
  return true
end

--- Draws the answer's next item (`step` 1) or previous one (-1), wrapping around and
--- skipping items that do not fit what is typed. Returns false (and changes nothing)
--- when there is no suggestion at the cursor or no other item to show.
function M.cycle(step)
  local bufnr = vim.api.nvim_get_current_buf()
  local row, col = cursor()
  if not current or current.bufnr ~= bufnr or current.row ~= row or current.col ~= col then
    return false
  end
  local items, index = current.items or { current.item }, current.index or 1
  for _ = 1, #items - 1 do
    index = (index - 1 + step) % #items + 1
    if show(bufnr, current.client, row, col, items[index]) then
      current.items, current.index = items, index
      return true
    end
  end
  return false
end

function M.next()
  return M.cycle(1)
end

function M.prev()
  return M.cycle(-1)
end

--- Hides the suggestion and cancels the request in flight. Returns whether there was anything to hide.
function M.dismiss()
  local had = current ~= nil or inflight ~= nil
  cancel()
  clear()
  return had
end

function M.toggle()
  enabled = not enabled
  if not enabled then
    M.dismiss()
    next_edit.dismiss()
  end
  vim.notify("efim: completions " .. (enabled and "on" or "off"))
  return enabled
end

--- Restarts the server (e.g. after it died, or to reload it) and re-attaches every buffer it had.
function M.restart()
  M.dismiss()
  next_edit.dismiss()
  local buffers = vim.tbl_filter(function(b)
    return vim.api.nvim_buf_is_loaded(b) and vim.b[b].efim_attached
  end, vim.api.nvim_list_bufs())
  moves.reset() -- the new server has not heard where the cursor is
  server.stop(function()
    for _, b in ipairs(buffers) do
      vim.b[b].efim_attached = nil
      M.attach(b)
    end
  end)
end

--- Client-side view of things: server state, counters, the ghost on screen (for status lines and tests).
function M.status()
  local client = server.client()
  return {
    enabled = enabled,
    state = server.status.state,
    detail = server.status.detail,
    client_id = client and client.id or nil,
    pending = inflight ~= nil,
    cursor_sent = moves.sent,
    suggestion = current and remainder() or nil,
    item_index = current and current.index or nil, -- which of the answer's items is drawn
    item_count = current and #(current.items or { current.item }) or nil,
    counters = vim.deepcopy(counters),
    last_error = last_error,
    next_edit = next_edit.shown(), -- the next edit on screen: { start, end, old, new, ... } or nil
    next_edit_pending = next_edit.pending(),
    next_edit_counters = vim.deepcopy(next_edit.counters),
  }
end

--- Asks the server for `efim/stats`; `callback(err, stats)`.
function M.stats(callback)
  local client = server.client()
  if not client then
    return callback("efim server not running", nil)
  end
  -- `{}` rather than no params: pygls rejects a custom request without any.
  server.request(client, "efim/stats", vim.empty_dict(), nil, callback)
end

local function ms(v)
  return type(v) == "number" and string.format("%d ms", math.floor(v + 0.5)) or "-"
end

local function pct(p)
  p = type(p) == "table" and p or {}
  return string.format("p50 %s, p95 %s, p99 %s", ms(p.p50), ms(p.p95), ms(p.p99))
end

--- `efim/stats` and the client's counters as lines of text.
function M.format_stats(s)
  s = s or {}
  local sessions = type(s.sessions) == "table" and s.sessions or {}
  local ne = type(s.nextEdit) == "table" and s.nextEdit or {}
  return {
    string.format("server: %s %s", server.status.state, server.status.detail),
    string.format("requests %s, served %s, typing-through %s, cancelled %s", s.requests, s.served, s.typingThroughHits, s.cancelled),
    string.format("prompt tokens %s: reused %s, prefilled %s (reuse %.1f%%)", s.promptTokens, s.reusedTokens,
      s.prefilledTokens, (tonumber(s.reuseRatio) or 0) * 100),
    "time to first token: " .. pct(s.ttftMs),
    "latency: " .. pct(s.latencyMs),
    string.format("KV cache %.1f MiB; sessions %s active, %s rebases", (tonumber(s.cacheBytes) or 0) / 1048576,
      sessions.active, sessions.rebases),
    string.format("client: %d requests, %d shown, %d accepted, %d partially accepted, %d errors", counters.requests,
      counters.shown, counters.accepted, counters.partially_accepted, counters.errors),
    string.format("next edits: %s requests, %s offered, %s shown, %s accepted; client: %d applied, %d dropped as stale",
      ne.requests, ne.offered, ne.shown, ne.accepted, next_edit.counters.applied, next_edit.counters.dropped),
  }
end

local function stats_command()
  M.stats(function(err, result)
    if err then
      vim.notify("efim: " .. (type(err) == "table" and (err.message or vim.inspect(err)) or tostring(err)), vim.log.levels.WARN)
      return
    end
    vim.notify(table.concat(M.format_stats(result), "\n"))
  end)
end

-- Mapping (insert mode unless `modes` says): do `action`, or type the key itself when it does nothing.
local function map(bufnr, lhs, action, modes)
  if not lhs or lhs == "" then
    return
  end
  local keys = vim.api.nvim_replace_termcodes(lhs, true, false, true)
  vim.keymap.set(modes or "i", lhs, function()
    if not action() then
      vim.api.nvim_feedkeys(keys, "n", false)
    end
  end, { buffer = bufnr, silent = true, desc = "efim" })
end

local function wanted(bufnr)
  if vim.bo[bufnr].buftype ~= "" then
    return false
  end
  local ft = vim.bo[bufnr].filetype
  if cfg.filetypes and #cfg.filetypes > 0 then
    return vim.tbl_contains(cfg.filetypes, ft)
  end
  return not vim.tbl_contains(cfg.exclude_filetypes or {}, ft)
end

--- Starts the server (if needed) for `bufnr` and wires the buffer up.
function M.attach(bufnr)
  bufnr = (bufnr == nil or bufnr == 0) and vim.api.nvim_get_current_buf() or bufnr
  if vim.b[bufnr].efim_attached then
    return true
  end
  local id, err = server.attach(cfg, bufnr)
  if not id then
    vim.notify(err, vim.log.levels.ERROR)
    return false
  end
  vim.b[bufnr].efim_attached = true
  if cfg.cursor_notify then
    moves.delay_ms = cfg.cursor_debounce_ms or moves.delay_ms
    moves.attach(bufnr, function()
      return enabled and server.client(bufnr) or nil
    end)
  end
  local km = cfg.keymaps or {}
  map(bufnr, km.accept, function()
    return M.accept("all")
  end)
  map(bufnr, km.accept_word, function()
    return M.accept("word")
  end)
  map(bufnr, km.accept_line, function()
    return M.accept("line")
  end)
  map(bufnr, km.dismiss, M.dismiss)
  map(bufnr, km.next, M.next)
  map(bufnr, km.prev, M.prev)
  if cfg.next_edit then
    next_edit.delay_ms = cfg.next_edit_debounce_ms or next_edit.delay_ms
    next_edit.dismiss_key = km.next_edit_dismiss
    next_edit.attach(bufnr, function()
      return enabled and server.client(bufnr) or nil
    end)
    map(bufnr, km.next_edit, next_edit.jump_or_apply, { "n", "i" })
  end
  local group = vim.api.nvim_create_augroup("efim_buffer_" .. bufnr, { clear = true })
  vim.api.nvim_create_autocmd({ "TextChangedI", "CursorMovedI" }, { group = group, buffer = bufnr, callback = M.trigger })
  vim.api.nvim_create_autocmd({ "InsertLeave", "BufLeave" }, {
    group = group,
    buffer = bufnr,
    callback = function()
      last_key = nil
      M.dismiss()
    end,
  })
  return true
end

--- New server settings at run time (merged into setup's `settings`).
function M.configure(settings)
  cfg.settings = vim.tbl_extend("force", cfg.settings or {}, settings or {})
  return server.configure(cfg.settings)
end

function M.setup(opts)
  opts = opts or {}
  cfg = vim.tbl_deep_extend("force", vim.deepcopy(defaults), opts)
  -- Lists replace rather than merge.
  cfg.cmd = opts.cmd or defaults.cmd
  cfg.filetypes = opts.filetypes
  cfg.exclude_filetypes = opts.exclude_filetypes or defaults.exclude_filetypes
  if type(cfg.cmd) ~= "table" or #cfg.cmd == 0 then
    error("efim.setup: cmd must be a non-empty list, e.g. { 'efim', 'serve' }")
  end
  vim.cmd("highlight default link EfimSuggestion Comment")
  vim.cmd("highlight default link EfimNextEdit DiffDelete")
  vim.cmd("highlight default link EfimNextEditText DiffAdd")
  vim.api.nvim_create_user_command("EfimStats", stats_command, { desc = "efim: server statistics" })
  vim.api.nvim_create_user_command("EfimToggle", M.toggle, { desc = "efim: completions on/off" })
  vim.api.nvim_create_user_command("EfimRestart", M.restart, { desc = "efim: restart the server" })
  vim.api.nvim_create_user_command("EfimNext", M.next, { desc = "efim: show the next suggestion" })
  vim.api.nvim_create_user_command("EfimPrev", M.prev, { desc = "efim: show the previous suggestion" })
  vim.api.nvim_create_user_command("EfimNextEdit", function()
    next_edit.jump_or_apply()
  end, { desc = "efim: jump to the proposed next edit, or apply it when the cursor is on it" })
  local group = vim.api.nvim_create_augroup("efim", { clear = true })
  vim.api.nvim_create_autocmd("FileType", {
    group = group,
    callback = function(args)
      if wanted(args.buf) then
        M.attach(args.buf)
      end
    end,
  })
  -- Buffers already open when setup runs (e.g. lazy loading).
  for _, bufnr in ipairs(vim.api.nvim_list_bufs()) do
    if vim.api.nvim_buf_is_loaded(bufnr) and vim.bo[bufnr].filetype ~= "" and wanted(bufnr) then
      M.attach(bufnr)
    end
  end
end

return M
