"""What the scheduler tests share: a sink that records what the scheduler tells it, and a
scheduler, a sequence and a prompt made small (tests/engine/test_scheduler*.py)."""

from __future__ import annotations

import torch

from engine.kv.radix import RadixCache
from engine.scheduling.scheduler import Scheduler
from engine.scheduling.sequence import Prompt, Sequence
from engine.text.sampler import Sampler


class Sink:
    """Records what the scheduler tells it; max_tokens via before_step."""

    def __init__(self, ids, max_tokens=4, end_ids=()):
        self.ids, self.max_tokens, self.end_ids = list(ids), max_tokens, set(end_ids)
        self.tokens, self.finished = [], None

    def prepare(self, context_length):
        return Prompt(self.ids)

    def before_step(self):
        return "length" if len(self.tokens) >= self.max_tokens else None

    def on_token(self, t):
        self.tokens.append(t)
        if t in self.end_ids:
            return "eos"
        return "length" if len(self.tokens) >= self.max_tokens else None

    def on_finish(self, reason, stats, error):
        assert self.finished is None, "finished twice"
        self.finished = (reason, stats, error)


def make(model, step=32, slots=4000):
    c = model.config
    cache = RadixCache(n_layers=c.n_layers, n_kv_heads=c.n_kv_heads, head_dim=c.head_dim, dtype=torch.float32,
                       budget_bytes=slots * 2 * c.n_layers * c.n_kv_heads * c.head_dim * 4)
    return Scheduler(model, cache, step_tokens=step, check_integrity=True)


def job(sink, key="k", cache=True, rid=[0]):
    rid[0] += 1
    return Sequence(request_id=rid[0], key=key, sink=sink, sampler=Sampler(), max_tokens=sink.max_tokens, cache=cache)


def drain(s: Scheduler, limit=1000):
    for _ in range(limit):
        if s.idle():
            return
        s.step()
    raise AssertionError("scheduler did not finish")


def prompt(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 1000, (n,), generator=g).tolist()
