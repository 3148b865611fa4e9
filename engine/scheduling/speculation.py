"""Prompt-lookup speculation: more tokens per decode step without a draft model.

Code repeats itself: an identifier list, a call's arguments, the line the user is typing
through. `NgramIndex` proposes the next tokens of a sequence by finding the last n-gram of
its token history (prompt ids — document window and context chunks — then every generated
token) at an earlier place, and the tokens that followed it there. `speculate_step` feeds
the pending token and the proposal to the model in ONE forward of k+1 rows on the
sequence's own KV, keeps the longest prefix of the proposal that greedy decoding would
have produced, and adds the model's own next token: 1 to k+1 tokens for one pass over the
weights, which on a CPU (decode is memory-bound) costs about one decode step.

Contracts (docs/design.md, "Prompt-lookup speculation"):
- Greedy only: the accepted tokens are exactly those plain greedy decoding of the same
  sequence emits (up to floating-point differences between a k+1-row and a 1-row forward,
  which tests on fp32 models find none of). Sampled sequences never speculate.
- Rollback: rows written for rejected tokens lie beyond `seq.n_valid` and are garbage; the
  sequence's tokens, its row count and everything stored from it (retained KV; the radix
  cache holds prompt rows only) never include them. A sequence that ends inside an
  accepted run keeps exactly the rows plain decoding would have fed.
- Nothing here knows the scheduler's lists: it reports each emitted token through the
  `accept` callback, which says whether the sequence goes on.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, NamedTuple, Sequence as Seq

if TYPE_CHECKING:
    from engine.scheduling.model_runner import ModelRunner
    from engine.scheduling.sequence import Sequence

# N-gram sizes tried, longest first: a longer match predicts better; a match of one token
# is still worth a short draft. Chosen by replaying the default model's greedy single-line
# suggestions at 64 stdlib places through policies (n-gram sizes, draft caps, growth) with a
# verify row costing 3-6 % of a step (measured): 4..1 with 1-token drafts capped at 2
# was within 1 % of the best at both costs (docs/design.md, "Prompt-lookup speculation").
NGRAM_MAX = 4
NGRAM_MIN = 1
ONE_TOKEN_MATCH_DRAFT = 2  # most tokens proposed after a match of a single token


class NgramIndex:
    """The n-grams of a token history -> where their latest occurrence ended.

    `history` grows by `append` (the sequence's tokens, generated ones included);
    `add_source` adds other token runs (the document's previous suggestion) to look up in.
    Each call is O(sizes) dict operations per token; `propose` is O(sizes + k).
    A later occurrence of an n-gram replaces an earlier one: the nearest repetition is
    the best predictor (history tokens appended after a source win over it).

    Contract: `propose` returns only tokens that follow an earlier occurrence of the
    history's last n-gram; an occurrence ending at the history's end is never its own match."""

    def __init__(
        self, tokens: Seq[int] = (), *, n_max: int = NGRAM_MAX, n_min: int = NGRAM_MIN,
        one_token_draft: int = ONE_TOKEN_MATCH_DRAFT,
    ) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= n_min <= n_max, got {n_min}, {n_max}")
        self.sizes = tuple(range(n_max, n_min - 1, -1))
        self.one_token_draft = one_token_draft
        self.history: list[int] = []
        self._sources: list[list[int]] = []
        # key: n-gram tuple -> (run, end): run -1 is the history, >= 0 a source; the
        # n-gram is run[end - n : end] and run[end] exists (its continuation).
        self._where: dict[tuple[int, ...], tuple[int, int]] = {}
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.history)

    def add_source(self, tokens: Seq[int]) -> None:
        """Index another token run for lookups (its own n-grams only, none spanning into
        the history)."""
        run = list(tokens)
        if len(run) < 2:
            return
        idx = len(self._sources)
        self._sources.append(run)
        self._index_run(run, idx, 0)

    def append(self, token: int) -> None:
        """The history grew by `token`: the n-grams ending just before it now have a continuation."""
        h = self.history
        end = len(h)
        h.append(token)
        where = self._where
        for n in self.sizes:
            if n <= end:
                where[tuple(h[end - n : end])] = (-1, end)

    def extend(self, tokens: Seq[int]) -> None:
        """`append` each of `tokens`, in bulk (a 2 K-token prompt: a few ms)."""
        h = self.history
        first = len(h)  # n-grams ending at positions >= first are new
        h.extend(tokens)
        self._index_run(h, -1, first)

    def _index_run(self, run: list[int], idx: int, first: int) -> None:
        """Map the n-grams of `run` that end at positions first..len(run)-1 to (idx, end);
        ascending, so a later occurrence replaces an earlier one."""
        where = self._where
        for n in self.sizes:
            lo = max(first, n)  # an n-gram ends at >= n
            if lo >= len(run):
                continue
            # the n-grams starting at lo-n .. len-n-1, as tuples: zip of n shifted slices
            grams = zip(*(run[lo - n + j : len(run) - n + j] for j in range(n)))
            where.update(zip(grams, ((idx, end) for end in range(lo, len(run)))))

    def propose(self, k: int) -> list[int]:
        """Up to `k` tokens that followed the latest earlier occurrence of the history's
        longest matching tail n-gram (at most `one_token_draft` after a one-token match;
        as many as that when the occurrence is in the history: a copy that reaches the end
        goes on with the tokens it copied); [] when none matches."""
        h = self.history
        if k <= 0:
            return []
        for n in self.sizes:
            if n > len(h):
                continue
            hit = self._where.get(tuple(h[len(h) - n :]))
            if hit is None:
                continue
            if n == 1:
                k = min(k, self.one_token_draft)  # a one-token match predicts little
            run_idx, end = hit
            if run_idx >= 0:
                return self._sources[run_idx][end : end + k]
            # In the history the copy may run into the tail it matched: a period of
            # len(h) - end tokens, repeated (a loop, an indentation run, "====").
            out = h[end : end + k]
            while len(out) < k:
                out.append(out[len(out) - (len(h) - end)])
            return out
        return []


class DraftLength:
    """How many tokens to propose next: grows by 2 after a fully accepted proposal and
    shrinks by 1 after a partly rejected one, within 1..`most` (the heuristic of
    transformers' assisted generation). A rejected token costs a row of the verify
    forward; a row is cheap on a memory-bound CPU but not free."""

    def __init__(self, most: int) -> None:
        self.most = most
        self.now = most

    def update(self, proposed: int, accepted: int) -> None:
        if proposed == 0:
            return
        if accepted == proposed:
            self.now = min(self.most, self.now + 2)
        else:
            self.now = max(1, self.now - 1)


class VerifyCost:
    """Engine-wide: what one more verify row costs, relative to a plain decode step, and
    how often draft tokens are accepted — so a draft is only as long as it pays.

    A row is nearly free where decode reads bf16 weights on several cores (measured on
    the default model, 1 thread: 7 rows 1.11x one row) and dear where the forward is
    compute-bound (fp32, 1 thread: 5 rows 1.82x). With per-token acceptance p (drafts
    modelled as accepted token by token, each with chance p) a draft of d tokens yields
    (1 - p^(d+1)) / (1 - p) tokens for 1 + c*d step costs; `best_length` picks the d that
    maximises that ratio, 0 (plain decoding) when no d beats one token per step. One step
    in `EXPLORE_EVERY` that would not speculate still verifies one token, so the costs
    and the acceptance keep being measured. Engine thread only."""

    WEIGHT = 0.1  # of the newest observation in the running averages
    PRIOR_ROW_COST = 0.05  # c before anything was measured
    EXPLORE_EVERY = 16

    def __init__(self) -> None:
        self.step_s: float | None = None  # a plain one-sequence decode step, seconds
        self.row_cost = self.PRIOR_ROW_COST  # c: (verify seconds / step seconds - 1) / extra rows
        self._accepted = 1.0  # decayed counts of accepted draft tokens and of rejections (prior p = 0.5)
        self._rejected = 1.0
        self._skipped = 0

    @property
    def acceptance(self) -> float:
        return self._accepted / (self._accepted + self._rejected)

    def observe_plain(self, seconds: float) -> None:
        w = self.WEIGHT
        self.step_s = seconds if self.step_s is None else self.step_s + w * (seconds - self.step_s)

    def observe_verify(self, drafted: int, accepted: int, seconds: float) -> None:
        w = self.WEIGHT
        self._accepted = (1 - w) * self._accepted + accepted
        self._rejected = (1 - w) * self._rejected + (accepted < drafted)
        if self.step_s and drafted > 0:
            c = max(0.0, (seconds / self.step_s - 1.0) / drafted)
            self.row_cost += w * (min(c, 2.0) - self.row_cost)

    def best_length(self, most: int) -> int:
        p, c = min(self.acceptance, 0.99), self.row_cost
        best, best_gain = 0, 1.0
        for d in range(1, most + 1):
            gain = (1 - p ** (d + 1)) / (1 - p) / (1 + c * d)
            if gain > best_gain:
                best, best_gain = d, gain
        if best == 0 and most > 0:
            self._skipped += 1
            if self._skipped % self.EXPLORE_EVERY == 0:
                return 1
        return best


class Speculation:
    """One greedy sequence's speculation state: its n-gram index and draft length.
    Engine thread only."""

    def __init__(self, most: int, extra: Seq[int] = ()) -> None:
        self.index = NgramIndex(n_max=NGRAM_MAX, n_min=NGRAM_MIN, one_token_draft=ONE_TOKEN_MATCH_DRAFT)
        self.index.add_source(extra)  # first: the sequence's own history wins over it
        self.length = DraftLength(most)

    def sync(self, tokens: Seq[int], pending: int) -> None:
        """Bring the history up to `tokens + [pending]` (tokens only ever grow)."""
        index = self.index
        for t in tokens[len(index.history) :]:
            index.append(t)
        if len(index.history) == len(tokens):
            index.append(pending)

    def propose(self, room: int) -> list[int]:
        """At most `room` tokens (and the draft length) to verify next."""
        return self.index.propose(min(room, self.length.now))


def draft_for(seq: Sequence, cost: VerifyCost | None = None) -> list[int]:
    """The draft to verify at `seq`'s next decode step ([] = decode plainly): at most
    `seq.speculate` tokens (and what `cost` says pays), fewer than the tokens it may
    still generate (the model adds one of its own) and fitting its KV. Builds the
    sequence's index at its first call (O(prompt tokens)), then adds the tokens fed since
    the last call."""
    room = min(seq.kv.capacity - seq.n_valid - 1, seq.max_tokens - seq.generated - 1)
    if room > 0 and cost is not None:
        room = min(room, cost.best_length(seq.speculate))
    if room <= 0 or seq.pending is None:
        return []
    spec = seq.speculation
    if spec is None:
        spec = seq.speculation = Speculation(seq.speculate, seq.lookup_extra)
        seq.lookup_extra = []
    spec.sync(seq.tokens, seq.pending)
    return spec.propose(room)


class StepResult(NamedTuple):
    proposed: int  # draft tokens verified
    accepted: int  # of them, those greedy decoding agreed with
    emitted: int  # tokens handed to `accept` (accepted + the model's own, fewer when it ended)


def greedy_accept(draft: Seq[int], picks: Seq[int]) -> int:
    """Length of the longest prefix of `draft` that greedy decoding reproduces: draft[i]
    stands iff picks[i] (the model's argmax after the pending token and draft[:i]) is it."""
    a = 0
    for d, p in zip(draft, picks):
        if d != p:
            break
        a += 1
    return a


def speculate_step(
    runner: ModelRunner, seq: Sequence, draft: list[int], accept: Callable[[Sequence, int], bool],
    cost: VerifyCost | None = None,
) -> StepResult:
    """One verify step of `seq` (greedy, `seq.pending` set, room for len(draft)+1 rows):
    feed `[pending] + draft` in one forward, count the step in `seq`'s figures, then hand
    the accepted drafts and the model's next token to `accept(seq, token)` one by one
    until it returns False (the sequence ended). `seq.tokens` / `seq.n_valid` advance exactly as that many plain
    decode steps would have advanced them; rows of rejected tokens are left beyond
    `n_valid`. When the forward raises, nothing has advanced."""
    t0 = time.perf_counter()
    logits = runner.verify(seq, draft)  # [k+1, V]
    picks = logits.argmax(dim=-1).tolist()  # picks[i]: greedy token after pending + draft[:i]
    a = greedy_accept(draft, picks)
    if cost is not None:
        cost.observe_verify(len(draft), a, time.perf_counter() - t0)
    # Counted before any token goes out: the token that ends the sequence reports its stats.
    seq.decode_steps += 1
    seq.verify_steps += 1
    seq.draft_tokens += len(draft)
    seq.accepted_tokens += a  # verified, even those after a token that ends the sequence
    if seq.speculation is not None:
        seq.speculation.length.update(len(draft), a)
    runner.feed_pending(seq)  # the pending token's row is valid
    emitted = 0
    for i, token in enumerate([*draft[:a], picks[a]]):
        emitted += 1
        if not accept(seq, token):
            break  # ended on `token`: like plain decoding, it is never fed
        if i < a:
            runner.feed_pending(seq)  # an accepted draft: its row was computed on the right prefix
    return StepResult(len(draft), a, emitted)


__all__ = [
    "NgramIndex", "DraftLength", "VerifyCost", "Speculation", "StepResult", "draft_for", "greedy_accept", "speculate_step",
    "NGRAM_MAX", "NGRAM_MIN", "ONE_TOKEN_MATCH_DRAFT",
]
