"""llama.vim's `/infill` request as `efim bench peers` replays it (`efim_tools.peers.llama_vim`)."""

from __future__ import annotations

from efim_tools.peers.llama_vim import InfillLayout, infill_body


def chars(text: str) -> int:  # a stand-in tokenizer: one token per character
    return len(text)


DOC = "import os\n\ndef f(x):\n    y = x + 1\n    ret\n    pass\n\nprint(f(2))\n"


def test_the_cursor_line_goes_behind_the_middle_and_the_rest_after_it():
    cursor = DOC.index("    ret") + len("    ret")
    body = infill_body(DOC, cursor, InfillLayout(prefix_tokens=10_000, suffix_tokens=10_000), chars)
    assert body["prompt"] == "    ret"  # the typed line, after the middle sentinel
    assert body["input_prefix"] == DOC[: DOC.index("    ret")]  # whole lines above
    assert body["input_suffix"] == "\n" + DOC[DOC.index("    pass") :]  # rest of the line, lines below
    assert body["input_prefix"] + body["prompt"] + body["input_suffix"] == DOC  # nothing lost or added
    assert body["n_indent"] == 4 and body["cache_prompt"] is True and body["stream"] is True
    assert body["stop"] == ["\n"] and body["input_extra"] == []


def test_windows_are_cut_to_the_token_budgets_in_whole_lines():
    cursor = DOC.index("    ret") + len("    ret")
    body = infill_body(DOC, cursor, InfillLayout(prefix_tokens=30, suffix_tokens=12), chars)
    # 30 - len("    ret") = 23 characters of whole lines above: "    y = x + 1\n" (14) fits, "def f(x):\n" (10) does not
    assert body["input_prefix"] == "    y = x + 1\n"
    # the rest of the line ("\n", 1) plus whole lines below within 12: "    pass\n" (9) fits, "\n" (1) fits, "print(f(2))\n" not
    assert body["input_suffix"] == "\n    pass\n\n"
    assert chars(body["input_prefix"]) + chars(body["prompt"]) <= 30
    assert chars(body["input_suffix"]) <= 12


def test_a_cursor_at_the_start_and_the_end_of_a_document():
    start = infill_body(DOC, 0, InfillLayout(), chars)
    assert start["input_prefix"] == "" and start["prompt"] == "" and start["input_suffix"].startswith("import os\n")
    end = infill_body(DOC, len(DOC), InfillLayout(), chars)
    assert end["prompt"] == "" and end["input_suffix"] == "\n" and end["input_prefix"] == DOC
