"""The VS Code client (editors/vscode): type-check, then its Node tests, which run
the extension's launch and request code against the real `efim serve`.

No VS Code host can run here; everything the extension does outside VS Code's
API lives in `src/core/` and is what these tests exercise.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

VSCODE = Path(__file__).resolve().parents[2] / "editors" / "vscode"


@pytest.fixture(scope="module")
def npm() -> str:
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip("node/npm not found on PATH: install Node.js >= 18 to run the VS Code client tests")
    major = int(re.match(r"v(\d+)", subprocess.run([node, "--version"], capture_output=True, text=True, timeout=10).stdout).group(1))
    if major < 18:
        pytest.skip(f"Node.js {major} is too old for `node --test` (needs >= 18)")
    if not (VSCODE / "node_modules" / "vscode-languageclient").is_dir():
        pytest.skip("editors/vscode/node_modules missing: run `bash editors/setup.sh` (npm ci) first")
    return npm


def _run(cmd: list[str], *, env: dict[str, str] | None = None, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=VSCODE, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def build(npm) -> subprocess.CompletedProcess:
    """`npm run compile`: a strict `tsc -p .` — the same diagnostics as `tsc --noEmit`, plus out/."""
    return _run([npm, "run", "--silent", "compile"], timeout=180)


def test_typecheck(build):
    assert build.returncode == 0, build.stdout + build.stderr


def test_node_tests_against_efim_serve(build, efim_serve, tiny_model_dir):
    assert build.returncode == 0, build.stdout + build.stderr
    env = dict(os.environ)
    env.update(EFIM_SERVER=efim_serve[0], EFIM_TEST_MODEL=str(tiny_model_dir), EFIM_REQUIRE_SERVER="1")
    result = _run(["node", "--test", "--test-reporter=tap", "out/test/"], env=env, timeout=150)
    output = result.stdout + result.stderr
    counts = {key: int(n) for key, n in re.findall(r"^# (pass|fail|skipped|cancelled|todo) (\d+)$", result.stdout, re.M)}
    assert result.returncode == 0, output
    assert counts.get("fail") == 0 and counts.get("cancelled") == 0, output
    assert counts.get("skipped") == 0, f"a Node test skipped itself:\n{output}"
    assert counts.get("pass", 0) >= 18, output  # 17 unit tests of core/ + the integration test
    assert "# suggestion after" in result.stdout, output  # the integration test reached a real suggestion
