"""`python lsp_tap.py LOG -- CMD...`: the stdio tap, moved to bench/lsp_tap.py (the
benchmarks tap Neovim's traffic too); this path stays for the editor tests. Runs it."""

import runpy
from pathlib import Path

if __name__ == "__main__":
    runpy.run_path(str(Path(__file__).resolve().parents[2] / "bench" / "lsp_tap.py"), run_name="__main__")
