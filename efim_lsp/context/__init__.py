"""Cross-file context for completions (no torch, no token ids).

Map: `workspace.py` (which files qualify) → `ignore.py` (.gitignore + vendor folders) →
`chunking.py` (64-line chunks and their identifiers) → `ranking.py` (BM25 index);
`imports.py` (a file's imports) → `modules.py` (the indexed files they name) → `outline.py`
(a module's definitions as one chunk) → `definitions.py` (every indexed module's outline and
imports); `picking.py` (BM25's best chunks, trimmed to their share) → `gatherer.py`
(`ContextGatherer`: open documents + watched workspace folders, stable selection for a cursor:
imports, recent files, BM25) ←
`watcher.py` (watchfiles thread); `source.py` (the completer's source, fed by the server) →
`prefetch.py` (chunk KV computed ahead in the background). Import names, no index needed:
`import_names.py` (where a `from X import` list wants a name, which of X's names the file
needs) ← `module_names.py` (X's names read from its file or open document when asked),
resolved by `modules.py` over the workspace folders.
"""

from efim_lsp.context.chunking import CHUNK_LINES, Chunk, identifiers, split_chunks
from efim_lsp.context.gatherer import ContextGatherer, document_key
from efim_lsp.context.ranking import ChunkIndex

__all__ = ["ContextGatherer", "ChunkIndex", "Chunk", "CHUNK_LINES", "identifiers", "split_chunks", "document_key"]
