"""Synthetic navigation tours: a person moving between functions and files, editing a little at each stop.

A tour opens 2–3 real files at once (an editor restoring its tabs) and makes `visits`
stops. Each stop is a jump — to another function of the same file, or to another file —
then one small edit from `edits.py` (retype a line's tail, add a line, paste, sometimes
undo it). What goes into the trace, as our editor clients send it:

- a file switch: `efim/didMoveCursor` where the cursor was in that file (the document
  became the active one), then, after finding the spot (0.3–0.9 s), the jump;
- a jump: `efim/didMoveCursor` at the landing position, sent `DEBOUNCE_MS` after the
  cursor settled (clients debounce it);
- the pause before the first key, counted from that notification: reading, 0.3–2 s, or,
  for `no_pause_rate` of the jumps, none at all (0–60 ms);
- every key press: one `didChange`, then one completion request at the cursor; keys
  80–250 ms apart.

The first completion request after each jump is listed in `meta["jumps"]` (`jumps.py`
reads it) with its pause. Every document's text after every event is what the planned
edits say (`Tour.expected`); the edits never make a Python file that parsed unparseable,
so later stops still find its functions.
"""

from __future__ import annotations

import ast
import hashlib
import random
from collections import Counter
from pathlib import Path
from typing import NamedTuple

from efim_lsp.trace_format import Event, Header, Trace, utc_now
from efim_tools.trace import edits
from efim_tools.trace.blocks import find_blocks, split_lines
from efim_tools.trace.document import TextDocument
from efim_tools.trace.jumps import meta_entry
from efim_tools.trace.synth import LANGUAGE_IDS, read_sources

READING_MS = (300.0, 2000.0)  # looking at the code after a jump, before typing
NO_PAUSE_MS = (0.0, 60.0)  # typing straight away
DEBOUNCE_MS = 80.0  # clients send the cursor notification this long after the cursor settles
NAVIGATE_MS = (300.0, 900.0)  # from switching to a file to landing on the spot
BETWEEN_MS = (200.0, 1500.0)  # after a stop's last key, before the next jump
ACTION_WEIGHTS = (("retype-tail", 0.45), ("new-line", 0.30), ("paste", 0.25))
MIN_FUNCTIONS = 2  # a file worth touring has functions to jump between
PLAN_TRIES = 8


class TourOptions(NamedTuple):
    seed: int = 0
    sessions: int = 1  # tours, one trace each
    visits: int = 12  # stops per tour
    files: int = 3  # files open in one tour (at most the usable sources)
    same_file_rate: float = 0.5  # chance a jump stays in the current file
    no_pause_rate: float = 0.3  # chance the first key follows a jump at once
    undo_rate: float = 0.3  # chance a new line or a paste is taken back
    settle_ms: float = 0.0  # how long the files were open before the first jump (a person who had them open a while)

    def check(self) -> "TourOptions":
        if self.sessions < 1 or self.visits < 1 or self.files < 1:
            raise ValueError("--sessions, --visits and --files must be at least 1")
        if not 0.0 <= self.settle_ms <= 3_600_000.0:
            raise ValueError(f"--settle must be in [0, 3600] seconds, got {self.settle_ms / 1000:g}")
        for name in ("same_file_rate", "no_pause_rate", "undo_rate"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"--{name.replace('_', '-')} must be in [0, 1], got {getattr(self, name)}")
        return self


class Site(NamedTuple):
    """A line inside a function body: where a jump can land."""

    function: int  # index of the body among the file's functions
    start: int  # offset of the line's first character
    end: int  # offset of its end, before the terminator
    indent: int


class Tour(NamedTuple):
    trace: Trace
    # (event index, uri, sha1 of the document's text after that event), one per change:
    # what the planned edits say the text is, computed on plain strings
    expected: list[tuple[int, str, str]]


def sites(text: str, path: Path) -> list[Site]:
    """Lines of at least 6 non-blank characters inside function bodies of two lines or more."""
    lines = split_lines(text)
    out = []
    for k, block in enumerate(b for b in find_blocks(text, path) if b.lines >= 2):
        first = lines.starts.index(block.start)
        for i in range(first, first + block.lines):
            start, end = lines.starts[i], lines.ends[i]
            content = text[start:end]
            if len(content.strip()) >= 6:
                out.append(Site(k, start, end, len(edits.indentation(content))))
    return out


def load_tour_sources(paths: list[str | Path]) -> list[tuple[Path, str]]:
    """Readable source files with at least `MIN_FUNCTIONS` function bodies to jump between."""
    return [(f, text) for f, text in read_sources(paths) if len({s.function for s in sites(text, f)}) >= MIN_FUNCTIONS]


def _parses(text: str, path: Path) -> bool:
    if path.suffix not in (".py", ".pyi"):
        return True  # no parser at hand: layout alone decides
    try:
        ast.parse(text)
    except (SyntaxError, ValueError):
        return False
    return True


class _Writer:
    """Events of one tour; keeps each document twice — a plain string the edits are
    planned on, and a `TextDocument` that turns them into LSP changes — and checks
    after every step that both agree."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.docs: dict[str, TextDocument] = {}
        self.texts: dict[str, str] = {}
        self.expected: list[tuple[int, str, str]] = []
        self.request_id = 0

    def open(self, uri: str, text: str, language: str) -> None:
        self.docs[uri] = TextDocument(uri, text, version=1)
        self.texts[uri] = text
        item = {"uri": uri, "languageId": language, "version": 1, "text": text}
        self.events.append(Event(t=0.0, kind="open", params={"textDocument": item}))

    def cursor(self, t: float, uri: str, offset: int) -> None:
        position = self.docs[uri].position_at(offset).to_lsp()
        self.events.append(Event(t=round(t, 1), kind="cursor", params={"textDocument": {"uri": uri}, "position": position}))

    def step(self, t: float, uri: str, step: edits.Step) -> int:
        """One key press: its change and its completion request; returns the request's id."""
        doc = self.docs[uri]
        text = self.texts[uri]
        self.texts[uri] = text[: step.start] + step.text + text[step.end :]
        change = doc.edit(step.start, step.end, step.text)
        doc.version += 1
        if doc.text != self.texts[uri]:  # cheap to check, fatal to miss
            raise AssertionError(f"{uri}: the LSP change does not do what the step says")
        t = round(t, 1)
        self.events.append(Event(t=t, kind="change", params={"textDocument": {"uri": uri, "version": doc.version}, "contentChanges": [change]}))
        self.expected.append((len(self.events) - 1, uri, hashlib.sha1(self.texts[uri].encode("utf-8", "surrogatepass")).hexdigest()))
        self.request_id += 1
        self.events.append(
            Event(
                t=round(t + 1.0, 1),
                kind="complete",
                id=self.request_id,
                params={
                    "textDocument": {"uri": uri},
                    "position": doc.position_at(step.cursor).to_lsp(),
                    "context": {"triggerKind": 2},  # Automatic: the editor asked, not the user
                },
            )
        )
        return self.request_id


class _Planner:
    """Chooses stops and plans the edit at each, on the writer's current texts."""

    def __init__(self, writer: _Writer, files: list[tuple[str, Path]], options: TourOptions, rng: random.Random) -> None:
        self.writer = writer
        self.files = files  # (uri, path)
        self.options = options
        self.rng = rng
        self._sites: dict[str, tuple[str, list[Site]]] = {}

    def sites(self, uri: str, path: Path) -> list[Site]:
        """`sites` of the document's current text (found again only after it changed)."""
        text = self.writer.texts[uri]
        cached = self._sites.get(uri)
        if cached is None or cached[0] is not text:
            cached = self._sites[uri] = (text, sites(text, path))
        return cached[1]

    def donor_line(self) -> str | None:
        rng = self.rng
        uri, path = rng.choice(self.files)
        text = self.writer.texts[uri]
        lines = [text[s.start : s.end].strip() for s in self.sites(uri, path)]
        lines = [ln for ln in lines if 6 <= len(ln) <= 60 and ln[-1] not in ":([{,\\" and ln[0] not in ")]}@#\"'"]
        return rng.choice(lines) if lines else None

    def donor_block(self) -> list[str] | None:
        rng = self.rng
        uri, path = rng.choice(self.files)
        text = self.writer.texts[uri]
        found = self.sites(uri, path)
        if not found:
            return None
        first = rng.choice(found)
        lines = split_lines(text)
        i = lines.starts.index(first.start)
        block = [text[first.start : first.end]]
        want = rng.randint(1, 4)
        while i + len(block) < len(lines.starts) and len(block) < 8:
            line = text[lines.starts[i + len(block)] : lines.ends[i + len(block)]]
            deeper = len(edits.indentation(line)) > first.indent
            if not line.strip() or len(edits.indentation(line)) < first.indent or (not deeper and len(block) >= want):
                break
            block.append(line)
        return block

    def plan(self, uri: str, path: Path, candidates: list[Site]) -> edits.Action:
        """An edit at one of `candidates`; a retyped tail when nothing else keeps the file parsing."""
        rng = self.rng
        text = self.writer.texts[uri]
        parsed = _parses(text, path)
        kinds, weights = zip(*ACTION_WEIGHTS)
        kind = rng.choices(kinds, weights)[0]
        for _ in range(PLAN_TRIES if kind != "retype-tail" else 0):
            site = rng.choice(candidates)
            if kind == "new-line":
                donor = self.donor_line()
                action = edits.new_line(text, site.end, donor, rng) if donor else None
            else:
                block = self.donor_block()
                action = edits.paste(text, site.start, block, rng) if block else None
            if action is not None and (not parsed or _parses(action.after, path)):
                return action
        return edits.retype_tail(text, rng.choice(candidates).end, rng)


def tour_trace(sources: list[tuple[Path, str]], options: TourOptions, rng: random.Random, index: int) -> Tour:
    """One tour over `sources` (each (path, text); the first is where it starts)."""
    writer = _Writer()
    files: list[tuple[str, Path]] = []
    names: Counter[str] = Counter()
    for k, (path, text) in enumerate(sources):
        names[path.name] += 1
        folder = f"t{index:03d}" if names[path.name] == 1 else f"t{index:03d}/{k}"
        uri = f"file:///efim-tour/{folder}/{path.name}"
        writer.open(uri, text, LANGUAGE_IDS.get(path.suffix, "plaintext"))
        files.append((uri, path))
    planner = _Planner(writer, files, options, rng)
    remembered = {uri: 0 for uri, _ in files}  # each document's cursor, as the editor keeps it
    jumps, actions = [], Counter()
    current: tuple[str, int] | None = None  # (uri, function index)
    t = rng.uniform(400.0, 1200.0) + options.settle_ms  # the editor comes up; the person looks around
    for visit in range(options.visits):
        switch = current is None or (len(files) > 1 and rng.random() >= options.same_file_rate)
        if switch:
            others = [f for f in files if current is None or f[0] != current[0]]
            uri, path = rng.choice(others)
            writer.cursor(t + DEBOUNCE_MS, uri, remembered[uri])  # the document became the active one
            t += DEBOUNCE_MS + rng.uniform(*NAVIGATE_MS)
        else:
            uri, path = current[0], dict(files)[current[0]]
        found = planner.sites(uri, path)
        elsewhere = [s for s in found if switch or s.function != current[1]]
        candidates = elsewhere or found
        before = writer.texts[uri]
        action = planner.plan(uri, path, candidates)
        function = next((s.function for s in found if s.start <= action.landing <= s.end), -1)
        t += DEBOUNCE_MS
        writer.cursor(t, uri, action.landing)
        paused = rng.random() >= options.no_pause_rate
        pause = rng.uniform(*(READING_MS if paused else NO_PAUSE_MS))
        t += pause
        first_id = None
        for n, step in enumerate(action.steps):
            t += 0.0 if n == 0 else step.gap_ms
            request_id = writer.step(t, uri, step)
            first_id = first_id or request_id
        jumps.append(meta_entry(first_id, pause, switch, visit=visit, action=action.kind, uri=uri))
        actions[action.kind] += 1
        if writer.texts[uri] != action.after:
            raise AssertionError(f"{uri}: a {action.kind} did not leave the text it planned")
        cursor = action.steps[-1].cursor
        if action.inserted is not None and rng.random() < options.undo_rate:
            taken_back = edits.undo(before, action, rng)
            t += taken_back.steps[0].gap_ms
            writer.step(t, uri, taken_back.steps[0])
            if writer.texts[uri] != before:
                raise AssertionError(f"{uri}: an undo did not restore the text")
            actions["undo"] += 1
            cursor = taken_back.steps[0].cursor
        remembered[uri] = cursor
        current = (uri, function)
        t += rng.uniform(*BETWEEN_MS)
    for uri, _ in files:
        writer.events.append(Event(t=round(t + 1000.0, 1), kind="close", params={"textDocument": {"uri": uri}}))
    header = Header(
        created=utc_now(),
        source="synth",
        client={"name": "efim trace synth --tour"},
        meta={
            "tour": True,
            "files": [str(p) for _, p in files],
            "visits": options.visits,
            "seed": options.seed,
            "session": index,
            "same_file_rate": options.same_file_rate,
            "no_pause_rate": options.no_pause_rate,
            "undo_rate": options.undo_rate,
            "settle_ms": options.settle_ms,
            "actions": dict(sorted(actions.items())),
            "jumps": jumps,
        },
    )
    return Tour(Trace(header=header, events=writer.events), writer.expected)


def synthesize_tours(paths: list[str | Path], options: TourOptions) -> list[Tour]:
    """`options.sessions` tours, each over `options.files` of the usable sources (chosen
    at random, deterministic by `options.seed`)."""
    options.check()
    sources = load_tour_sources(paths)
    if not sources:
        raise ValueError(f"no source file with at least {MIN_FUNCTIONS} functions to jump between among the given paths")
    rng = random.Random(options.seed)
    tours = []
    for index in range(options.sessions):
        chosen = rng.sample(sources, min(options.files, len(sources)))
        tours.append(tour_trace(chosen, options, rng, index))
    return tours
