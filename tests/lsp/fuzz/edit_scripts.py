"""Random incremental edit scripts and an independent client-side model of them.

A script is an initial text and a list of `didChange` batches; each batch holds one to
three changes (inserts, deletes, replacements spanning lines, inserts at the end, full-text
replacements), every change's range counted in the client's position encoding against
the text after the previous change, as the LSP spec says. The reference client applies
the same edits to its own string by offset; the server's text must equal it after every
batch.

Text is drawn from pieces that stress positions: CRLF, lone CR, tabs, BMP non-ASCII,
astral characters (two UTF-16 units, four UTF-8 bytes), a zero-width joiner, and a lone
*low* surrogate (one unit; lows alone can never pair up into an astral character, so
the text survives a JSON round trip unchanged).
"""

from __future__ import annotations

from typing import NamedTuple

from hypothesis import strategies as st

PIECES = ("a", "b", "xyz", " ", "    ", "\t", "\n", "\n", "\r\n", "\r\n", "\r", "é", "ß", "中", "😀", "𝔘", "\u200d", "\udc80", "def f(x):", "return")
ENCODINGS = ("utf-16", "utf-16", "utf-8", "utf-32")

small_texts = st.lists(st.sampled_from(PIECES), max_size=6).map("".join)
texts = st.one_of(
    st.lists(st.sampled_from(PIECES), max_size=40).map("".join),
    st.lists(st.sampled_from(PIECES), min_size=100, max_size=300).map("".join),
)

# (kind, where, length, text): `where`/`length` are mapped onto the current text when applied.
change_ops = st.one_of(
    st.tuples(st.just("insert"), st.integers(0, 1 << 20), st.just(0), small_texts),
    st.tuples(st.just("delete"), st.integers(0, 1 << 20), st.integers(1, 40), st.just("")),
    st.tuples(st.just("replace"), st.integers(0, 1 << 20), st.integers(1, 120), small_texts),
    st.tuples(st.just("end"), st.just(0), st.just(0), small_texts),
    st.tuples(st.just("delete-end"), st.just(0), st.integers(1, 10), st.just("")),
    st.tuples(st.just("full"), st.just(0), st.just(0), texts),
)
# After a batch, maybe a completion request: at the end of the last change ("edit"), or elsewhere.
requests = st.one_of(st.none(), st.just("edit"), st.just("edit"), st.integers(0, 1 << 20))
batches = st.tuples(st.lists(change_ops, min_size=1, max_size=3), requests)


class Script(NamedTuple):
    text: str
    batches: list
    encoding: str


scripts = st.builds(Script, texts, st.lists(batches, min_size=1, max_size=20), st.sampled_from(ENCODINGS))


def snap(text: str, offset: int) -> int:
    """An offset a client can name: not between the CR and LF of a CRLF."""
    offset = max(0, min(offset, len(text)))
    if 0 < offset < len(text) and text[offset - 1] == "\r" and text[offset] == "\n":
        offset -= 1
    return offset


def units(chunk: str, encoding: str) -> int:
    if encoding == "utf-32":
        return len(chunk)
    if encoding == "utf-16":
        return sum(2 if ord(c) > 0xFFFF else 1 for c in chunk)
    return len(chunk.encode("utf-8", "surrogatepass"))


def position(text: str, offset: int, encoding: str) -> dict:
    """LSP position of `offset`, by walking the text (independent of efim_lsp.positions)."""
    line, start, i = 0, 0, 0
    while i < offset:
        ch = text[i]
        if ch == "\r" and i + 1 < len(text) and text[i + 1] == "\n":
            i += 2
        elif ch in "\r\n":
            i += 1
        else:
            i += 1
            continue
        line, start = line + 1, i
    return {"line": line, "character": units(text[start:offset], encoding)}


class Step(NamedTuple):
    changes: list  # wire `contentChanges`
    edits: list  # (start, end, new_text) per range change, offsets of the text before it; None for a full change
    text: str  # the client's text after the batch
    cursor: int | None  # a completion request after the batch at this offset


def play(script: Script):
    """The client side: yields a `Step` per batch."""
    text = script.text
    for ops, request in script.batches:
        changes, edits = [], []
        last_end = None
        for kind, where, length, new in ops:
            if kind == "full":
                changes.append({"text": new})
                edits.append(None)
                text, last_end = new, None
                continue
            if kind == "end":
                start = end = len(text)
            elif kind == "delete-end":
                end = len(text)
                start = snap(text, end - length)
            else:
                start = snap(text, where % (len(text) + 1))
                end = snap(text, start + length) if length else start
                end = max(end, start)
            changes.append({"range": {"start": position(text, start, script.encoding), "end": position(text, end, script.encoding)}, "text": new})
            edits.append((start, end, new))
            text = text[:start] + new + text[end:]
            last_end = start + len(new)
        if request is None:
            cursor = None
        elif request == "edit":
            cursor = snap(text, last_end) if last_end is not None else len(text)
        else:
            cursor = snap(text, request % (len(text) + 1))
        yield Step(changes, edits, text, cursor)
