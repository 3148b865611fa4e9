"""Next-token choice and stop rules.

- `Sampler`: greedy (argmax) by default; temperature + top-p (nucleus) with a seeded
  `torch.Generator` so a seeded request is reproducible. An optional `allowed` id set
  restricts the choice (token healing, while the healed text is spelled out). A
  `FreshLine` mask makes it refuse to end an answer that is still whitespace-only (the
  fresh-line rule, below).
- `StopRules`: EOS / template end tokens, max tokens, deadline, and stop strings.
  Stop strings may span token boundaries; text that could still become a stop string
  is held back, so streamed text never contains any part of a stop string.
"""

from __future__ import annotations

import time
from typing import NamedTuple, Sequence

import torch

from engine.api import DEFAULT_FRESH_LINE_GUARD, FinishReason


class FreshLine(NamedTuple):
    """Per-vocabulary token classes of the fresh-line rule, built once per tokenizer by the
    text layer (`engine.prompting.PromptBuilder.fresh_line`).

    The rule: on an empty cursor line inside a block that goes on, an answer that ends
    while it is still whitespace-only shows nothing, so while the generated text is
    whitespace-only the sampler refuses the tokens that would end it."""

    ends: torch.Tensor  # [V] bool: a line break in the token's text, or an end token
    blank: torch.Tensor  # [V] bool: whitespace only, no line break (the answer stays blank)
    # Every token's bytes: under token healing a token's classes are judged on what it adds
    # after the healed text (`healed`), not on its whole text.
    token_bytes: Sequence[bytes] = ()
    # Per token, from `token_bytes` (`with_table`): the index of the last line-break byte
    # and of the last non-whitespace byte, -1 where none ([V] int32 each): `healed` is then
    # two comparisons instead of a loop over ~32k tokens (a healed " ").
    last_break: torch.Tensor | None = None
    last_text: torch.Tensor | None = None

    @classmethod
    def with_table(cls, ends: torch.Tensor, blank: torch.Tensor, table: Sequence[bytes]) -> "FreshLine":
        """The classes with every token's bytes and the positions `healed` reads."""
        return cls(ends, blank, table, *_text_positions(table))

    def healed(self, allowed: torch.Tensor, rest: bytes | None = None) -> "FreshLine":
        """The classes of token healing's set `allowed` ([n] ids) while `rest` (the healed
        text not spelled out yet) is pending: a token is judged on the bytes it adds after
        `rest` — "\n        " after a healed "\n" is blank, "\n\n" ends the line — and one
        that spells only a first part of `rest` adds nothing and keeps the answer blank.
        `rest` None: the shortest token of `allowed` (single-token healing's dropped token)."""
        table = self.token_bytes
        head = min(len(table[i]) for i in allowed.tolist()) if rest is None else len(rest)
        if self.last_break is not None and self.last_text is not None:
            index = allowed.to(self.last_break.device)
            last_break, last_text = self.last_break.index_select(0, index), self.last_text.index_select(0, index)
        else:  # built without `with_table`: the positions of these tokens only
            last_break, last_text = _text_positions([table[i] for i in allowed.tolist()])
        ends = last_break >= head  # [n]: a line break among the bytes after `rest`
        blank = (last_text < head) & ~ends  # [n]: only whitespace after `rest`
        return FreshLine(ends, blank)

    def sized(self, n: int) -> "FreshLine":
        """The masks for a logits row of `n` entries (a model's head may be padded past the
        tokenizer: those ids are neither)."""
        if self.ends.shape[0] == n:
            return self
        if self.ends.shape[0] > n:
            return self._replace(ends=self.ends[:n], blank=self.blank[:n])
        pad = torch.zeros(n - self.ends.shape[0], dtype=torch.bool)
        return self._replace(ends=torch.cat([self.ends, pad]), blank=torch.cat([self.blank, pad]))


def _text_positions(table: Sequence[bytes]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token: the index of its last line-break byte and of its last non-whitespace byte,
    -1 where none ([n] int32 each)."""
    last_break = torch.tensor([max(b.rfind(b"\n"), b.rfind(b"\r")) for b in table], dtype=torch.int32)
    last_text = torch.tensor([len(b.rstrip()) - 1 for b in table], dtype=torch.int32)
    return last_break, last_text


class Sampler:
    """Chooses one token from a logits row. Not thread-safe (one per request).

    With `fresh_line`, the first tokens are chosen under the fresh-line rule (`FreshLine`):
    tokens in `ends` are refused while every token so far was `blank`; the first other
    token lifts the rule for good. The guard: along the path taken, the model's own
    probability of a blank answer (sum over constrained steps of P(path so far) x P(an
    `ends` token), softmax at temperature 1) is accumulated; once it reaches `guard` the
    rule is lifted and the model chooses freely (a line the model is that sure is blank
    stays blank). While the rule is on, `greedy` is False, so the scheduler's batched
    argmax and prompt-lookup speculation (both greedy-only) send the sequence through
    `sample`; afterwards a greedy sampler is greedy again."""

    def __init__(
        self,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        *,
        fresh_line: FreshLine | None = None,
        guard: float = DEFAULT_FRESH_LINE_GUARD,
    ) -> None:
        if temperature < 0 or not (0.0 < top_p <= 1.0):
            raise ValueError(f"temperature must be >= 0 and top_p in (0, 1]; got {temperature}, {top_p}")
        if not 0.0 < guard <= 1.0:
            raise ValueError(f"the fresh-line guard must be in (0, 1]; got {guard}")
        self.temperature = temperature
        self.top_p = top_p
        self._greedy = temperature == 0.0
        self._gen: torch.Generator | None = None
        if not self._greedy:
            self._gen = torch.Generator()
            self._gen.manual_seed(seed if seed is not None else torch.seed() & 0x7FFF_FFFF)
        self._fresh = fresh_line  # None once lifted
        self.guard = guard
        self.blank_p = 0.0  # the model's probability of a blank answer, along the path taken
        self._path_p = 1.0  # probability of the whitespace-only path taken so far
        self.fresh_line_applied = False  # the rule refused the model's top choice at least once

    @property
    def greedy(self) -> bool:
        """Argmax of the raw logits is this sampler's choice (false while the fresh-line rule is on)."""
        return self._greedy and self._fresh is None

    @property
    def constrained(self) -> bool:
        """The fresh-line rule is still on (the answer is whitespace-only so far)."""
        return self._fresh is not None

    def sample(self, logits: torch.Tensor, allowed: torch.Tensor | None = None, *, healed: bytes | None = None) -> int:
        """`logits`: [V] float. `allowed`: [n] int64 ids (None = any). `healed`: with
        `allowed` from token healing, the healed text still to spell out (the fresh-line
        rule judges tokens on what they add after it). Returns a token id."""
        if self._fresh is not None:
            return self._sample_fresh(logits, allowed, healed)
        if allowed is not None:
            sub = logits.index_select(0, allowed)  # [n]
            return int(allowed[self._choose(sub)])
        return int(self._choose(logits))

    def _sample_fresh(self, logits: torch.Tensor, allowed: torch.Tensor | None, healed: bytes | None) -> int:
        masks = self._fresh.sized(logits.shape[0])
        if masks.ends.device != logits.device:  # a model on an accelerator: the masks follow, once
            masks = masks._replace(ends=masks.ends.to(logits.device), blank=masks.blank.to(logits.device))
        self._fresh = masks
        ends, blank = masks.ends, masks.blank  # [V] bool each
        if allowed is not None:  # token healing's set: the rule works inside it
            index = allowed.to(logits.device)
            logits = logits.index_select(0, index)  # [n]
            if masks.token_bytes:  # judged on what each token adds after the healed bytes
                first = masks.healed(allowed, healed)
                ends, blank = first.ends.to(logits.device), first.blank.to(logits.device)
            else:
                ends, blank = ends.index_select(0, index), blank.index_select(0, index)
        probs = torch.softmax(logits.float(), dim=-1)  # [n]: the model's own distribution
        self.blank_p += self._path_p * float(probs[ends].sum())
        if self.blank_p >= self.guard or bool(ends.all()):
            self._fresh = None  # sure enough of a blank line (or nothing else allowed)
            pick = self._choose(logits)
        else:
            pick = self._choose(logits.masked_fill(ends, float("-inf")))
            self.fresh_line_applied |= bool(ends[int(torch.argmax(logits))])  # the top choice was refused
            self._path_p *= float(probs[pick])
            if not bool(blank[pick]):
                self._fresh = None  # the answer has text: the rule is done
        return int(allowed[pick]) if allowed is not None else int(pick)

    def _choose(self, logits: torch.Tensor) -> int:  # logits [n]
        if self._greedy:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits.float() / self.temperature, dim=-1)  # [n]
        if self.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)  # [n], [n]
            cum = torch.cumsum(sorted_p, dim=-1)
            # Keep the smallest head whose mass reaches top_p (always at least one token).
            keep = (cum - sorted_p) < self.top_p
            sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
            pick = torch.multinomial(sorted_p, 1, generator=self._gen)
            return int(order[pick])
        return int(torch.multinomial(probs, 1, generator=self._gen))


def greedy_batch(logits: torch.Tensor) -> list[int]:
    """Argmax of each row of `logits` [B, V] in one op."""
    return logits.argmax(dim=-1).tolist()


class StopCheck(NamedTuple):
    emit: str  # text that may be streamed now
    finish: FinishReason | None  # set when generation must end after this token


class StopRules:
    """Decides when a completion ends; tracks the text released so far.

    `on_token(id, text)` is called with each generated token and its decoded text;
    the caller streams `emit` and stops when `finish` is set. `finish_text()` returns
    everything still held back at a non-stop-string end."""

    def __init__(
        self,
        *,
        end_ids: Sequence[int],
        stop: Sequence[str] = (),
        max_tokens: int = 64,
        deadline: float | None = None,
    ) -> None:
        self.end_ids = frozenset(int(i) for i in end_ids)
        self.stop = tuple(s for s in stop if s)
        self.max_tokens = max(0, int(max_tokens))
        self.deadline = deadline
        self.tokens = 0
        self.text = ""  # released text
        self._held = ""  # generated but not yet released (could start a stop string)
        self._hold = max((len(s) for s in self.stop), default=0)

    def before_step(self) -> FinishReason | None:
        """Checked before computing another token: "length" or "deadline" or None."""
        if self.tokens >= self.max_tokens:
            return "length"
        if self.deadline is not None and time.monotonic() >= self.deadline:
            return "deadline"
        return None

    def on_token(self, token_id: int, text: str) -> StopCheck:
        self.tokens += 1
        if token_id in self.end_ids:
            return StopCheck(self._release_all(), "eos")
        pending = self._held + text
        if self.stop:
            # The earliest match of any stop string; text before it is final.
            hits = [i for i in (pending.find(s) for s in self.stop) if i >= 0]
            if hits:
                cut = min(hits)
                self._held = ""
                self.text += pending[:cut]
                return StopCheck(pending[:cut], "stop")
            keep = self._partial_tail(pending)
        else:
            keep = 0
        emit = pending[: len(pending) - keep]
        self._held = pending[len(pending) - keep :]
        self.text += emit
        finish: FinishReason | None = "length" if self.tokens >= self.max_tokens else None
        if finish:
            emit += self._release_all()
        return StopCheck(emit, finish)

    def _partial_tail(self, pending: str) -> int:
        """Length of the longest suffix of `pending` that is a proper prefix of a stop string."""
        for n in range(min(self._hold - 1, len(pending)), 0, -1):
            tail = pending[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0

    def _release_all(self) -> str:
        out, self._held = self._held, ""
        self.text += out
        return out

    def finish_text(self) -> str:
        """Release held-back text at an end that was not a stop string."""
        return self._release_all()


__all__ = ["Sampler", "FreshLine", "StopRules", "StopCheck", "greedy_batch"]
