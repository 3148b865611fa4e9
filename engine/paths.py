"""Where the engine keeps files of its own: one root for converted models and the KV disk tier."""

from __future__ import annotations

from pathlib import Path


def cache_root() -> Path:
    """$EFIM_CACHE_DIR, else $XDG_CACHE_HOME/efim-lsp, else ~/.cache/efim-lsp."""
    import os  # noqa: PLC0415

    if os.environ.get("EFIM_CACHE_DIR"):
        return Path(os.environ["EFIM_CACHE_DIR"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "efim-lsp"


__all__ = ["cache_root"]
