-- The efim language server: starting it, attaching buffers, and talking to it
-- across Neovim versions (`vim.lsp.start_client` on 0.7, `vim.lsp.start` from
-- 0.8, `client:method()` calls from 0.11). Also follows its `$/progress` so the
-- plugin can tell "loading the model" from "ready".
local M = {}

local has_011 = vim.fn.has("nvim-0.11") == 1

-- Server state for the status line: stopped | starting | loading | ready | error.
M.status = { state = "stopped", detail = "" }
local open_progress = {}
local client_id = nil

-- Calls a client method the way this Neovim version expects (`client:f()` from 0.11, `client.f()` before).
local function call(client, name, ...)
  if has_011 then
    return client[name](client, ...)
  end
  return client[name](...)
end

local function stopped(client)
  return client == nil or call(client, "is_stopped")
end

local function on_progress(result)
  local value = result and result.value
  if type(value) ~= "table" then
    return
  end
  local token = tostring(result.token)
  if value.kind == "end" then
    open_progress[token] = nil
    if next(open_progress) == nil and (M.status.state == "loading" or M.status.state == "starting") then
      M.status = { state = "ready", detail = value.message or "" }
    end
    return
  end
  local title = value.title or open_progress[token] or ""
  open_progress[token] = title
  local pieces = { title, value.message }
  local detail = table.concat(vim.tbl_filter(function(p)
    return p and p ~= ""
  end, pieces), ": ")
  if value.percentage then
    detail = string.format("%s %d%%", detail, value.percentage)
  end
  M.status = { state = "loading", detail = detail }
end

--- A suggestion came back, so the model is up whatever progress said.
function M.served()
  if M.status.state == "starting" or M.status.state == "loading" then
    M.status = { state = "ready", detail = "" }
  end
end

local function capabilities()
  local caps = vim.lsp.protocol.make_client_capabilities()
  caps.textDocument = caps.textDocument or {}
  caps.textDocument.inlineCompletion = { dynamicRegistration = false }
  caps.window = caps.window or {}
  caps.window.workDoneProgress = true
  return caps
end

local function client_config(cfg, bufnr)
  local root = cfg.root_dir and cfg.root_dir(bufnr) or (vim.uv or vim.loop).cwd()
  return {
    name = "efim",
    cmd = cfg.cmd,
    root_dir = root,
    workspace_folders = { { uri = vim.uri_from_fname(root), name = root } },
    init_options = cfg.settings,
    -- Answers `workspace/configuration` for the section "efim" with the same flat table.
    settings = { efim = cfg.settings },
    capabilities = capabilities(),
    -- The server cancels superseded requests itself; it must see every keystroke at once.
    flags = { debounce_text_changes = 0, allow_incremental_sync = true },
    handlers = {
      ["$/progress"] = function(err, result, ctx, config)
        if ctx and ctx.client_id == client_id then
          on_progress(result)
        end
        local default = vim.lsp.handlers["$/progress"]
        if default then
          return default(err, result, ctx, config)
        end
      end,
    },
    on_exit = function(code, signal, id)
      if id ~= client_id then
        return -- an earlier server (restart): the current one's state stands
      end
      open_progress = {}
      if code ~= 0 then
        M.status = { state = "error", detail = string.format("efim serve exited (code %s, signal %s)", code, signal) }
      else
        M.status = { state = "stopped", detail = "" }
      end
    end,
  }
end

--- Starts the server if needed and attaches `bufnr`. Returns the client id,
--- or nil and an error message (a missing executable is reported, not thrown).
function M.attach(cfg, bufnr)
  local config = client_config(cfg, bufnr)
  local ok, id = pcall(function()
    if vim.lsp.start then
      return vim.lsp.start(config, { bufnr = bufnr })
    end
    local existing = client_id and vim.lsp.get_client_by_id(client_id)
    local new_id = (existing and not stopped(existing)) and client_id or vim.lsp.start_client(config)
    if new_id then
      vim.lsp.buf_attach_client(bufnr, new_id)
    end
    return new_id
  end)
  if not ok or not id then
    local message = string.format(
      "efim: cannot start %s (%s). Install efim-lsp or pass setup{ cmd = { '/path/to/efim', 'serve' } }.",
      table.concat(cfg.cmd, " "),
      ok and "start failed" or tostring(id)
    )
    M.status = { state = "error", detail = message }
    return nil, message
  end
  if id ~= client_id then
    M.status = { state = "starting", detail = "" } -- a new server: not ready until its progress ends
    open_progress = {}
  end
  client_id = id
  return id
end

--- Stops the server; `on_stopped()` runs once it has exited (forced after 3 s).
function M.stop(on_stopped)
  local client = client_id and vim.lsp.get_client_by_id(client_id)
  client_id = nil
  if stopped(client) then
    return on_stopped and on_stopped()
  end
  vim.lsp.stop_client(client.id)
  local timer, waited = (vim.uv or vim.loop).new_timer(), 0
  timer:start(50, 50, vim.schedule_wrap(function()
    waited = waited + 50
    if not stopped(client) and waited < 3000 then
      return
    end
    if not stopped(client) then
      vim.lsp.stop_client(client.id, true)
    end
    timer:stop()
    timer:close()
    if on_stopped then
      on_stopped()
    end
  end))
end

--- The running client attached to `bufnr` (any buffer when nil), or nil.
function M.client(bufnr)
  local client = client_id and vim.lsp.get_client_by_id(client_id)
  if stopped(client) or not client.initialized then
    return nil -- before `initialized` the server knows no documents yet
  end
  if bufnr and vim.lsp.buf_is_attached and not vim.lsp.buf_is_attached(bufnr, client.id) then
    return nil
  end
  return client
end

--- The version of `bufnr` the client last sent the server (its changedtick from Neovim 0.10;
--- before that the changedtick of its last `didChange`), or nil when it has sent none.
function M.version(bufnr)
  local versions = vim.lsp.util.buf_versions
  local v = type(versions) == "table" and versions[bufnr] or nil
  return type(v) == "number" and v or nil
end

--- Sends a request by name (Neovim 0.7 does not know `textDocument/inlineCompletion`,
--- and sending by name skips any capability check). Returns the request id or nil.
function M.request(client, method, params, bufnr, callback)
  local ok, id = call(client, "request", method, params, function(err, result)
    callback(err, result)
  end, bufnr)
  return ok and id or nil
end

function M.notify(client, method, params)
  return call(client, "notify", method, params)
end

function M.cancel(client, id)
  if client and id and not stopped(client) then
    call(client, "cancel_request", id)
  end
end

--- New settings for the running server (`workspace/didChangeConfiguration`, flat camelCase keys).
function M.configure(settings)
  local client = M.client()
  if not client then
    return false
  end
  client.config.settings = { efim = settings }
  return M.notify(client, "workspace/didChangeConfiguration", { settings = settings })
end

return M
