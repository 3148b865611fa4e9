"""The embedded-Neovim driver lives in bench/nvim_driver.py (the benchmarks drive Neovim
too); this name stays for the editor tests' `from embedded_nvim import EmbeddedNvim`."""

from bench.nvim_driver import EmbeddedNvim, NvimError

__all__ = ["EmbeddedNvim", "NvimError"]
