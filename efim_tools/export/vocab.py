"""The vocabulary of a GGUF export: the source GGUF's tokens with the adapter's tokens
appended at the ids it was trained with, and the FIM token ids llama.cpp reads
(`tokenizer.ggml.fim_{pre,suf,mid,pad,rep,sep}_token_id`).

llama-server's `/infill` needs pre, suf and mid (it refuses without them); with
`--spm-infill` the pinned build makes `[repo header] SUF suffix PRE prefix prompt MID`
(prefix-first without it). pad, rep and sep also end generation there. llama.cpp also finds
some of these tokens by their spelling when the file names none (SmolLM2's `<reponame>`).
"""

from __future__ import annotations

from typing import NamedTuple

# llama.cpp token types (gguf.TokenType)
NORMAL, CONTROL, UNUSED = 1, 3, 5

# Spellings of the roles the engine's templates do not name (middle of a suffix-first
# template, pad, repo name), ours (the shipped adapter's `<spm_*>`) first.
FIM_SPELLINGS: dict[str, tuple[str, ...]] = {
    "mid": ("<spm_middle>", "[MIDDLE]"),
    "pad": ("<spm_pad>", "<fim_pad>", "<|fim_pad|>"),
    "rep": ("<repo_name>", "<|repo_name|>", "<reponame>"),
}
FIM_ROLES = ("pre", "suf", "mid", "pad", "rep", "sep")


class Vocabulary(NamedTuple):
    tokens: list[str]
    token_types: list[int]
    scores: list[float] | None  # only when the source has scores (SentencePiece)


def extend_vocabulary(
    tokens: list[str], token_types: list[int] | None, scores: list[float] | None,
    added: list[tuple[int, str]], n_rows: int,
) -> Vocabulary:
    """The source vocabulary with `added` (id, content) appended as control tokens, then
    padded with unused `[PAD<i>]` tokens up to `n_rows` (the embedding's rows: llama.cpp
    wants one token per row). ValueError when an added token's id is not the next free id
    or the vocabulary would outgrow the embedding."""
    tokens = list(tokens)
    types = list(token_types) if token_types is not None else [NORMAL] * len(tokens)
    scores = list(scores) if scores is not None else None
    for token_id, content in sorted(added):
        if token_id < len(tokens) and tokens[token_id] == content:
            continue  # the source already has it
        if token_id != len(tokens):
            raise ValueError(f"adapter token {content!r} has id {token_id}, but the next free id of the source vocabulary is {len(tokens)}")
        tokens.append(content)
        types.append(CONTROL)
        if scores is not None:
            scores.append(0.0)
    if len(tokens) > n_rows:
        raise ValueError(f"the vocabulary has {len(tokens)} tokens but the embedding only {n_rows} rows")
    for i in range(len(tokens), n_rows):
        tokens.append(f"[PAD{i}]")
        types.append(UNUSED)
        if scores is not None:
            scores.append(-1000.0)
    return Vocabulary(tokens, types, scores)


def fim_token_ids(tokens: list[str], template) -> dict[str, int]:
    """role -> id for the FIM roles llama.cpp should use with this vocabulary.

    `template` (the `engine.text.templates.FimTemplate` the engine detects for the merged
    vocabulary) decides: pre/suf/mid/sep are its sentinels, so `/infill` builds the
    prompts the engine builds. A suffix-first template without a middle token (the shipped
    adapter's) gets its family's unplaced middle token, because llama.cpp always places one.
    rep and sep only with a template that has a file separator: llama.cpp puts
    `REP myproject\n SEP filename\n` in front of every infill prompt when they are set,
    a context a model trained without them (the shipped adapter) never saw. No FIM
    template: no ids (llama-server then refuses `/infill`)."""
    if template is None or not template.supports_fim:
        return {}
    index = {t: i for i, t in enumerate(tokens)}

    def spelled(role: str) -> int | None:
        return next((index[s] for s in FIM_SPELLINGS[role] if s in index), None)

    ids = {"pre": template.prefix_id, "suf": template.suffix_id, "mid": template.middle_id, "pad": spelled("pad")}
    if ids["mid"] is None:
        ids["mid"] = spelled("mid")
    if template.file_sep_id is not None:
        ids["sep"] = template.file_sep_id
        ids["rep"] = spelled("rep")
    return {role: int(i) for role, i in ids.items() if i is not None}


__all__ = ["Vocabulary", "extend_vocabulary", "fim_token_ids", "FIM_ROLES", "FIM_SPELLINGS"]
