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


def private_dir(path: Path) -> bool:
    """The folder exists (created 0700 here if not), is the user's and no one else may write it."""
    import os  # noqa: PLC0415
    import stat  # noqa: PLC0415

    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = path.stat()
    except OSError:
        return False
    return st.st_uid == os.getuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


__all__ = ["cache_root", "private_dir"]
