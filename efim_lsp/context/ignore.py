"""Which workspace paths are never context: `.gitignore` rules plus vendor/build folders.

A small gitignore matcher (no third-party dependency): patterns with `*`, `?`, `[...]`,
`**`, a leading `/` or inner `/` (anchored to the `.gitignore`'s folder), a trailing `/`
(folders only) and `!` negation; nested `.gitignore` files apply below their folder; the
last matching pattern wins; nothing below an ignored folder can be re-included (as in git).
"""

from __future__ import annotations

import logging
import re
import threading
from pathlib import Path
from typing import NamedTuple

log = logging.getLogger(__name__)

# Folders that are dependencies, build output or tool state in most ecosystems.
VENDOR_DIRS = frozenset(
    {
        ".git", ".hg", ".svn", ".bzr", "node_modules", "bower_components", "vendor", "third_party",
        "build", "dist", "target", "out", "_build", ".next", ".nuxt", "coverage", "Pods", ".gradle",
        "__pycache__", ".venv", "venv", ".tox", ".nox", ".eggs", ".mypy_cache", ".pytest_cache",
        ".ruff_cache", ".hypothesis", ".cache", ".idea", "site-packages",
    }
)
# File kinds that are text but never useful as code context.
SKIPPED_SUFFIXES = (".lock", ".min.js", ".min.css", ".map", ".svg", ".csv", ".tsv", ".log", ".pyc", ".pyo")


class Pattern(NamedTuple):
    regex: re.Pattern[str]
    negated: bool
    dir_only: bool


def _translate(body: str) -> str:
    """Regex for one gitignore glob body (already stripped of `!`, anchoring `/` and trailing `/`)."""
    out: list[str] = []
    i, n = 0, len(body)
    while i < n:
        c = body[i]
        if body.startswith("**/", i) and (i == 0 or body[i - 1] == "/"):
            out.append("(?:.*/)?")  # zero or more folders
            i += 3
        elif body.startswith("**", i) and i + 2 == n and (i == 0 or body[i - 1] == "/"):
            out.append(".*")  # everything inside
            i += 2
        elif c == "*":
            out.append("[^/]*")
            i += 1
        elif c == "?":
            out.append("[^/]")
            i += 1
        elif c == "[":
            end = body.find("]", i + 2 if body[i + 1 : i + 2] in ("!", "^") else i + 1)
            if end < 0:
                out.append(re.escape(c))
                i += 1
                continue
            inner = body[i + 1 : end]
            if inner[:1] == "!":
                inner = "^" + inner[1:]
            out.append("[" + inner.replace("\\", "\\\\") + "]")
            i = end + 1
        elif c == "\\" and i + 1 < n:
            out.append(re.escape(body[i + 1]))
            i += 2
        else:
            out.append(re.escape(c))
            i += 1
    return "".join(out)


def parse_gitignore(text: str) -> list[Pattern]:
    """Patterns of one `.gitignore` file, in file order; malformed lines are skipped."""
    patterns: list[Pattern] = []
    for raw in text.splitlines():
        line = raw.rstrip()
        if raw.endswith("\\ "):  # an escaped trailing space is part of the name
            line = raw[:-1]
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        if negated:
            line = line[1:]
        elif line.startswith("\\"):
            line = line[1:]
        dir_only = line.endswith("/")
        line = line.rstrip("/")
        if not line:
            continue
        anchored = "/" in line
        line = line.lstrip("/")
        body = _translate(line)
        regex = body if anchored or line.startswith("**") else "(?:.*/)?" + body
        try:
            patterns.append(Pattern(re.compile(regex + r"\Z", re.DOTALL), negated, dir_only))
        except re.error:
            log.debug("skipping malformed .gitignore line %r", raw)
    return patterns


class IgnoreRules:
    """Decides whether a path under `root` is excluded from context. Thread-safe.

    `.gitignore` files are read lazily and cached per folder; call `forget(folder)` when
    one changes on disk.
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._rules: dict[str, list[Pattern]] = {}  # folder relative to root ("" = root) -> patterns
        self._lock = threading.Lock()

    def forget(self, folder_rel: str) -> None:
        with self._lock:
            self._rules.pop(folder_rel, None)

    def _patterns(self, folder_rel: str) -> list[Pattern]:
        with self._lock:
            cached = self._rules.get(folder_rel)
        if cached is not None:
            return cached
        path = self.root / folder_rel / ".gitignore"
        try:
            patterns = parse_gitignore(path.read_text(encoding="utf-8", errors="replace")) if path.is_file() else []
        except OSError:
            patterns = []
        if folder_rel == "":
            exclude = self.root / ".git" / "info" / "exclude"
            try:
                if exclude.is_file():
                    patterns = parse_gitignore(exclude.read_text(encoding="utf-8", errors="replace")) + patterns
            except OSError:
                pass
        with self._lock:
            self._rules[folder_rel] = patterns
        return patterns

    def matches(self, rel: str, is_dir: bool) -> bool:
        """True if `rel` (posix, relative to root) itself is excluded — its parents are not
        checked (callers walking top-down have pruned ignored folders already)."""
        name = rel.rsplit("/", 1)[-1]
        if is_dir and name in VENDOR_DIRS:
            return True
        if not is_dir and name.endswith(SKIPPED_SUFFIXES):
            return True
        parts = rel.split("/")
        ignored = False
        for depth in range(len(parts)):  # rules of root, then of each deeper folder
            folder = "/".join(parts[:depth])
            sub = "/".join(parts[depth:])
            for pattern in self._patterns(folder):
                if pattern.dir_only and not is_dir:
                    continue
                if pattern.regex.match(sub):
                    ignored = not pattern.negated
        return ignored

    def is_ignored(self, rel: str, is_dir: bool = False) -> bool:
        """True if `rel` or any folder above it is excluded."""
        parts = rel.split("/")
        for depth in range(1, len(parts)):
            if self.matches("/".join(parts[:depth]), True):
                return True
        return self.matches(rel, is_dir)


__all__ = ["IgnoreRules", "parse_gitignore", "Pattern", "VENDOR_DIRS", "SKIPPED_SUFFIXES"]
