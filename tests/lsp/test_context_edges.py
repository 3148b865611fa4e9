"""Bad workspaces: symlink loops, files that are huge, binary, unreadable or change while
being read are skipped with one log line each, and the rest is still indexed; with
context on, indexing starts at `initialized`, not at the first request."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from efim_lsp.context import ContextGatherer
from efim_lsp.context.source import WorkspaceContext
from efim_lsp.context.workspace import ContextFolder
from efim_lsp.server import build_server

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lsp_fakes import FakeEngine  # noqa: E402
from test_context_push import _Client  # noqa: E402


def _skips(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("context: skipped")]


def test_a_symlink_loop_is_skipped_and_the_scan_goes_on(tmp_path, caplog):
    root = tmp_path / "ws"
    root.mkdir()
    (root / "a_first.py").write_text("def first():\n    return 1\n")
    os.symlink(root / "loop_b", root / "loop_a")
    os.symlink(root / "loop_a", root / "loop_b")
    (root / "sub").mkdir()
    os.symlink(root, root / "sub" / "up")  # a folder link back up: not followed
    (root / "z_last.py").write_text("def last():\n    return 2\n")
    caplog.set_level(logging.INFO, logger="efim_lsp.context")
    scanned = sorted(p.name for p in ContextFolder(root).scan())
    assert scanned == ["a_first.py", "z_last.py"]
    loops = [m for m in _skips(caplog) if "loop_" in m]
    assert len(loops) == 2 and all("link not resolvable" in m for m in loops)  # one line each

    g = ContextGatherer(watch=False)
    try:
        g.set_workspaces([root])
        assert g.wait_idle(10)
        assert sorted(Path(p).name for p in g.index.paths()) == ["a_first.py", "z_last.py"]
    finally:
        g.close()


def test_each_skipped_file_gets_one_log_line_with_its_reason(tmp_path, caplog, monkeypatch):
    root = tmp_path / "ws"
    (root / "node_modules" / "dep").mkdir(parents=True)
    (root / "node_modules" / "dep" / "index.js").write_text("module.exports = 1\n")
    (root / "ok.py").write_text("x = 1\n")
    (root / "huge.py").write_text("x = 1\n" * 200_000)
    (root / "blob.py").write_bytes(b"\x00\x01binary")
    (root / "latin.py").write_bytes("caf\xe9 = 1\n".encode("latin-1"))
    (root / "secret.py").write_text("token = 1\n")
    (root / "moving.py").write_text("grows = 1\n")
    real_read = Path.read_bytes

    def read_bytes(self):
        if self.name == "secret.py":  # tests run as root: chmod 000 would not stop a read
            raise PermissionError(13, "Permission denied")
        data = real_read(self)
        if self.name == "moving.py":
            with open(self, "a") as f:
                f.write("more = 2\n")  # written to while being read
        return data

    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    caplog.set_level(logging.INFO, logger="efim_lsp.context")
    g = ContextGatherer(watch=False)
    try:
        g.set_workspaces([root])
        assert g.wait_idle(10)
        assert [Path(p).name for p in g.index.paths()] == ["ok.py"]
    finally:
        g.close()
    lines = _skips(caplog)
    reasons = {name: [m for m in lines if f"/{name} " in m] for name in ("huge.py", "blob.py", "latin.py", "secret.py", "moving.py", "node_modules")}
    assert all(len(found) == 1 for found in reasons.values()), reasons
    assert "over" in reasons["huge.py"][0] and "binary" in reasons["blob.py"][0] and "UTF-8" in reasons["latin.py"][0]
    assert "unreadable" in reasons["secret.py"][0] and "changed while being read" in reasons["moving.py"][0]
    assert "vendor" in reasons["node_modules"][0]
    assert not any("index.js" in m for m in lines)  # a skipped folder is one line, not one per file


async def test_with_context_on_the_workspace_is_indexed_at_initialized(tmp_path):
    root = tmp_path / "ws"
    root.mkdir()
    (root / "lib.py").write_text("def helper():\n    return 1\n")
    source = WorkspaceContext(watch=False)
    server = build_server(lambda model, **_options: FakeEngine(), context_source=source)
    client = _Client(server)
    try:
        client.send("initialize", {"processId": None, "rootUri": root.as_uri(), "capabilities": {},
                                   "initializationOptions": {"context": "blend"}}, msg_id=1)
        assert source.status()["folders"] == 0  # told at initialize, indexed from initialized on
        client.send("initialized", {})
        assert source.gatherer.wait_idle(10)
        assert source.status()["folders"] == 1 and source.status()["files"] == 1  # no request was made
    finally:
        server.close()
        source.close()
