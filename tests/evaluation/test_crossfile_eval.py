"""`efim eval crossfile`: targets drawn from a tiny package written here (names from a sibling
module, unseen earlier in their own file), the scores, bad packages, and one run of the
command through `efim serve` with a tiny random model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from efim_tools.evaluation.crossfile import (
    PackageError,
    Target,
    configurations,
    find_targets,
    name_hit,
    resolve_package,
    score,
    suggestion_at,
)

REPO = Path(__file__).resolve().parents[2]

SHAPES = '''"""Shapes of crosspkg."""

DEFAULT_SIDE = 2


class Square:
    def __init__(self, side=DEFAULT_SIDE):
        self.side = side


def make_square(side):
    return Square(side)


def decode(data):
    return data


def helper():
    return 1


def area_of(side):
    return side * side
'''

REPORT = '''"""Reports."""
from crosspkg import shapes
from .shapes import make_square


def describe(side):
    # the helper is called below
    square = make_square(side)
    return helper() + str(shapes.DEFAULT_SIDE)


def total(sides):
    return sum(area_of(s) for s in sides)


def area_of(side):
    return side


def unit():
    data = b"x"
    return data.decode("ascii"), "\U0001d535", Square
'''

INIT = '''"""A tiny package."""
from crosspkg.shapes import Square
'''

# (file, line, name, text before the cursor, rest of the line): every target of the package
EXPECTED = {
    ("__init__.py", 2, "Square", "from crosspkg.shapes import ", "Square"),
    ("report.py", 3, "make_square", "from .shapes import ", "make_square"),
    ("report.py", 9, "DEFAULT_SIDE", "    return helper() + str(shapes.", "DEFAULT_SIDE)"),
    ("report.py", 22, "Square", '    return data.decode("ascii"), "\U0001d535", ', "Square"),
}


def write_package(root: Path) -> Path:
    pkg = root / "crosspkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(INIT, encoding="utf-8")
    (pkg / "shapes.py").write_text(SHAPES, encoding="utf-8")
    (pkg / "report.py").write_text(REPORT, encoding="utf-8")
    (pkg / "__pycache__").mkdir()
    (pkg / "__pycache__" / "junk.py").write_text("make_square = 1\n", encoding="utf-8")
    return pkg


def test_targets_need_a_sibling_name_unseen_earlier_in_their_file(tmp_path):
    pkg = resolve_package(str(write_package(tmp_path)))
    assert pkg.name == "crosspkg" and pkg.files == ("__init__.py", "report.py", "shapes.py")
    targets = find_targets(pkg)
    # Left out: make_square's second use (seen on line 3), helper (seen in a comment first),
    # area_of (report.py defines it too), data.decode (read off a local, not off the package).
    assert {(t.file, t.line_no, t.name, t.before, t.rest) for t in targets} == EXPECTED
    for t in targets:
        assert t.defined_in == ("shapes.py",)
        original = (pkg.root / t.file).read_text(encoding="utf-8").split("\n")
        opened = t.text.split("\n")
        line = t.line_no - 1
        assert original[line] == t.before + t.rest  # the cursor sits right before the name
        assert original[line][t.column:].startswith(t.name)
        assert opened[line] == t.before  # the rest of the line is removed...
        assert opened[:line] == original[:line] and opened[line + 1 :] == original[line + 1 :]  # ...and nothing else
        assert not any(t.name in earlier for earlier in original[:line])
    astral = next(t for t in targets if "\U0001d535" in t.before)
    assert astral.column == len(astral.before) and astral.character == astral.column + 1  # LSP counts UTF-16 units


def test_the_sample_is_fixed_by_the_seed(tmp_path):
    pkg = resolve_package(str(write_package(tmp_path)))
    everything = set(find_targets(pkg))
    samples = {seed: find_targets(pkg, limit=2, seed=seed) for seed in range(8)}
    for seed, sample in samples.items():
        assert len(sample) == 2 and set(sample) <= everything
        assert find_targets(pkg, limit=2, seed=seed) == sample
    assert len({tuple(s) for s in samples.values()}) > 1  # another seed, another sample
    assert set(find_targets(pkg, limit=10, seed=3)) == everything


def test_packages_resolve_by_import_name_and_bad_ones_are_named(tmp_path, monkeypatch):
    write_package(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert resolve_package("crosspkg").root == (tmp_path / "crosspkg").resolve()
    assert len(resolve_package("email").files) > 10  # a standard-library package, read where it is
    with pytest.raises(PackageError, match="no_such_package_here.*not found"):
        resolve_package("no_such_package_here")
    with pytest.raises(PackageError, match="'textwrap'.*single module"):
        resolve_package("textwrap")
    lonely = tmp_path / "lonely"
    lonely.mkdir()
    (lonely / "__init__.py").write_text("X = 1\n")
    with pytest.raises(PackageError, match="lonely.*1 module"):
        resolve_package(str(lonely))


def test_scores():
    target = Target("p", "m.py", 1, 4, "make_square", ("shapes.py",), "x = ", "make_square(side)", "x = \n")
    assert score("make_square(side)  ", target) == (True, True, 1.0)
    hit, exact, sim = score("make_square(2)\nmore", target)  # one line is scored
    assert hit and not exact and sim == pytest.approx(1 - 4 / 17)
    assert score("make_squares(side)", target)[:2] == (False, False)
    assert not name_hit(" make_square", "make_square") and name_hit("make_square.x", "make_square")
    assert score("", target) == (False, False, 0.0)
    # An item whose range starts before the cursor repeats the text there.
    item = {"insertText": "= make_square(", "range": {"start": {"line": 0, "character": 2}, "end": {"line": 0, "character": 4}}}
    assert suggestion_at({"items": [item]}, target) == "make_square("
    assert suggestion_at({"items": []}, target) == "" and suggestion_at(None, target) == ""


def test_configurations_cross_the_context_budgets():
    configs = configurations(["off", "blend"], chunks=[4, 8], tokens=None, extra={"maxTokens": 8})
    assert [c.name for c in configs] == ["off", "blend/chunks 4", "blend/chunks 8"]
    assert configs[0].settings == {"timeoutMs": 0, "maxTokens": 8, "multiline": "never", "firstWindowTokens": 0, "context": "off"}
    assert configs[2].settings["contextChunks"] == 8 and configs[2].settings["context"] == "blend"
    with pytest.raises(ValueError, match="unknown context configuration 'full'"):
        configurations(["full"])


def test_configurations_may_name_the_selection():
    configs = configurations(["off", "blend:bm25", "prefix:imports", "blend"])
    assert [c.name for c in configs] == ["off", "blend:bm25", "prefix:imports", "blend"]
    assert configs[1].settings["contextSelection"] == "bm25" and configs[1].settings["context"] == "blend"
    assert configs[2].settings["contextSelection"] == "imports" and configs[2].settings["context"] == "prefix"
    assert "contextSelection" not in configs[3].settings  # the server's default
    for bad in ("off:imports", "blend:magic"):
        with pytest.raises(ValueError, match="unknown context configuration"):
            configurations([bad])


def _eval(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "efim_tools.cli", "eval", "crossfile", *args],
                          check=False, capture_output=True, text=True, timeout=timeout, cwd=REPO)


def test_the_command_refuses_an_unknown_package():
    bad = _eval("--packages", "json,no_such_package_here")
    assert bad.returncode != 0
    assert "no_such_package_here" in bad.stderr and "not found" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.slow
def test_the_command_asks_the_server_with_and_without_context(tmp_path, tiny_model_dir):
    pkg = write_package(tmp_path)
    quiet = tmp_path / "quiet"  # two modules, nothing of one used by the other
    quiet.mkdir()
    (quiet / "a.py").write_text("def alpha():\n    return 1\n")
    (quiet / "b.py").write_text("def beta():\n    return 2\n")
    out = tmp_path / "out.json"
    run = _eval("--packages", f"{quiet},{pkg}", "--configs", "off,blend", "--model", str(tiny_model_dir),
                "--config", '{"contextTokens": 256}', "--max-tokens", "8", "--json", str(out), "-q")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "quiet" in run.stderr and "no targets" in run.stderr  # said, then the other package ran
    assert "| off | crosspkg | 4 |" in run.stdout and "| blend | crosspkg | 4 |" in run.stdout
    doc = json.loads(out.read_text())
    by_config: dict[str, dict] = {}
    for r in doc["records"]:
        assert r["package"] == "crosspkg" and r["latency_ms"] > 0 and (r["prompt_tokens"] > 0 or r["import_names"])
        assert (r["file"], r["line_no"], r["name"], r["expected"]) in {(f, n, name, rest) for f, n, name, _, rest in EXPECTED}
        by_config.setdefault(r["config"], {})[(r["file"], r["line_no"])] = r
    assert set(by_config) == {"off", "blend"} and all(len(v) == 4 for v in by_config.values())
    assert any(r["ttft_ms"] for r in doc["records"])
    # The blend server indexed the package's folder and put its sibling module into the prompts.
    assert doc["context_index"]["blend/crosspkg"]["files"] == 3 and not doc["context_index"]["blend/crosspkg"]["indexing"]
    # report.py's import line was answered from the workspace's names (with or without context),
    # not the model: it uses make_square, helper and Square and binds none of them — all three,
    # sorted by type. __init__.py uses nothing below its import: the model answered there.
    for config in ("off", "blend"):
        assert by_config[config][("report.py", 3)]["import_names"] and by_config[config][("report.py", 3)]["suggestion"] == "Square, helper, make_square"
        assert not by_config[config][("__init__.py", 2)]["import_names"]
    for key, off in by_config["off"].items():
        if key[0] == "report.py" and not by_config["blend"][key]["import_names"]:
            assert by_config["blend"][key]["prompt_tokens"] > off["prompt_tokens"] + 20
    assert doc["settings"]["timeoutMs"] == 0 and doc["settings"]["multiline"] == "never"
    # After each first answer: 3 keystrokes (a request each, client time always, TTFT when the
    # engine answered) and the first answer after a jump; their medians are in the table's rows.
    for r in doc["records"]:
        assert len(r["keystrokes"]) == min(3, len(r["expected"])) and all(ms > 0 for ms, _ in r["keystrokes"])
        assert r["jump"] is not None and r["jump"][0] > 0
    assert any(t for r in doc["records"] for _, t in r["keystrokes"]) and any(r["jump"][1] for r in doc["records"])
    rows = {(row["config"], row["package"]): row for row in doc["rows"]}
    assert rows[("blend", "crosspkg")]["keystroke_ms_p50"] > 0 and rows[("off", "crosspkg")]["jump_ms_p50"] > 0
    assert "keystroke p50: client / TTFT" in run.stdout
