-- efim for Neovim >= 0.11 without the plugin: the server's configuration for
-- `vim.lsp.enable`. With this folder (editors/nvim) on 'runtimepath':
--
--   vim.lsp.enable('efim')
--   vim.lsp.inline_completion.enable()   -- Neovim 0.12: suggestions as ghost text in insert mode
--
-- and accept with `vim.lsp.inline_completion.get()`, cycle with `.select()`, e.g.
--   vim.keymap.set('i', '<Tab>', function()
--     if not vim.lsp.inline_completion.get() then return '<Tab>' end
--   end, { expr = true })
--
-- Override any field with `vim.lsp.config('efim', { ... })`, e.g.
--   cmd = { '/path/to/efim-lsp/.venv/bin/efim', 'serve' },
--   init_options = { model = '/path/to/model', maxTokens = 32 },   -- flat camelCase server settings
--
-- Besides completions, buffers attached to this client report their cursor to
-- the server (`efim/didMoveCursor`, debounced) so it can prefill ahead of the
-- first keystroke after a jump; a `vim.lsp.config` that sets its own `on_attach`
-- replaces that (call `require('efim.cursor').attach(bufnr, ...)` from it to keep it).
-- The plugin (lua/efim, `require('efim').setup{}`) is the alternative for Neovim
-- 0.7-0.11 and adds :EfimStats, :EfimToggle and partial accepts; use one or the other.
return {
  cmd = { "efim", "serve" },
  filetypes = {
    "bash", "c", "cmake", "cpp", "cs", "css", "cuda", "dart", "elixir", "erlang", "fish", "go", "haskell",
    "html", "java", "javascript", "javascriptreact", "json", "julia", "kotlin", "lua", "make", "nix", "ocaml",
    "perl", "php", "python", "r", "ruby", "rust", "scala", "sh", "sql", "swift", "terraform", "toml",
    "typescript", "typescriptreact", "vim", "vue", "yaml", "zig", "zsh",
  },
  root_markers = { ".git", ".hg", "pyproject.toml", "package.json", "Cargo.toml", "go.mod" },
  -- The server cancels superseded requests itself: it should see every keystroke at once
  -- (and a cursor notification must never overtake the change it follows).
  flags = { debounce_text_changes = 0 },
  on_attach = function(client, bufnr)
    local ok, cursor = pcall(require, "efim.cursor")
    if not ok then
      return -- lsp/efim.lua copied somewhere on its own: completions work, cursor reports do not
    end
    local id = client.id
    cursor.attach(bufnr, function()
      local c = vim.lsp.get_client_by_id(id)
      if c == nil or c:is_stopped() or not c.initialized or not vim.lsp.buf_is_attached(bufnr, id) then
        return nil
      end
      return c
    end)
  end,
}
