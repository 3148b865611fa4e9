"""A client-side model of LSP positions, written independently of `efim_lsp.positions`."""

from efim_lsp.documents import RangeChange


def client_position(text: str, offset: int, encoding: str = "utf-16") -> tuple[int, int]:
    """An independent client-side model: walk the text character by character."""
    line, col_start, i = 0, 0, 0
    while i < offset:
        ch = text[i]
        if ch == "\r" and i + 1 < len(text) and text[i + 1] == "\n":
            if i + 1 >= offset:
                break
            i += 2
            line, col_start = line + 1, i
            continue
        if ch in "\r\n":
            i += 1
            line, col_start = line + 1, i
            continue
        i += 1
    chunk = text[col_start:offset]
    if encoding == "utf-16":
        units = sum(2 if ord(c) > 0xFFFF else 1 for c in chunk)
    elif encoding == "utf-8":
        units = len(chunk.encode("utf-8"))
    else:
        units = len(chunk)
    return line, units


def range_change(text: str, start: int, end: int, new: str, encoding: str = "utf-16") -> RangeChange:
    return RangeChange(*client_position(text, start, encoding), *client_position(text, end, encoding), new)
