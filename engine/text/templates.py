"""FIM prompt templates, detected from a tokenizer's special tokens.

A template turns an `InfillRequest` into an ordered tuple of `Segment`s: sentinel
tokens as ids, text as strings. `engine.text.tokenize` tokenizes every text segment on its
own and concatenates the ids, so a segment's ids never depend on the segments after
it — that is what lets an EFIM prompt be an exact token prefix of the next keystroke's
(docs/design.md, "Prefix stability").

Layouts (P = prefix, S = suffix, I = increment, C = context chunks):

    efim   : [BOS] C PRE P SUF S MID I      suffix-first (Codestral): [BOS] C SUF S PRE P I
    fim    : [BOS] C PRE (P+I) SUF S MID    suffix-first:             [BOS] C SUF S PRE (P+I)
    prefix : [BOS] C P I                    (also what every format becomes without FIM tokens)

`prefix` keeps P and I as separate segments for the same reason EFIM does: the next
keystroke only appends to I.

Context chunks use the model's repo-level layout where it has one (`<file_sep>path\\n`
text for StarCoder2 / Qwen2.5-Coder, `<|file_separator|>` for CodeGemma); other models
get a comment header line (`# path` / `// path`) in the chunk's language.
"""

from __future__ import annotations

import dataclasses
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Literal, NamedTuple

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from engine.api import ContextChunk, InfillRequest, PromptFormat

SegmentRole = Literal["bos", "sentinel", "chunk", "prefix", "suffix", "increment", "probe"]


class Segment(NamedTuple):
    """One piece of a prompt: a sentinel token id (int) or a text (str) tokenized on its own."""

    value: int | str
    role: SegmentRole
    # SentencePiece models only: keep the tokenizer's word-boundary space ("▁") in front
    # of this text. CodeLlama was trained with it on the prefix and without it elsewhere.
    dummy_prefix: bool = False


@dataclasses.dataclass(frozen=True)
class FimTemplate:
    """Sentinel ids and layout rules of one model family (`name` is shown in `EngineInfo`)."""

    name: str
    prefix_id: int | None = None
    suffix_id: int | None = None
    middle_id: int | None = None  # None for suffix-first templates without a middle token
    suffix_first: bool = False
    file_sep_id: int | None = None
    # Tokens that end a completion besides the model's EOS (generating a sentinel is an end).
    stop_ids: frozenset[int] = frozenset()
    # Ids the tokenizer's post-processor puts before a text (e.g. Llama's <s>); the
    # template places them once, at the very start.
    bos_ids: tuple[int, ...] = ()
    prefix_dummy_space: bool = False
    # The sentinel in front of a request's `probe` (a next-edit question after the prompt);
    # None: the template takes no probes.
    probe_id: int | None = None

    @property
    def supports_fim(self) -> bool:
        return self.prefix_id is not None and self.suffix_id is not None

    def render(self, request: InfillRequest, fmt: PromptFormat | None = None) -> tuple[Segment, ...]:
        """Segments of `request` in format `fmt` (default: the request's). Empty text
        segments are left out; a model without FIM tokens renders every format as `prefix`."""
        fmt = fmt or request.format
        if fmt not in ("efim", "fim", "prefix"):
            raise ValueError(f"unknown prompt format {fmt!r}; expected 'efim', 'fim' or 'prefix'")
        if not self.supports_fim:
            fmt = "prefix"
        segs: list[Segment] = [Segment(i, "bos") for i in self.bos_ids]
        segs += self.render_chunks(request.chunks)
        P, S, I = request.prefix, request.suffix, request.increment  # noqa: E741
        pre = Segment(P, "prefix", self.prefix_dummy_space)
        if fmt == "prefix":
            segs += [pre, Segment(I, "increment")]
        elif self.suffix_first:
            segs += [Segment(self.suffix_id, "sentinel"), Segment(S, "suffix"), Segment(self.prefix_id, "sentinel")]
            segs += [pre, Segment(I, "increment")] if fmt == "efim" else [pre._replace(value=P + I)]
        else:
            segs.append(Segment(self.prefix_id, "sentinel"))
            segs.append(pre if fmt == "efim" else pre._replace(value=P + I))
            segs += [Segment(self.suffix_id, "sentinel"), Segment(S, "suffix"), Segment(self.middle_id, "sentinel")]
            if fmt == "efim":
                segs.append(Segment(I, "increment"))
        if request.probe:
            if self.probe_id is None:
                raise ValueError(f"the {self.name} template takes no probe (next-edit checks need the efim-spm adapter)")
            segs += [Segment(self.probe_id, "sentinel"), Segment(request.probe, "probe")]
        return tuple(s for s in segs if not (isinstance(s.value, str) and s.value == ""))

    def render_chunks(self, chunks: tuple[ContextChunk, ...]) -> list[Segment]:
        """Context chunks in this model's repo-level layout (two segments per chunk with a
        file separator, one otherwise). Each chunk's text ends with a newline."""
        out: list[Segment] = []
        for chunk in chunks:
            text = chunk.text if chunk.text.endswith("\n") else chunk.text + "\n"
            if self.file_sep_id is not None:
                out += [Segment(self.file_sep_id, "sentinel"), Segment(f"{chunk.path}\n{text}", "chunk")]
            else:
                out.append(Segment(f"{comment_marker(chunk.path)} {chunk.path}\n{text}", "chunk"))
        return out


# Line-comment marker by file extension, for the chunk header of models without a file separator.
_SLASH_COMMENT = {"c", "h", "cc", "cpp", "cxx", "hpp", "cs", "java", "js", "jsx", "ts", "tsx", "go", "rs",
                  "swift", "kt", "kts", "scala", "dart", "php", "zig", "proto", "css", "scss", "groovy"}
_DASH_COMMENT = {"lua", "sql", "hs", "elm", "ada", "adb"}
_PERCENT_COMMENT = {"tex", "m", "erl"}
_SEMI_COMMENT = {"lisp", "clj", "cljs", "el", "scm", "asm"}


def comment_marker(path: str) -> str:
    """The line-comment marker of `path`'s language (`#` when unknown)."""
    ext = PurePosixPath(path).suffix.lstrip(".").lower()
    if ext in _SLASH_COMMENT:
        return "//"
    if ext in _DASH_COMMENT:
        return "--"
    if ext in _PERCENT_COMMENT:
        return "%"
    if ext in _SEMI_COMMENT:
        return ";"
    return "#"


class _Family(NamedTuple):
    name: str
    prefix: str
    suffix: str
    middle: str | None
    file_sep: str | None
    # Extra end tokens (present ones are used); all sentinels above are end tokens too.
    ends: tuple[str, ...]
    suffix_first: bool = False
    prefix_dummy_space: bool = False
    # Tokens that must be present too (tells apart families sharing sentinel spellings).
    requires: tuple[str, ...] = ()
    # The sentinel a probe (a next-edit question) follows; only a layout trained with it.
    probe: str | None = None


# Order matters: CodeGemma shares Qwen's `<|fim_prefix|>` spellings and is recognised by its
# `<|file_separator|>`, so it is tried first.
FAMILIES: tuple[_Family, ...] = (
    _Family("codegemma", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|file_separator|>",
            ("<eos>", "<end_of_turn>"), requires=("<|file_separator|>",)),
    _Family("qwen2.5-coder", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|file_sep|>",
            ("<|endoftext|>", "<|fim_pad|>", "<|repo_name|>", "<|im_end|>")),
    _Family("starcoder", "<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<file_sep>",
            ("<|endoftext|>", "<fim_pad>", "<repo_name>", "<filename>")),
    _Family("deepseek-coder", "<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>", None,
            ("<｜end▁of▁sentence｜>", "<|EOT|>")),
    _Family("codellama", "▁<PRE>", "▁<SUF>", "▁<MID>", None, ("▁<EOT>", "</s>"), prefix_dummy_space=True),
    _Family("codellama", "<PRE>", "<SUF>", "<MID>", None, ("<EOT>", "</s>"), prefix_dummy_space=True),
    _Family("codestral", "[PREFIX]", "[SUFFIX]", None, None, ("</s>", "[MIDDLE]"), suffix_first=True),
    # This project's suffix-first adapter layout (efim_tools.training.samples.SPM_SENTINELS).
    _Family("efim-spm", "<spm_prefix>", "<spm_suffix>", None, None, ("<|endoftext|>", "<spm_middle>", "<spm_pad>"), suffix_first=True,
            probe="<spm_middle>"),
)

PREFIX_ONLY = "prefix-only"


def detect_template(tokenizer: Tokenizer, family: str | None = None) -> FimTemplate:
    """The first family in `FAMILIES` whose sentinels are all in `tokenizer`'s vocabulary;
    a prefix-only template when none matches. StarCoder1's `<filename>` stands in for
    `<file_sep>` when only it exists. `family` (a family name) considers only that
    family: training picks its layout's family even when a tokenizer has both."""
    tid = tokenizer.token_to_id
    bos_ids = bos_ids_of(tokenizer)
    for fam in FAMILIES:
        if family is not None and fam.name != family:
            continue
        needed = [fam.prefix, fam.suffix, *([fam.middle] if fam.middle else []), *fam.requires]
        if any(tid(t) is None for t in needed):
            continue
        file_sep = tid(fam.file_sep) if fam.file_sep else None
        if fam.name == "starcoder" and file_sep is None:
            file_sep = tid("<filename>")
        stops = {tid(t) for t in (fam.prefix, fam.suffix, fam.middle, fam.file_sep, *fam.ends) if t}
        if file_sep is not None:
            stops.add(file_sep)
        stops.discard(None)
        return FimTemplate(
            name=fam.name,
            prefix_id=tid(fam.prefix),
            suffix_id=tid(fam.suffix),
            middle_id=tid(fam.middle) if fam.middle else None,
            suffix_first=fam.suffix_first,
            file_sep_id=file_sep,
            stop_ids=frozenset(stops),
            bos_ids=bos_ids,
            prefix_dummy_space=fam.prefix_dummy_space,
            probe_id=tid(fam.probe) if fam.probe else None,
        )
    return FimTemplate(name=PREFIX_ONLY, bos_ids=bos_ids)


def bos_ids_of(tokenizer: Tokenizer) -> tuple[int, ...]:
    """Ids the tokenizer's post-processor adds in front of any text (`<s>` for Llama-style
    tokenizers; none for byte-level GPT-2-style ones)."""
    plain = tokenizer.encode("x", add_special_tokens=False).ids
    full = tokenizer.encode("x", add_special_tokens=True).ids
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return tuple(full[:start])
    return ()


__all__ = ["Segment", "SegmentRole", "FimTemplate", "FAMILIES", "PREFIX_ONLY", "detect_template", "bos_ids_of",
           "comment_marker"]
