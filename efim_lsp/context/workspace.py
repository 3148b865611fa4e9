"""A workspace folder as a source of context files: which files qualify and their text.

A file qualifies when it is inside the folder (symlinks that leave it do not), not
excluded by `.gitignore` or a vendor/build folder (see `ignore.py`), at most 1 MB, and
text (no NUL byte, valid UTF-8).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Iterator

from efim_lsp.context.ignore import IgnoreRules

log = logging.getLogger(__name__)

MAX_FILE_BYTES = 1 << 20
MAX_FILES = 20_000  # a scan stops here: beyond it, a workspace is too big to index whole


def skipped(path: Path | str, reason: str) -> None:
    """The one log line of a file (or a link) that is not context."""
    log.info("context: skipped %s (%s)", path, reason)


def read_text_file(path: Path, max_bytes: int = MAX_FILE_BYTES, *, quiet: bool = False) -> str | None:
    """The file's text, or None for binary, oversized, non-UTF-8 or unreadable files and
    files that changed while being read (each logged once, unless `quiet`)."""
    say = (lambda reason: None) if quiet else (lambda reason: skipped(path, reason))
    try:
        before = path.stat()
        if before.st_size > max_bytes:
            say(f"{before.st_size} bytes, over {max_bytes}")
            return None
        data = path.read_bytes()
        after = path.stat()
    except OSError as exc:
        say(f"unreadable: {exc.strerror or exc}")
        return None
    if len(data) > max_bytes:
        say(f"{len(data)} bytes, over {max_bytes}")
        return None
    if len(data) != after.st_size or (after.st_mtime_ns, after.st_size) != (before.st_mtime_ns, before.st_size):
        say("changed while being read")  # the watcher reports the change; it is read again then
        return None
    if b"\0" in data[:8192]:
        say("binary")
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        say("not UTF-8")
        return None


def is_text(text: str, max_bytes: int = MAX_FILE_BYTES) -> bool:
    """Same rule for an editor buffer: no NUL character, not oversized."""
    return "\0" not in text[:8192] and len(text) <= max_bytes


class ContextFolder:
    """One workspace folder as a source of context files (not pygls' `Workspace`, the
    LSP-side view of folders and documents). Thread-safe (its only state is the ignore-rule
    cache)."""

    def __init__(self, root: Path, max_file_bytes: int = MAX_FILE_BYTES) -> None:
        self.root = Path(os.path.abspath(root))
        self.real_root = self.root.resolve()
        if not self.root.is_dir():
            raise ValueError(f"workspace folder {str(root)!r} is not a directory")
        self.rules = IgnoreRules(self.root)
        self.max_file_bytes = max_file_bytes

    def relative(self, path: Path | str) -> str | None:
        """Posix path relative to the root, or None if `path` is not below it (lexically)."""
        path = Path(os.path.abspath(path))
        for root in (self.root, self.real_root):
            if path == root or root in path.parents:
                return path.relative_to(root).as_posix()
        return None

    def _inside(self, path: Path) -> bool:
        """True if `path` with every symlink resolved is still below the root (False for a
        symlink loop or a link that cannot be resolved)."""
        try:
            real = path.resolve()
        except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop (Python < 3.13)
            skipped(path, f"link not resolvable: {exc}")
            return False
        return self.real_root in real.parents

    def admits(self, path: Path | str) -> bool:
        """True if `path` may be used as context (checks the path, not the content)."""
        path = Path(os.path.abspath(path))
        rel = self.relative(path)
        if rel is None or rel == ".":
            return False
        if self.rules.is_ignored(rel, is_dir=False):
            return False
        try:
            return self._inside(path) and path.is_file()  # a link that leaves the workspace: no
        except OSError:
            return False

    def read(self, path: Path | str) -> str | None:
        """The file's text if it qualifies as context, else None."""
        path = Path(os.path.abspath(path))
        if not self.admits(path):
            return None
        return read_text_file(path, self.max_file_bytes)

    def scan(self, limit: int = MAX_FILES) -> Iterator[Path]:
        """Files that qualify by path, top-down, ignored folders pruned, in sorted order.
        Symlinked folders are not followed."""
        count = 0
        for dirpath, dirnames, filenames in os.walk(self.root, followlinks=False):
            base = Path(dirpath)
            rel_dir = base.relative_to(self.root).as_posix()
            prefix = "" if rel_dir == "." else rel_dir + "/"
            kept = sorted(d for d in dirnames if not self.rules.matches(prefix + d, is_dir=True))
            for name in sorted(set(dirnames) - set(kept)):
                skipped(base / name, "folder ignored: .gitignore or a vendor/build folder")
            dirnames[:] = kept
            for name in sorted(filenames):
                if self.rules.matches(prefix + name, is_dir=False):
                    continue
                path = base / name
                if path.is_symlink() and not self._inside(path):
                    if path.exists():  # a loop was logged by _inside
                        skipped(path, "a link that leaves the workspace folder")
                    continue
                count += 1
                if count > limit:
                    log.info("workspace %s: stopped indexing after %d files", self.root, limit)
                    return
                yield path


__all__ = ["ContextFolder", "read_text_file", "skipped", "is_text", "MAX_FILE_BYTES", "MAX_FILES"]
