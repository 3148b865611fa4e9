"""The first answers at a new place: a small window now, the full window in the background.

A new edit session somewhere the engine has not computed (a jump, a file just opened, a
line rewritten far from the last session) needs its whole window prefilled before the
first token: about 2,000 tokens with the default budgets, a second or more on 2 cores.
Instead, while that window is cold, requests of the session are answered from a small
window of the same session (`firstWindowTokens`, the text just around the cursor) under
a key of their own, and the full window is prefilled as a background warm-up under the
document's key. The small window is the same for every keystroke of the session, so its
prompt stays a prefix of the next one (EFIM) and each keystroke prefills only what was
typed. Once the warm-up has run, the session's requests use the full window, which then
needs only the increment (docs/navigation.md, "The first answer at a new place").

Cold or not is judged from the text: the prompts this document's requests and warm-ups
computed to their end are remembered (`ComputedPrompts`), and the tokens a new full
prompt does not share with any of them at its start are what a full request would
prefill. The engine's caches may hold more (other documents, the disk tier) or, after
evictions under `--kv-budget`, less: a wrong guess costs one small-window answer where the
full window was ready, or one full-window wait where it had been evicted.
"""

from __future__ import annotations

import collections
from typing import NamedTuple

from efim_lsp.positions import LineIndex
from efim_lsp.session import Segments
from efim_lsp.window import TokenMeter, cut

# Prompts remembered per document: the last few places worked at (a person going back and
# forth between two functions finds both computed).
PROMPTS_KEPT = 4
# The small window's share before the cursor (the default full budgets are 1536 : 512).
PREFIX_SHARE = 0.75


def first_window_key(uri: str) -> str:
    """The engine key of a document's small-window requests (its own retained KV, so its
    keystrokes do not end the document's background warm-up)."""
    return f"{uri}#first-window"


def prompt_text(segments: Segments, *, suffix_first: bool, with_suffix: bool, chunks: str = "") -> str:
    """The prompt's text in the order the template lays it out (sentinels left out)."""
    if not with_suffix:
        return chunks + segments.prefix + segments.increment
    if suffix_first:
        return chunks + segments.suffix + segments.prefix + segments.increment
    return chunks + segments.prefix + segments.suffix + segments.increment


class SmallWindow(NamedTuple):
    session_id: int
    prefix: str
    suffix: str
    prefix_start: int = 0  # where `prefix` starts in the session's prefix segment

    def following(self, segments: Segments) -> "SmallWindow | None":
        """This small window for the session's `segments` now; None when it must be cut
        again. The session's prefix segment only ever loses its end (a Backspace past the
        anchor moves the anchor back when the prompt puts the prefix last, `efim_lsp.session`):
        the small window then loses the same end, keeping its head, so its prompt keeps its
        computed rows and never shows text that is gone."""
        if segments.session_id != self.session_id or self.prefix_start > len(segments.prefix):
            return None
        prefix = segments.prefix[self.prefix_start :]
        if prefix == self.prefix:
            return self
        if not self.prefix.startswith(prefix) or not segments.suffix.startswith(self.suffix):
            return None
        return self._replace(prefix=prefix)


def small_window(segments: Segments, tokens: int, meter: TokenMeter) -> SmallWindow:
    """The end of the session's prefix and the start of its suffix within `tokens`, cut at
    line boundaries as the full window is. Depends on the session's fixed segments only, so
    every keystroke of the session gets the same small window."""
    before = max(1, int(tokens * PREFIX_SHARE)) if segments.suffix else tokens
    after = max(0, tokens - before)
    text = segments.prefix + segments.suffix
    cursor = len(segments.prefix)
    window = cut(LineIndex(text), cursor, before, after, meter)
    return SmallWindow(segments.session_id, text[window.start : cursor], text[cursor : window.end], window.start)


class ComputedPrompts:
    """The prompt texts of one document that the engine computed to their end."""

    def __init__(self) -> None:
        self._texts: collections.deque[str] = collections.deque(maxlen=PROMPTS_KEPT)

    def add(self, text: str) -> None:
        if text in self._texts:
            self._texts.remove(text)
        self._texts.append(text)

    def uncached_chars(self, text: str) -> int:
        """Characters of `text` after its longest common start with a computed prompt."""
        best = 0
        for known in self._texts:
            best = max(best, _common_start(known, text))
        return len(text) - best

    def clear(self) -> None:
        self._texts.clear()


def _common_start(a: str, b: str) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def is_cold(uncached_chars: int, meter: TokenMeter, first_window_tokens: int) -> bool:
    """A full request would prefill more than the whole small window."""
    return uncached_chars > meter.chars_for(first_window_tokens)


__all__ = ["ComputedPrompts", "SmallWindow", "first_window_key", "is_cold", "prompt_text", "small_window"]
