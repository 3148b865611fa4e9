"""The embedded-Neovim driver lives in bench/nvim_driver.py (the benchmarks drive Neovim
too); this name stays for the editor tests' `from embedded_nvim import EmbeddedNvim`, with
the tests' one way of opening a file under our plugin (`open_with_plugin`)."""

from __future__ import annotations

from pathlib import Path

from bench.nvim_driver import EmbeddedNvim, NvimError


def open_with_plugin(nvim: EmbeddedNvim, setup: str, cmd: list[str], model: Path, path: Path) -> None:
    """Run the plugin's `setup` Lua chunk (given the server command and the model), edit
    `path`, and wait until the efim client attached and its model finished loading."""
    nvim.command("filetype on")
    nvim.command("set noautoindent nosmartindent")  # the typed text carries its own indentation
    nvim.lua(setup, cmd, str(model))
    nvim.command(f"edit {path}")
    nvim.wait_for("return require('efim').status().client_id", timeout=10, what="the efim client to attach")
    # The model loads in the background; $/progress tells the plugin when it is ready.
    nvim.wait_for("return require('efim').status().state == 'ready'", timeout=30, what="model load progress to end")


__all__ = ["EmbeddedNvim", "NvimError", "open_with_plugin"]
