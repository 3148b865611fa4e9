"""What a person's key presses insert when they type a body of text into an editor.

One splitter for every typist: the trace synthesiser's (`typist.type_block`) and the
keystroke benchmark's (`bench/lsp_typing.py`), so both send the same edits for the same
text. The edits are what an editor reports in one didChange per key, and replaying a
trace sends each of them as it stands, so the split follows what the editor inserts:

- a character is one key press, counted in code points (the unit of the traces' spans):
  `é`, `日` and `😀` are one key each (an input method commits a character at once);
- Enter inserts the line break and the next line's indentation, spaces and tabs alike,
  in one edit: the editor's auto-indent (a person then adjusts it; when the indentation
  is right, the net edit is that one didChange, and the text stays exact). A `\\r\\n`
  is one Enter, as are `\\r` and `\\n`;
- indentation that opens the body (a block that starts at its line's start) arrives in
  one edit too: the editor indented the line the cursor was put on.

Joining the key presses gives the body back exactly.
"""

from __future__ import annotations

import re

_LINE_BREAK = re.compile(r"\r\n|\r|\n")
_INDENT = " \t"


def key_presses(body: str) -> list[str]:
    """What each key press inserts: a character, or a line break with the next line's
    indentation (the body's own leading indentation: one edit as well)."""
    out: list[str] = []
    i = 0
    lead = len(body) - len(body.lstrip(_INDENT))
    if lead:
        out.append(body[:lead])
        i = lead
    while i < len(body):
        m = _LINE_BREAK.match(body, i)
        if m:
            j = m.end()
            while j < len(body) and body[j] in _INDENT:
                j += 1
            out.append(body[i:j])
            i = j
        else:
            out.append(body[i])
            i += 1
    return out


__all__ = ["key_presses"]
