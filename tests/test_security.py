"""Security checks as tests: no pickle-based deserialisation anywhere in the shipped code,
and `efim serve` speaks over stdio only (no network listener)."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("efim_lsp", "engine", "kernels", "efim_tools", "bench")
# `torch.load(` anywhere without weights_only=True in the same call, and any pickle load.
TORCH_LOAD = re.compile(r"\btorch\.load\s*\(")
PICKLE_LOAD = re.compile(r"\b(c?pickle|_pickle|dill|joblib)\.loads?\s*\(|\bpickle\.Unpickler\b|\bnp\.load\s*\([^)]*allow_pickle\s*=\s*True")


def _call_text(source: str, start: int) -> str:
    """The text of the call whose '(' is at or after `start`, to its matching ')'."""
    i = source.index("(", start)
    depth = 0
    for j in range(i, len(source)):
        depth += {"(": 1, ")": -1}.get(source[j], 0)
        if depth == 0:
            return source[i : j + 1]
    return source[i:]


def unsafe_loads(root: Path = REPO) -> list[str]:
    found = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            source = path.read_text(encoding="utf-8", errors="replace")
            for m in TORCH_LOAD.finditer(source):
                if not re.search(r"weights_only\s*=\s*True", _call_text(source, m.start())):
                    found.append(f"{path.relative_to(root)}:{source.count(chr(10), 0, m.start()) + 1}: torch.load without weights_only=True")
            for m in PICKLE_LOAD.finditer(source):
                found.append(f"{path.relative_to(root)}:{source.count(chr(10), 0, m.start()) + 1}: {m.group(0)}")
    return found


def test_no_pickle_deserialisation_in_the_source_tree():
    assert unsafe_loads() == []


def test_the_check_finds_what_it_looks_for(tmp_path):
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "bad.py").write_text(
        "import pickle, torch\n"
        "a = torch.load(path)\n"
        "b = torch.load(path, map_location='cpu',\n    weights_only=True)\n"
        "c = pickle.loads(blob)\n"
        "d = pickle.load(f)\n"
    )
    for package in PACKAGES:
        (tmp_path / package).mkdir(exist_ok=True)
    found = unsafe_loads(tmp_path)
    assert [f.split(":")[1] for f in found] == ["2", "5", "6"], found


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = fd.readlink().as_posix()
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    return inodes


def _inet_sockets(pid: int, inodes: set[str]) -> list[str]:
    """The process's TCP/UDP sockets (IPv4 and IPv6): 'proto state local-address'."""
    found = []
    for proto in ("tcp", "tcp6", "udp", "udp6"):
        table = Path(f"/proc/{pid}/net/{proto}")
        if not table.exists():
            continue
        for row in table.read_text().splitlines()[1:]:
            cols = row.split()
            if cols[9] in inodes:
                found.append(f"{proto} state {cols[3]} {cols[1]}")
    return found


def test_efim_serve_has_no_network_socket(tiny_model_dir):
    import sys

    sys.path.insert(0, str(REPO / "tests" / "lsp"))
    from stdio_client import ServerProcess, inline_params

    with ServerProcess(["--model", str(tiny_model_dir), "--kv-budget", "16MB"]) as server:
        server.initialize({"maxTokens": 4})
        assert server.wait_model()["model"]["state"] == "ready"
        server.open("file:///s.py", "def f(x):\n    \n")
        assert "result" in server.request("textDocument/inlineCompletion", inline_params("file:///s.py", 1, 4), timeout=60)
        time.sleep(0.2)
        inodes = _socket_inodes(server.proc.pid)
        assert _inet_sockets(server.proc.pid, inodes) == []  # no TCP listener, no TCP/UDP socket at all
        # stdin and stdout are the pipes the client holds
        for fd in (0,):
            assert Path(f"/proc/{server.proc.pid}/fd/{fd}").readlink().as_posix().startswith("pipe:")
        assert server.shutdown_and_exit() == 0


def _rejected_messages_with(secret: str) -> list[bytes]:
    """Bodies a buggy client might send, each carrying document text the log must not quote."""
    import json

    opened = {"textDocument": {"uri": "file:///p.py", "languageId": "python", "version": 0, "text": secret}}
    return [
        json.dumps({"jsonrpc": "2.0", "method": "textDocument/didOpen", "params": {"textDocument": {"text": secret}}}).encode(),
        json.dumps({"jsonrpc": "1.0", "method": "textDocument/didOpen", "params": opened}).encode(),
        json.dumps({"method": "textDocument/didOpen", "params": opened}).encode(),
        json.dumps([opened]).encode(),
        b'{"jsonrpc": "2.0", "method": "textDocument/didOpen", "params": {"text": "' + secret.encode() + b'"',
        b"\xff" + secret.encode(),
        b"Content-Type: x\r\n" + secret.encode() + b"\r\n",  # framing garbage
    ]


@pytest.mark.parametrize("level", ["info", "debug"])
def test_the_log_file_is_private_and_quotes_no_document_text_below_debug(tmp_path, level):
    import os
    import stat
    import sys

    sys.path.insert(0, str(REPO / "tests" / "lsp"))
    from stdio_client import ServerProcess, frame

    secret = "password_hunter2 = 'do not log me'"
    log_file = tmp_path / "serve.log"
    with ServerProcess(["--model", "/nonexistent-model", "--log-level", level, "--log-file", str(log_file)]) as server:
        server.initialize()
        for body in _rejected_messages_with(secret):
            server.send_bytes(frame(body) if not body.startswith(b"Content-Type") else body)
        server.request("efim/stats")  # answered after every message above was read
        assert server.shutdown_and_exit() == 0
    mode = stat.S_IMODE(os.stat(log_file).st_mode)
    assert mode == 0o600, oct(mode)
    text = log_file.read_text()
    assert "not JSON" in text and "JSON-RPC 2.0" in text  # the rejections are logged...
    if level == "info":
        assert "hunter2" not in text, [line for line in text.splitlines() if "hunter2" in line]  # ...without the text
    else:
        assert "hunter2" in text  # asked for: DEBUG quotes what was rejected
