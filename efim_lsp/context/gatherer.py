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

from efim_lsp.context.chunking import CHUNK_LINES, Chunk, identifiers, split_chunks, sub_chunk
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


class Selection(NamedTuple):
    terms: frozenset[str]
    anchor: Hashable
    budget: tuple[int, int]
    index_version: int  # ChunkIndex.version it was chosen at
    digests: tuple[str, ...]  # the index chunks the selection was cut from
    chunks: tuple[ContextChunk, ...]


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

    def close_document(self, path: str) -> None:
        """The document's chunks stay (with the last editor text) until the file changes on disk."""
        key = document_key(path)
        with self._lock:
            self._refresh(key)
            self._open.pop(key, None)
            self._selections.pop(key, None)

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
    ) -> tuple[ContextChunk, ...]:
        """Chunks of other files for a completion at code-point offset `cursor` of `text`
        (the document `path`), least relevant first so the most relevant sits next to the
        local prompt. At most `max_chunks` chunks and `max_tokens` tokens in total;
        `window` = (start, end) offsets of the local prompt window (chunks mostly inside
        it are dropped). The same selection is returned while the user types in one place
        (see the module docstring)."""
        if max_chunks <= 0 or max_tokens <= 0:
            return ()
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
            if (
                last is not None
                and last.anchor == anchor
                and last.budget == budget
                and last.index_version == self.index.version
                and jaccard(last.terms, terms) >= STABLE_JACCARD
            ):
                return last.chunks
            version = self.index.version
        local = _significant_lines(_window_text(text, cursor, window))
        picked = self._pick(key, terms, local, max_chunks, max_tokens)
        picked.sort(key=lambda item: (item[0], item[1].path, item[1].start_line))  # ascending relevance
        selection = Selection(
            terms=terms,
            anchor=anchor,
            budget=budget,
            index_version=version,
            digests=tuple(source.digest for _score, _chunk, source in picked),
            chunks=tuple(ContextChunk(path=self.display_path(c.path), text=c.text) for _s, c, _src in picked),
        )
        with self._lock:
            self._selections[key] = selection
        return selection.chunks

    def _pick(
        self, key: str, terms: frozenset[str], local: set[str], max_chunks: int, max_tokens: int
    ) -> list[tuple[float, Chunk, Chunk]]:
        per_chunk = max(MIN_CHUNK_TOKENS, max_tokens // max_chunks)
        picked: list[tuple[float, Chunk, Chunk]] = []  # (score, chunk as used, chunk in index)
        seen: set[str] = set()
        total = 0
        for scored in self.index.search(terms, exclude_paths=(key,), limit=max_chunks * 4):
            if len(picked) == max_chunks:
                break
            source = scored.chunk
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
            self._replace(key, [])
            return
        self._replace(key, split_chunks(key, text, self.chunk_lines))

    def _replace(self, key: str, chunks: list[Chunk]) -> None:
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
