"""The text side of a request: render, tokenize, fit to the context; stream text back.

`PromptBuilder.build` turns an `InfillRequest` into the token ids the scheduler runs:
the FIM template's segments (`engine.templates`), tokenized segment by segment with token
healing (`engine.tokenize`), cut to the context by `fit_to_context`, plus the CacheBlend
plan when the request blends (`engine.blend`). `RequestSink` is the `TokenSink` one
request hands the scheduler: it builds the prompt at admission and turns generated ids
into streamed text with stop rules.

Threads: both run on the engine thread only (an unchanged prefix/suffix is a dict lookup
in the segment tokenizer's LRU), so `submit` never waits on tokenization.
"""

from __future__ import annotations

from typing import Callable, Iterable, NamedTuple

import msgspec

from engine.api import Completion, FinishReason, InfillRequest, RequestStats, StreamEvent
from engine.blend import blend_request
from engine.handle import LocalHandle
from engine.sampler import StopRules
from engine.sequence import Prompt
from engine.templates import FimTemplate
from engine.tokenize import Encoded, SegmentTokenizer, StreamDecoder


class BuiltPrompt(NamedTuple):
    prompt: Prompt
    healed_bytes: int  # bytes of the prompt's tail that healing removed (the stream re-emits them)


class PromptBuilder:
    """Request -> prompt ids, the serving path's one renderer (template + segment tokenizer + healing)."""

    def __init__(self, template: FimTemplate, tokenizer: SegmentTokenizer, *, fragment_trained: bool) -> None:
        self.template = template
        self.tokenizer = tokenizer
        self.fragment_trained = fragment_trained  # healing off by default: the model saw word fragments

    def end_ids(self, model_eos: Iterable[int]) -> frozenset[int]:
        """Tokens that end a completion: the model's EOS, the template's sentinels and
        stops, and any special token (code never contains one, and a model that emits
        `<|endoftext|>` where its config names `<|im_end|>` as EOS is done too)."""
        return frozenset(model_eos) | self.template.stop_ids | self.tokenizer.vocab.special_ids

    def encode(self, req: InfillRequest) -> Encoded:
        """The whole prompt, uncut: rendered segments tokenized one by one (healed unless the
        request or a fragment-trained model says otherwise)."""
        heal = req.heal if req.heal is not None else not self.fragment_trained
        return self.tokenizer.encode(self.template.render(req), heal=heal)

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
        return BuiltPrompt(Prompt(ids, healing.allowed_ids, 1, blend=blend), len(healing.removed_bytes))


class RequestSink:
    """The text side of one request (called on the engine thread only)."""

    def __init__(
        self,
        prompts: PromptBuilder,
        request: InfillRequest,
        handle: LocalHandle,
        *,
        end_ids: frozenset[int],
        on_finished: Callable[[LocalHandle, Completion], None],
    ) -> None:
        self.prompts = prompts
        self.request = request
        self.handle = handle
        self.on_finished = on_finished
        self.rules = StopRules(end_ids=end_ids, stop=request.stop, max_tokens=request.max_tokens, deadline=request.deadline)
        self.decoder: StreamDecoder | None = None

    def prepare(self, context_length: int) -> Prompt:
        built = self.prompts.build(self.request, context_length)
        self.decoder = StreamDecoder(self.prompts.tokenizer.vocab, built.healed_bytes)
        return built.prompt

    def before_step(self) -> FinishReason | None:
        return self.rules.before_step()

    def on_token(self, token_id: int) -> FinishReason | None:
        text = self.decoder.feed(token_id)
        chk = self.rules.on_token(token_id, text)
        self.handle._push(StreamEvent(kind="token", text=chk.emit))
        return chk.finish

    def on_finish(self, reason: FinishReason, stats: RequestStats, error: str | None) -> None:
        if reason not in ("stop", "error") and self.decoder is not None:
            held = self.rules.finish_text()  # appended to rules.text
            flushed = self.decoder.flush()  # an unfinished UTF-8 character, if any
            if held or flushed:
                self.handle._push(StreamEvent(kind="token", text=held + flushed))
            text = self.rules.text + flushed
        else:
            text = self.rules.text
        completion = Completion(text=text, finish_reason=reason, stats=stats, error=error)
        self.on_finished(self.handle, completion)
        kind = "error" if reason == "error" else "done"
        self.handle._complete(StreamEvent(kind=kind, completion=completion, error=error))


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


__all__ = ["PromptBuilder", "BuiltPrompt", "RequestSink", "fit_to_context"]
