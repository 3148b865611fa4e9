"""The top-level names of the modules an import list names, read when asked (#33).

Import names (`import_names`) need one fact about one other file — which names it binds —
so they need no workspace index: the module is found on disk under the workspace folders
(`modules.ModuleResolver` over the files that exist there, or an open document), its names
read once per version of the file (modification time and size) and kept for the last
`MAX_MODULES` files asked about. An open document's text wins over the disk. A module that
does not parse (half typed) keeps the names it last had.
"""

from __future__ import annotations

import collections
import os
import threading
from pathlib import Path

from efim_lsp.context.import_names import top_level_names
from efim_lsp.context.workspace import read_text_file

MAX_MODULES = 256
MAX_MODULE_BYTES = 1_000_000


class ModuleNames:
    """Names per module file, cached (thread-safe)."""

    def __init__(self, max_modules: int = MAX_MODULES) -> None:
        self.max_modules = max_modules
        self._cache: collections.OrderedDict[str, tuple[object, frozenset[str]]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def of(self, path: str, open_text: str | None = None) -> frozenset[str]:
        """The names module `path` binds at its top level; `open_text` is the editor's text
        when the file is open. Empty when it cannot be read."""
        if open_text is not None:
            stamp: object = ("open", hash(open_text))
        else:
            try:
                st = os.stat(path)
            except OSError:
                return frozenset()
            stamp = (st.st_mtime_ns, st.st_size)
        with self._lock:
            cached = self._cache.get(path)
            if cached is not None and cached[0] == stamp:
                self._cache.move_to_end(path)
                return cached[1]
        text = open_text if open_text is not None else read_text_file(Path(path), MAX_MODULE_BYTES, quiet=True)
        names = top_level_names(text) if text is not None else frozenset()
        if not names and cached is not None:
            names = cached[1]  # does not parse now (half typed): what it bound last
        with self._lock:
            self._cache[path] = (stamp, names)
            self._cache.move_to_end(path)
            while len(self._cache) > self.max_modules:
                self._cache.popitem(last=False)
        return names


__all__ = ["ModuleNames", "MAX_MODULES"]
