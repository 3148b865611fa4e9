"""The text side of a request: render, tokenize, fit to the context; stream text back.

`PromptBuilder.build` turns an `InfillRequest` into the token ids the scheduler runs:
the FIM template's segments (`engine.text.templates`), tokenized segment by segment with token
healing (`engine.text.tokenize`), cut to the context by `fit_to_context`, plus the CacheBlend
plan when the request blends (`engine.cacheblend.blend`). `RequestSink` is the `TokenSink` one
request hands the scheduler: it builds the prompt at admission and turns generated ids
into streamed text with stop rules.

Threads: both run on the engine thread only (an unchanged prefix/suffix is a dict lookup
in the segment tokenizer's LRU), so `submit` never waits on tokenization.
"""

from __future__ import annotations

from typing import Callable, Iterable, NamedTuple

import msgspec
import torch

from engine.api import Completion, FinishReason, InfillRequest, RequestStats, StreamEvent
from engine.cacheblend.blend import blend_request
from engine.handle import RequestHandle
from engine.scheduling.sequence import Prompt, Sequence
from engine.text.sampler import FreshLine, StopRules
from engine.text.templates import FimTemplate
from engine.text.tokenize import Encoded, SegmentTokenizer, StreamDecoder, ends_with_blank, whole_indentation


class BuiltPrompt(NamedTuple):
    prompt: Prompt
    healed_bytes: int  # bytes of the prompt's tail that healing removed (the stream re-emits them)
    healed: bytes = b""  # those bytes (a server that constrains by text, not by id, needs them)


class PromptBuilder:
    """Request -> prompt ids, the serving path's one renderer (template + segment tokenizer + healing)."""

    def __init__(self, template: FimTemplate, tokenizer: SegmentTokenizer, *, fragment_trained: bool) -> None:
        self.template = template
        self.tokenizer = tokenizer
        self.fragment_trained = fragment_trained  # healing off by default: the model saw word fragments
        self._fresh_line: FreshLine | None = None

    def end_ids(self, model_eos: Iterable[int]) -> frozenset[int]:
        """Tokens that end a completion: the model's EOS, the template's sentinels and
        stops, and any special token (code never contains one, and a model that emits
        `<|endoftext|>` where its config names `<|im_end|>` as EOS is done too)."""
        return frozenset(model_eos) | self.template.stop_ids | self.tokenizer.vocab.special_ids

    def fresh_line(self, end_ids: Iterable[int]) -> FreshLine:
        """The fresh-line rule's token classes for this tokenizer (computed once, then shared:
        the tensors are only read). `ends`: tokens whose text holds a line break, and
        `end_ids`; `blank`: the other tokens whose text is non-empty whitespace."""
        if self._fresh_line is None:
            table = self.tokenizer.vocab.token_bytes
            ends = torch.tensor([b"\n" in b or b"\r" in b for b in table], dtype=torch.bool)  # [V]
            blank = torch.tensor([bool(b) and not b.strip() and not e for b, e in zip(table, ends.tolist())], dtype=torch.bool)
            ids = torch.tensor([i for i in end_ids if 0 <= i < len(table)], dtype=torch.int64)
            ends[ids] = True
            blank[ids] = False
            self._fresh_line = FreshLine.with_table(ends, blank, table)
        return self._fresh_line

    def encode(self, req: InfillRequest) -> Encoded:
        """The whole prompt, uncut: rendered segments tokenized one by one (healed unless the
        request or a fragment-trained model says otherwise)."""
        heal = req.heal if req.heal is not None else not self.fragment_trained
        whole = (heal and ends_with_blank(req.increment or req.prefix)
                 and whole_indentation(req.prefix + req.increment, req.suffix))
        return self.tokenizer.encode(self.template.render(req), heal=heal, whole_indent=whole)

    def build(self, req: InfillRequest, context_length: int) -> BuiltPrompt:
        """The prompt the scheduler runs, with room left for `req.max_tokens` (at most half
        the context) to be generated."""
        if req.context == "off" and req.chunks:
            req = msgspec.structs.replace(req, chunks=())
        enc = self.encode(req)
        room = context_length - min(max(req.max_tokens, 1), context_length // 2) - 1
        ids = fit_to_context(enc, room)
        healing = enc.healing
        # CacheBlend needs the chunks' rows as rendered: a prompt cut to fit is prefilled normally.
        wants = (req.context == "blend" or req.document_kv) and req.cache and len(ids) == len(enc.ids)
        blend = (
            blend_request(req, enc, self.template, chunks=req.context == "blend", local=req.document_kv) if wants else None
        )
        if healing is None:
            return BuiltPrompt(Prompt(ids, blend=blend), 0)
        progress = healing.progress(self.tokenizer.vocab)
        return BuiltPrompt(Prompt(ids, progress, len(healing.removed_ids), blend=blend), len(healing.removed_bytes),
                           healing.removed_bytes)


# Once fork 0 of a request has ended, an alternative still decoding may generate at most
# this many times fork 0's tokens (plus ALTERNATIVE_SLACK_TOKENS) in all: the answer waits
# for every fork, and a sampled line that never ends must not hold a short greedy one
# back for `max_tokens` steps.
ALTERNATIVE_TOKEN_FACTOR = 2
ALTERNATIVE_SLACK_TOKENS = 4


class RequestSink:
    """The text side of one request (called on the engine thread only). With alternatives
    it is fork 0's sink and the group's: it streams fork 0's text, collects the forks'
    (`ForkSink`) and completes the handle once all have ended."""

    def __init__(
        self,
        prompts: PromptBuilder,
        request: InfillRequest,
        handle: RequestHandle[Sequence],
        *,
        end_ids: frozenset[int],
        on_finished: Callable[[RequestHandle[Sequence], Completion], None],
    ) -> None:
        self.prompts = prompts
        self.request = request
        self.handle = handle
        self.on_finished = on_finished
        self.end_ids = end_ids
        self.rules = self._rules()
        self.decoder: StreamDecoder | None = None
        self.healed_bytes = 0
        self.forks: list[ForkSink] = []
        self.ended: Completion | None = None  # fork 0's completion, while forks still run

    def _rules(self) -> StopRules:
        req = self.request
        return StopRules(end_ids=self.end_ids, stop=req.stop, max_tokens=req.max_tokens, deadline=req.deadline)

    def prepare(self, context_length: int) -> Prompt:
        built = self.prompts.build(self.request, context_length)
        self.healed_bytes = built.healed_bytes
        self.decoder = StreamDecoder(self.prompts.tokenizer.vocab, built.healed_bytes)
        return built.prompt

    def fork(self, index: int) -> ForkSink:
        sink = ForkSink(self, index)
        self.forks.append(sink)
        return sink

    def before_step(self) -> FinishReason | None:
        return self.rules.before_step()

    def on_token(self, token_id: int) -> FinishReason | None:
        text = self.decoder.feed(token_id)
        chk = self.rules.on_token(token_id, text)
        self.handle.push(StreamEvent(kind="token", text=chk.emit))
        return chk.finish

    def on_finish(self, reason: FinishReason, stats: RequestStats, error: str | None) -> None:
        if reason not in ("stop", "error") and self.decoder is not None:
            held = self.rules.finish_text()  # appended to rules.text
            flushed = self.decoder.flush()  # an unfinished UTF-8 character, if any
            if held or flushed:
                self.handle.push(StreamEvent(kind="token", text=held + flushed))
            text = self.rules.text + flushed
        else:
            text = self.rules.text
        self.ended = Completion(text=text, finish_reason=reason, stats=stats, error=error)
        cap = self.rules.tokens * ALTERNATIVE_TOKEN_FACTOR + ALTERNATIVE_SLACK_TOKENS
        for fork in self.forks:
            fork.rules.max_tokens = min(fork.rules.max_tokens, cap)
        self.maybe_complete()

    def maybe_complete(self) -> None:
        """Complete the handle once fork 0 and every fork have ended (exactly once)."""
        if self.ended is None or any(f.result is None for f in self.forks):
            return
        completion, self.ended = self.ended, None
        if self.forks:
            completion = msgspec.structs.replace(
                completion,
                alternatives=tuple(f.result[0] for f in self.forks),
                alternatives_finish=tuple(f.result[1] for f in self.forks),
            )
        self.on_finished(self.handle, completion)
        kind = "error" if completion.finish_reason == "error" else "done"
        self.handle.complete(StreamEvent(kind=kind, completion=completion, error=completion.error))


class ForkSink:
    """The text side of fork `index` >= 1 of a request (alternatives): its own stop rules
    and decoder over the same prompt; it streams nothing and reports its text to the
    request's sink when it ends. Engine thread only."""

    def __init__(self, group: RequestSink, index: int) -> None:
        self.group = group
        self.index = index
        self.rules = group._rules()
        self.decoder = StreamDecoder(group.prompts.tokenizer.vocab, group.healed_bytes)
        self.result: tuple[str, FinishReason] | None = None

    def prepare(self, context_length: int) -> Prompt:
        raise RuntimeError("a fork is never admitted: it starts from its request's prefill")

    def before_step(self) -> FinishReason | None:
        return self.rules.before_step()

    def on_token(self, token_id: int) -> FinishReason | None:
        return self.rules.on_token(token_id, self.decoder.feed(token_id)).finish

    def on_finish(self, reason: FinishReason, stats: RequestStats, error: str | None) -> None:
        if reason not in ("stop", "error"):
            self.rules.finish_text()
            text = self.rules.text + self.decoder.flush()
        else:
            text = self.rules.text if reason == "stop" else ""
        self.result = (text, reason)
        self.group.maybe_complete()

    def fork(self, index: int) -> ForkSink:
        raise RuntimeError("forks do not fork")


def fit_to_context(enc: Encoded, budget: int) -> list[int]:
    """`enc.ids` cut to at most `budget` tokens. Order: context chunks (from the left);
    the suffix from its right down to a quarter of the budget; the prefix from its left;
    the rest of the suffix; the increment from its left. Sentinels are kept.

    Why the suffix's far end goes before the prefix: while the increment grows by a
    token per keystroke, cutting one more suffix token (next to the middle sentinel)
    keeps every prefix token — and its cached KV — in place, whereas cutting the
    prefix's left shifts the whole prompt and invalidates all of it (docs/design.md,
    "Prefix stability")."""
    ids = enc.ids
    budget = max(budget, 1)
    excess = len(ids) - budget
    if excess <= 0:
        return list(ids)
    drop = [False] * len(ids)
    suffix_len = sum(sp.end - sp.start for sp in enc.spans if sp.role == "suffix")
    suffix_floor = min(suffix_len, budget // 4)
    plan = [("chunk", "left", 0), ("suffix", "right", suffix_floor), ("prefix", "left", 0),
            ("suffix", "right", 0), ("increment", "left", 0)]
    for role, side, keep in plan:
        spans = [sp for sp in enc.spans if sp.role == role]
        if side == "right":
            spans.reverse()
        for sp in spans:
            left = [i for i in range(sp.start, sp.end) if not drop[i]]
            kept_total = sum(1 for x in enc.spans if x.role == role for i in range(x.start, x.end) if not drop[i])
            take = min(excess, len(left), max(0, kept_total - keep))
            if take <= 0:
                continue
            for i in (left[:take] if side == "left" else left[len(left) - take :]):
                drop[i] = True
            excess -= take
            if excess <= 0:
                break
        if excess <= 0:
            break
    out = [t for t, d in zip(ids, drop) if not d]
    return out[-budget:] if len(out) > budget else out  # only sentinels left over budget


__all__ = ["PromptBuilder", "BuiltPrompt", "RequestSink", "ForkSink", "fit_to_context"]
