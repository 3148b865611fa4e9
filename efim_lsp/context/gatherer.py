"""Cross-file context for a completion: the few chunks of other files most related to
the text around the cursor.

Sources: other open documents (their editor text) and the files of the workspace
folders (indexed on a worker thread, kept current by `watchfiles`). The document being
edited is never its own context — the prompt window already carries it, and its chunks
change at every keystroke.

Stability: a selection is remembered per document and returned again while the
identifiers around the cursor stay close to those it was chosen for (Jaccard ≥
`STABLE_JACCARD`), the caller's `anchor` (e.g. the edit session's rebase count) is
unchanged, and the index has not changed since (a file edited elsewhere, or indexing
still in progress: a selection made from a half-built index must not stick). Typing in one place therefore keeps
the same chunks in the same order, which keeps the prompt prefix — and its KV — stable
(docs/design.md, "Prefix stability").
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import re
import threading
from pathlib import Path
from typing import Callable, Hashable, NamedTuple

from engine.api import ContextChunk

from efim_lsp.context.chunking import CHUNK_LINES, Chunk, chunk_digest, identifiers, split_chunks, sub_chunk
from efim_lsp.context.imports import ImportRef, imports_of
from efim_lsp.context.modules import ModuleResolver
from efim_lsp.context.outline import Outline
from efim_lsp.context.ranking import ChunkIndex, jaccard
from efim_lsp.context.watcher import WorkspaceWatcher
from efim_lsp.context.workspace import ContextFolder, is_text

log = logging.getLogger(__name__)

# Lines around the cursor whose identifiers form the query.
QUERY_LINES_BEFORE = 40
QUERY_LINES_AFTER = 10
# Lines around the cursor taken as "the local window" when the caller gives none.
WINDOW_LINES_BEFORE = 150
WINDOW_LINES_AFTER = 50
# Keep the previous selection while the query identifiers are at least this similar.
STABLE_JACCARD = 0.7
# A chunk with at least this fraction of its lines already in the local window adds nothing.
DUPLICATE_FRACTION = 0.5
# Trimmed chunks start on this line grid, so a re-trim tends to land on the same lines.
TRIM_GRID = 8
MIN_CHUNK_TOKENS = 32


def estimate_tokens(text: str) -> int:
    """Token count when no tokenizer is attached yet (code averages ~3.5 characters a token)."""
    return max(1, (len(text) * 2 + 6) // 7)


# Strategies of `select`: "imports" (definitions of what the file imports, then recently
# edited open documents, then BM25) or "bm25" (BM25 over every chunk alone).
STRATEGIES = ("imports", "bm25")
# Open documents (most recently edited or opened first) the "imports" strategy looks at after the imports.
RECENT_DOCUMENTS = 3
PYTHON_SUFFIXES = (".py", ".pyi")


class Selection(NamedTuple):
    terms: frozenset[str]
    anchor: Hashable
    budget: tuple[int, int]
    index_version: int  # ChunkIndex.version it was chosen at
    digests: tuple[str, ...]  # the index chunks the selection was cut from
    chunks: tuple[ContextChunk, ...]
    strategy: str = "bm25"
    sources: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (path, its chunks' digests) of every file used


class ModuleInfo(NamedTuple):
    """A Python file's outline (None: it does not parse) and imports, read when it was indexed."""

    outline: Outline | None
    imports: tuple[ImportRef, ...]
    digest: str  # of the text they were read from


def is_python(path: str) -> bool:
    return path.endswith(PYTHON_SUFFIXES)


class ContextGatherer:
    """Keeps the candidate chunks and answers `select` for a cursor. Thread-safe.

    Keys: a document is identified by its file-system path (made absolute) or, for
    documents that have none, by its URI string. Listeners added with `add_listener`
    are called with a key whenever that key's chunks change or disappear (a file
    edited in the editor or on disk), so caches of their KV can be dropped.
    """

    def __init__(
        self,
        *,
        count_tokens: Callable[[str], int] | None = None,
        chunk_lines: int = CHUNK_LINES,
        watch: bool = True,
        debounce_ms: int = 300,
    ) -> None:
        self.chunk_lines = chunk_lines
        self.index = ChunkIndex()
        self._count_tokens = count_tokens
        self._token_cache: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._workspaces: dict[Path, ContextFolder] = {}
        self._open: dict[str, str] = {}
        self._dirty: set[str] = set()
        self._selections: dict[str, Selection] = {}
        self._modules: dict[str, ModuleInfo] = {}  # Python files of the index: outline and imports
        self._recent: collections.OrderedDict[str, None] = collections.OrderedDict()  # open documents, last edited last
        self._resolver: tuple[int, tuple[Path, ...], ModuleResolver] | None = None
        self._outline_chunks: collections.OrderedDict[tuple[str, int], ContextChunk | None] = collections.OrderedDict()
        self._listeners: list[Callable[[str], None]] = []
        self._lock = threading.RLock()
        self._tasks: queue.Queue[tuple[str, object] | None] = queue.Queue()
        self._worker = threading.Thread(target=self._work, name="efim-context", daemon=True)
        self._worker.start()
        self._watcher = WorkspaceWatcher(self._on_disk_changes, debounce_ms=debounce_ms) if watch else None

    # ---- configuration ---------------------------------------------------------------

    def set_token_counter(self, count_tokens: Callable[[str], int] | None) -> None:
        """Attach the engine's tokenizer (`Engine.count_tokens`) once it is loaded."""
        with self._lock:
            self._count_tokens = count_tokens
            self._token_cache.clear()
            self._outline_chunks.clear()

    def add_listener(self, listener: Callable[[str], None]) -> None:
        with self._lock:
            self._listeners.append(listener)

    def set_workspaces(self, roots: list[Path | str]) -> None:
        """Index exactly these folders (added ones are scanned in the background; removed
        ones are forgotten, except their documents that are open)."""
        wanted: dict[Path, ContextFolder] = {}
        with self._lock:
            for root in roots:
                path = Path(os.path.abspath(root))
                if path in self._workspaces:
                    wanted[path] = self._workspaces[path]
                elif path.is_dir():
                    wanted[path] = ContextFolder(path)
                else:
                    log.warning("context: workspace folder %s is not a directory; skipped", path)
            removed = [w for p, w in self._workspaces.items() if p not in wanted]
            added = [w for p, w in wanted.items() if p not in self._workspaces]
            self._workspaces = wanted
        for workspace in removed:
            self._tasks.put(("forget", workspace))
        for workspace in added:
            self._tasks.put(("scan", workspace))
        if self._watcher is not None:
            self._watcher.set_roots(list(wanted))

    def add_workspace(self, root: Path | str) -> None:
        with self._lock:
            roots = [*self._workspaces, Path(os.path.abspath(root))]
        self.set_workspaces(roots)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until queued disk work (scans, changes) is done; False on timeout."""
        with self._tasks.all_tasks_done:
            return self._tasks.all_tasks_done.wait_for(lambda: self._tasks.unfinished_tasks == 0, timeout)

    def status(self) -> dict[str, object]:
        """What is indexed and whether disk work is still queued (for `efim/stats`)."""
        with self._lock:
            folders = len(self._workspaces)
        return {
            "folders": folders,
            "files": len(self.index.paths()),
            "chunks": len(self.index),
            "indexing": self._tasks.unfinished_tasks > 0,
            "watch": self._watcher.state() if self._watcher is not None else {"state": "off"},
        }

    def on_watch_problem(self, report: Callable[[str], None] | None) -> None:
        """`report(message)` is called on the watcher thread, once per folder the watch
        loses (deleted, moved away) and once if the watch fails (`watcher.WorkspaceWatcher`)."""
        if self._watcher is not None:
            self._watcher.on_problem = report

    def wait_watching(self, timeout: float = 5.0) -> bool:
        """Block until the file watcher is installed (tests write files only after this)."""
        return self._watcher is None or self._watcher.wait_started(timeout)

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.close()
        self._tasks.put(None)
        self._worker.join(timeout=10)

    # ---- editor documents ------------------------------------------------------------

    def open_document(self, path: str, text: str) -> None:
        self.change_document(path, text)

    def change_document(self, path: str, text: str) -> None:
        """The editor's text of `path` (open or changed). Chunking happens lazily."""
        key = document_key(path)
        with self._lock:
            if self._open.get(key) == text:
                return
            self._open[key] = text
            self._dirty.add(key)
            self._recent[key] = None
            self._recent.move_to_end(key)
            while len(self._recent) > 64:
                self._recent.popitem(last=False)

    def close_document(self, path: str) -> None:
        """The document's chunks stay (with the last editor text) until the file changes on disk."""
        key = document_key(path)
        with self._lock:
            self._refresh(key)
            self._open.pop(key, None)
            self._selections.pop(key, None)
            self._recent.pop(key, None)

    # ---- selection -------------------------------------------------------------------

    def select(
        self,
        path: str,
        text: str,
        cursor: int,
        *,
        max_chunks: int = 4,
        max_tokens: int = 1024,
        window: tuple[int, int] | None = None,
        anchor: Hashable = None,
        strategy: str = "bm25",
    ) -> tuple[ContextChunk, ...]:
        """Chunks of other files for a completion at code-point offset `cursor` of `text`
        (the document `path`), least relevant first so the most relevant sits next to the
        local prompt. At most `max_chunks` chunks and `max_tokens` tokens in total;
        `window` = (start, end) offsets of the local prompt window (chunks mostly inside
        it are dropped). `strategy`: "bm25" (the chunks whose identifiers best match the
        text around the cursor) or "imports" (the definitions of the workspace modules the
        document imports, then the recently edited open documents, then BM25).

        The same selection is returned while the user types in one place: with an
        `anchor` (the edit session) and "imports", for as long as the anchor stays and
        none of the files it was cut from changed; otherwise while the identifiers
        around the cursor stay similar and the index is unchanged (module docstring)."""
        if max_chunks <= 0 or max_tokens <= 0:
            return ()
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown context selection {strategy!r}; expected one of {', '.join(STRATEGIES)}")
        key = document_key(path)
        cursor = min(max(cursor, 0), len(text))
        before = text[:cursor].splitlines()[-QUERY_LINES_BEFORE:]
        after = text[cursor:].splitlines()[:QUERY_LINES_AFTER]
        terms = frozenset(identifiers("\n".join(before + after)))
        budget = (max_chunks, max_tokens)
        with self._lock:
            for other in list(self._dirty):
                if other != key:
                    self._refresh(other)
            last = self._selections.get(key)
            if last is not None and last.strategy == strategy and last.anchor == anchor and last.budget == budget:
                if anchor is not None and strategy == "imports":
                    if all(self._fingerprint(p) == f for p, f in last.sources):
                        return last.chunks
                elif last.index_version == self.index.version and jaccard(last.terms, terms) >= STABLE_JACCARD:
                    return last.chunks
            version = self.index.version
        local = _significant_lines(_window_text(text, cursor, window))
        if strategy == "imports":
            chosen = self._pick_tiered(key, text, cursor, terms, local, max_chunks, max_tokens)
        else:
            picked = self._pick(key, terms, local, max_chunks, max_tokens)
            picked.sort(key=lambda item: (item[0], item[1].path, item[1].start_line))  # ascending relevance
            chosen = [(c.path, c, src.digest) for _score, c, src in picked]
        with self._lock:
            sources = tuple((p, self._fingerprint(p)) for p in dict.fromkeys(p for p, _c, _d in chosen))
        selection = Selection(
            terms=terms,
            anchor=anchor,
            budget=budget,
            index_version=version,
            digests=tuple(d for _p, _c, d in chosen),
            chunks=tuple(c if isinstance(c, ContextChunk) else ContextChunk(path=self.display_path(c.path), text=c.text) for _p, c, _d in chosen),
            strategy=strategy,
            sources=sources,
        )
        with self._lock:
            self._selections[key] = selection
        return selection.chunks

    def _fingerprint(self, path: str) -> tuple[str, ...]:
        return tuple(c.digest for c in self.index.chunks_of(path))

    # ---- the "imports" strategy ------------------------------------------------------

    def _module_resolver(self) -> ModuleResolver:
        with self._lock:
            roots = tuple(self._workspaces)
            cached = self._resolver
            version = self.index.version
            if cached is not None and cached[0] == version and cached[1] == roots:
                return cached[2]
        resolver = ModuleResolver(set(self.index.paths()), [str(r) for r in roots])
        with self._lock:
            self._resolver = (version, roots, resolver)
        return resolver

    def imported_modules(self, path: str, text: str, cursor: int | None = None, terms: frozenset[str] = frozenset()) -> list[str]:
        """The indexed modules `text` (the document `path`) imports, most relevant first: the
        import statement at the cursor's line, then those whose names or alias the text
        around the cursor mentions (by count), then text order."""
        key = document_key(path)
        refs = imports_of(text) if is_python(key) or "://" in key else []
        if not refs:
            return []
        resolver = self._module_resolver()
        line = text.count("\n", 0, cursor) if cursor is not None else -1
        # `alias.` right before the cursor names the module the next word comes from
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
        """The outline of the indexed Python module `path` (`outline.Outline`) in at most
        `max_tokens` tokens; None when it has none (not Python, does not parse, nothing public)."""
        with self._lock:
            info = self._modules.get(path)
        if info is None or info.outline is None:
            return None
        cache_key = (info.digest, max_tokens)
        with self._lock:
            if cache_key in self._outline_chunks:
                self._outline_chunks.move_to_end(cache_key)
                return self._outline_chunks[cache_key]
        text = info.outline.render(lambda t: self.count_tokens(t) <= max_tokens)
        chunk = ContextChunk(path=self.display_path(path), text=text) if text.strip() else None
        with self._lock:
            self._outline_chunks[cache_key] = chunk
            while len(self._outline_chunks) > 4096:
                self._outline_chunks.popitem(last=False)
        return chunk

    def import_chunks(self, path: str, text: str, *, max_chunks: int = 4, max_tokens: int = 1024) -> list[ContextChunk]:
        """The definition chunks of the modules `text` imports, in text order (no cursor):
        what a request in the document is likely to use, for computing their KV ahead."""
        per_chunk = max(MIN_CHUNK_TOKENS, max_tokens // max(1, max_chunks))
        out = []
        for module in self.imported_modules(path, text):
            chunk = self.definition_chunk(module, per_chunk)
            if chunk is not None:
                out.append(chunk)
        return out

    def popular_chunks(self, *, max_chunks: int = 4, max_tokens: int = 1024, limit: int = 64) -> list[ContextChunk]:
        """Definition chunks of the indexed modules that the most indexed files import
        (ties: path order), at most `limit`: the likely chunks of a workspace."""
        with self._lock:
            modules = dict(self._modules)
        resolver = self._module_resolver()
        importers: collections.Counter[str] = collections.Counter()
        for path, info in modules.items():
            for found in {r.path for ref in info.imports for r in resolver.resolve(ref, path)}:
                importers[found] += 1
        per_chunk = max(MIN_CHUNK_TOKENS, max_tokens // max(1, max_chunks))
        out = []
        for path in sorted(importers, key=lambda p: (-importers[p], p)):
            chunk = self.definition_chunk(path, per_chunk)
            if chunk is not None:
                out.append(chunk)
                if len(out) >= limit:
                    break
        return out

    def _pick_tiered(
        self, key: str, text: str, cursor: int, terms: frozenset[str], local: set[str], max_chunks: int, max_tokens: int
    ) -> list[tuple[str, ContextChunk | Chunk, str]]:
        """(path, chunk, digest) least relevant first: imports' definitions, then the best
        chunk of each recently edited open document, then BM25 (see `select`)."""
        per_chunk = max(MIN_CHUNK_TOKENS, max_tokens // max_chunks)
        imported: list[tuple[str, ContextChunk | Chunk, str]] = []
        total = 0
        for module in self.imported_modules(key, text, cursor, terms):
            if len(imported) == max_chunks:
                break
            chunk = self.definition_chunk(module, per_chunk)
            if chunk is None:
                continue
            n = self.count_tokens(chunk.text)
            if total + n > max_tokens:
                continue
            imported.append((module, chunk, chunk_digest(module, chunk.text)))
            total += n
        used = {p for p, _c, _d in imported} | {key}
        recent: list[tuple[str, ContextChunk | Chunk, str]] = []
        left = max_chunks - len(imported)
        if left > 0 and max_tokens - total >= MIN_CHUNK_TOKENS:
            with self._lock:
                others = [p for p in reversed(self._recent) if p not in used][:RECENT_DOCUMENTS]
            if others:
                picked = self._pick(key, terms, local, min(left, len(others)), max_tokens - total, only_paths=set(others), per_chunk=per_chunk)
                picked.sort(key=lambda item: (item[0], item[1].path, item[1].start_line))
                recent = [(src.path, c, src.digest) for _s, c, src in picked]
                total += sum(self.count_tokens(c.text) for _p, c, _d in recent)
                used |= {p for p, _c, _d in recent}
        fallback: list[tuple[str, ContextChunk | Chunk, str]] = []
        left = max_chunks - len(imported) - len(recent)
        if left > 0 and max_tokens - total >= MIN_CHUNK_TOKENS:
            picked = self._pick(key, terms, local, left, max_tokens - total, exclude_paths=used, per_chunk=per_chunk)
            picked.sort(key=lambda item: (item[0], item[1].path, item[1].start_line))
            fallback = [(src.path, c, src.digest) for _s, c, src in picked]
        return fallback + recent + imported[::-1]

    def _pick(
        self,
        key: str,
        terms: frozenset[str],
        local: set[str],
        max_chunks: int,
        max_tokens: int,
        *,
        exclude_paths: set[str] | None = None,
        only_paths: set[str] | None = None,
        per_chunk: int | None = None,
    ) -> list[tuple[float, Chunk, Chunk]]:
        """BM25's best chunks (one per file when `only_paths` is given), trimmed to their share."""
        per_chunk = per_chunk or max(MIN_CHUNK_TOKENS, max_tokens // max_chunks)
        picked: list[tuple[float, Chunk, Chunk]] = []  # (score, chunk as used, chunk in index)
        seen: set[str] = set()
        files: set[str] = set()
        total = 0
        excluded = {key} | (exclude_paths or set())
        limit = max_chunks * 4 if only_paths is None else max(64, max_chunks * 16)
        for scored in self.index.search(terms, exclude_paths=excluded, limit=limit):
            if len(picked) == max_chunks:
                break
            source = scored.chunk
            if only_paths is not None and (source.path not in only_paths or source.path in files):
                continue
            if source.text in seen or _duplicate_fraction(source.text, local) >= DUPLICATE_FRACTION:
                continue
            chunk = source
            n = self.count_tokens(chunk.text)
            if n > per_chunk:
                chunk = self._trim(chunk, terms, per_chunk, n)
                n = self.count_tokens(chunk.text)
            if total + n > max_tokens or not chunk.text.strip():
                continue
            seen.add(source.text)
            files.add(source.path)
            picked.append((scored.score, chunk, source))
            total += n
        return picked

    def _trim(self, chunk: Chunk, terms: frozenset[str], limit: int, tokens: int) -> Chunk:
        """The grid-aligned run of lines of `chunk` that fits `limit` tokens and mentions
        the most query identifiers (the first such run on ties)."""
        lines = chunk.text.splitlines(keepends=True)
        span = max(1, int(len(lines) * limit / tokens))
        best, best_hits = 0, -1
        for start in range(0, max(1, len(lines) - span + 1), TRIM_GRID):
            hits = len(terms & set(identifiers("".join(lines[start : start + span]))))
            if hits > best_hits:
                best, best_hits = start, hits
        lo = chunk.start_line + best
        hi = lo + span
        trimmed = sub_chunk(chunk, lo, hi)
        while hi - lo > 1 and self.count_tokens(trimmed.text) > limit:
            hi -= max(1, (hi - lo) // 8)
            trimmed = sub_chunk(chunk, lo, hi)
        return trimmed

    # ---- tokens and paths ------------------------------------------------------------

    def count_tokens(self, text: str) -> int:
        counter = self._count_tokens
        if counter is None:
            return estimate_tokens(text)
        with self._lock:
            cached = self._token_cache.get(text)
            if cached is not None:
                self._token_cache.move_to_end(text)
                return cached
        n = int(counter(text))
        with self._lock:
            self._token_cache[text] = n
            while len(self._token_cache) > 4096:
                self._token_cache.popitem(last=False)
        return n

    def display_path(self, key: str) -> str:
        """Path as shown in the prompt: relative to its workspace folder when inside one."""
        with self._lock:
            workspaces = list(self._workspaces.values())
        for workspace in workspaces:
            rel = workspace.relative(key) if "://" not in key else None
            if rel is not None:
                return rel
        return key

    # ---- index maintenance -----------------------------------------------------------

    def _refresh(self, key: str) -> None:
        """Re-chunk an edited open document (caller holds the lock)."""
        if key not in self._dirty:
            return
        self._dirty.discard(key)
        text = self._open.get(key)
        if text is None:
            return
        if not is_text(text):
            self._note_module(key, None)
            self._replace(key, [])
            return
        self._note_module(key, text)
        self._replace(key, split_chunks(key, text, self.chunk_lines))

    def _note_module(self, key: str, text: str | None) -> None:
        """Keep a Python file's outline and imports (for the "imports" strategy)."""
        if text is None or not is_python(key):
            with self._lock:
                self._modules.pop(key, None)
            return
        digest = chunk_digest(key, text)
        with self._lock:
            old = self._modules.get(key)
        if old is not None and old.digest == digest:
            return
        info = ModuleInfo(Outline.of(text), tuple(imports_of(text)), digest)
        with self._lock:
            self._modules[key] = info

    def _replace(self, key: str, chunks: list[Chunk]) -> None:
        if not chunks:
            with self._lock:
                self._modules.pop(key, None)
        changed = self.index.replace(key, chunks) if chunks else self.index.remove(key)
        if changed:
            with self._lock:
                listeners = list(self._listeners)
            for listener in listeners:
                try:
                    listener(key)
                except Exception:
                    log.exception("context: invalidation listener failed for %s", key)

    def _workspace_of(self, key: str) -> ContextFolder | None:
        with self._lock:
            for workspace in self._workspaces.values():
                if workspace.relative(key) is not None:
                    return workspace
        return None

    def _on_disk_changes(self, paths: set[str]) -> None:
        self._tasks.put(("changed", paths))

    def _work(self) -> None:
        while True:
            task = self._tasks.get()
            try:
                if task is None:
                    return
                kind, arg = task
                if kind == "scan":
                    self._scan(arg)  # type: ignore[arg-type]
                elif kind == "forget":
                    self._forget(arg)  # type: ignore[arg-type]
                elif kind == "changed":
                    self._apply_changes(arg)  # type: ignore[arg-type]
            except Exception:
                log.exception("context: %s failed", task[0] if task else "task")
            finally:
                self._tasks.task_done()

    def _load_from_disk(self, workspace: ContextFolder, key: str) -> None:
        with self._lock:
            if key in self._open:
                return  # the editor's text wins while the document is open
        text = workspace.read(key)
        self._note_module(key, text)
        self._replace(key, split_chunks(key, text, self.chunk_lines) if text is not None else [])

    def _scan(self, workspace: ContextFolder) -> None:
        with self._lock:
            if self._workspaces.get(workspace.root) is not workspace:
                return  # removed before its scan ran
        found = set()
        for path in workspace.scan():
            key = str(path)
            found.add(key)
            self._load_from_disk(workspace, key)
        for key in self.index.paths():
            if key not in found and workspace.relative(key) is not None:
                with self._lock:
                    if key in self._open:
                        continue
                self._replace(key, [])
        log.debug("context: indexed %d files of %s (%d chunks in all)", len(found), workspace.root, len(self.index))

    def _forget(self, workspace: ContextFolder) -> None:
        for key in self.index.paths():
            if workspace.relative(key) is not None and self._workspace_of(key) is None:
                with self._lock:
                    if key in self._open:
                        continue
                self._replace(key, [])

    def _apply_changes(self, paths: set[str]) -> None:
        rescans: list[ContextFolder] = []
        for raw in sorted(paths):
            key = document_key(raw)
            workspace = self._workspace_of(key)
            if workspace is None:
                continue
            if os.path.basename(key) == ".gitignore":
                rel = workspace.relative(key) or ""
                workspace.rules.forget(rel.rsplit("/", 1)[0] if "/" in rel else "")
                if workspace not in rescans:
                    rescans.append(workspace)
                continue
            if os.path.isdir(key):
                if workspace not in rescans:
                    rescans.append(workspace)  # a folder appeared (moved in, unpacked...)
                continue
            if not os.path.exists(key):  # deleted: a file, or a folder and all below it
                inside = key.rstrip(os.sep) + os.sep
                for indexed in self.index.paths():
                    if indexed.startswith(inside):
                        self._load_from_disk(workspace, indexed)
            self._load_from_disk(workspace, key)
        for workspace in rescans:
            self._scan(workspace)


_ATTRIBUTE_BEFORE = re.compile(r"([A-Za-z_]\w*)\.\w*$")


def document_key(path: str) -> str:
    """The gatherer's identity for a document: an absolute path, or the URI as given."""
    return path if "://" in path else os.path.abspath(path)


def _window_text(text: str, cursor: int, window: tuple[int, int] | None) -> str:
    if window is not None:
        start, end = window
        return text[max(0, start) : max(0, end)]
    before = text[:cursor].splitlines(keepends=True)[-WINDOW_LINES_BEFORE:]
    after = text[cursor:].splitlines(keepends=True)[:WINDOW_LINES_AFTER]
    return "".join(before + after)


def _significant_lines(text: str) -> set[str]:
    """Lines that identify content (trimmed; braces and blank lines say nothing)."""
    return {s for s in (line.strip() for line in text.splitlines()) if len(s) > 3}


def _duplicate_fraction(text: str, local: set[str]) -> float:
    lines = [s for s in (line.strip() for line in text.splitlines()) if len(s) > 3]
    if not lines:
        return 1.0
    return sum(1 for s in lines if s in local) / len(lines)


__all__ = ["ContextGatherer", "Selection", "document_key", "estimate_tokens"]
