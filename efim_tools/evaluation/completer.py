"""Greedy infilling for evaluation: prompt layout as the engine renders it, token healing,
stop rules.

Layouts (each text segment tokenized on its own, as `engine.templates` does):

    prefix : P I                  (models without FIM sentinels)
    fim    : PRE (P+I) SUF S MID  suffix-first (<spm_*>): SUF S PRE (P+I)
    efim   : PRE P SUF S MID I    suffix-first (<spm_*>): SUF S PRE P I

Token healing (`heal=True`, increment not empty): the increment's last token is dropped
and the first generated token must decode to a string that starts with that token's
text — the repair for a model that never saw a word split at a segment boundary.

This runs transformers' forward directly (greedy, KV cache). It is the measuring path
while the product engine (`engine.local`) matures; the prompt layout is the same.
"""

from __future__ import annotations

import functools
from typing import Literal, NamedTuple

import torch

from efim_tools.evaluation.model import EvalModel
from efim_tools.training.fragment import encode_text

Format = Literal["prefix", "fim", "efim"]


class Infill(NamedTuple):
    text: str  # generated continuation of the increment (the increment itself not included)
    prompt_tokens: int
    generated_tokens: int
    healed: bool
    finish: Literal["newline", "eos", "length", "stop"]


class Completer:
    def __init__(self, em: EvalModel, max_prompt_tokens: int = 1536):
        self.em = em
        self.max_prompt_tokens = max_prompt_tokens
        tok = em.tokenizer
        self.eos = {i for i in [tok.token_to_id("<|endoftext|>")] if i is not None}
        if em.fim is not None:
            self.eos |= {em.fim.prefix, em.fim.suffix, em.fim.middle, em.fim.pad}

    @functools.cached_property
    def _token_texts(self) -> list[str]:
        tok = self.em.tokenizer
        return [tok.decode([i], skip_special_tokens=False) for i in range(tok.get_vocab_size())]

    def _allowed_after_heal(self, text: str) -> torch.Tensor:
        ok = [i for i, t in enumerate(self._token_texts) if t.startswith(text) and i not in self.eos]
        return torch.tensor(ok, dtype=torch.long)

    def prompt_ids(self, prefix: str, suffix: str, increment: str, fmt: Format) -> tuple[list[int], list[int]]:
        """(ids before the increment, increment ids); the increment is empty except in
        `efim` and `prefix` layouts (in `fim` it is part of the prefix segment)."""
        tok, fim = self.em.tokenizer, self.em.fim
        if fmt in ("fim", "efim") and fim is None:
            raise ValueError(f"format {fmt!r} needs FIM sentinels; this model has none (use 'prefix' or an adapter)")
        if fmt == "prefix":
            return encode_text(tok, prefix), encode_text(tok, increment)
        if fmt in ("fim", "efim"):
            head = fim.head(encode_text(tok, prefix + increment if fmt == "fim" else prefix), encode_text(tok, suffix))
            return head, encode_text(tok, increment) if fmt == "efim" else []
        raise ValueError(f"unknown format {fmt!r}")

    @torch.inference_mode()
    def complete(self, prefix: str, suffix: str, increment: str, fmt: Format, *, heal: bool = False, max_tokens: int = 48, single_line: bool = True, stop_line=None) -> Infill:
        """Greedy continuation after `increment`. `single_line` stops at the first newline
        after some text (leading blank lines are dropped);
        `stop_line(line) -> bool` (multi-line mode) stops before a finished line it rejects."""
        head, inc_ids = self.prompt_ids(prefix, suffix, increment, fmt)
        healed_text = ""
        if heal and inc_ids:
            healed_text = self.em.tokenizer.decode(inc_ids[-1:], skip_special_tokens=False)
            inc_ids = inc_ids[:-1]
        ids = head + inc_ids
        if len(ids) > self.max_prompt_tokens:  # keep the end: the sentinels and the increment
            ids = ids[-self.max_prompt_tokens :]
        model = self.em.model
        out = model(input_ids=torch.tensor([ids]), use_cache=True)
        cache, logits = out.past_key_values, out.logits[0, -1]  # [V]
        allowed = self._allowed_after_heal(healed_text) if healed_text else None
        generated: list[int] = []
        text, finish = "", "length"
        for step in range(max_tokens):
            if allowed is not None and step == 0 and allowed.numel():
                masked = torch.full_like(logits, float("-inf"))
                masked[allowed] = logits[allowed]
                logits = masked
            next_id = int(torch.argmax(logits))
            if next_id in self.eos:
                finish = "eos"
                break
            generated.append(next_id)
            text = self.em.tokenizer.decode(generated, skip_special_tokens=False)
            body = text[len(healed_text) :] if text.startswith(healed_text) else text
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
        body = text[len(healed_text) :] if text.startswith(healed_text) else text
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
        return Infill(body, len(ids), len(generated), bool(healed_text), finish)


class EngineCompleter:
    """The same `complete` contract through the product engine (`engine.local`): the
    merged model folder is loaded by the engine's loader and the request goes through its
    template detection, per-segment tokenization, healing and stop rules. Differences:
    single-line stops at the first newline even before any text."""

    def __init__(self, model_dir, name: str, threads: int | None = None, dtype: str | None = None):
        from engine.local import load_engine  # noqa: PLC0415

        self.engine = load_engine(str(model_dir), threads=threads, dtype=dtype, fragment_trained=False)
        info = self.engine.info()
        if not info.supports_fim:
            raise ValueError(f"the engine found no FIM template in {model_dir} ({info.template})")
        self.name = name
        self._n = 0

    def complete(self, prefix: str, suffix: str, increment: str, fmt: Format, *, heal: bool = False, max_tokens: int = 48, single_line: bool = True, stop_line=None) -> Infill:
        from engine.api import InfillRequest  # noqa: PLC0415

        self._n += 1
        req = InfillRequest(key=f"eval-{self._n}", prefix=prefix, suffix=suffix, increment=increment, format=fmt, context="off",
                            max_tokens=max_tokens, stop=("\n",) if single_line else (), heal=heal, temperature=0.0)
        done = self.engine.submit(req).result(timeout=600)
        if done.finish_reason == "error":
            raise RuntimeError(done.error or "engine error")
        text = done.text.split("\n", 1)[0] if single_line else done.text
        return Infill(text, done.stats.prompt_tokens, done.stats.generated_tokens, done.stats.healed_tokens > 0, "stop" if done.finish_reason == "stop" else "eos" if done.finish_reason in ("eos",) else "length")

    def close(self) -> None:
        self.engine.close()


__all__ = ["Completer", "EngineCompleter", "Infill", "Format"]
