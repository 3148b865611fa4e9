"""CacheBlend: chunks prefilled alone keep their KV wherever they land, a few rows are
recomputed (`blend`); windows assembled from a document's stored pieces (`document_kv`)."""
