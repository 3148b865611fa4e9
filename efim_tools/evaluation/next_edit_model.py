"""The model's next edits for `efim eval next-edit --proposer model|rules+model`, and the
issue's non-model baseline (`--proposer textual`).

`ModelProposer` asks the product engine as the server would: the document's prompt (cursor
right after the changed token, the token typed as the session's increment) is computed first,
as a keystroke's completion would have left it, then each candidate of
`efim_lsp.next_edit.probe` is one request with that prompt and the candidate's probe after it
(`InfillRequest.probe`), so only the probe is prefilled. Timed from the first probe to the
decision (`latencies_ms`); the document prompt is not counted, as it is resident when a
person has just typed there.

`textual`: the last edit widened to whole words, repeated at the next occurrence of the old
text below it (else the nearest above), with no regard for scope, strings or kind.
"""

from __future__ import annotations

import re
import time

from engine.api import InfillRequest

from efim_lsp.next_edit import probe
from efim_lsp.next_edit.history import Change
from efim_lsp.next_edit.proposer import NextEdit, widened

# The document's window around the cursor (characters before, after), whole lines.
WINDOW = (2400, 1200)


class ModelProposer:
    def __init__(self, engine, window: tuple[int, int] = WINDOW):
        self.engine = engine
        self.window = window
        self.latencies_ms: list[float] = []
        self.probes = 0
        self._n = 0

    def propose(self, text: str, change: Change | None) -> NextEdit | None:
        tc = probe.token_change(text, change)
        if tc is None:
            return None
        found = probe.candidates(text, tc)
        if not found:
            return None
        self._n += 1
        key = f"next-edit-eval-{self._n}"
        before, after = self.window
        lo = text.rfind("\n", 0, max(0, tc.start - before)) + 1 if tc.start > before else 0
        hi = text.find("\n", tc.end + after)
        hi = len(text) if hi < 0 else hi + 1
        doc = dict(prefix=text[lo : tc.start], increment=text[tc.start : tc.end], suffix=text[tc.end : hi], format="efim",
                   context="off", heal=False)
        # The keystroke's prompt, resident before anyone asks for a next edit.
        self.engine.submit(InfillRequest(key=key, max_tokens=1, **doc)).result(timeout=600)
        budget = max(self.engine.count_tokens(tc.new), self.engine.count_tokens(tc.old)) + 2
        t0 = time.perf_counter()
        chosen = None
        for cand in found:
            self.probes += 1
            done = self.engine.submit(
                InfillRequest(key=key + "/probe", probe=cand.probe, max_tokens=budget, stop=("\n",), speculate=0, **doc)
            ).result(timeout=600)
            if done.finish_reason == "error":
                raise RuntimeError(done.error or "engine error")
            if probe.accepts(done.text, tc):
                chosen = probe.as_edit(cand, tc)
                break
        self.latencies_ms.append((time.perf_counter() - t0) * 1000)
        self.engine.forget_document(key)
        return chosen


def textual(text: str, change: Change | None) -> NextEdit | None:
    """The issue's baseline: the last edit again at the next textual occurrence of what it replaced."""
    word = widened(text, change) if change is not None else None
    if word is None:
        return None
    left, right, old, new = word
    if not old.strip() or old == new:
        return None
    pattern = re.compile(rf"(?<!\w){re.escape(old)}(?!\w)" if re.match(r"\w", old[0]) and re.match(r"\w", old[-1]) else re.escape(old))
    below = pattern.search(text, right)
    if below is not None:
        return NextEdit(below.start(), below.end(), new, "textual (below)")
    above = [m for m in pattern.finditer(text, 0, left)]
    if above:
        return NextEdit(above[-1].start(), above[-1].end(), new, "textual (above)")
    return None


__all__ = ["ModelProposer", "WINDOW", "textual"]
