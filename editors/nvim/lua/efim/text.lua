-- Text arithmetic for suggestions: LSP columns <-> byte columns, and the
-- pieces a partial accept takes. Pure functions: no editor state, no API calls.
local M = {}

-- Byte length of the UTF-8 character whose lead byte is `b` (1 for stray bytes).
local function char_len(b)
  if b >= 0xF0 then
    return 4
  elseif b >= 0xE0 then
    return 3
  elseif b >= 0xC0 then
    return 2
  end
  return 1
end

-- Columns one character occupies in `encoding` ("utf-8", "utf-16", "utf-32").
local function char_units(nbytes, encoding)
  if encoding == "utf-8" then
    return nbytes
  elseif encoding == "utf-32" then
    return 1
  end
  return nbytes == 4 and 2 or 1 -- utf-16: characters outside the BMP are surrogate pairs
end

--- LSP column of byte offset `byte` (0-based) in `line`.
function M.byte_to_col(line, byte, encoding)
  if encoding == "utf-8" then
    return math.min(byte, #line)
  end
  local col, i = 0, 1
  while i <= byte and i <= #line do
    local n = char_len(line:byte(i))
    col = col + char_units(n, encoding)
    i = i + n
  end
  return col
end

--- Byte offset (0-based) of LSP column `col` in `line`; past the end gives #line.
function M.col_to_byte(line, col, encoding)
  if encoding == "utf-8" then
    return math.min(col, #line)
  end
  local units, i = 0, 1
  while i <= #line and units < col do
    local n = char_len(line:byte(i))
    units = units + char_units(n, encoding)
    i = i + n
  end
  return i - 1
end

--- Length of `s` in `encoding` units (acceptedLength is counted in the client's position encoding).
function M.units(s, encoding)
  return M.byte_to_col(s, #s, encoding)
end

--- Splits on "\n" keeping empty pieces ("a\n" -> {"a", ""}).
function M.lines(s)
  local out = {}
  for piece in (s .. "\n"):gmatch("(.-)\n") do
    out[#out + 1] = piece
  end
  return out
end

--- The next word of `s`: leading blanks, then a run of word characters or a
--- run of other non-blank characters. At a line break, the break and the next
--- line's indentation.
function M.next_word(s)
  if s:sub(1, 1) == "\n" then
    return s:match("^\n[ \t]*")
  end
  return s:match("^[ \t]*[%w_]+") or s:match("^[ \t]*[^%w_%s]+") or s:match("^[ \t]+") or s:sub(1, 1)
end

--- The rest of the current line of `s` (without its break); at a line break,
--- the break and the whole next line.
function M.next_line(s)
  if s:sub(1, 1) == "\n" then
    return "\n" .. (s:sub(2):match("^[^\n]*"))
  end
  return s:match("^[^\n]*")
end

return M
