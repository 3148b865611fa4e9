"""Suggestion post-processing: from a raw generation to the text shown as ghost text.

Rules:
- Mode. `multiline="auto"`: one line when the cursor has code to its right or
  sits mid-line; a block when the cursor ends a line that opens one (`:`, `{`,
  `(`, `[`) or sits on an empty line inside one. `never` / `always` force it.
- A block is cut before the first line indented less than the block's floor
  (the block has ended); in brace languages a closing line at the opener's
  indentation is kept when the suffix does not already close it.
- Cut where the generation starts repeating the next line of the suffix.
- Brackets: a closer that closes something opened before the cursor, when the
  text right of the cursor already closes it, ends the suggestion there; a
  single line that ends with the text right of the cursor drops that overlap.
- Trailing whitespace is stripped (every line, and trailing blank lines).
- Cut short: a generation that ran out of tokens (`maxTokens`) is cut at its last line
  boundary; when not even its first line finished, that line is kept up to the end of
  its last whole word (a trailing identifier may be cut mid-way), so nothing ends
  mid-word — an identifier fragment alone is nothing to show.
- Indentation: on an empty line already indented to a level the code around uses, 1-3
  spaces the model adds before its first line (landing between levels) are dropped.
- Docstrings: a finished suggestion on an empty line that opens a triple-quoted string and
  leaves it open (three double quotes, then `Return the address.`) is closed with the same
  quotes, unless the cursor is inside a triple-quoted string already or the lines below,
  before the block ends or the next definition starts, hold that delimiter (the string's
  end may be there): an unclosed one turns the rest of the file into a string.
- The off-side rule (Python, `CursorContext.offside`): a suggestion that ends its line
  does not end with a plain statement above a deeper line (only a header, or a line that
  continues, could take it); such trailing lines are dropped, which can leave nothing to
  show.
The caller never sends an empty item: `shape(...).text == ""` means "no suggestion".

Plain string functions; no LSP, no engine.
"""

from __future__ import annotations

import re
from typing import Iterable, Literal, NamedTuple

Mode = Literal["line", "block"]
Multiline = Literal["auto", "never", "always"]

BLOCK_OPENERS = (":", "{", "(", "[")
# languageIds whose blocks are indentation (the off-side rule), for `CursorContext.offside`
OFFSIDE_LANGUAGES = frozenset({"python", "cython"})
_PAIRS = {")": "(", "]": "[", "}": "{"}
_OPENERS = set(_PAIRS.values())
_LINE_BREAK = re.compile(r"\r\n|\r|\n")
_CONTEXT_LINES = 8
_SCAN_CHARS = 4000


def indent_width(line: str) -> int:
    """Columns of leading whitespace (a tab counts as 4, as most editors show it)."""
    width = 0
    for ch in line:
        if ch == " ":
            width += 1
        elif ch == "\t":
            width += 4
        else:
            break
    return width


class CursorContext(NamedTuple):
    line_before: str  # the cursor line, left of the cursor
    line_after: str  # the cursor line, right of the cursor (no line break)
    next_lines: tuple[str, ...]  # the lines below the cursor line
    previous_line: str  # the last non-blank line above the cursor line ("" if none)
    in_string: bool = False  # an empty cursor line inside a triple-quoted string (a docstring); False on other lines
    offside: bool = False  # the language's blocks are its indentation (Python): see `_fit_offside`

    @classmethod
    def at(cls, text: str, cursor: int, *, offside: bool = False) -> "CursorContext":
        line_start = max(text.rfind("\n", 0, cursor), text.rfind("\r", 0, cursor)) + 1
        m = _LINE_BREAK.search(text, cursor)
        line_end = m.start() if m else len(text)
        below = text[m.end() : m.end() + _SCAN_CHARS] if m else ""
        next_lines = tuple(_LINE_BREAK.split(below)[:_CONTEXT_LINES]) if below else ()
        above = text[max(0, line_start - _SCAN_CHARS) : line_start]
        previous = ""
        for line in reversed(_LINE_BREAK.split(above)):
            if line.strip():
                previous = line
                break
        before, after = text[line_start:cursor], text[cursor:line_end]
        # Only an empty line asks (the fresh-line rule): typing mid-line never pays for the scan.
        in_string = not before.strip() and not after.strip() and _inside_triple_quotes(text, line_start)
        return cls(before, after, next_lines, previous, in_string, offside)

    @property
    def next_code_line(self) -> str:
        """The first non-blank line below the cursor line, stripped ("" if none)."""
        for line in self.next_lines:
            if line.strip():
                return line.strip()
        return ""


_TRIPLE_QUOTE = re.compile(r"\"\"\"|'''")


def _open_triple_quote(text: str, end: int | None = None) -> str | None:
    """The triple-quote delimiter `text[:end]` leaves open, or None: the delimiters are
    paired from the start (a delimiter inside the other kind's string is text). A
    heuristic — a triple quote inside a one-line string or a comment miscounts — but one
    regex pass (a 100 kB prefix in about a millisecond) needs no parser."""
    open_quote = None
    for m in _TRIPLE_QUOTE.finditer(text, 0, len(text) if end is None else end):
        if open_quote is None:
            open_quote = m.group()
        elif m.group() == open_quote:
            open_quote = None
    return open_quote


def _inside_triple_quotes(text: str, end: int) -> bool:
    """Whether `text[:end]` leaves a triple-quoted string open (`_open_triple_quote`)."""
    return _open_triple_quote(text, end) is not None


def choose_mode(ctx: CursorContext, multiline: Multiline = "auto") -> Mode:
    if multiline == "never":
        return "line"
    if multiline == "always":
        return "block"
    if ctx.line_after.strip():
        return "line"  # code to the right of the cursor
    before = ctx.line_before
    if not before.strip():
        # An empty line: a block when it is inside one (indented, or right under an opener).
        if before or ctx.previous_line.rstrip().endswith(BLOCK_OPENERS):
            return "block"
        return "line"
    return "block" if before.rstrip().endswith(BLOCK_OPENERS) else "line"


def block_floor(ctx: CursorContext) -> int:
    """Lines of a block indented less than this have left the block."""
    before = ctx.line_before
    if before.strip():
        if before.rstrip().endswith(BLOCK_OPENERS):
            return indent_width(before) + 1
        return indent_width(before)
    if before:
        return indent_width(before)
    if ctx.previous_line.rstrip().endswith(BLOCK_OPENERS):
        return indent_width(ctx.previous_line) + 1
    return 0


_CONTINUATION_ENDS = BLOCK_OPENERS + (",", "\\")
# A blank line before these is the convention (PEP 8), not a missing line of code.
_STARTS_AFTER_BLANK = re.compile(r"(async\s+def|def|class)\b|@")


def fresh_line(ctx: CursorContext) -> bool:
    """The fresh-line rule's test (`InfillRequest.fresh_line`): the cursor line is empty
    (only whitespace on it) and the block around it goes on, so a blank answer would be
    no suggestion where code is due. The block goes on when the last non-blank line above
    opens a block or continues a statement (ends with `:`, a bracket, `,` or `\\`); or
    when the cursor is inside a block (its scope: the typed indentation, else the line
    above's) and the first non-blank line below is indented at least that deep and is
    not a `def` / `class` / decorator (a blank line before those is the convention), or
    the text ends inside the block. Top-level lines (scope 0) are not a block: between
    top-level statements a blank line is as likely as code. Inside a triple-quoted string
    (a docstring's paragraphs) it is never set."""
    if ctx.line_before.strip() or ctx.line_after.strip() or ctx.in_string:
        return False
    previous = ctx.previous_line.rstrip()
    if previous.endswith(_CONTINUATION_ENDS):
        return True
    scope = indent_width(ctx.line_before) if ctx.line_before else indent_width(previous)
    if scope == 0:
        return False
    below = next((line for line in ctx.next_lines if line.strip()), None)
    if below is None:
        return True  # the text ends inside the block
    return indent_width(below) >= scope and not _STARTS_AFTER_BLANK.match(below.strip())


class Shaped(NamedTuple):
    text: str  # what to insert ("" = nothing worth showing)
    final: bool  # True when more generated tokens could not change `text` (stop decoding)


def shape(generated: str, ctx: CursorContext, mode: Mode, *, done: bool = True, cut_short: bool = False, snap_indent: bool = True,
          close_docstring: bool = True) -> Shaped:
    """Cut a generation into the suggestion to show.

    `done=False` while tokens still stream in: rules that need a whole line wait
    for it, and `Shaped.final` says whether decoding can stop already.
    `cut_short=True`: the generation ended at its token limit, so its last line is
    unfinished (see the module docstring).
    `snap_indent=False` leaves the first line's leading spaces as generated, and
    `close_docstring=False` an open triple-quoted string open (measurements).
    """
    if cut_short:
        generated = cut_short_text(generated)
    if snap_indent:
        generated = _snap_indent(generated, ctx)
    lines = _LINE_BREAK.split(generated)
    final = False
    if mode == "line":
        final = len(lines) > 1
        lines = lines[:1]
    else:
        lines, final = _cut_block(lines, ctx, done)

    first = lines[0]
    complete_first = len(lines) > 1 or final or done
    if not ctx.line_before.strip() and complete_first and _repeats(ctx.line_before + first, ctx.next_code_line):
        return Shaped("", True)
    if ctx.line_after.strip():
        first, cut_at_bracket = _balance(first, ctx.line_after)
        if cut_at_bracket:
            lines, final = [first], True
        else:
            tail = ctx.line_after.strip()
            if len(lines) == 1 and complete_first and first.rstrip().endswith(tail) and first.rstrip() != tail:
                first = first.rstrip()[: -len(tail)]
        lines[0] = first

    if ctx.offside and (final or done):
        lines = _fit_offside(lines, ctx)
    text = "\n".join(line.rstrip() for line in lines).rstrip()
    if not text.strip():
        return Shaped("", final)
    if close_docstring and (final or done):
        text = _close_docstring(text, ctx)
    return Shaped(text, final)


def _fit_offside(lines: list[str], ctx: CursorContext) -> list[str]:
    """`lines` without the trailing lines that, accepted, break the off-side rule against
    the first code line below the cursor line (a comment's indentation does not count):
    a line that neither opens a block nor continues one (`:`, a bracket, `,`, `\\` at its
    end) above a deeper line, which only a header (or a continued line) can take; a comment
    there leaves the header missing too. Only when the suggestion ends its line (nothing
    right of the cursor) outside a triple-quoted string (a docstring's text has no
    blocks); the first line counts with what is typed before it. May leave nothing to show.

    A header above a line that is not deeper is kept: in an editor that is a new block
    being written above the code that follows, its body still to come."""
    if ctx.line_after.strip() or ctx.in_string:
        return lines
    below = next((line for line in ctx.next_lines if line.strip() and not line.lstrip().startswith("#")), None)
    if below is None:
        return lines  # the end of the file, or more than the context holds: nothing to check against
    depth = indent_width(below)
    out = list(lines)
    while out:
        last = (ctx.line_before if len(out) == 1 else "") + out[-1]
        body = last.strip()
        if not body:
            if len(out) == 1:
                break
            out.pop()  # a blank line between the suggestion's code and the line below
            continue
        if depth > indent_width(last) and not body.endswith(_CONTINUATION_ENDS):
            out.pop()  # the line below is a body (or continuation) this line cannot take
        else:
            break
    return out or [""]


_WORD_TAIL = re.compile(r"\w+$")


def cut_short_text(generated: str) -> str:
    """What a generation cut short at its token limit may show: up to its last line break,
    or — no line finished — its first line without a trailing word that may be unfinished."""
    ends = [m.end() for m in _LINE_BREAK.finditer(generated)]
    if ends:
        return generated[: ends[-1]]
    tail = _WORD_TAIL.search(generated)
    return generated[: tail.start()] if tail else generated


def _close_docstring(text: str, ctx: CursorContext) -> str:
    """`text` with the triple quotes it opened and left open closed (see the module
    docstring); only on an empty cursor line, where `ctx.in_string` is known."""
    if ctx.line_before.strip() or ctx.line_after.strip() or ctx.in_string:
        return text
    open_quote = _open_triple_quote(text)
    if open_quote is None:
        return text
    scope = indent_width(ctx.line_before)
    for line in ctx.next_lines:  # the string's end may be below, within this block
        body = line.strip()
        if body and (indent_width(line) < scope or _STARTS_AFTER_BLANK.match(body)):
            break  # the block ended, or the next definition: a delimiter there is its own
        if open_quote in line:
            return text
    return text + open_quote


def _snap_indent(generated: str, ctx: CursorContext) -> str:
    """Drop 1-3 leading spaces the model put before its first line on an empty line whose
    typed indentation is already a level the code around uses (the previous or next
    line's, or under a block opener a deeper one) when they land the line between levels:
    a tokenization artefact (` if`, ` x` after the indentation token) that leaves Python
    unparseable (`efim eval shape`). Kept under an opener while the typed indentation has
    not reached the body's level, and with tabs."""
    typed = ctx.line_before
    if not typed or typed.strip() or ctx.line_after.strip() or "\t" in typed:
        return generated
    lead = len(generated) - len(generated.lstrip(" "))
    if not 1 <= lead <= 3 or generated[lead:lead + 1] in ("", "\t", "\n", "\r"):
        return generated
    width = indent_width(typed)
    above = indent_width(ctx.previous_line)
    levels = {above}
    if ctx.previous_line.rstrip().endswith(BLOCK_OPENERS):
        if width <= above:
            return generated  # the body's level is not typed yet: the spaces may be it
        levels.add(width)  # the typed indentation is the body's level
    below = next((line for line in ctx.next_lines if line.strip()), None)
    if below is not None:
        levels.add(indent_width(below))
    if width in levels and width + lead not in levels:
        return generated[lead:]
    return generated


def distinct_alternatives(first: str, generated: Iterable[tuple[str, bool]], ctx: CursorContext, mode: Mode) -> tuple[str, ...]:
    """The shaped texts of `generated` (alternative generations, in order, each with
    whether it was cut short at the token limit) that are neither empty nor equal to
    `first` (the shaped first suggestion) or to an earlier one."""
    out: list[str] = []
    seen = {first}
    for raw, cut_short in generated:
        text = shape(raw, ctx, mode, done=True, cut_short=cut_short).text
        if text and text not in seen:
            seen.add(text)
            out.append(text)
    return tuple(out)


def _cut_block(lines: list[str], ctx: CursorContext, done: bool) -> tuple[list[str], bool]:
    floor = block_floor(ctx)
    opener_indent = indent_width(ctx.line_before) if ctx.line_before.strip() else None
    target = ctx.next_code_line
    out = [lines[0]]
    for i in range(1, len(lines)):
        line = lines[i]
        growing = not done and i == len(lines) - 1  # the last line may still get more characters
        body = line.strip()
        if not body:
            out.append(line)
            continue
        if indent_width(line) < floor:
            if (
                opener_indent is not None
                and indent_width(line) == opener_indent
                and body[0] in _PAIRS
                and not target.startswith(body[0])
            ):
                if growing:
                    return out, False  # wait for the whole closing line
                out.append(line)  # the closing brace the suffix lacks
            return out, True
        if not growing and _repeats(line, target):
            return out, True
        out.append(line)
    return out, False


def _repeats(line: str, target: str) -> bool:
    return bool(target) and line.strip() == target


def _balance(first: str, line_after: str) -> tuple[str, bool]:
    """Cut `first` at a closer that the text right of the cursor already provides.

    Only the first `_SCAN_CHARS` of the line are scanned: this runs at every streamed
    token, and a 100,000-character line must not cost a Python loop over all of it."""
    needed = _unmatched_closers(line_after[:_SCAN_CHARS])
    if not needed:
        return first, False
    stack: list[str] = []
    quote: str | None = None
    for i, ch in enumerate(first):
        if quote:
            if ch == quote and (i == 0 or first[i - 1] != "\\"):
                quote = None
            continue
        if ch in "\"'`":
            quote = ch
        elif ch in _OPENERS:
            stack.append(ch)
        elif ch in _PAIRS:
            if stack and stack[-1] == _PAIRS[ch]:
                stack.pop()
            elif ch == needed[0]:
                return first[:i], True
    return first, False


def _unmatched_closers(text: str) -> list[str]:
    """Closers in `text` that close brackets opened before it, in order."""
    stack: list[str] = []
    out: list[str] = []
    for ch in text:
        if ch in _OPENERS:
            stack.append(ch)
        elif ch in _PAIRS:
            if stack and stack[-1] == _PAIRS[ch]:
                stack.pop()
            else:
                out.append(ch)
    return out
