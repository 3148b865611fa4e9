"""The training corpus: CPython standard library sources read at run time (PSF licence).

Nothing is copied into the repository. A fixed list of modules is held out: training
never reads them, the line-completion evaluation reads only them.
"""

from __future__ import annotations

import random
import sysconfig
from pathlib import Path
from typing import NamedTuple

# Held out from training, used by `efim_tools.evaluation.linecompletion`. Fixed so that every
# run of every configuration is measured on code it never saw; chosen to mix numeric,
# text-processing and data-structure code of different sizes.
HELD_OUT_MODULES: tuple[str, ...] = (
    "fractions.py",
    "statistics.py",
    "difflib.py",
    "heapq.py",
    "textwrap.py",
    "shlex.py",
    "calendar.py",
    "csv.py",
    "graphlib.py",
    "colorsys.py",
    "fnmatch.py",
    "ipaddress.py",
    "json/encoder.py",
    "json/decoder.py",
    "pprint.py",
    "numbers.py",
    "glob.py",
    "base64.py",
)

# Directories that are tests, vendored third-party code or generated tables, not the
# kind of code a user writes.
_SKIP_PARTS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "encodings", "lib2to3", "pydoc_data", "turtledemo", "ensurepip"})
_MIN_CHARS = 400
_MAX_CHARS = 400_000


class SourceFile(NamedTuple):
    path: Path
    name: str  # relative to the stdlib root, with "/" separators
    text: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _readable(path: Path) -> str | None:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    if not (_MIN_CHARS <= len(text) <= _MAX_CHARS):
        return None
    return text


def training_files(root: Path | None = None) -> list[SourceFile]:
    """Every usable stdlib `.py` file except the held-out ones, sorted by name (deterministic)."""
    root = root or stdlib_root()
    held = set(HELD_OUT_MODULES)
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        name = rel.as_posix()
        if name in held or _SKIP_PARTS.intersection(rel.parts[:-1]):
            continue
        text = _readable(path)
        if text is not None:
            files.append(SourceFile(path, name, text))
    if not files:
        raise FileNotFoundError(f"no Python sources found under {root}")
    return files


def held_out_files(root: Path | None = None) -> list[SourceFile]:
    """The held-out modules present in this Python's stdlib (in list order)."""
    root = root or stdlib_root()
    files = []
    for name in HELD_OUT_MODULES:
        text = _readable(root / name)
        if text is not None:
            files.append(SourceFile(root / name, name, text))
    if not files:
        raise FileNotFoundError(f"none of the held-out modules were found under {root}")
    return files


class Corpus:
    """Files drawn with probability proportional to their length (each character equally likely)."""

    def __init__(self, files: list[SourceFile]):
        if not files:
            raise ValueError("empty corpus")
        self.files = files
        self._weights = [len(f.text) for f in files]

    def draw(self, rng: random.Random) -> SourceFile:
        return rng.choices(self.files, weights=self._weights, k=1)[0]

    @property
    def chars(self) -> int:
        return sum(self._weights)


__all__ = ["HELD_OUT_MODULES", "SourceFile", "stdlib_root", "training_files", "held_out_files", "Corpus"]
