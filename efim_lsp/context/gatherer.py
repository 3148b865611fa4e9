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
import threading
from pathlib import Path
from typing import Callable, Hashable, NamedTuple

from engine.api import ContextChunk

from efim_lsp.context.chunking import CHUNK_LINES, Chunk, chunk_digest, identifiers, split_chunks
from efim_lsp.context.definitions import ModuleDefinitions
from efim_lsp.context.foreground import ForegroundGate
from efim_lsp.context.picking import MIN_CHUNK_TOKENS, Picked, by_relevance, pick_chunks, share, significant_lines, window_text
from efim_lsp.context.ranking import ChunkIndex, jaccard
from efim_lsp.context.watcher import WorkspaceWatcher
from efim_lsp.context.workspace import ContextFolder, is_text

log = logging.getLogger(__name__)

# Lines around the cursor whose identifiers form the query.
QUERY_LINES_BEFORE = 40
QUERY_LINES_AFTER = 10
# Keep the previous selection while the query identifiers are at least this similar.
STABLE_JACCARD = 0.7


def estimate_tokens(text: str) -> int:
    """Token count when no tokenizer is attached yet (code averages ~3.5 characters a token)."""
    return max(1, (len(text) * 2 + 6) // 7)


# Strategies of `select`: "imports" (definitions of what the file imports, then recently
# edited open documents, then BM25) or "bm25" (BM25 over every chunk alone).
STRATEGIES = ("imports", "bm25")
# Open documents (most recently edited or opened first) the "imports" strategy looks at after the imports.
RECENT_DOCUMENTS = 3


class Selection(NamedTuple):
    terms: frozenset[str]
    anchor: Hashable
    budget: tuple[int, int]
    index_version: int  # ChunkIndex.version it was chosen at
    digests: tuple[str, ...]  # the index chunks the selection was cut from
    chunks: tuple[ContextChunk, ...]
    strategy: str = "bm25"
    sources: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (path, its chunks' digests) of every file used


class ContextGatherer:
    """Keeps the candidate chunks and answers `select` for a cursor. Thread-safe.

    Keys: a document is identified by its file-system path (made absolute) or, for
    documents that have none, by its URI string. Listeners added with `add_listener`
    are called with a key whenever that key's chunks change or disappear (a file
    edited in the editor or on disk), so caches of their KV can be dropped — not when a
    file is indexed for the first time (nothing can hold KV of chunks that did not exist,
    and a first scan of 10,000 files would otherwise send 10,000 drops to the engine).
    """

    def __init__(
        self,
        *,
        count_tokens: Callable[[str], int] | None = None,
        chunk_lines: int = CHUNK_LINES,
        watch: bool = True,
        debounce_ms: int = 300,
        gate: ForegroundGate | None = None,
    ) -> None:
        self.chunk_lines = chunk_lines
        self.gate = gate if gate is not None else ForegroundGate()  # disk work waits between files while it is busy
        self.index = ChunkIndex(read_text=self.current_text)  # disk files' chunk texts read back when picked
        self._count_tokens = count_tokens
        self._token_cache: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._workspaces: dict[Path, ContextFolder] = {}
        self._open: dict[str, str] = {}
        self._dirty: set[str] = set()
        self._selections: dict[str, Selection] = {}
        self._recent: collections.OrderedDict[str, None] = collections.OrderedDict()  # open documents, last edited last
        self._listeners: list[Callable[[str], None]] = []
        self._lock = threading.RLock()
        # Python files of the index: outline and imports (the "imports" strategy)
        self.definitions = ModuleDefinitions(
            self.index, self._lock, roots=self._roots, count_tokens=self.count_tokens, display_path=self.display_path,
            read_text=self.current_text,
        )
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
        self.definitions.forget_rendered()

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
            "pausedS": round(self.gate.paused_s, 1),  # indexing's waits for requests and model loads
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
        local = significant_lines(window_text(text, cursor, window))
        if strategy == "imports":
            chosen = self._pick_tiered(key, text, cursor, terms, local, max_chunks, max_tokens)
        else:
            picked = by_relevance(self._pick(key, terms, local, max_chunks, max_tokens))
            chosen = [(p.chunk.path, p.chunk, p.source.digest) for p in picked]
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
        return self.index.digests_of(path)

    # ---- the "imports" strategy ------------------------------------------------------

    def _roots(self) -> tuple[Path, ...]:
        with self._lock:
            return tuple(self._workspaces)

    def imported_modules(self, path: str, text: str, cursor: int | None = None, terms: frozenset[str] = frozenset()) -> list[str]:
        """The indexed modules `text` (the document `path`) imports, most relevant to the
        cursor first (`definitions.ModuleDefinitions.imported_modules`)."""
        return self.definitions.imported_modules(document_key(path), text, cursor, terms)

    def definition_chunk(self, path: str, max_tokens: int) -> ContextChunk | None:
        """The outline of the indexed Python module `path` (`outline.Outline`) in at most
        `max_tokens` tokens; None when it has none (not Python, does not parse, nothing public)."""
        return self.definitions.definition_chunk(path, max_tokens)

    def import_chunks(self, path: str, text: str, *, max_chunks: int = 4, max_tokens: int = 1024,
                      pause: Callable[[], None] = lambda: None) -> list[ContextChunk]:
        """The definition chunks of the modules `text` imports, in text order (no cursor):
        what a request in the document is likely to use, for computing their KV ahead.
        `pause()` is called before each module (a background caller: `gate.pause_point`)."""
        per_chunk = share(max_tokens, max_chunks)
        out = []
        for module in self.imported_modules(path, text):
            pause()
            chunk = self.definition_chunk(module, per_chunk)
            if chunk is not None:
                out.append(chunk)
        return out

    def popular_chunks(self, *, max_chunks: int = 4, max_tokens: int = 1024, limit: int = 64,
                       pause: Callable[[], None] = lambda: None) -> list[ContextChunk]:
        """Definition chunks of the indexed modules that the most indexed files import
        (ties: path order), at most `limit`: the likely chunks of a workspace. `pause()` is
        called every few modules (a background caller: `gate.pause_point`)."""
        return self.definitions.popular(share(max_tokens, max_chunks), limit, pause)

    def _pick_tiered(
        self, key: str, text: str, cursor: int, terms: frozenset[str], local: set[str], max_chunks: int, max_tokens: int
    ) -> list[tuple[str, ContextChunk | Chunk, str]]:
        """(path, chunk, digest) least relevant first: imports' definitions, then the best
        chunk of each recently edited open document, then BM25 (see `select`)."""
        per_chunk = share(max_tokens, max_chunks)
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
                recent = [(p.source.path, p.chunk, p.source.digest) for p in by_relevance(picked)]
                total += sum(self.count_tokens(c.text) for _p, c, _d in recent)
                used |= {p for p, _c, _d in recent}
        fallback: list[tuple[str, ContextChunk | Chunk, str]] = []
        left = max_chunks - len(imported) - len(recent)
        if left > 0 and max_tokens - total >= MIN_CHUNK_TOKENS:
            picked = self._pick(key, terms, local, left, max_tokens - total, exclude_paths=used, per_chunk=per_chunk)
            fallback = [(p.source.path, p.chunk, p.source.digest) for p in by_relevance(picked)]
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
    ) -> list[Picked]:
        """BM25's best chunks of files other than `key` (`picking.pick_chunks`)."""
        return pick_chunks(
            self.index, terms, local, max_chunks, max_tokens, self.count_tokens,
            exclude_paths={key} | (exclude_paths or set()), only_paths=only_paths, per_chunk=per_chunk,
        )

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

    def current_text(self, key: str) -> str | None:
        """The text of `key` as context sees it: the editor's while open, else the file's
        in its workspace folder (None: neither, or not readable as context)."""
        with self._lock:
            text = self._open.get(key)
        if text is not None:
            return text
        workspace = self._workspace_of(key)
        return workspace.read(key) if workspace is not None else None

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
            self.definitions.note(key, None)
            self._replace(key, [])
            return
        self.definitions.note(key, text)
        self._replace(key, split_chunks(key, text, self.chunk_lines))

    def _replace(self, key: str, chunks: list[Chunk]) -> None:
        if not chunks:
            self.definitions.forget(key)
        had = bool(self.index.digests_of(key))
        changed = self.index.replace(key, chunks, keep_text=key in self._open) if chunks else self.index.remove(key)
        if changed and had:  # a file indexed for the first time has no KV anywhere to drop
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
        self.definitions.note(key, text)
        self._replace(key, split_chunks(key, text, self.chunk_lines) if text is not None else [])

    def _scan(self, workspace: ContextFolder) -> None:
        with self._lock:
            if self._workspaces.get(workspace.root) is not workspace:
                return  # removed before its scan ran
        found = set()
        for path in workspace.scan():
            key = str(path)
            found.add(key)
            self.gate.pause_point()
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
                self.gate.pause_point()
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
            self.gate.pause_point()
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


def document_key(path: str) -> str:
    """The gatherer's identity for a document: an absolute path, or the URI as given."""
    return path if "://" in path else os.path.abspath(path)


__all__ = ["ContextGatherer", "Selection", "document_key", "estimate_tokens"]
