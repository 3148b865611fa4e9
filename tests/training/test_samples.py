"""Sample builders keep every character, and layouts match the engine's segment order."""

from __future__ import annotations

import random

import pytest
from tokenizers import AddedToken, Tokenizer

from engine.api import InfillRequest
from engine.prompting import PromptBuilder
from engine.text.templates import detect_template
from engine.text.tokenize import SegmentTokenizer
from tiny_models import tiny_tokenizer_json
from efim_tools.training.data import HELD_OUT_MODULES, Corpus, held_out_files, training_files
from efim_tools.training.samples import FIM_SENTINELS, SENTINELS, SPM_SENTINELS, FimIds, SampleBuilder, SampleConfig, build_sample, choose_middle, suffix_informed_lines


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    tok = Tokenizer.from_str(tiny_tokenizer_json(False))  # no FIM tokens: add them as training does
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in FIM_SENTINELS])
    return tok


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    return Corpus(training_files())


def _check(tok, sample, window=None, layout="psm"):
    fim = FimIds.from_tokenizer(tok, layout)
    if window is not None:
        assert sample.document == window
    for seg in sample.segments:
        assert tok.decode(list(seg.ids), skip_special_tokens=False) == seg.text, seg.role
    roles = [s.role for s in sample.segments]
    by_role = {s.role: s for s in sample.segments}
    if sample.kind == "plain":
        assert roles == ["text"] and sample.ids == list(by_role["text"].ids) and all(sample.targets)
        return
    middle_ids = [i for s in sample.segments if s.role in ("increment", "middle") for i in s.ids]
    if layout == "spm":
        expected = [fim.suffix, *by_role["suffix"].ids, fim.prefix, *by_role["prefix"].ids, *middle_ids, fim.eot]
    else:
        expected = [fim.prefix, *by_role["prefix"].ids, fim.suffix, *by_role["suffix"].ids, fim.middle, *middle_ids, fim.eot]
    assert sample.ids == expected
    n_head = len(expected) - len(middle_ids) - 1
    assert sample.targets == [False] * n_head + [True] * (len(middle_ids) + 1)


@pytest.mark.parametrize("fragment", [True, False])
def test_builder_keeps_every_character(tokenizer, corpus, fragment):
    builder = SampleBuilder(tokenizer, corpus, SampleConfig(fragment=fragment, min_window_tokens=64, max_window_tokens=160), seed=5)
    kinds = set()
    for i in range(60):
        s = builder.sample(i)
        kinds.add(s.kind)
        _check(tokenizer, s)
        assert len(s.document) > 0
        if s.kind == "efim" and fragment:
            assert [x.role for x in s.segments] == ["prefix", "increment", "middle", "suffix"]
    assert kinds == {"fim", "efim", "plain"}


def test_suffix_first_layout_puts_the_middle_right_after_the_prefix(corpus):
    tok = Tokenizer.from_str(tiny_tokenizer_json(False))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPM_SENTINELS])
    builder = SampleBuilder(tok, corpus, SampleConfig(layout="spm", min_window_tokens=64, max_window_tokens=160), seed=5)
    fim = FimIds.detect(tok)
    assert fim.layout == "spm" and builder.fim == fim
    kinds = set()
    for i in range(40):
        s = builder.sample(i)
        kinds.add(s.kind)
        _check(tok, s, layout="spm")
    assert kinds == {"fim", "efim", "plain"}
    with pytest.raises(ValueError, match="lacks"):
        SampleBuilder(tok, corpus, SampleConfig(layout="psm"))  # the tokenizer has only the SPM sentinels
    with pytest.raises(ValueError, match="layout"):
        SampleConfig(layout="mps").validate()


def test_same_seed_same_text_with_and_without_fragments(tokenizer, corpus):
    a = SampleBuilder(tokenizer, corpus, SampleConfig(fragment=True, fragment_prob=1.0, min_window_tokens=64, max_window_tokens=128), seed=2)
    b = SampleBuilder(tokenizer, corpus, SampleConfig(fragment=False, min_window_tokens=64, max_window_tokens=128), seed=2)
    differ = 0
    for i in range(20):
        x, y = a.sample(i), b.sample(i)
        assert x.document == y.document and x.kind == y.kind
        differ += x.ids != y.ids
    assert differ > 10  # fragmenting really changed the ids


@pytest.mark.parametrize("kind", ["fim", "efim", "plain"])
def test_build_sample_on_awkward_text(tokenizer, kind):
    cfg = SampleConfig(fragment=True, fragment_prob=1.0, fragment_mean_chars=3)
    for seed in range(30):
        window = "é\tx = 'ü'\n\n  return  f(ā)\n" + "#" * seed
        sample = build_sample(SegmentTokenizer(tokenizer), FimIds.from_tokenizer(tokenizer), window, kind, random.Random(seed), cfg)
        _check(tokenizer, sample, window)


@pytest.mark.parametrize(("layout", "family"), [("psm", "starcoder"), ("spm", "efim-spm")])
def test_a_samples_prompt_is_what_serving_renders_for_its_text(corpus, layout, family):
    """One renderer: a training sample's ids up to the middle's first target equal the ids
    the engine's prompt builder gives a request with the sample's prefix, suffix and
    increment (fragments off: cut pieces are tokenized differently on purpose)."""
    tok = Tokenizer.from_str(tiny_tokenizer_json(False))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SENTINELS[layout]])
    serving = PromptBuilder(detect_template(tok), SegmentTokenizer(tok), fragment_trained=True)
    assert serving.template.name == family
    cfg = SampleConfig(layout=layout, fragment=True, fragment_prob=0.0, min_window_tokens=64, max_window_tokens=160)
    builder = SampleBuilder(tok, corpus, cfg, seed=11)
    checked = {"fim": 0, "efim": 0}
    for i in range(60):
        sample = builder.sample(i)
        if sample.kind == "plain":
            continue
        seg = {s.role: s for s in sample.segments}
        inc = seg["increment"].text if "increment" in seg else ""
        req = InfillRequest(key="k", prefix=seg["prefix"].text, suffix=seg["suffix"].text, increment=inc, format="efim", context="off")
        rendered = serving.encode(req).ids
        assert sample.ids[: len(rendered)] == rendered, (i, sample.kind)
        n_head = len(rendered) - (len(seg["increment"].ids) if inc else 0)
        assert not any(sample.targets[:n_head]) and all(sample.targets[n_head:])  # loss on the middle only
        checked[sample.kind] += 1
    assert checked["fim"] > 5 and checked["efim"] > 5


def test_held_out_modules_never_in_training():
    train = {f.name for f in training_files()}
    held = {f.name for f in held_out_files()}
    assert held and not (train & held)
    assert held <= set(HELD_OUT_MODULES)


def test_missing_sentinels_is_a_clear_error():
    tok = Tokenizer.from_str(tiny_tokenizer_json(False))
    with pytest.raises(ValueError, match="sentinels"):
        FimIds.from_tokenizer(tok)


def test_line_start_bias_puts_middles_where_the_cursor_usually_is():
    window = "".join(f"    def f{n}(x):\n        return x + {n}\n\n" for n in range(30))
    line_starts = {0} | {i + 1 for i, ch in enumerate(window) if ch == "\n"}
    def indent_end(i: int) -> bool:
        before = window[window.rfind("\n", 0, i) + 1 : i]
        return window[i] not in " \n" and before != "" and before.strip(" ") == ""

    after_indent = {i for i in range(len(window)) if indent_end(i)}

    def starts(prob: float) -> list[int]:
        cfg = SampleConfig(line_start_prob=prob)
        return [choose_middle(window, random.Random(i), cfg)[0] for i in range(400)]

    biased, uniform = starts(1.0), starts(0.0)
    assert all(s in line_starts or s in after_indent for s in biased)
    assert sum(s in line_starts for s in biased) > 120 and sum(s in after_indent for s in biased) > 120
    assert sum(s in line_starts or s in after_indent for s in uniform) < 100  # a random character mostly is neither
    # Off means no extra random draw: a run configured before the bias existed keeps its data.
    assert uniform == [random.Random(i).randrange(0, len(window) - 1) for i in range(400)]
    for i in range(100):
        start, end = choose_middle(window, random.Random(i), SampleConfig(line_start_prob=0.5))
        assert 0 <= start < end <= len(window)
    with pytest.raises(ValueError, match="line_start_prob"):
        SampleConfig(line_start_prob=1.5).validate()


def test_suffix_informed_middles_are_lines_the_suffix_pins_down():
    window = (
        "def largest_divisor(n):\n"
        "    # scan downwards\n"
        "    for i in reversed(range(n)):\n"
        "        if n % i == 0:\n"
        "            return i\n"
        "    total = n + 1\n"
        "    print('done')\n"
        "    if opt_name in seen:\n"
        "        opt_name.strip()\n"
        "    return total\n"
    )
    picked = suffix_informed_lines(window)
    lines = {window[s : window.index("\n", s)].strip() for s in picked}
    # binds a name used later: the parameter `n`, `i`, `total`; `if opt_name in seen:` uses
    # `opt_name` first but binds nothing (it came from above the window)
    assert lines == {"def largest_divisor(n):", "for i in reversed(range(n)):", "total = n + 1"}
    cfg = SampleConfig(suffix_informed_prob=1.0)
    for i in range(50):
        start, end = choose_middle(window, random.Random(i), cfg)
        line_start = window.rfind("\n", 0, start) + 1
        assert line_start in picked
        assert window[start:end].count("\n") <= 1 and window[start:end].rstrip("\n").count("\n") == 0  # one line
    # a window with no such line falls back to the ordinary draw
    assert suffix_informed_lines("x = 1\ny = 2\n") == []
    start, end = choose_middle("x = 1\ny = 2\n", random.Random(0), cfg)
    assert 0 <= start < end <= len("x = 1\ny = 2\n")
    with pytest.raises(ValueError, match="suffix_informed_prob"):
        SampleConfig(suffix_informed_prob=-0.1).validate()


def test_blank_middles_move_to_the_next_line_with_code():
    """With `blank_middle_keep` 0, no middle starts on a blank line or is whitespace only
    (they teach the blank answer on a fresh line); at 1.0 the stream is the old one."""
    window = "".join(f"    def f{n}(x):\n\n        return x + {n}\n    \n" for n in range(30))

    def middles(keep: float, prob: float = 1.0) -> list[tuple[int, int]]:
        cfg = SampleConfig(line_start_prob=prob, blank_middle_keep=keep)
        return [choose_middle(window, random.Random(i), cfg) for i in range(400)]

    def blank_first_line(start: int) -> bool:
        end = window.find("\n", start)
        return not window[start : end if end >= 0 else len(window)].strip()

    kept, dropped = middles(1.0), middles(0.0)
    assert sum(blank_first_line(s) for s, _ in kept) > 40  # short lines, so a character falls in them less often
    assert not any(blank_first_line(s) or not window[s:e].strip() for s, e in dropped)
    line_starts = {0} | {i + 1 for i, ch in enumerate(window) if ch == "\n"}
    assert all(s in line_starts or window[s - 1] == " " for s, _ in dropped)  # still where a cursor sits
    # A share in between keeps about that share of the blank ones.
    some = sum(blank_first_line(s) for s, _ in middles(0.5))
    assert 0.3 * sum(blank_first_line(s) for s, _ in kept) < some < 0.7 * sum(blank_first_line(s) for s, _ in kept)
    # Off (1.0) draws nothing extra: the stream of a run from before the option is unchanged.
    old = [choose_middle(window, random.Random(i), SampleConfig(line_start_prob=1.0)) for i in range(400)]
    assert kept == old
    with pytest.raises(ValueError, match="blank_middle_keep"):
        SampleConfig(blank_middle_keep=1.5).validate()


@pytest.mark.parametrize(("layout", "family"), [("psm", "starcoder"), ("spm", "efim-spm")])
def test_healed_samples_are_prompted_as_serving_heals(corpus, layout, family):
    """With `healed_prob` 1, a sample whose prompt ends with text is the prompt serving
    builds with token healing on (its last tokens dropped), and its first target token is
    one healing's constraint admits there; the document still is the window."""
    tok = Tokenizer.from_str(tiny_tokenizer_json(False))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SENTINELS[layout]])
    segments = SegmentTokenizer(tok)
    serving = PromptBuilder(detect_template(tok), segments, fragment_trained=True)
    cfg = SampleConfig(layout=layout, fragment=True, fragment_prob=0.3, healed_prob=1.0, min_window_tokens=64, max_window_tokens=160)
    builder = SampleBuilder(tok, corpus, cfg, seed=3)
    healed = {"fim": 0, "efim": 0}
    for i in range(80):
        sample = builder.sample(i)
        _check(tok, sample, layout=layout)
        if sample.kind == "plain":
            continue
        if layout == "psm" and sample.kind == "fim":
            assert not sample.healed  # the prompt ends with a sentinel: nothing to heal
            continue
        if not sample.healed or sample.fragmented:
            continue  # fragments are tokenized differently from serving on purpose
        seg = {s.role: s for s in sample.segments}
        assert seg["middle"].text.startswith(sample.healed)
        # What serving was asked: the dropped text is still in the increment, or in the prefix.
        typed = seg["increment"].text if "increment" in seg else ""
        if sample.kind == "efim":
            req = InfillRequest(key="k", prefix=seg["prefix"].text, suffix=seg["suffix"].text, increment=typed + sample.healed, format="efim", context="off", heal=True)
        else:
            req = InfillRequest(key="k", prefix=seg["prefix"].text + sample.healed, suffix=seg["suffix"].text, format="efim", context="off", heal=True)
        enc = serving.encode(req)
        assert enc.healing is not None and enc.healing.removed_bytes == sample.healed.encode(), i
        n_prompt = len(sample.ids) - len(seg["middle"].ids) - 1
        assert sample.ids[:n_prompt] == enc.ids, (i, sample.kind)
        n_head = n_prompt - len(seg["increment"].ids) if "increment" in seg else n_prompt
        assert not any(sample.targets[:n_head]) and all(sample.targets[n_head:])
        allowed = set(enc.healing.progress(segments.vocab).allowed().tolist())
        assert seg["middle"].ids[0] in allowed, (i, seg["middle"].text[:20])
        healed[sample.kind] += 1
    assert healed["efim"] > 3 and (healed["fim"] > 3 if layout == "spm" else healed["fim"] == 0)
    with pytest.raises(ValueError, match="healed_prob"):
        SampleConfig(healed_prob=-0.1).validate()
