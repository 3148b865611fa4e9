"""What the indexed Python modules define and import — the "imports" selection's knowledge.

For each Python file of the index: its imports, read once per text when it is indexed, and
its outline (`outline.Outline`: signatures, class heads, docstring first lines), read the
first time a chunk of it is wanted (the file read again, its digest checked) and kept for the
`MAX_OUTLINES` most recently used texts — parsing a whole module is most of what indexing
would cost (`compile` holds the GIL for a big file's whole parse), and few modules of a big
workspace are ever imported by an open document. From these: which indexed modules
a document imports, most relevant to the cursor first (`imported_modules`); a module's
definitions as one chunk within a token budget (`definition_chunk`); and the modules most
files import (`popular`), whose chunks are worth computing before anyone asks.
"""

from __future__ import annotations

import collections
import os
import re
import threading
from pathlib import Path
from typing import Callable, NamedTuple

from engine.api import ContextChunk

from efim_lsp.context.chunking import chunk_digest
from efim_lsp.context.imports import ImportRef, imports_of
from efim_lsp.context.modules import ModuleResolver
from efim_lsp.context.outline import Outline
from efim_lsp.context.ranking import ChunkIndex

PYTHON_SUFFIXES = (".py", ".pyi")
# Rendered definition chunks kept (per module text and token budget).
MAX_RENDERED = 4096
# Outlines kept (per module text), most recently used.
MAX_OUTLINES = 1024
# `popular` offers its caller a pause after this many modules counted.
PAUSE_EVERY = 64

# `alias.` right before the cursor names the module the next word comes from.
_ATTRIBUTE_BEFORE = re.compile(r"([A-Za-z_]\w*)\.\w*$")


def is_python(path: str) -> bool:
    return path.endswith(PYTHON_SUFFIXES)


class ModuleInfo(NamedTuple):
    """A Python file's imports, read when it was indexed."""

    imports: tuple[ImportRef, ...]
    digest: str  # of the text they were read from (its outline is read from the same text)


class ModuleDefinitions:
    """Outlines and imports of the index's Python files. Guarded by the owner's `lock`.

    `roots()` gives the workspace folders (module names resolve against them),
    `count_tokens` measures a rendered outline, `display_path` names a file in a prompt,
    `read_text` gives a file's current text (the open document's, else the disk's; None when
    unreadable). None of the four is called with `lock` held by this class.
    """

    def __init__(
        self,
        index: ChunkIndex,
        lock: threading.RLock,
        *,
        roots: Callable[[], tuple[Path, ...]],
        count_tokens: Callable[[str], int],
        display_path: Callable[[str], str],
        read_text: Callable[[str], str | None],
    ) -> None:
        self.index = index
        self._lock = lock
        self._roots = roots
        self._count_tokens = count_tokens
        self._display_path = display_path
        self._read_text = read_text
        self._modules: dict[str, ModuleInfo] = {}
        self._outlines: collections.OrderedDict[str, Outline | None] = collections.OrderedDict()  # digest -> outline (None: no parse)
        self._resolver: tuple[int, tuple[Path, ...], ModuleResolver] | None = None
        self._rendered: collections.OrderedDict[tuple[str, int], ContextChunk | None] = collections.OrderedDict()

    # ---- what is known -----------------------------------------------------------------

    def note(self, key: str, text: str | None) -> None:
        """Read `key`'s imports from `text` (None, or not Python: forget it)."""
        if text is None or not is_python(key):
            self.forget(key)
            return
        digest = chunk_digest(key, text)
        with self._lock:
            old = self._modules.get(key)
        if old is not None and old.digest == digest:
            return
        info = ModuleInfo(tuple(imports_of(text)), digest)
        with self._lock:
            self._modules[key] = info

    def forget(self, key: str) -> None:
        with self._lock:
            self._modules.pop(key, None)

    def forget_rendered(self) -> None:
        """Drop the rendered chunks (their token counts came from another tokenizer)."""
        with self._lock:
            self._rendered.clear()

    def resolver(self) -> ModuleResolver:
        """Module names → indexed files, rebuilt when the index or the folders change."""
        roots = self._roots()
        with self._lock:
            cached = self._resolver
            version = self.index.version
            if cached is not None and cached[0] == version and cached[1] == roots:
                return cached[2]
        resolver = ModuleResolver(set(self.index.paths()), [str(r) for r in roots])
        with self._lock:
            self._resolver = (version, roots, resolver)
        return resolver

    # ---- answers -----------------------------------------------------------------------

    def imported_modules(self, key: str, text: str, cursor: int | None = None, terms: frozenset[str] = frozenset()) -> list[str]:
        """The indexed modules `text` (the document `key`) imports, most relevant first: the
        import statement at the cursor's line, then those whose names or alias the text
        around the cursor mentions (by count), then text order."""
        refs = imports_of(text) if is_python(key) or "://" in key else []
        if not refs:
            return []
        resolver = self.resolver()
        line = text.count("\n", 0, cursor) if cursor is not None else -1
        dotted = _ATTRIBUTE_BEFORE.search(text, max(0, cursor - 200), cursor) if cursor is not None else None
        owner = dotted.group(1) if dotted else None
        scores: dict[str, tuple[int, int, int]] = {}
        for order, ref in enumerate(refs):
            for found in resolver.resolve(ref, key):
                words = set(found.names or ()) | ({ref.alias} if ref.alias else set())
                if found.names is None and not ref.alias:
                    words.add(os.path.splitext(os.path.basename(found.path))[0])
                at_cursor = 1 if ref.line == line or (owner is not None and owner in words) else 0
                mentions = sum(1 for w in words if w.lower() in terms)
                score = (at_cursor, mentions, -order)
                if found.path not in scores or score > scores[found.path]:
                    scores[found.path] = score
        return sorted(scores, key=lambda p: scores[p], reverse=True)

    def definition_chunk(self, path: str, max_tokens: int) -> ContextChunk | None:
        """The outline of the indexed Python module `path` in at most `max_tokens` tokens;
        None when it has none (not Python, does not parse, nothing public)."""
        with self._lock:
            info = self._modules.get(path)
        if info is None:
            return None
        cache_key = (info.digest, max_tokens)
        with self._lock:
            if cache_key in self._rendered:
                self._rendered.move_to_end(cache_key)
                return self._rendered[cache_key]
        outline = self._outline(path, info.digest)
        if outline is None:
            return None
        text = outline.render(lambda t: self._count_tokens(t) <= max_tokens)
        chunk = ContextChunk(path=self._display_path(path), text=text) if text.strip() else None
        with self._lock:
            self._rendered[cache_key] = chunk
            while len(self._rendered) > MAX_RENDERED:
                self._rendered.popitem(last=False)
        return chunk

    def _outline(self, path: str, digest: str) -> Outline | None:
        """The outline of `path`'s text with `digest` (None: it does not parse, or the text
        changed since it was indexed — the change is indexed again, and asked about then)."""
        with self._lock:
            if digest in self._outlines:
                self._outlines.move_to_end(digest)
                return self._outlines[digest]
        text = self._read_text(path)
        if text is None or chunk_digest(path, text) != digest:
            return None
        outline = Outline.of(text)
        with self._lock:
            self._outlines[digest] = outline
            while len(self._outlines) > MAX_OUTLINES:
                self._outlines.popitem(last=False)
        return outline

    def popular(self, per_chunk: int, limit: int, pause: Callable[[], None] = lambda: None) -> list[ContextChunk]:
        """Definition chunks (`per_chunk` tokens each) of the modules that the most indexed
        files import (ties: path order), at most `limit`. `pause()` is called every
        `PAUSE_EVERY` modules counted and before each outline read: over a big workspace this
        is seconds of Python, and a background caller gives way to requests there."""
        with self._lock:
            modules = dict(self._modules)
        resolver = self.resolver()
        importers: collections.Counter[str] = collections.Counter()
        for n, (path, info) in enumerate(modules.items()):
            if n % PAUSE_EVERY == 0:
                pause()
            for found in {r.path for ref in info.imports for r in resolver.resolve(ref, path)}:
                importers[found] += 1
        out = []
        for path in sorted(importers, key=lambda p: (-importers[p], p)):
            pause()
            chunk = self.definition_chunk(path, per_chunk)
            if chunk is not None:
                out.append(chunk)
                if len(out) >= limit:
                    break
        return out


__all__ = ["ModuleDefinitions", "ModuleInfo", "is_python", "PYTHON_SUFFIXES"]
