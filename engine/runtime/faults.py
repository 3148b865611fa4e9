"""Test-only fault injection for a served engine (`tests/lsp/test_engine_faults.py`).

`EFIM_FAULT`, read here only (`install_from_env`, once when a `LocalEngine` starts), names
faults, comma-separated. Each fires once, for the first request whose key (the document
URI) contains "fault", so the server's warm-up request and other documents are unaffected:

- `engine-crash`: the engine step that would admit that request raises `InjectedCrash`, a
  `BaseException`, which escapes `Scheduler.run` and kills the engine thread
  (`LocalEngine` reports it and restarts the thread).
- `prefill-oom`: the model forward of that request's prefill raises
  `torch.OutOfMemoryError`, as an allocation failure inside the model would.

Unset (normal use) nothing is patched. Not a user setting: it exists so the tests can
inject these faults into the real `efim serve` process.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    from engine.scheduling.scheduler import Scheduler
    from engine.scheduling.sequence import Sequence

log = logging.getLogger(__name__)

ENV = "EFIM_FAULT"
KINDS = ("engine-crash", "prefill-oom")


class InjectedCrash(BaseException):
    """Raised by the `engine-crash` fault: not an Exception, so no `except Exception` stops it."""


def _targets(seqs: Iterable[Sequence]) -> bool:
    return any("fault" in getattr(s, "key", "") for s in seqs)


def install(scheduler: Scheduler, kinds: list[str]) -> None:
    """Patch `scheduler` with the faults `kinds`."""
    for kind in kinds:
        if kind == "engine-crash":
            _crash_once(scheduler)
        elif kind == "prefill-oom":
            _oom_once(scheduler)
        else:
            log.warning("%s: unknown fault %r ignored (known: %s)", ENV, kind, ", ".join(KINDS))
            continue
        log.warning("%s: fault %r armed (test hook)", ENV, kind)


def install_from_env(scheduler: Scheduler) -> None:
    raw = os.environ.get(ENV, "")
    kinds = [k.strip() for k in raw.split(",") if k.strip()]
    if kinds:
        install(scheduler, kinds)


def _crash_once(scheduler: Scheduler) -> None:
    step = scheduler.step
    fired = False

    def crashing_step() -> None:
        nonlocal fired
        if not fired and _targets(list(scheduler._inbox)):
            fired = True
            raise InjectedCrash(f"injected engine-thread crash ({ENV}=engine-crash)")
        step()

    scheduler.step = crashing_step


def _oom_once(scheduler: Scheduler) -> None:
    import torch

    runner = scheduler.runner
    model = runner.model
    prefill_step, forward = runner.prefill_step, model.forward
    state = {"armed": False, "fired": False}

    def armed_prefill_step(seq: Sequence, *args, **kwargs):
        state["armed"] = not state["fired"] and _targets([seq])
        try:
            return prefill_step(seq, *args, **kwargs)
        finally:
            state["armed"] = False

    def failing_forward(*args, **kwargs):
        if state["armed"]:
            state["armed"], state["fired"] = False, True
            raise torch.OutOfMemoryError(f"out of memory: injected in the model forward ({ENV}=prefill-oom)")
        return forward(*args, **kwargs)

    runner.prefill_step = armed_prefill_step
    model.forward = failing_forward


__all__ = ["InjectedCrash", "install", "install_from_env", "ENV"]
