from peers_fixtures import exported_gguf, llama_bin  # noqa: F401
