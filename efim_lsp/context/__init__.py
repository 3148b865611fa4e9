"""Cross-file context for completions (no torch, no token ids).

Map: `workspace.py` (which files qualify) → `ignore.py` (.gitignore + vendor folders) →
`chunking.py` (64-line chunks and their identifiers) → `ranking.py` (BM25 index) →
`gatherer.py` (`ContextGatherer`: open documents + watched workspace folders, stable
selection for a cursor) ← `watcher.py` (watchfiles thread).
"""

from efim_lsp.context.chunking import CHUNK_LINES, Chunk, identifiers, split_chunks
from efim_lsp.context.gatherer import ContextGatherer, document_key
from efim_lsp.context.ranking import ChunkIndex

__all__ = ["ContextGatherer", "ChunkIndex", "Chunk", "CHUNK_LINES", "identifiers", "split_chunks", "document_key"]
