"""Offline tools around the serving path: the `efim` CLI and its commands, typing-trace
synthesis and replay, fine-tuning, evaluation. They import `engine` and `efim_lsp`; the
serving path never imports them (import-linter contracts in pyproject.toml)."""
