"""The KV stores, one contract for all (`store.KVStore`): the radix prefix cache (`radix`)
over the paged slot pool (`pool`), CacheBlend's blend store (`blend_store`), each
document's retained KV between keystrokes (`retained`), and the disk tier (`disk_format`
for the files, `disk_tier` for the thread that fills them); KV budgets in `budget`."""
