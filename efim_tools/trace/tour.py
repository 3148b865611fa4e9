"""Synthetic navigation tours: a person moving between functions and files, editing a little at each stop.

A tour opens 2–3 real files at once (an editor restoring its tabs; with `late_open_rate`
some of them only when the tour first switches to them: a file opened by go-to-definition)
and makes `visits` stops. Each stop is a jump — to another function of the same file, or
to another file — then one small edit from `edits.py` (retype a line's tail, add a line,
paste, sometimes undo it). The same person, the same edits at the same times, goes into
one trace per client style (`CLIENT_STYLES`), since clients tell a server different
things about a jump:

- `ours` (what our editor clients send): on a file switch `efim/didMoveCursor` where the
  cursor was in that file (the document became the active one), then, after finding the
  spot (0.3–0.9 s), the jump: `efim/didMoveCursor` at the landing position, sent
  `DEBOUNCE_MS` after the cursor settled (clients debounce it);
- `insert-enter` (Neovim 0.12's built-in inline completion): no notification; at the
  moment `ours` notifies the landing, a completion request there (insert mode entered),
  before any edit;
- `plain` (any LSP client): nothing of ours; the server hears of a jump from its first
  `didChange` (or a `didOpen`, for a file opened at the switch).
- `editor` (an LSP client with nothing of ours that asks about the cursor's place, as VS
  Code, Zed, Sublime and Emacs do for the symbol's highlights): `EDITOR_ASK_MS` after the
  cursor settles — at a file switch, at the landing, after a key when no other key follows
  that soon — a `textDocument/documentHighlight` request there (kind `cursor` with its
  `id`; the answer is not waited for).

Then, in every style: the pause before the first key, counted from the landing
notification's moment: reading, 0.3–2 s, or, for `no_pause_rate` of the jumps, none at
all (0–60 ms); every key press: one `didChange`, then one completion request at the
cursor; keys 80–250 ms apart.

Each jump has a pattern (`PATTERNS`, `jump_pattern`): a file switch, or within a file the
edit it starts with — a line's tail deleted at once (one selection deleted), Backspace by
Backspace, Enter and a new line under the cursor's line, a paste. The first completion
request after each jump is listed in `meta["jumps"]` (`jumps.py` reads it) with its
pause, its pattern and the request after the first edit (`key_id`). Every document's text
after every event is what the planned edits say (`Tour.expected`); the edits never make a
Python file that parsed unparseable, so later stops still find its functions.

Deterministic by `seed`; the stops and edits are drawn from one stream and which files
open late from another, so `client_styles=("ours",)` with `late_open_rate=0` writes the
tours this module wrote before it had client styles.
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
CLIENT_STYLES = ("plain", "editor", "insert-enter", "ours")
# How long after the cursor settles an `editor`-style client asks about the place (VS Code's
# word highlighter waits 250 ms; Zed's highlights 75 ms, its code actions 250 ms; Emacs and
# Sublime about 500 ms): a key pressed sooner moves the cursor first and the ask is dropped.
EDITOR_ASK_MS = 250.0
EDITOR_ASK_METHOD = "textDocument/documentHighlight"
PATTERNS = ("file-switch", "tail-deleted", "backspaces", "new-line", "paste")
EDIT_PATTERNS = PATTERNS[1:]  # what a stop's first edit can be (`TourOptions.edit_mix`)
BACKSPACE_SHARE = 0.6  # of the retyped tails, deleted Backspace by Backspace (the rest: one selection)
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
    # One trace per style and tour, in this order. The library's defaults write the tours
    # as before client styles existed (`efim trace synth --tour` asks for every style and
    # opens half the files late).
    client_styles: tuple[str, ...] = ("ours",)
    late_open_rate: float = 0.0  # chance a file (not the first) is opened only when the tour first switches to it
    # Relative weights of the stops' edits by pattern (`EDIT_PATTERNS`), e.g. equal weights to
    # measure every pattern on as many jumps; empty: the default mix (`ACTION_WEIGHTS`, and
    # `BACKSPACE_SHARE` of the tails Backspace by Backspace), the tours written before it existed.
    edit_mix: tuple[tuple[str, float], ...] = ()

    def action_weights(self) -> tuple[tuple[tuple[str, float], ...], float]:
        """(the weights of the planner's actions, the share of retyped tails deleted Backspace
        by Backspace)."""
        if not self.edit_mix:
            return ACTION_WEIGHTS, BACKSPACE_SHARE
        mix = dict(self.edit_mix)
        tails = mix.get("tail-deleted", 0.0) + mix.get("backspaces", 0.0)
        actions = (("retype-tail", tails), ("new-line", mix.get("new-line", 0.0)), ("paste", mix.get("paste", 0.0)))
        return actions, (mix.get("backspaces", 0.0) / tails if tails else BACKSPACE_SHARE)

    def check(self) -> "TourOptions":
        if self.sessions < 1 or self.visits < 1 or self.files < 1:
            raise ValueError("--sessions, --visits and --files must be at least 1")
        if not 0.0 <= self.settle_ms <= 3_600_000.0:
            raise ValueError(f"--settle must be in [0, 3600] seconds, got {self.settle_ms / 1000:g}")
        unknown = [s for s in self.client_styles if s not in CLIENT_STYLES]
        if unknown or not self.client_styles or len(set(self.client_styles)) < len(self.client_styles):
            raise ValueError(f"--client-styles: each of {', '.join(CLIENT_STYLES)} at most once, got {','.join(self.client_styles) or 'none'}")
        for name in ("same_file_rate", "no_pause_rate", "undo_rate", "late_open_rate"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"--{name.replace('_', '-')} must be in [0, 1], got {getattr(self, name)}")
        names = [name for name, _ in self.edit_mix]
        if any(name not in EDIT_PATTERNS for name in names) or len(set(names)) < len(names):
            raise ValueError(f"--edit-mix: each of {', '.join(EDIT_PATTERNS)} at most once, got {','.join(names)}")
        if any(not 0.0 <= w < float("inf") for _, w in self.edit_mix) or (self.edit_mix and not sum(w for _, w in self.edit_mix) > 0):
            raise ValueError("--edit-mix: weights must be finite, at least 0, and not all 0")
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
    style: str = "ours"  # the client style the trace was written as (`CLIENT_STYLES`)


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


def jump_pattern(action: edits.Action, switch: bool) -> str:
    """What a jump looks like to a server (`PATTERNS`): a file switch, or the first edit at the spot."""
    if switch:
        return "file-switch"
    if action.kind == "retype-tail":
        first = action.steps[0]
        return "tail-deleted" if first.end - first.start > 1 else "backspaces"
    return action.kind


class _Writer:
    """Events of one tour as one client style sends them; keeps each document twice — a
    plain string the edits are planned on, and a `TextDocument` that turns them into LSP
    changes — and checks after every step that both agree. A document is known (its text
    planned on) from the start and opened (`didOpen`) when `open` says."""

    def __init__(self, style: str = "ours") -> None:
        self.style = style
        self.events: list[Event] = []
        self.docs: dict[str, TextDocument] = {}
        self.texts: dict[str, str] = {}
        self.expected: list[tuple[int, str, str]] = []
        self.jumps: list[dict] = []
        self.request_id = 0
        self._ask: tuple[float, str, dict] | None = None  # an editor-style ask due: (t, uri, LSP position)

    def _append(self, event: Event) -> None:
        """Append `event`, after the editor-style ask due before it; an ask due later is
        dropped (the cursor moved again before the editor asked)."""
        self._settle(event.t)
        self.events.append(event)

    def _settle(self, t: float) -> None:
        """The cursor moves at `t`: the editor-style ask due by then is sent, a later one dropped."""
        if self._ask is not None and self._ask[0] <= t:
            due, uri, position = self._ask
            self.request_id += 1
            self.events.append(Event(t=round(due, 1), kind="cursor", method=EDITOR_ASK_METHOD, id=self.request_id,
                                     params={"textDocument": {"uri": uri}, "position": position}))
        self._ask = None

    def _ask_later(self, t: float, uri: str, offset: int) -> None:
        """An `editor` client asks about `offset` once the cursor settled there (`t`)."""
        if self.style == "editor":
            self._settle(t)
            self._ask = (t + EDITOR_ASK_MS, uri, self.docs[uri].position_at(offset).to_lsp())

    def load(self, uri: str, text: str) -> None:
        self.docs[uri] = TextDocument(uri, text, version=1)
        self.texts[uri] = text

    def open(self, t: float, uri: str, language: str) -> None:
        item = {"uri": uri, "languageId": language, "version": 1, "text": self.texts[uri]}
        self._append(Event(t=round(t, 1), kind="open", params={"textDocument": item}))

    def cursor(self, t: float, uri: str, offset: int) -> None:
        position = self.docs[uri].position_at(offset).to_lsp()
        self._append(Event(t=round(t, 1), kind="cursor", params={"textDocument": {"uri": uri}, "position": position}))

    def activated(self, t: float, uri: str, offset: int) -> None:
        """The document became the active one, its cursor at `offset`: only our clients say so."""
        if self.style == "ours":
            self.cursor(t, uri, offset)
        self._ask_later(t - DEBOUNCE_MS, uri, offset)

    def landed(self, t: float, uri: str, offset: int) -> int | None:
        """The cursor settled at `offset` after a jump: our clients notify, a client that
        asks on entering insert mode asks (returns that request's id), a plain one is silent."""
        if self.style == "ours":
            self.cursor(t, uri, offset)
        elif self.style == "insert-enter":
            return self.request(t, uri, offset)
        self._ask_later(t - DEBOUNCE_MS, uri, offset)
        return None

    def request(self, t: float, uri: str, offset: int) -> int:
        self.request_id += 1
        self._append(
            Event(
                t=round(t, 1),
                kind="complete",
                id=self.request_id,
                params={
                    "textDocument": {"uri": uri},
                    "position": self.docs[uri].position_at(offset).to_lsp(),
                    "context": {"triggerKind": 2},  # Automatic: the editor asked, not the user
                },
            )
        )
        return self.request_id

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
        self._append(Event(t=t, kind="change", params={"textDocument": {"uri": uri, "version": doc.version}, "contentChanges": [change]}))
        self.expected.append((len(self.events) - 1, uri, hashlib.sha1(self.texts[uri].encode("utf-8", "surrogatepass")).hexdigest()))
        request_id = self.request(t + 1.0, uri, step.cursor)
        self._ask_later(t, uri, step.cursor)
        return request_id


class _Planner:
    """Chooses stops and plans the edit at each, on the writer's current texts."""

    def __init__(self, writer: _Writer, files: list[tuple[str, Path]], options: TourOptions, rng: random.Random) -> None:
        self.actions, self.backspace_share = options.action_weights()
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
        kinds, weights = zip(*self.actions)
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
        return edits.retype_tail(text, rng.choice(candidates).end, rng, self.backspace_share)


def tour_traces(sources: list[tuple[Path, str]], options: TourOptions, rng: random.Random, index: int) -> list[Tour]:
    """One tour over `sources` (each (path, text); the first is open from the start), one
    trace per `options.client_styles`."""
    writers = [_Writer(style) for style in options.client_styles]
    lead = writers[0]  # the planner reads its texts: every writer's are the same
    files: list[tuple[str, Path]] = []
    names: Counter[str] = Counter()
    languages: dict[str, str] = {}
    late_rng = random.Random(f"efim-tour-late-open/{options.seed}/{index}")  # not the stops' stream
    unopened: list[str] = []
    for k, (path, text) in enumerate(sources):
        names[path.name] += 1
        folder = f"t{index:03d}" if names[path.name] == 1 else f"t{index:03d}/{k}"
        uri = f"file:///efim-tour/{folder}/{path.name}"
        languages[uri] = LANGUAGE_IDS.get(path.suffix, "plaintext")
        late = k > 0 and late_rng.random() < options.late_open_rate
        for w in writers:
            w.load(uri, text)
            if not late:
                w.open(0.0, uri, languages[uri])
        if late:
            unopened.append(uri)
        files.append((uri, path))
    opened_late = [str(p) for uri, p in files if uri in unopened]
    planner = _Planner(lead, files, options, rng)
    remembered = {uri: 0 for uri, _ in files}  # each document's cursor, as the editor keeps it
    actions, patterns = Counter(), Counter()
    current: tuple[str, int] | None = None  # (uri, function index)
    t = rng.uniform(400.0, 1200.0) + options.settle_ms  # the editor comes up; the person looks around
    for visit in range(options.visits):
        switch = current is None or (len(files) > 1 and rng.random() >= options.same_file_rate)
        opened = False
        if switch:
            others = [f for f in files if current is None or f[0] != current[0]]
            uri, path = rng.choice(others)
            if uri in unopened:  # opened now (go-to-definition, the file picker)
                unopened.remove(uri)
                opened = True
                for w in writers:
                    w.open(t, uri, languages[uri])
            for w in writers:
                w.activated(t + DEBOUNCE_MS, uri, remembered[uri])
            t += DEBOUNCE_MS + rng.uniform(*NAVIGATE_MS)
        else:
            uri, path = current[0], dict(files)[current[0]]
        found = planner.sites(uri, path)
        elsewhere = [s for s in found if switch or s.function != current[1]]
        candidates = elsewhere or found
        before = lead.texts[uri]
        action = planner.plan(uri, path, candidates)
        function = next((s.function for s in found if s.start <= action.landing <= s.end), -1)
        t += DEBOUNCE_MS
        landed = [w.landed(t, uri, action.landing) for w in writers]
        paused = rng.random() >= options.no_pause_rate
        pause = rng.uniform(*(READING_MS if paused else NO_PAUSE_MS))
        t += pause
        keys: list[int] = []
        for n, step in enumerate(action.steps):
            t += 0.0 if n == 0 else step.gap_ms
            ids = [w.step(t, uri, step) for w in writers]
            keys = keys or ids
        pattern = jump_pattern(action, switch)
        for w, first, key in zip(writers, landed, keys):
            w.jumps.append(meta_entry(first or key, pause, switch, visit=visit, action=action.kind, uri=uri,
                                      pattern=pattern, key_id=key, opened=opened))
        actions[action.kind] += 1
        patterns[pattern] += 1
        if lead.texts[uri] != action.after:
            raise AssertionError(f"{uri}: a {action.kind} did not leave the text it planned")
        cursor = action.steps[-1].cursor
        if action.inserted is not None and rng.random() < options.undo_rate:
            taken_back = edits.undo(before, action, rng)
            t += taken_back.steps[0].gap_ms
            for w in writers:
                w.step(t, uri, taken_back.steps[0])
            if lead.texts[uri] != before:
                raise AssertionError(f"{uri}: an undo did not restore the text")
            actions["undo"] += 1
            cursor = taken_back.steps[0].cursor
        remembered[uri] = cursor
        current = (uri, function)
        t += rng.uniform(*BETWEEN_MS)
    tours = []
    for w in writers:
        for uri, _ in files:
            if uri not in unopened:
                w._append(Event(t=round(t + 1000.0, 1), kind="close", params={"textDocument": {"uri": uri}}))
        header = Header(
            created=utc_now(),
            source="synth",
            client={"name": "efim trace synth --tour"},
            meta={
                "tour": True,
                "client_style": w.style,
                "files": [str(p) for _, p in files],
                "opened_late": opened_late,
                "visits": options.visits,
                "seed": options.seed,
                "session": index,
                "same_file_rate": options.same_file_rate,
                "no_pause_rate": options.no_pause_rate,
                "undo_rate": options.undo_rate,
                "late_open_rate": options.late_open_rate,
                **({"edit_mix": dict(options.edit_mix)} if options.edit_mix else {}),
                "settle_ms": options.settle_ms,
                "actions": dict(sorted(actions.items())),
                "patterns": dict(sorted(patterns.items())),
                "jumps": w.jumps,
            },
        )
        tours.append(Tour(Trace(header=header, events=w.events), w.expected, w.style))
    return tours


def synthesize_tours(paths: list[str | Path], options: TourOptions) -> list[Tour]:
    """`options.sessions` tours, each over `options.files` of the usable sources (chosen
    at random, deterministic by `options.seed`): tour by tour, one trace per client style
    in `options.client_styles` order."""
    options.check()
    sources = load_tour_sources(paths)
    if not sources:
        raise ValueError(f"no source file with at least {MIN_FUNCTIONS} functions to jump between among the given paths")
    rng = random.Random(options.seed)
    tours = []
    for index in range(options.sessions):
        chosen = rng.sample(sources, min(options.files, len(sources)))
        tours.extend(tour_traces(chosen, options, rng, index))
    return tours
