"""What the completer keeps per open document: its edit session, the request it waits
for, the typed-through suggestion and the background warm-ups (`efim_lsp.warm_ahead`)."""

from __future__ import annotations

import asyncio

from efim_lsp.first_window import ComputedPrompts, SmallWindow
from efim_lsp.session import EditSession
from efim_lsp.typing_through import TypingThrough
from efim_lsp.window import TokenMeter
from engine.api import CompletionHandle


class PendingRequest:
    """The engine request a document is waiting for."""

    __slots__ = ("version", "handle", "superseded", "ahead")

    def __init__(self, version: int, *, ahead: bool = False):
        self.version = version
        self.ahead = ahead  # an answer computed ahead of any request (efim_lsp.answer_ahead)
        self.handle: CompletionHandle | None = None
        self.superseded: str | None = None

    def supersede(self, reason: str) -> None:
        if self.superseded is None:
            self.superseded = reason
        if self.handle is not None:
            self.handle.cancel()


# Finish reasons of a request whose prompt was not computed to its end.
UNFINISHED = frozenset({"cancelled", "deadline", "error"})


class DocumentState:
    def __init__(self, meter: TokenMeter):
        self.session = EditSession(meter)
        self.typed = TypingThrough()
        self.pending: PendingRequest | None = None
        self.warming: CompletionHandle | None = None  # the background warm-up in flight
        self.warming_small: CompletionHandle | None = None  # its small window's, submitted first
        self.warm_cursor: int | None = None  # where the latest cursor signal put the user
        self.warm_timer: asyncio.TimerHandle | None = None
        # The cursor of the last request that ran to its end (its KV is the engine's latest
        # for this document); None once a request was cancelled or superseded.
        self.served_at: int | None = None
        # First answers at a new place (efim_lsp.first_window): the session the warm-up in
        # flight computes, the prompts computed to their end, the session's small window.
        self.warming_session: int | None = None
        self.warming_prompt: str | None = None  # the prompt the warm-up in flight computes
        self.computed = ComputedPrompts()
        self.small: SmallWindow | None = None
        self.ahead = None  # the answer ahead computed (or being computed) here (efim_lsp.answer_ahead.Ahead)

    def stop_warming(self) -> None:
        if self.warm_timer is not None:
            self.warm_timer.cancel()
            self.warm_timer = None
        for handle in (self.warming, self.warming_small):
            if handle is not None and not handle.done:
                handle.cancel()
        self.warming = self.warming_small = None
        self.warming_session = self.warming_prompt = None


__all__ = ["DocumentState", "PendingRequest", "UNFINISHED"]
