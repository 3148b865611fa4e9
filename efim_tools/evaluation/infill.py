"""Greedy infilling for evaluation: the prompt as serving builds it, transformers' forward.

The prompt — layout, segment tokenization, token healing — comes from serving's own code
(`engine.prompting.PromptBuilder`: `engine.text.templates` + `engine.text.tokenize`), so what is
measured here is what the engine would run; only the forward pass is transformers'
(greedy, KV cache), which keeps it independent of the engine's model code.

Layouts (each text segment tokenized on its own):

    prefix : P I                  (models without FIM sentinels)
    fim    : PRE (P+I) SUF S MID  suffix-first (<spm_*>): SUF S PRE (P+I)
    efim   : PRE P SUF S MID I    suffix-first (<spm_*>): SUF S PRE P I

Token healing (`heal=True`, the prompt's last text ends inside an identifier): serving's
rule — the last token is dropped and the first generated token must start with its bytes.

The fresh-line rule (`fresh_line=True`; the caller decides when, as the language server
does with `efim_lsp.suggest.fresh_line`): serving's `engine.text.sampler.Sampler` with the
tokenizer's `FreshLine` classes chooses the tokens, so a whitespace-only answer cannot end.
"""

from __future__ import annotations

from typing import Literal, NamedTuple, Protocol

import torch

from engine.api import DEFAULT_FRESH_LINE_GUARD, InfillRequest
from engine.prompting import PromptBuilder
from engine.text.sampler import Sampler
from engine.text.templates import detect_template
from engine.text.tokenize import Encoded, SegmentTokenizer, StreamDecoder

from efim_tools.evaluation.beam import beam_line
from efim_tools.evaluation.model import EvalModel, resolve_adapter

Format = Literal["prefix", "fim", "efim"]


class Infill(NamedTuple):
    text: str  # generated continuation of the increment (the increment itself not included)
    prompt_tokens: int
    generated_tokens: int
    healed: bool
    finish: Literal["newline", "eos", "length", "stop"]


class Infiller(Protocol):
    """What the benchmarks call: `TransformersInfiller` or `EngineInfiller`."""

    name: str

    def complete(self, prefix: str, suffix: str, increment: str, fmt: Format, *, heal: bool = False, max_tokens: int = 48, single_line: bool = True, stop_line=None, fresh_line: bool = False, fresh_line_guard: float = DEFAULT_FRESH_LINE_GUARD) -> Infill: ...


class TransformersInfiller:
    """Greedy infills from a transformers model with serving's prompts (see the module docstring)."""

    def __init__(self, em: EvalModel, max_prompt_tokens: int = 1536, beams: int = 1):
        """`beams` > 1: single lines by beam search of that width (`evaluation.beam`) instead
        of greedy decoding — an experiment; without the fresh-line rule or multi-line stops."""
        if beams < 1:
            raise ValueError(f"beams must be at least 1, not {beams}")
        self.em = em
        self.name = em.name if beams == 1 else f"{em.name} (beam {beams})"
        self.max_prompt_tokens = max_prompt_tokens
        self.beams = beams
        tok = em.tokenizer
        self.prompts = PromptBuilder(detect_template(tok), SegmentTokenizer(tok), fragment_trained=False)
        self.eos = self.prompts.end_ids(i for i in [tok.token_to_id("<|endoftext|>")] if i is not None)

    def prompt(self, prefix: str, suffix: str, increment: str, fmt: Format, *, heal: bool = False) -> Encoded:
        """The whole prompt as the engine renders it (`PromptBuilder.encode`)."""
        if fmt not in ("prefix", "fim", "efim"):
            raise ValueError(f"unknown format {fmt!r}")
        if fmt != "prefix" and not self.prompts.template.supports_fim:
            raise ValueError(f"format {fmt!r} needs FIM sentinels; this model has none (use 'prefix' or an adapter)")
        request = InfillRequest(key="eval", prefix=prefix, suffix=suffix, increment=increment, format=fmt, context="off", heal=heal)
        return self.prompts.encode(request)

    @torch.inference_mode()
    def complete(self, prefix: str, suffix: str, increment: str, fmt: Format, *, heal: bool = False, max_tokens: int = 48, single_line: bool = True, stop_line=None, fresh_line: bool = False, fresh_line_guard: float = DEFAULT_FRESH_LINE_GUARD) -> Infill:
        """Greedy continuation after `increment`. `single_line` stops at the first newline
        after some text (leading blank lines are dropped);
        `stop_line(line) -> bool` (multi-line mode) stops before a finished line it rejects."""
        enc = self.prompt(prefix, suffix, increment, fmt, heal=heal)
        ids = enc.ids
        if len(ids) > self.max_prompt_tokens:  # keep the end: the sentinels and the increment
            ids = ids[-self.max_prompt_tokens :]
        healing = enc.healing
        healed = len(healing.removed_bytes) if healing else 0  # bytes of the prompt the output starts after
        decoder = StreamDecoder(self.prompts.tokenizer.vocab, healed)
        progress = healing.progress(self.prompts.tokenizer.vocab) if healing is not None else None
        model = self.em.model
        if self.beams > 1:
            if not single_line or fresh_line or stop_line is not None:
                raise ValueError("beam search infills single lines only, without the fresh-line rule")
            tokens, text = beam_line(model, ids, self.prompts.tokenizer.vocab, width=self.beams, max_tokens=max_tokens, eos=self.eos,
                                     progress=progress, healed=healed)
            return Infill(text, len(ids), len(tokens), healing is not None, "newline")
        out = model(input_ids=torch.tensor([ids]), use_cache=True)
        cache, logits = out.past_key_values, out.logits[0, -1]  # [V]
        generated: list[int] = []
        body, finish = "", "length"  # body: the text after the increment (healing's bytes skipped)
        fresh = self.prompts.fresh_line(self.eos) if fresh_line else None
        sampler = Sampler(fresh_line=fresh, guard=fresh_line_guard)  # greedy
        for _ in range(max_tokens):
            if progress is None:
                next_id = sampler.sample(logits)
            else:  # the healed text is spelled out first, in tokens of the model's choosing
                next_id = sampler.sample(logits, progress.allowed(), healed=progress.rest)
                progress = progress.after(next_id)
            if next_id in self.eos:
                finish = "eos"
                break
            generated.append(next_id)
            body += decoder.feed(next_id)
            if single_line and "\n" in body.lstrip("\n"):
                finish = "newline"
                break
            if stop_line is not None and "\n" in body:
                lines = body.split("\n")[:-1]
                if any(stop_line(line) for line in lines):
                    finish = "stop"
                    break
            out = model(input_ids=torch.tensor([[next_id]]), past_key_values=cache, use_cache=True)
            cache, logits = out.past_key_values, out.logits[0, -1]  # [V]
        body += decoder.flush()
        if single_line:
            # Leading blank lines are skipped (a prefix-only model often starts with one);
            # the line ends at the first newline after them.
            body = body.lstrip("\n")
            body = body.split("\n", 1)[0]
        if stop_line is not None:
            kept = []
            for line in body.split("\n"):
                if kept and stop_line(line) and finish == "stop":
                    break
                kept.append(line)
            body = "\n".join(kept)
        return Infill(body, len(ids), len(generated), healing is not None, finish)


class EngineInfiller:
    """The same `complete` contract through the product engine (`engine.local`): the
    merged model folder (or, `as_served`, the model as serving loads it) is loaded by the
    engine's loader and the request goes through its template detection, per-segment
    tokenization, healing and stop rules. Differences: single-line stops at the first
    newline even before any text."""

    def __init__(self, model_dir, name: str, threads: int | None = None, dtype: str | None = None, *, engine=None):
        """The local engine on `model_dir`; or, with `engine`, any `engine.api.Engine` (a
        `RemoteEngine` on a llama.cpp server: the serving path's remote side)."""
        if engine is None:
            from engine.local import load_engine  # noqa: PLC0415

            engine = load_engine(str(model_dir), threads=threads, dtype=dtype, fragment_trained=False)
        self.engine = engine
        info = self.engine.info()
        if not info.supports_fim:
            raise ValueError(f"the engine found no FIM template in {model_dir} ({info.template})")
        self.name = name
        self._n = 0

    @classmethod
    def as_served(cls, model_spec: str, adapter: str | None, quant: str, *, threads: int | None = None, dtype: str | None = None, prefill: str | None = None) -> "EngineInfiller":
        """The local engine loaded as `efim serve --quant` loads it (`engine.local.load_engine`
        on `model_spec` itself): the engine's loader merges the adapter — or, for a GGUF's
        kept int4 groups (quant "int4", "mixed", "auto"), computes it beside them — where the
        merged float folder of the constructor would be requantised, losing the file's own
        groups. `adapter` means what it means to this package (`model.resolve_adapter`:
        "auto" is the shipped adapter, ready or not); healing stays the request's `heal`."""
        from engine.local import load_engine  # noqa: PLC0415

        chosen = resolve_adapter(model_spec, adapter)
        engine = load_engine(model_spec, quant=quant, dtype=dtype, threads=threads, adapter=chosen if chosen is not None else "none",
                             fragment_trained=False, prefill=prefill)
        try:
            form = f"quant {quant}" + (f", {prefill} prefill" if prefill else "")
            return cls(model_spec, f"{model_spec}+{adapter} (engine, {form})", engine=engine)
        except BaseException:
            engine.close()
            raise

    def complete(self, prefix: str, suffix: str, increment: str, fmt: Format, *, heal: bool = False, max_tokens: int = 48, single_line: bool = True, stop_line=None, fresh_line: bool = False, fresh_line_guard: float = DEFAULT_FRESH_LINE_GUARD) -> Infill:
        from engine.api import InfillRequest  # noqa: PLC0415

        self._n += 1
        req = InfillRequest(key=f"eval-{self._n}", prefix=prefix, suffix=suffix, increment=increment, format=fmt, context="off",
                            max_tokens=max_tokens, stop=("\n",) if single_line else (), heal=heal, temperature=0.0,
                            fresh_line=fresh_line, fresh_line_guard=fresh_line_guard)
        done = self.engine.submit(req).result(timeout=600)
        if done.finish_reason == "error":
            raise RuntimeError(done.error or "engine error")
        text = done.text.split("\n", 1)[0] if single_line else done.text
        return Infill(text, done.stats.prompt_tokens, done.stats.generated_tokens, done.stats.healed_tokens > 0, "stop" if done.finish_reason == "stop" else "eos" if done.finish_reason in ("eos",) else "length")

    def close(self) -> None:
        self.engine.close()


__all__ = ["Infiller", "TransformersInfiller", "EngineInfiller", "Infill", "Format"]
