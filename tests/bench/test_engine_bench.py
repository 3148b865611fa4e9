"""bench.engine_bench helpers (the benchmark itself runs outside pytest: `efim bench engine`)."""

from __future__ import annotations

import pytest

from bench.engine_bench import head_tokens, keystroke_series, keystroke_window, memory_bandwidth_gbs, stdlib_text


def words(s: str) -> int:
    return len(s.split())


def test_keystroke_window_shape():
    text = stdlib_text()
    prefix, line, suffix = keystroke_window(text, words, prefix_tokens=300, suffix_tokens=100)
    assert len(line.strip()) >= 20 and "\n" not in line
    assert words(prefix) <= 300 and words(suffix) <= 100 and words(suffix) > 50
    assert text.index(prefix + line) >= 0 and (line + "\n" + suffix) in text
    assert words(head_tokens(text, 50, words)) <= 50


def test_memory_bandwidth_is_positive():
    assert memory_bandwidth_gbs(size_mb=16, repeats=2) > 0


def test_keystroke_series_efim_prefills_a_few_tokens(tiny_model_factory):
    from engine.local import load_engine

    eng = load_engine(str(tiny_model_factory("llama")), dtype="fp32", kv_budget="32M")
    try:
        P, line, S = keystroke_window(stdlib_text(), eng.count_tokens, prefix_tokens=400, suffix_tokens=150)
        efim = keystroke_series(eng, P, line, S, "efim", 6)
        fim = keystroke_series(eng, P, line, S, "fim", 6)
    finally:
        eng.close()
    assert all(p <= 4 for p, _ in efim)
    assert min(p for p, _ in fim) > 100  # FIM re-prefills the suffix at every keystroke
