"""Fixtures shared by the editor-client tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EFIM = Path(sys.executable).parent / "efim"


@pytest.fixture(scope="session")
def efim_serve() -> list[str]:
    """The command line of the real server (this venv's `efim serve`)."""
    if not EFIM.exists():
        pytest.skip(f"{EFIM} missing: install the project (make setup) to run the editor tests")
    probe = subprocess.run([str(EFIM), "serve", "--help"], capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        pytest.skip(f"`efim serve` is not available: {probe.stderr.strip()[-300:]}")
    return [str(EFIM), "serve"]
