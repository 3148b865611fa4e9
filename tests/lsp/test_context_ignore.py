"""The gitignore matcher and the workspace file rules (what may never become context)."""

from __future__ import annotations

import os

import pytest

from efim_lsp.context.ignore import IgnoreRules, parse_gitignore
from efim_lsp.context.workspace import ContextFolder


def _matches(patterns_text: str, rel: str, is_dir: bool = False) -> bool:
    ignored = False
    for p in parse_gitignore(patterns_text):
        if p.dir_only and not is_dir:
            continue
        if p.regex.match(rel):
            ignored = not p.negated
    return ignored


@pytest.mark.parametrize(
    "patterns, rel, is_dir, expected",
    [
        ("*.log", "a/b/x.log", False, True),
        ("*.log\n!keep.log", "a/keep.log", False, False),
        ("/build", "build", True, True),
        ("/build", "src/build", True, False),  # anchored to the root
        ("build", "src/build", True, True),  # unanchored: any depth
        ("docs/*.txt", "docs/a.txt", False, True),
        ("docs/*.txt", "docs/sub/a.txt", False, False),  # `*` does not cross folders
        ("docs/**/*.txt", "docs/sub/deep/a.txt", False, True),
        ("**/gen", "x/y/gen", True, True),
        ("tmp/", "tmp", False, False),  # folders only
        ("tmp/", "tmp", True, True),
        ("file[0-9].py", "file7.py", False, True),
        ("file[!0-9].py", "file7.py", False, False),
        ("# comment\n\n", "comment", False, False),
        ("a?c", "abc", False, True),
        ("a?c", "a/c", False, False),
    ],
)
def test_gitignore_patterns(patterns, rel, is_dir, expected):
    assert _matches(patterns, rel, is_dir) is expected


def test_nested_gitignore_and_parent_exclusion(tmp_path):
    (tmp_path / ".gitignore").write_text("secret/\n*.tmp\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / ".gitignore").write_text("local_*.py\n!important.tmp\n")
    rules = IgnoreRules(tmp_path)
    assert rules.is_ignored("secret/a.py")  # under an ignored folder
    assert rules.is_ignored("x.tmp")
    assert rules.is_ignored("pkg/local_conf.py")
    assert not rules.is_ignored("local_conf.py")  # the nested rule applies only below pkg/
    assert not rules.is_ignored("pkg/important.tmp")  # re-included by the deeper file
    assert rules.is_ignored("node_modules/lib/index.js")  # vendor folder
    assert rules.is_ignored("pkg/bundle.min.js")
    assert not rules.is_ignored("pkg/mod.py")


def test_workspace_admits_only_text_inside_the_folder(tmp_path):
    root = tmp_path / "ws"
    (root / "src").mkdir(parents=True)
    outside = tmp_path / "outside.py"
    outside.write_text("x = 1\n")
    (root / "src" / "ok.py").write_text("def ok():\n    return 1\n")
    (root / "src" / "blob.bin").write_bytes(b"\x00\x01\x02binary")
    (root / "src" / "latin.txt").write_bytes("caf\xe9".encode("latin-1"))
    (root / "src" / "huge.py").write_text("x = 1\n" * 200_000)  # 1.2 MB
    (root / "build").mkdir()
    (root / "build" / "gen.py").write_text("generated = True\n")
    (root / ".gitignore").write_text("ignored.py\n")
    (root / "src" / "ignored.py").write_text("nope = 1\n")
    os.symlink(outside, root / "src" / "link_out.py")
    os.symlink(root / "src" / "ok.py", root / "src" / "link_in.py")

    ws = ContextFolder(root)
    scanned = sorted(p.relative_to(root).as_posix() for p in ws.scan())
    assert "src/ok.py" in scanned and "src/link_in.py" in scanned
    assert "build/gen.py" not in scanned and "src/ignored.py" not in scanned
    assert "src/link_out.py" not in scanned
    assert ws.read(root / "src" / "ok.py").startswith("def ok")
    for name in ("blob.bin", "latin.txt", "huge.py", "link_out.py", "ignored.py"):
        assert ws.read(root / "src" / name) is None, name
    assert ws.read(outside) is None
    with pytest.raises(ValueError, match="not a directory"):
        ContextFolder(tmp_path / "missing")
