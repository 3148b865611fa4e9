"""Telling the server about engine faults, including those found before anyone listened.

An engine that runs work on a thread or connection of its own (`engine.remote.RemoteEngine`,
`engine.daemon.DaemonEngine`) finds faults on its own schedule, sometimes while it is being
built, before the server has set `on_fault`. `FaultReporting` keeps those and tells them
when the callback is set; a callback that raises is logged, never passed on.
"""

from __future__ import annotations

import logging
from typing import Callable

log = logging.getLogger(__name__)

FaultCallback = Callable[[str, str], None]  # (kind, message)


class FaultReporting:
    """Mixin: the `on_fault` property and `_report(kind, message)`; call `__init__` first."""

    def __init__(self) -> None:
        self._on_fault: FaultCallback | None = None
        self._pending_faults: list[tuple[str, str]] = []

    @property
    def on_fault(self) -> FaultCallback | None:
        return self._on_fault

    @on_fault.setter
    def on_fault(self, callback: FaultCallback | None) -> None:
        """Faults found before anyone listened are told on setting it."""
        self._on_fault = callback
        pending, self._pending_faults = self._pending_faults, []
        for kind, message in pending:
            self._report(kind, message)

    def _report(self, kind: str, message: str) -> None:
        callback = self._on_fault
        if callback is None:
            self._pending_faults.append((kind, message))
            return
        try:
            callback(kind, message)
        except Exception:
            log.exception("reporting an engine fault (%s) failed", kind)


__all__ = ["FaultCallback", "FaultReporting"]
