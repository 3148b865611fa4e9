"""The VS Code client (editors/vscode): type-check, then its Node tests, which run
the extension's launch and request code against the real `efim serve`.

No VS Code host can run here; everything the extension does outside VS Code's
API lives in `src/core/` and is what these tests exercise.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
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
    env.update(EFIM_SERVER=efim_serve[0], EFIM_TEST_MODEL=str(tiny_model_dir), EFIM_REQUIRE_SERVER="1", EFIM_PYTHON=sys.executable)
    result = _run(["node", "--test", "--test-reporter=tap", "out/test/"], env=env, timeout=150)
    output = result.stdout + result.stderr
    counts = {key: int(n) for key, n in re.findall(r"^# (pass|fail|skipped|cancelled|todo) (\d+)$", result.stdout, re.M)}
    assert result.returncode == 0, output
    assert counts.get("fail") == 0 and counts.get("cancelled") == 0, output
    assert counts.get("skipped") == 0, f"a Node test skipped itself:\n{output}"
    # unit tests of core/ (4 of them core/nextEdit's) + 3 integration tests (efim serve, settings change, next edits)
    assert counts.get("pass", 0) >= 25, output
    assert "# suggestion after" in result.stdout, output  # the integration test reached a real suggestion


def _runtime_packages(lock: dict) -> set[str]:
    """Top-level node_modules packages that are not dev-only: the runtime dependencies and theirs."""
    out = set()
    for key, info in lock["packages"].items():
        if not key.startswith("node_modules/") or info.get("dev") or info.get("devOptional"):
            continue
        out.add(key[len("node_modules/") :].split("/node_modules/")[0])  # a nested copy ships inside its top-level owner
    return out


def test_vsix_package(build):
    """`npm run package` builds efim.vsix with the compiled extension, its manifest, and only the runtime dependencies."""
    assert build.returncode == 0, build.stdout + build.stderr
    vsix = VSCODE / "efim.vsix"
    vsix.unlink(missing_ok=True)
    result = _run(["npm", "run", "--silent", "package"], timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    with zipfile.ZipFile(vsix) as z:
        names = set(z.namelist())
        manifest = json.loads(z.read("extension/package.json"))
    source = json.loads((VSCODE / "package.json").read_text())

    # The compiled extension, without tests, maps or sources.
    compiled = {f"extension/out/{p.relative_to(VSCODE / 'out').as_posix()}" for p in (VSCODE / "out").rglob("*.js") if "test" not in p.parts}
    assert compiled and compiled <= names, sorted(compiled - names)
    assert f"extension/{manifest['main'].removeprefix('./')}" in names
    leaked = [n for n in names if n.startswith(("extension/src/", "extension/out/test/")) or n.endswith((".map", ".ts", ".vsix"))]
    assert leaked == []

    # The manifest VS Code reads: the same contributes (commands, settings) as the source.
    assert manifest["contributes"] == source["contributes"]
    assert {c["command"] for c in manifest["contributes"]["commands"]} == {
        "efim.toggle", "efim.showStats", "efim.restartServer", "efim.nextEdit.apply", "efim.nextEdit.dismiss"}
    # Next-edit keys only while an edit is drawn (Alt+] / Alt+[ stay VS Code's inline-suggestion cycling).
    keys = {(k["command"], k["key"]) for k in manifest["contributes"]["keybindings"]}
    assert keys == {("efim.nextEdit.apply", "alt+n"), ("efim.nextEdit.dismiss", "escape")}
    assert all("efim.nextEditVisible" in k["when"] for k in manifest["contributes"]["keybindings"])
    assert manifest["engines"]["vscode"] == source["engines"]["vscode"]

    # node_modules: exactly the runtime closure of vscode-languageclient (+ the protocol package it
    # brings, which core/ imports), per the lock file; no dev tool (typescript, vsce, @types).
    lock = json.loads((VSCODE / "package-lock.json").read_text())
    runtime = _runtime_packages(lock)
    assert set(source["dependencies"]) <= runtime and "vscode-languageclient" in runtime
    packaged = set()
    for name in names:
        parts = name.split("/")
        if len(parts) > 3 and parts[:2] == ["extension", "node_modules"]:
            packaged.add("/".join(parts[2:4]) if parts[2].startswith("@") else parts[2])
    assert packaged == runtime, {"extra": sorted(packaged - runtime), "missing": sorted(runtime - packaged)}
    assert not packaged & {"typescript", "@vscode/vsce", "@types/node", "@types/vscode"}
