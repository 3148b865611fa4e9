"""FIM template detection and rendering."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from engine.api import ContextChunk, InfillRequest
from engine.text.templates import PREFIX_ONLY, comment_marker, detect_template


def _tok_with(specials: list[str]) -> Tokenizer:
    """A tiny word-level tokenizer whose added special tokens are `specials`."""
    vocab = {"[UNK]": 0, "a": 1, "b": 2, "x": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(specials)
    return tok


FAMILY_TOKENS = {
    "starcoder": ["<|endoftext|>", "<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>", "<file_sep>"],
    "qwen2.5-coder": ["<|endoftext|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
                      "<|repo_name|>", "<|file_sep|>"],
    "codegemma": ["<eos>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|file_separator|>"],
    "deepseek-coder": ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜fim▁begin｜>", "<｜fim▁hole｜>",
                       "<｜fim▁end｜>"],
    "codellama": ["<s>", "</s>", "▁<PRE>", "▁<MID>", "▁<SUF>", "▁<EOT>"],
    "codestral": ["<s>", "</s>", "[PREFIX]", "[SUFFIX]", "[MIDDLE]"],
    "efim-spm": ["<|endoftext|>", "<spm_prefix>", "<spm_middle>", "<spm_suffix>", "<spm_pad>"],  # our SPM adapter
}


@pytest.mark.parametrize("family", sorted(FAMILY_TOKENS))
def test_detects_each_family(family):
    tok = _tok_with(FAMILY_TOKENS[family])
    tpl = detect_template(tok)
    assert tpl.name == family
    assert tpl.supports_fim
    # every sentinel is also an end token: a model that emits one has left the middle
    assert tpl.prefix_id in tpl.stop_ids and tpl.suffix_id in tpl.stop_ids


def test_prefix_only_without_sentinels():
    tpl = detect_template(_tok_with(["<|endoftext|>"]))
    assert tpl.name == PREFIX_ONLY and not tpl.supports_fim
    req = InfillRequest(key="k", prefix="P", suffix="S", increment="I", format="efim")
    segs = tpl.render(req)
    assert [s.value for s in segs] == ["P", "I"]  # the suffix cannot be shown to such a model
    assert [s.role for s in segs] == ["prefix", "increment"]


def _ids(tok, *names):
    return [tok.token_to_id(n) for n in names]


def test_efim_and_fim_layouts_starcoder():
    tok = _tok_with(FAMILY_TOKENS["starcoder"])
    tpl = detect_template(tok)
    pre, suf, mid = _ids(tok, "<fim_prefix>", "<fim_suffix>", "<fim_middle>")
    req = InfillRequest(key="k", prefix="P", suffix="S", increment="I")
    assert [s.value for s in tpl.render(req, "efim")] == [pre, "P", suf, "S", mid, "I"]
    assert [s.value for s in tpl.render(req, "fim")] == [pre, "PI", suf, "S", mid]
    assert [s.value for s in tpl.render(req, "prefix")] == ["P", "I"]


def test_suffix_first_codestral():
    tok = _tok_with(FAMILY_TOKENS["codestral"])
    tpl = detect_template(tok)
    pre, suf = _ids(tok, "[PREFIX]", "[SUFFIX]")
    req = InfillRequest(key="k", prefix="P", suffix="S", increment="I")
    vals = [s.value for s in tpl.render(req, "efim")]
    assert vals[-5:] == [suf, "S", pre, "P", "I"]
    assert [s.value for s in tpl.render(req, "fim")][-4:] == [suf, "S", pre, "PI"]


def test_suffix_first_adapter_layout_matches_training():
    """The SPM adapter's prompt at inference is its training head: SUF S PRE P, then I."""
    tok = _tok_with(FAMILY_TOKENS["efim-spm"])
    tpl = detect_template(tok)
    assert tpl.suffix_first and tpl.name == "efim-spm"
    pre, suf = _ids(tok, "<spm_prefix>", "<spm_suffix>")
    req = InfillRequest(key="k", prefix="P", suffix="S", increment="I")
    assert [s.value for s in tpl.render(req, "efim")] == [suf, "S", pre, "P", "I"]
    assert tok.token_to_id("<|endoftext|>") in tpl.stop_ids


def test_probe_follows_the_prompt_only_where_the_template_has_a_probe_sentinel():
    """A next-edit probe goes after the increment, behind <spm_middle>: the document's prompt
    before it is unchanged, so its KV is reused. Other families refuse a probe."""
    tok = _tok_with(FAMILY_TOKENS["efim-spm"])
    tpl = detect_template(tok)
    pre, mid, suf = _ids(tok, "<spm_prefix>", "<spm_middle>", "<spm_suffix>")
    assert tpl.probe_id == mid
    plain = InfillRequest(key="k", prefix="P", suffix="S", increment="I")
    probed = InfillRequest(key="k", prefix="P", suffix="S", increment="I", probe="-a\n+b\n@")
    assert [s.value for s in tpl.render(probed)] == [*[s.value for s in tpl.render(plain)], mid, "-a\n+b\n@"]
    assert [s.role for s in tpl.render(probed)][-2:] == ["sentinel", "probe"]
    for family in ("starcoder", "codestral"):
        other = detect_template(_tok_with(FAMILY_TOKENS[family]))
        assert other.probe_id is None
        with pytest.raises(ValueError, match="takes no probe"):
            other.render(probed)


def test_codellama_prefix_keeps_word_boundary_space_only_on_prefix():
    tpl = detect_template(_tok_with(FAMILY_TOKENS["codellama"]))
    segs = tpl.render(InfillRequest(key="k", prefix="P", suffix="S", increment="I"), "efim")
    spaced = {s.role for s in segs if s.dummy_prefix}
    assert spaced == {"prefix"}


def test_empty_segments_dropped_and_unknown_format_rejected():
    tpl = detect_template(_tok_with(FAMILY_TOKENS["starcoder"]))
    segs = tpl.render(InfillRequest(key="k", prefix="P"), "efim")
    assert all(s.value != "" for s in segs)
    with pytest.raises(ValueError, match="unknown prompt format"):
        tpl.render(InfillRequest(key="k", prefix="P"), "middle")  # type: ignore[arg-type]


def test_chunks_repo_layout_and_comment_header():
    chunks = (ContextChunk(path="lib/util.py", text="def f():\n    pass"), ContextChunk(path="a.ts", text="let x"))
    req = InfillRequest(key="k", prefix="P", chunks=chunks)
    tok = _tok_with(FAMILY_TOKENS["qwen2.5-coder"])
    tpl = detect_template(tok)
    segs = tpl.render(req, "efim")
    sep = tok.token_to_id("<|file_sep|>")
    assert [s.value for s in segs[:4]] == [sep, "lib/util.py\ndef f():\n    pass\n", sep, "a.ts\nlet x\n"]
    # no file separator: one comment header line per chunk, in the chunk's language
    tpl2 = detect_template(_tok_with(FAMILY_TOKENS["deepseek-coder"]))
    texts = [s.value for s in tpl2.render(req, "efim") if s.role == "chunk"]
    assert texts == ["# lib/util.py\ndef f():\n    pass\n", "// a.ts\nlet x\n"]
    assert comment_marker("x.lua") == "--" and comment_marker("Makefile") == "#"


def test_bos_from_post_processor_is_placed_once_at_start():
    from tokenizers import processors

    tok = _tok_with(FAMILY_TOKENS["codellama"])
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    tpl = detect_template(tok)
    segs = tpl.render(InfillRequest(key="k", prefix="P", suffix="S", increment="I"), "efim")
    assert segs[0].value == bos and segs[0].role == "bos"
    assert sum(1 for s in segs if s.value == bos) == 1
