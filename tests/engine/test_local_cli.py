"""`efim complete` on a tiny model, and its position/window helpers."""

from __future__ import annotations

import json

import pytest

from efim_tools.cli import main
from efim_tools.commands.complete import split_at, window


def test_split_at_and_bad_positions():
    text = "a = 1\nbcd = 2\nlast"
    assert split_at(text, 1, 3) == ("a = 1\n", "bcd", " = 2\nlast")
    assert split_at(text, 2, 4) == ("a = 1\nbcd = 2\n", "last", "")
    with pytest.raises(ValueError, match="line 3"):
        split_at(text, 3, 0)
    with pytest.raises(ValueError, match="column 9"):
        split_at(text, 0, 9)


def test_window_keeps_whole_lines_within_budget():
    text = "".join(f"line {i}\n" for i in range(100))
    count = lambda s: len(s.split())  # noqa: E731 - two "tokens" per line
    tail = window(text, 21, count, keep_end=True)
    assert tail == "".join(f"line {i}\n" for i in range(90, 100))
    head = window(text, 20, count, keep_end=False)
    assert head == "".join(f"line {i}\n" for i in range(10))
    assert window("short\n", 5, count, keep_end=True) == "short\n"


def test_complete_json_on_tiny_model(tiny_model_factory, tmp_path, capsys):
    src = tmp_path / "demo.py"
    src.write_text("import os\n\n\ndef main():\n    path = os.getcwd()\n    retu\n\nmain()\n", encoding="utf-8")
    model = str(tiny_model_factory("llama"))
    code = main(["complete", str(src), "--line", "5", "--col", "8", "--model", model, "--dtype", "fp32",
                 "--max-tokens", "5", "--json", "--kv-budget", "16M"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"text", "prompt_tokens", "reused_tokens", "ttft_ms", "total_ms"}
    assert out["prompt_tokens"] > 10 and out["reused_tokens"] == 0 and out["total_ms"] >= out["ttft_ms"] > 0
    # a position outside the file is a clear CLI error, not a traceback
    assert main(["complete", str(src), "--line", "99", "--col", "0", "--model", model]) == 2
    assert "outside the file" in capsys.readouterr().err
