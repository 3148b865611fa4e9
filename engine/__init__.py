"""The inference engine: token ids in, tokens out; it knows no LSP.

The boundary (what callers use): `api` (requests, completions, stats, the `Engine` protocol),
`handle` (a submitted request's events), `local` (start the in-process engine), `remote`
(the same `Engine` on an inference server). Inside:

- `prompting`  request -> prompt ids (template, tokenization, healing) and ids -> streamed text
- `scheduling/` the engine thread: loop, admission, steps, finishing, working share, speculation
- `cacheblend/` KV of spans prefilled alone reused wherever it lands; windows assembled from stored pieces
- `kv/`         the KV stores: radix cache over the slot pool, blend store, retained, disk tier
- `text/`       templates, segment tokenization and healing, sampling rules (no model)
- `model/`      the forward pass, weight formats, loading (safetensors, GGUF)
- `runtime/`    process plumbing: loading by name, CPU threads, fault injection for tests
- `adapters/`   the shipped FIM adapter
- `paths`       where the engine keeps its files
"""
