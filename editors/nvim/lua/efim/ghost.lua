-- Ghost text: the suggestion drawn with extmarks in one namespace.
-- Neovim >= 0.10 draws the first line `inline` at the cursor; before that an
-- `overlay` at the end of the line, or at `eol` when text follows the cursor
-- (an overlay would hide it). Further lines are `virt_lines` below.
local text = require("efim.text")

local M = {}

M.ns = vim.api.nvim_create_namespace("efim_ghost")
local has_inline = vim.fn.has("nvim-0.10") == 1

--- Draws `remainder` (the part of the suggestion not yet in the buffer) at
--- 0-based `row` and byte column `col` of `bufnr`, replacing any earlier ghost.
function M.draw(bufnr, row, col, remainder, hl_group)
  M.clear(bufnr)
  if remainder == "" then
    return
  end
  local lines = text.lines(remainder)
  local line = vim.api.nvim_buf_get_lines(bufnr, row, row + 1, false)[1] or ""
  local opts = { hl_mode = "combine", priority = 1000 }
  if lines[1] ~= "" then
    opts.virt_text = { { lines[1], hl_group } }
    if has_inline then
      opts.virt_text_pos = "inline"
    elseif col >= #line then
      opts.virt_text_pos = "overlay"
    else
      opts.virt_text_pos = "eol"
    end
  end
  if #lines > 1 then
    local below = {}
    for i = 2, #lines do
      below[#below + 1] = { { lines[i], hl_group } }
    end
    opts.virt_lines = below
  end
  vim.api.nvim_buf_set_extmark(bufnr, M.ns, row, math.min(col, #line), opts)
end

function M.clear(bufnr)
  if vim.api.nvim_buf_is_valid(bufnr) then
    vim.api.nvim_buf_clear_namespace(bufnr, M.ns, 0, -1)
  end
end

--- The ghost text as drawn, read back from the extmarks ("" when none):
--- the first line's virt_text, then each virt_line after a "\n".
function M.read(bufnr)
  local marks = vim.api.nvim_buf_get_extmarks(bufnr, M.ns, 0, -1, { details = true })
  local parts = {}
  for _, mark in ipairs(marks) do
    local details = mark[4] or {}
    local first = {}
    for _, chunk in ipairs(details.virt_text or {}) do
      first[#first + 1] = chunk[1]
    end
    parts[#parts + 1] = table.concat(first)
    for _, vline in ipairs(details.virt_lines or {}) do
      local pieces = {}
      for _, chunk in ipairs(vline) do
        pieces[#pieces + 1] = chunk[1]
      end
      parts[#parts + 1] = "\n" .. table.concat(pieces)
    end
  end
  return table.concat(parts), marks
end

return M
