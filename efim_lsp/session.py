"""Edit sessions: the EFIM part of the server (docs/design.md, "Prefix stability").

Per document a session holds a base prefix P, a base suffix S and the
increment `inc` typed since the session began. While it lives,
`text == P + inc + S` and the cursor sits right after `inc`, so the prompt
`PRE P_win SUF S_win MID inc` of one keystroke is an exact token prefix of the
next one's: the engine prefills only the new characters.

`P_win` / `S_win` are P and S cut to the token budgets (see `window.py`); they
are fixed for the session's whole life — that is what keeps the KV valid.

Rules (`EditSession.observe` for edits, `EditSession.segments` at requests):
- an edit inside `inc` (typing, backspacing, a paste at the cursor) keeps the
  session and updates `inc`;
- an edit entirely outside the prompt window (above P_win's first line or
  below S_win's last) keeps it too: the prompt's text is unchanged, only
  offsets shift;
- an edit that touches P_win or S_win (backspace past the anchor, an edit in
  S, a paste elsewhere in the window) ends it — except, when the prompt puts the prefix
  last (`prefix_last`: a suffix-first template, or a model without FIM tokens, where P and
  `inc` are adjacent at the prompt's end), an edit inside P_win + inc: the anchor moves
  back to the edit's start (P_win shrinks, `inc` holds the rest), so the prompt keeps its
  head and only its tail changes (a backspace after a jump costs a token or two);
- at a request, a cursor that is not right after `inc` (a jump), or an `inc`
  longer than `MAX_INCREMENT_CHARS` characters or `MAX_INCREMENT_LINES` line
  breaks, rebases: `P, S = text[:cursor], text[cursor:]`, `inc = ""`.

Increment limits, chosen: 384 characters / 12 lines. A rebase costs one
prefill of the new suffix window (~`suffixTokens`), the p99 tail, so rebases
must stay rare while typing a function body (a few per hundred keystrokes);
but the increment sits after the suffix in the prompt, farther from the
prefix it continues than in normal text, and models trained on FIM middles
have seen middles of a few lines, not pages. 384 characters is ~100 tokens.
"""

from __future__ import annotations

import itertools
import logging
from collections import Counter
from typing import NamedTuple

from efim_lsp.documents import Edit
from efim_lsp.positions import LineIndex
from efim_lsp.window import TokenMeter, cut

log = logging.getLogger(__name__)

MAX_INCREMENT_CHARS = 384
MAX_INCREMENT_LINES = 12

_session_ids = itertools.count(1)


class Budget(NamedTuple):
    prefix_tokens: int
    suffix_tokens: int


class Segments(NamedTuple):
    """What the engine request is made of, as strings."""

    prefix: str  # P_win
    suffix: str  # S_win
    increment: str
    session_id: int
    rebased: bool
    rebase_reason: str | None


class _Live(NamedTuple):
    session_id: int
    window_start: int  # document offset of P_win's first character
    anchor: int  # len(P): where the increment begins
    increment: str
    prefix: str  # P_win, fixed for the session's life
    suffix: str  # S_win, fixed for the session's life
    budget: Budget


class EditSession:
    """The edit session of one document. Plain state machine; no engine, no LSP."""

    def __init__(self, meter: TokenMeter | None = None):
        self.meter = meter or TokenMeter()
        self._live: _Live | None = None
        self._ended: str | None = "new document"  # why there is no live session
        self._sticky_start: int | None = None  # previous window start, kept across rebases
        self.rebases = 0
        self.reasons: Counter[str] = Counter()
        # The prompt layout puts P_win and inc last and adjacent (set by the caller, which
        # knows the engine's template; False is always safe).
        self.prefix_last = False

    # -- state -------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self._live is not None

    @property
    def anchor(self) -> int | None:
        return self._live.anchor if self._live else None

    @property
    def increment(self) -> str | None:
        return self._live.increment if self._live else None

    @property
    def cursor(self) -> int | None:
        """Where the cursor must be for the session to continue (right after inc)."""
        return self._live.anchor + len(self._live.increment) if self._live else None

    @property
    def window_start(self) -> int | None:
        return self._live.window_start if self._live else self._sticky_start

    def end(self, reason: str) -> None:
        """End the live session (if any); the next request rebases and says why."""
        if self._live is not None:
            log.debug("session %d ends: %s", self._live.session_id, reason)
            self._live = None
            self._ended = reason

    def forget(self, reason: str) -> None:
        """Drop everything, including the sticky window start (document replaced)."""
        self.end(reason)
        self._ended = reason
        self._sticky_start = None

    # -- edits -------------------------------------------------------------
    def observe(self, edit: Edit) -> None:
        """Follow one applied edit (offsets of the text before it)."""
        self._shift_sticky(edit)
        live = self._live
        if live is None:
            return
        a, b = edit.start, edit.end
        cursor = live.anchor + len(live.increment)
        suffix_end = cursor + len(live.suffix)
        if live.anchor <= a and b <= cursor:
            lo, hi = a - live.anchor, b - live.anchor
            inc = live.increment[:lo] + edit.new_text + live.increment[hi:]
            self._live = live._replace(increment=inc)
        elif b < live.window_start or (b == live.window_start and a < b):
            # Above the window: the prompt's text is unchanged, only offsets move.
            # (An insertion exactly at the window start is taken as inside it.)
            d = edit.delta
            self._live = live._replace(window_start=live.window_start + d, anchor=live.anchor + d)
        elif a >= suffix_end:
            pass  # below the window: nothing in the prompt moves
        elif self.prefix_last and live.window_start <= a and b <= cursor:
            # P_win + inc is one stretch at the prompt's end: cut P_win at the edit.
            head = live.prefix + live.increment
            lo, hi = a - live.window_start, b - live.window_start
            edited = head[:lo] + edit.new_text + head[hi:]
            self._live = live._replace(anchor=a, prefix=head[:lo], increment=edited[lo:])
        elif a < live.anchor:
            self.end("edit before the anchor (in the prefix window)")
        else:
            self.end("edit in the suffix window")

    def _shift_sticky(self, edit: Edit) -> None:
        s = self._sticky_start
        if s is None:
            return
        if edit.end <= s and not (edit.start == edit.end == s):
            self._sticky_start = s + edit.delta
        elif edit.start >= s:
            return
        else:
            self._sticky_start = None  # the edit straddles it: no longer a known line start

    # -- requests ----------------------------------------------------------
    def segments(self, index: LineIndex, cursor: int, budget: Budget) -> Segments:
        """The prompt segments for a request at `cursor`; rebases when the rules say so.

        Contract: the returned segments satisfy `prefix` == text[window_start:anchor],
        `increment` == text[anchor:cursor], `suffix` == text[cursor:cursor+len(suffix)].
        """
        text = index.text
        live = self._live
        reason = self._continue_reason(text, cursor, budget)
        if reason is None and live is not None:
            return Segments(live.prefix, live.suffix, live.increment, live.session_id, False, None)
        if live is not None:
            self.rebases += 1
        elif self._ended != "new document":
            self.rebases += 1
        self.reasons[reason or "?"] += 1
        window = cut(index, cursor, budget.prefix_tokens, budget.suffix_tokens, self.meter, self.window_start)
        self._sticky_start = window.start
        live = _Live(
            session_id=next(_session_ids),
            window_start=window.start,
            anchor=cursor,
            increment="",
            prefix=text[window.start : cursor],
            suffix=text[cursor : window.end],
            budget=budget,
        )
        self._live = live
        self._ended = None
        return Segments(live.prefix, live.suffix, "", live.session_id, True, reason)

    def _continue_reason(self, text: str, cursor: int, budget: Budget) -> str | None:
        """None when the live session serves `cursor`; else why it must rebase."""
        live = self._live
        if live is None:
            return self._ended or "no session"
        if live.budget != budget:
            return "window budget changed"
        if cursor != live.anchor + len(live.increment):
            return "cursor moved away from the increment"
        inc = live.increment
        if len(inc) > MAX_INCREMENT_CHARS:
            return "increment over the character limit"
        if inc.count("\n") + inc.count("\r") - inc.count("\r\n") > MAX_INCREMENT_LINES:
            return "increment over the line limit"
        if not self.consistent(text):
            log.warning("edit session lost track of the text (a bug); rebasing")
            return "session inconsistent with the text"
        return None

    def consistent(self, text: str) -> bool:
        """Integrity check: the live session's segments are where it says they are."""
        live = self._live
        if live is None:
            return True
        cursor = live.anchor + len(live.increment)
        return (
            text.startswith(live.prefix, live.window_start)
            and live.window_start + len(live.prefix) == live.anchor
            and text.startswith(live.increment, live.anchor)
            and text.startswith(live.suffix, cursor)
        )
