"""Which completion requests of a trace are the first after a jump, and the pause before them.

A synthesised tour names them in its header (`meta["jumps"]`: one entry per jump, with
the JSON-RPC `id` of that first request, the pause in ms, whether the jump switched
files, and — tours with client styles — the jump's `pattern` and the `key_id` of the
first request after the jump's first edit: the same request, except for a client that
asks at the jump itself, before any edit); any other trace is read from its events: the
first completion request after a cursor notification (`kind == "cursor"`) is a jump's,
its pause is the time from the last cursor notification to the first edit, and it
switched files when that edit is in another document than the edit before it (the
trace's first edit counts as a switch).

The pause is what a server can use: the time between the cursor notification (where the
user is; a tour without notifications keeps the moment it would have been sent) and
the first key press there.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from efim_lsp.trace_format import Trace

PAUSE_SPLIT_MS = 500.0  # "paused" means at least this long before the first key


class JumpMark(NamedTuple):
    pause_ms: float  # from the cursor notification to the first key press
    switch: bool  # the jump changed the active document
    pattern: str | None = None  # what the person did there (`tour.PATTERNS`); None: not said

    @property
    def paused(self) -> bool:
        return self.pause_ms >= PAUSE_SPLIT_MS


def meta_entry(request_id: int, pause_ms: float, switch: bool, **extra: Any) -> dict[str, Any]:
    """One `meta["jumps"]` entry, as `tour.py` writes it."""
    return {"id": request_id, "pause_ms": round(pause_ms, 1), "switch": switch, **extra}


def _listed(trace: Trace) -> list[dict[str, Any]] | None:
    listed = trace.header.meta.get("jumps")
    if not isinstance(listed, list):
        return None
    return [e for e in listed if isinstance(e, dict) and "id" in e]


def jump_marks(trace: Trace) -> dict[int, JumpMark]:
    """Event index (into `trace.events`) of each jump's first completion request → its mark."""
    listed = _listed(trace)
    if listed is not None:
        by_id = {e["id"]: JumpMark(float(e["pause_ms"]), bool(e.get("switch")), e.get("pattern")) for e in listed}
        return {i: by_id[e.id] for i, e in enumerate(trace.events) if e.kind == "complete" and e.id in by_id}
    return derived_marks(trace)


def first_keys(trace: Trace) -> set[int]:
    """Event index of each jump's first completion request after its first edit (for most
    clients the jump's first request itself)."""
    listed = _listed(trace)
    if listed is None:
        return set(derived_marks(trace))
    ids = {e.get("key_id", e["id"]) for e in listed}
    return {i for i, e in enumerate(trace.events) if e.kind == "complete" and e.id in ids}


def stop_patterns(trace: Trace) -> dict[int, str]:
    """Event index of every completion request from the first jump on → the pattern of the
    jump it follows (requests of a jump without a pattern are left out)."""
    out: dict[int, str] = {}
    marks = jump_marks(trace)
    pattern: str | None = None
    for i, event in enumerate(trace.events):
        if event.kind != "complete":
            continue
        if i in marks:
            pattern = marks[i].pattern
        if pattern is not None:
            out[i] = pattern
    return out


def derived_marks(trace: Trace) -> dict[int, JumpMark]:
    marks: dict[int, JumpMark] = {}
    cursor_t: float | None = None  # the last cursor notification not yet followed by an edit
    pending: JumpMark | None = None
    last_uri: str | None = None
    for i, event in enumerate(trace.events):
        if event.kind == "cursor":
            cursor_t = event.t
        elif event.kind == "change":
            if cursor_t is not None:
                pending = JumpMark(event.t - cursor_t, event.uri != last_uri)
                cursor_t = None
            last_uri = event.uri
        elif event.kind == "complete" and pending is not None:
            marks[i] = pending
            pending = None
    return marks
