"""One request as the engine thread sees it: a token sequence that grows from its prompt.

A `Sequence` is created on the caller's thread (`LocalEngine.submit`) with what the
request asked for; from admission on, only the engine thread reads or writes it — except
`cancelled`, which any thread may set (the scheduler checks it between steps).

Everything about text (template, tokenization, detokenization, stop strings) sits behind
the sequence's `TokenSink`; the scheduler and the model runner see token ids only
(`engine.prompting` implements the sink).

Row invariant: `kv` rows `0 .. n_valid-1` hold `tokens[:n_valid]`; `tokens[:n_prompt]` is
the prompt, the rest are generated tokens already fed to the model. `pending` is the last
sampled token, not yet fed (it becomes `tokens[n_valid]` after the next decode step).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, TYPE_CHECKING

from engine.api import FinishReason, RequestStats
from engine.kv.radix import RadixNode
from engine.text.sampler import Sampler
from engine.text.tokenize import HealingProgress

if TYPE_CHECKING:
    from engine.model.sequence_kv import KV


class Prompt(NamedTuple):
    ids: list[int]
    healing: HealingProgress | None = None  # token healing: the dropped text generation spells out first
    healed_tokens: int = 0
    blend: Any = None  # engine.cacheblend.blend.BlendRequest: prefill the chunks by CacheBlend (context="blend")


class TokenSink(Protocol):
    """What the scheduler needs from the text layer. All calls come from the engine thread."""

    def prepare(self, context_length: int) -> Prompt: ...

    def before_step(self) -> FinishReason | None: ...

    def on_token(self, token_id: int) -> FinishReason | None: ...

    def on_finish(self, reason: FinishReason, stats: RequestStats, error: str | None) -> None: ...

    def fork(self, index: int) -> "TokenSink":
        """The sink of fork `index` (>= 1) of this request, forked after its prefill; called
        only for sequences with `fork_samplers`. The request's terminal event waits for
        every fork's `on_finish`."""
        ...


@dataclass(eq=False)  # identity equality: the scheduler finds a sequence in its lists by `is`
class Sequence:
    request_id: int
    key: str  # the document: a newer request with the same key reuses this one's rows
    sink: TokenSink
    sampler: Sampler
    max_tokens: int
    cache: bool = True  # False: reuse nothing, store nothing (the no-cache baseline)
    background: bool = False  # a warm-up: runs only while no foreground sequence waits or runs
    idle_only: bool = False  # background that gets no slice beside requests (InfillRequest.idle_only)
    deadline: float | None = None  # time.monotonic() after which it ends ("deadline"), its rows kept
    owner: str = ""  # InfillRequest.owner: whose turn it runs in (engine.scheduling.fairness)
    submitted: float = field(default_factory=time.perf_counter)
    cancelled: bool = False  # any thread may set it; honoured before the next prefill / decode step
    # --- engine-thread state
    tokens: list[int] = field(default_factory=list)  # prompt ids, then fed generated ids
    n_prompt: int = 0
    healing: HealingProgress | None = None  # while the healed text is not spelled out yet
    kv: KV | None = None
    n_valid: int = 0  # rows of kv holding tokens[:n_valid]
    pending: int | None = None  # sampled, not yet fed
    pinned: RadixNode | None = None  # the radix path this sequence's reused rows came from
    generated: int = 0
    reused: int = 0
    prefilled: int = 0
    healed: int = 0
    t_admit: float = 0.0
    t_first: float = 0.0
    blend: Any = None  # engine.cacheblend.blend.BlendRequest, while the prompt still has to be blended
    blend_spans: Any = ()  # local segments found in the document's previous sequence (and stored pieces)
    compute_s: float = 0.0  # seconds of model work spent on this sequence (background accounting)
    # A warm-up's prefill step that gave way between layers to a foreground request
    # (engine.model.transformer.LayerPause); it goes on from there at its next step.
    paused: Any = None
    paused_at: float | None = None  # time.perf_counter() when its step last paused
    starved_s: float = 0.0  # seconds it has spent paused, waiting for foreground work
    # Alternatives (InfillRequest.n): one sampler per extra fork, forked after the prefill.
    fork_samplers: tuple[Sampler, ...] = ()
    parent: "Sequence | None" = None  # a fork's request sequence (forks prefill nothing)
    # Prompt-lookup speculation (engine.scheduling.speculation): most draft tokens per step (0: off).
    speculate: int = 0
    lookup_extra: list[int] = field(default_factory=list)  # other tokens to look up in (the previous suggestion)
    speculation: Any = None  # engine.scheduling.speculation.Speculation, built at the first speculative step
    decode_steps: int = 0
    verify_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def may_speculate(self) -> bool:
        """Greedy request decoding on its own (not a fork, not a warm-up, the healed text
        spelled out) with speculation on."""
        return (self.speculate > 0 and self.sampler.greedy and self.healing is None and self.parent is None
                and not self.background)

    def expired(self, now: float) -> bool:
        """Its deadline (`time.monotonic()`) has passed."""
        return self.deadline is not None and now >= self.deadline

    @property
    def cancel_requested(self) -> bool:
        """Cancelled itself, or (a fork) its request was: cancelling a request cancels every fork."""
        return self.cancelled or (self.parent is not None and self.parent.cancelled)

    def start(self, prompt: Prompt) -> None:
        """Take the prompt the sink rendered (admission)."""
        self.tokens = list(prompt.ids)
        self.n_prompt = len(self.tokens)
        self.healing, self.healed = prompt.healing, prompt.healed_tokens

    def stats(self, now: float) -> RequestStats:
        """The request's figures when it ends at `now` (`time.perf_counter()`)."""
        return RequestStats(
            prompt_tokens=self.n_prompt,
            reused_tokens=self.reused,
            prefilled_tokens=self.prefilled,
            generated_tokens=self.generated,
            healed_tokens=self.healed,
            queue_ms=max(0.0, (self.t_admit - self.submitted) * 1e3) if self.t_admit else 0.0,
            ttft_ms=(self.t_first - self.submitted) * 1e3 if self.generated else 0.0,
            total_ms=(now - self.submitted) * 1e3,
            decode_ms_per_token=(now - self.t_first) * 1e3 / (self.generated - 1) if self.generated > 1 else 0.0,
            decode_steps=self.decode_steps,
            verify_steps=self.verify_steps,
            draft_tokens=self.draft_tokens,
            accepted_tokens=self.accepted_tokens,
        )


__all__ = ["Sequence", "Prompt", "TokenSink"]
