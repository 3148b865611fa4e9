"""The KV stores: the radix prefix cache over the paged slot pool (`radix`), CacheBlend's
chunk store (`chunk_store`), each document's retained KV between keystrokes (`retained`),
and the disk tier (`disk_format` for the files, `disk_tier` for the thread that fills them)."""
