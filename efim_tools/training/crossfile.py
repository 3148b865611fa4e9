"""Cross-file training samples (issue #33): teach the model to read the context chunks.

The shipped adapter was trained on prompts with no context chunks, so at serving time the
chunks are text it has never been asked to use: with the `imports` selection the expected
name is inside the chunks for about 4 targets in 5 (docs/crossfile.md, "Selection"), yet
the suggestion names it for 1 in 4. A cross-file sample is what the server sends at a place
that needs a sibling module's name: the chunks chosen by the server's own gatherer
(`efim_lsp.context.ContextGatherer.select`, strategy `imports`) for the document as the
eval opens it (`efim_tools.evaluation.crossfile.find_targets`: the line cut right before
the name), then the local window, rendered by serving's template (`[BOS] C SUF S PRE P I`
suffix first). The middle is the rest of that line — or that and the next line or two —
and sometimes a middle elsewhere in the window, so the chunks are present without being
the answer.

Packages are read where they are installed, at run time (nothing is copied). Training
uses `TRAINING_PACKAGES`; the packages of the eval's tables (`HELD_OUT_PACKAGES`, and the
tuning pair `email`, `json`) are never read here (checked at construction).
"""

from __future__ import annotations

import logging
import math
import random
import threading
from typing import TYPE_CHECKING, Callable, NamedTuple

from efim_tools.crossfile_targets import Package, PackageError, Target, find_targets, resolve_package

if TYPE_CHECKING:
    from engine.api import ContextChunk

log = logging.getLogger(__name__)

# Multi-module packages present on this machine whose lines the cross-file samples come
# from: standard-library packages and installed libraries. A name missing on a machine is
# skipped with a log line.
TRAINING_PACKAGES: tuple[str, ...] = (
    "asyncio", "importlib", "http", "urllib", "tkinter", "sqlite3", "wsgiref", "xmlrpc", "zoneinfo",
    "tomllib", "collections", "html", "curses", "dbm", "distutils", "idlelib", "venv", "re",
    "httpx", "httpcore", "anyio", "rich", "click", "typer", "requests", "urllib3", "jinja2", "pydantic",
    "huggingface_hub", "_pytest", "hypothesis", "networkx", "matplotlib", "fontTools", "pygments",
    "markdown_it", "importlinter", "grimp", "attr", "dateutil", "fsspec", "PIL", "tqdm", "setuptools", "pip",
)
# Never trained on: the packages `efim eval crossfile` reports on (docs/crossfile.md) and the
# two it was tuned on.
HELD_OUT_PACKAGES: frozenset[str] = frozenset({
    "email", "json", "xml", "multiprocessing", "concurrent", "unittest", "logging", "ctypes",
    "pygls", "lsprotocol", "msgspec", "cattrs", "gguf", "packaging",
    "h11", "yaml", "pluggy", "watchfiles", "idna", "charset_normalizer", "sortedcontainers", "iniconfig", "mdurl",
})


class CrossFileSpot(NamedTuple):
    """One place for a sample: the local window's text with the middle at [start, end), and
    the chunks the server would put in front of it."""
    window: str
    start: int
    end: int
    chunks: tuple[ContextChunk, ...]
    target: Target
    at_target: bool  # the middle starts at the target's name (else elsewhere in the window)


class CrossFileSource:
    """Targets of the training packages, and one context gatherer per package (built on
    first use, indexing only that package's folder, as a workspace of it would)."""

    def __init__(self, packages: tuple[str, ...] | list[str], count_tokens: Callable[[str], int], *,
                 max_chunks: int = 4, max_tokens: tuple[int, int] = (384, 1024),
                 prefix_tokens: tuple[int, int] = (96, 448), suffix_tokens: tuple[int, int] = (24, 192),
                 at_target_prob: float = 0.75, more_lines_prob: float = 0.25) -> None:
        # The gatherer logs each skipped folder and binary file at INFO: one package's worth
        # of lines per package here, none of them news for training.
        logging.getLogger("efim_lsp.context").setLevel(logging.WARNING)
        clash = sorted(HELD_OUT_PACKAGES.intersection(packages))
        if clash:
            raise ValueError(f"cross-file training packages {clash} are held out for `efim eval crossfile`")
        self.count_tokens = count_tokens
        self.max_chunks, self.max_tokens = max_chunks, max_tokens
        self.prefix_tokens, self.suffix_tokens = prefix_tokens, suffix_tokens
        self.at_target_prob, self.more_lines_prob = at_target_prob, more_lines_prob
        self.packages: list[Package] = []
        self.targets: list[list[Target]] = []
        for name in packages:
            try:
                package = resolve_package(name)
            except PackageError as e:
                log.info("cross-file samples: %s; skipped", e)
                continue
            found = find_targets(package)
            if found:
                self.packages.append(package)
                self.targets.append(found)
        if not self.packages:
            raise ValueError(f"none of the cross-file training packages has targets here: {', '.join(packages)}")
        # A package is drawn with weight sqrt(#targets): big libraries do not drown the rest.
        self.weights = [math.sqrt(len(t)) for t in self.targets]
        self._gatherers: dict[str, object] = {}
        self._lock = threading.Lock()
        log.info("cross-file samples: %d packages, %d targets", len(self.packages), sum(map(len, self.targets)))

    def _gatherer(self, package: Package):
        from efim_lsp.context import ContextGatherer  # noqa: PLC0415

        with self._lock:
            g = self._gatherers.get(package.name)
            if g is None:
                g = ContextGatherer(count_tokens=self.count_tokens, watch=False)
                g.set_workspaces([package.root])
                g.wait_idle(timeout=600)
                self._gatherers[package.name] = g
            return g

    def draw(self, rng: random.Random) -> CrossFileSpot:
        """A spot, a pure function of `rng`'s state (and the installed packages)."""
        k = rng.choices(range(len(self.packages)), weights=self.weights)[0]
        package, target = self.packages[k], rng.choice(self.targets[k])
        text = target.text
        lines = text.split("\n")
        line_start = sum(len(line) + 1 for line in lines[: target.line_no - 1])
        cursor = line_start + len(target.before)
        # The original module: the cut line restored, so the middle can run past its end.
        original = text[:cursor] + target.rest + text[cursor:]
        p_tok = rng.randint(*self.prefix_tokens)
        s_tok = rng.randint(*self.suffix_tokens)
        start = _lines_back(original, line_start, p_tok)
        line_end = cursor + len(target.rest)
        middle_end = line_end
        extra = rng.random() < self.more_lines_prob
        if extra:  # the rest of the line and the next line or two
            for _ in range(rng.randint(1, 2)):
                nxt = original.find("\n", middle_end + 1)
                middle_end = len(original) if nxt < 0 else nxt
        end = _lines_forward(original, middle_end, s_tok)
        window = original[start:end]
        budget = rng.randint(*self.max_tokens)
        path = str(package.root / target.file)
        gatherer = self._gatherer(package)
        gatherer.open_document(path, text)  # as the server has it: the line cut, not the file on disk
        try:
            chunks = gatherer.select(path, text, cursor, max_chunks=self.max_chunks, max_tokens=budget,
                                     window=(start, max(start, end - len(target.rest))), strategy="imports")
        finally:
            gatherer.close_document(path)
        at_target = rng.random() < self.at_target_prob
        if at_target:
            return CrossFileSpot(window, cursor - start, middle_end - start, tuple(chunks), target, True)
        return CrossFileSpot(window, -1, -1, tuple(chunks), target, False)  # the builder draws the middle


def _lines_back(text: str, at: int, tokens: int) -> int:
    """A line start before `at` with about `tokens` tokens (4 characters each) between."""
    want = max(0, at - 4 * tokens)
    if want == 0:
        return 0
    return text.find("\n", want) + 1 if text.find("\n", want) < at else at


def _lines_forward(text: str, at: int, tokens: int) -> int:
    """A line end after `at` with about `tokens` tokens between (the text's end at most)."""
    want = min(len(text), at + 4 * tokens)
    end = text.find("\n", want)
    return len(text) if end < 0 else end + 1


__all__ = ["TRAINING_PACKAGES", "HELD_OUT_PACKAGES", "CrossFileSpot", "CrossFileSource"]
