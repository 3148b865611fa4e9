"""Training samples: FIM, EFIM and plain left-to-right, built from windows of real code.

    fim   : PRE prefix SUF suffix MID middle EOT
    efim  : PRE prefix SUF suffix MID inc rest EOT     (middle = inc + rest, inc cut at a random character)
    plain : text

With the suffix-first layout (`layout="spm"`, own sentinels `<spm_*>`) the suffix comes
first and the middle continues the prefix directly — a base model's left-to-right skill
carries over, and typing still only appends to the prompt:

    fim   : SUF suffix PRE prefix middle EOT
    efim  : SUF suffix PRE prefix inc rest EOT

Targets (loss) are everything after the last sentinel for fim/efim and every token for plain.
The prompt head is rendered by serving's own code: `engine.text.templates.FimTemplate.render`
places the sentinels and `engine.text.tokenize.SegmentTokenizer` tokenizes each text segment
on its own, so a sample's head is what the engine runs for the same text (tested). With
fragment tokenization on, the increment is its own segment
(it ends wherever the random cut fell, usually inside a word) and, with probability
`fragment_prob`, every segment is further cut into fragments at random characters.
Without it, `inc + rest` is tokenized as one piece: the model then never sees a
segment boundary inside the middle — the baseline EFIM's paper compares against.

With `healed_prob`, a share of the samples whose prompt ends with text (every EFIM sample,
and a suffix-first FIM sample, whose prompt ends with the prefix) is built as serving heals
it (`engine.text.tokenize.SegmentTokenizer.encode(heal=True)`): the prompt's last text tokens
are dropped, and the target is the dropped text plus the middle in ordinary tokenization —
the first target token covers the dropped text, as healing's constraint asks at serving
time. Without it, the model only ever sees the middle continue from the prompt's own
token boundary, never a token that crosses it.

Contract (tested): a sample's segments in document order concatenate to its window
exactly, and each segment's ids decode to its text.
"""

from __future__ import annotations

import keyword
import random
import re
from typing import TYPE_CHECKING, Literal, NamedTuple

from engine.api import ContextChunk, InfillRequest
from engine.text.templates import FimTemplate, detect_template
from engine.text.tokenize import HealingProgress, SegmentTokenizer, whole_indentation

from efim_tools.training.fragment import encode_text, fragment_encode

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from efim_tools.training.crossfile import CrossFileSource
    from efim_tools.training.data import Corpus

SampleKind = Literal["fim", "efim", "plain", "next-edit"]
Layout = Literal["psm", "spm"]
SegmentRole = Literal["prefix", "suffix", "increment", "middle", "text", "chunk"]

FIM_SENTINELS = ("<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>")
# The suffix-first layout's own spellings (prefix, middle, suffix, pad — the same order, so
# an adapter's added rows line up across layouts); `engine.text.templates` knows them as a
# suffix-first family. <spm_middle> is never placed; it is there to keep the four rows.
SPM_SENTINELS = ("<spm_prefix>", "<spm_middle>", "<spm_suffix>", "<spm_pad>")
SENTINELS: dict[str, tuple[str, ...]] = {"psm": FIM_SENTINELS, "spm": SPM_SENTINELS}
# The `engine.text.templates` family that serves each layout.
LAYOUT_FAMILY: dict[str, str] = {"psm": "starcoder", "spm": "efim-spm"}
EOT_TOKEN = "<|endoftext|>"


class FimIds(NamedTuple):
    prefix: int
    suffix: int
    middle: int
    pad: int
    eot: int
    layout: Layout = "psm"
    template: FimTemplate | None = None  # serving's template for this layout (renders the head)

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer, layout: Layout = "psm") -> FimIds:
        names = SENTINELS[layout]
        ids = {name: tokenizer.token_to_id(name) for name in (*names, EOT_TOKEN)}
        missing = [name for name, i in ids.items() if i is None]
        if missing:
            raise ValueError(f"tokenizer lacks {missing}; add the FIM sentinels first (lora.add_fim_tokens)")
        pre, mid, suf, pad = names
        template = detect_template(tokenizer, LAYOUT_FAMILY[layout])
        if (template.prefix_id, template.suffix_id) != (ids[pre], ids[suf]):  # FAMILIES and SENTINELS disagree
            raise ValueError(f"serving's {LAYOUT_FAMILY[layout]} template does not use the {layout} sentinels")
        return cls(ids[pre], ids[suf], ids[mid], ids[pad], ids[EOT_TOKEN], layout, template)

    def head(self, prefix: TextSegment, suffix: TextSegment, chunks: tuple[TextSegment, ...] = ()) -> list[int]:
        """The prompt up to where the middle (increment first) goes — C PRE p SUF s MID, or
        suffix-first C SUF s PRE p — as serving renders a request with these context chunks,
        this prefix and suffix and no increment (`FimTemplate.render`, format "efim"), each
        text segment carrying the ids the sample gave it (fragments included). `chunks` are
        the text segments `FimTemplate.render_chunks` writes, one per chunk, in order."""
        placeholders = tuple(ContextChunk(path="c.py", text="c\n") for _ in chunks)
        request = InfillRequest(key="sample", prefix=prefix.text, suffix=suffix.text, format="efim", context="off", chunks=placeholders)
        own = {"prefix": prefix, "suffix": suffix}
        given = iter(chunks)
        ids: list[int] = []
        for seg in self.template.render(request):
            if isinstance(seg.value, int):
                ids.append(seg.value)
            elif seg.role == "chunk":
                ids.extend(next(given).ids)
            else:
                ids.extend(own[seg.role].ids)
        return ids

    @classmethod
    def detect(cls, tokenizer: Tokenizer) -> FimIds | None:
        """The sentinels `tokenizer` has (either layout), or None."""
        for layout, names in SENTINELS.items():
            if all(tokenizer.token_to_id(t) is not None for t in (*names, EOT_TOKEN)):
                return cls.from_tokenizer(tokenizer, layout)  # type: ignore[arg-type]
        return None


class TextSegment(NamedTuple):
    role: SegmentRole
    text: str
    ids: tuple[int, ...]


class Sample(NamedTuple):
    kind: SampleKind
    ids: list[int]
    targets: list[bool]  # targets[i]: token i is predicted (loss at position i - 1)
    # Text segments in document order (prefix, increment, middle, suffix) — not prompt order;
    # a next-edit sample's are (prefix, [increment], suffix, probe, answer).
    segments: tuple[TextSegment, ...]
    fragmented: bool
    # The text serving's token healing dropped from the prompt's end, now the target's
    # start (`SampleConfig.healed_prob`); empty when the sample is not healed.
    healed: str = ""
    # Context chunks in front of the prompt (cross-file samples, `SampleConfig.crossfile_prob`),
    # each as serving renders it (header line and text); not part of the window.
    chunks: tuple[TextSegment, ...] = ()

    @property
    def document(self) -> str:
        return "".join(s.text for s in self.segments)


class SampleConfig(NamedTuple):
    fim_rate: float = 0.45
    efim_rate: float = 0.35  # plain left-to-right gets the rest
    fragment: bool = True  # increment as its own segment + random fragments
    fragment_prob: float = 0.5  # chance that a sample's segments are cut into fragments
    fragment_mean_chars: float = 24.0
    min_window_tokens: int = 256
    max_window_tokens: int = 512
    # Middles of one line to a few lines (what a completer is asked for); weights for 1..4 lines.
    middle_line_weights: tuple[float, ...] = (0.5, 0.25, 0.15, 0.1)
    # Chance the middle ends inside its last line (the rest of that line stays in the suffix).
    mid_line_end_prob: float = 0.25
    # Chance the middle starts where a completer's cursor usually is: at a line start or right
    # after its indentation (half each); otherwise at a uniformly random character.
    line_start_prob: float = 0.0
    # Chance the middle is a line that introduces a name the suffix goes on to use (a loop
    # variable, an assignment, a def): lines the suffix pins down, so the model learns to
    # read it. A window without such a line falls back to the draw above.
    suffix_informed_prob: float = 0.0
    # Share of middles kept whose first line is blank (a blank line, or the rest of a line
    # that is only whitespace): the rest move to the next line with code. Blank middles
    # teach the answer "nothing" at a line start, which on a fresh line the editor shows
    # as no suggestion (issue 18). 1.0 keeps them all (runs from before the option).
    blank_middle_keep: float = 1.0
    layout: Layout = "psm"
    # Share of samples whose prompt ends with text that are built healed, as serving's
    # token healing prompts the model (module docstring). 0 keeps earlier runs' streams.
    healed_prob: float = 0.0
    # Share of FIM/EFIM samples that are cross-file samples (`efim_tools.training.crossfile`):
    # a place needing a sibling module's name, with the chunks the server's gatherer picks.
    # 0 draws nothing extra: earlier runs keep their stream.
    crossfile_prob: float = 0.0
    # Share of samples that are next-edit probes (`efim_tools.training.next_edit`; suffix-first
    # layout only). 0 draws nothing extra: earlier runs keep their stream.
    next_edit_prob: float = 0.0

    def validate(self) -> SampleConfig:
        if not (0 <= self.fim_rate and 0 <= self.efim_rate and self.fim_rate + self.efim_rate <= 1):
            raise ValueError("fim_rate and efim_rate must be >= 0 and sum to at most 1")
        for name in ("fragment_prob", "line_start_prob", "suffix_informed_prob", "blank_middle_keep", "healed_prob", "crossfile_prob", "next_edit_prob"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1]")
        if self.layout not in SENTINELS:
            raise ValueError(f"layout must be one of {sorted(SENTINELS)}, got {self.layout!r}")
        if self.next_edit_prob > 0 and self.layout != "spm":
            raise ValueError("next-edit samples need the suffix-first layout (layout='spm'): only it has a probe sentinel")
        if not 8 <= self.min_window_tokens <= self.max_window_tokens:
            raise ValueError("need 8 <= min_window_tokens <= max_window_tokens")
        return self


def draw_window(tokenizer: Tokenizer, text: str, rng: random.Random, n_tokens: int) -> str:
    """A run of whole lines of `text`, starting at a random line, about `n_tokens` long."""
    starts = [0] + [i + 1 for i, ch in enumerate(text) if ch == "\n" and i + 1 < len(text)]
    start = rng.choice(starts)
    candidate = text[start : start + n_tokens * 6]
    enc = tokenizer.encode(candidate, add_special_tokens=False)
    if len(enc.ids) <= n_tokens:
        return candidate
    cut = enc.offsets[n_tokens][0]  # character offset of the first token past the budget
    last_nl = candidate.rfind("\n", 0, cut)
    # Keep whole lines unless that throws away more than half the window.
    return candidate[: last_nl + 1] if last_nl + 1 > cut // 2 else candidate[:cut]


_NAME = re.compile(r"[A-Za-z_][A-Za-z_0-9]*")
# Lines that bind names, and where the bound names sit in them.
_BINDERS = (
    re.compile(r"^\s*(?:async\s+)?(?:def|class)\s+(\w+)"),
    re.compile(r"^\s*(?:async\s+)?def\s+\w+\s*\((.*)"),  # parameters
    re.compile(r"^\s*(?:async\s+)?for\s+(.+?)\s+in\s"),
    re.compile(r"^\s*([\w.\[\]\s,()*]+?)\s*(?::[^=]+)?(?<![=!<>])=(?!=)"),  # a = ..., a, b = ..., self.x: int = ...
    re.compile(r"\bas\s+(\w+)"),  # with ... as f, except ... as e, import x as y
    re.compile(r"^\s*import\s+([\w.]+)"),
    re.compile(r"^\s*from\s+\S+\s+import\s+(.+)"),
)


def _names(text: str) -> set[str]:
    return {n for n in _NAME.findall(text) if not keyword.iskeyword(n)}


def _bound_names(code: str) -> set[str]:
    bound: set[str] = set()
    for pattern in _BINDERS:
        for m in pattern.finditer(code):
            bound |= _names(m.group(1))
    return bound - {"self", "cls"}  # every method binds them; the suffix using them says nothing


def suffix_informed_lines(window: str) -> list[int]:
    """Start offsets of the lines of `window` that bind a new name (def, class, for,
    assignment, `as`, import) which a later line uses: lines the suffix pins down."""
    lines, starts, pos = window.split("\n"), [], 0
    for line in lines:
        starts.append(pos)
        pos += len(line) + 1
    code = [line.split("#", 1)[0] for line in lines]
    names = [_names(c) for c in code]
    last_use = {name: i for i, own in enumerate(names) for name in own}  # the last line naming it
    seen_before: set[str] = set()
    picked = []
    for i, own in enumerate(names):
        new = _bound_names(code[i]) - seen_before
        if any(last_use[name] > i for name in new if name in last_use) and starts[i] < len(window) - 1:
            picked.append(starts[i])
        seen_before |= own
    return picked


def _line_rest(window: str, start: int) -> str:
    """`window` from `start` to the end of its line (without the line break)."""
    eol = window.find("\n", start)
    return window[start : eol if eol >= 0 else len(window)]


def _next_code_line(window: str, start: int, *, at_indent: bool) -> int:
    """The start (or first non-blank character) of the first line after `start`'s line that
    holds more than whitespace; `start` itself when there is none."""
    pos = window.find("\n", start)
    while 0 <= pos < len(window) - 2:
        line = pos + 1
        text = _line_rest(window, line)
        if text.strip():
            body = line + len(text) - len(text.lstrip(" \t"))
            return min(body if at_indent else line, len(window) - 2)
        pos = window.find("\n", line)
    return start


def choose_middle(window: str, rng: random.Random, config: SampleConfig) -> tuple[int, int]:
    """[start, end) of a middle: begins at a random character (or, with `line_start_prob`,
    at a line start or after its indentation; with `suffix_informed_prob`, at a line the
    suffix pins down), spans 1..4 lines."""
    start = rng.randrange(0, len(window) - 1)
    informed = []
    # No extra draw when a bias is off: runs configured before it existed keep their stream.
    if config.suffix_informed_prob > 0 and rng.random() < config.suffix_informed_prob:
        informed = suffix_informed_lines(window)
        if informed:
            start = rng.choice(informed)
    if informed or (config.line_start_prob > 0 and rng.random() < config.line_start_prob):
        line = window.rfind("\n", 0, start) + 1  # the line `start` fell in
        text = _line_rest(window, line)
        body = line + len(text) - len(text.lstrip(" \t"))  # first non-blank character
        at_indent = rng.random() < 0.5 and body < line + len(text)  # a blank line has none
        start = min(body if at_indent else line, len(window) - 2)
    # No extra draw when the option is off: earlier runs keep their stream.
    if config.blank_middle_keep < 1 and not _line_rest(window, start).strip() and rng.random() >= config.blank_middle_keep:
        start = _next_code_line(window, start, at_indent=rng.random() < 0.5)
    n_lines = 1 if informed else rng.choices(range(1, len(config.middle_line_weights) + 1), weights=config.middle_line_weights)[0]
    end = line_start = start
    for _ in range(n_lines):
        nl = window.find("\n", end)
        if nl < 0:
            end = len(window)
            break
        line_start, end = end, nl + 1
    if rng.random() < config.mid_line_end_prob and end - 1 > max(start, line_start) + 1:
        end = rng.randrange(max(start, line_start) + 1, end - 1)  # stop inside the last line
    if config.blank_middle_keep < 1 and not window[start:end].strip() and rng.random() >= config.blank_middle_keep:
        end = max(end, start + len(_line_rest(window, start)))  # a cut inside indentation: take the line's code too
    return start, max(end, start + 1)


class SampleBuilder:
    """Draws samples from a corpus; sample `index` under `seed` is always the same sample,
    so a resumed run continues the exact data stream."""

    def __init__(self, tokenizer: Tokenizer, corpus: Corpus, config: SampleConfig = SampleConfig(), seed: int = 0,
                 crossfile: CrossFileSource | None = None):
        self.tokenizer = tokenizer
        self.segments = SegmentTokenizer(tokenizer)  # serving's segment tokenization
        self.corpus = corpus
        self.config = config.validate()
        self.seed = seed
        self.fim = FimIds.from_tokenizer(tokenizer, self.config.layout)
        if self.config.crossfile_prob > 0 and crossfile is None:
            raise ValueError("crossfile_prob > 0 needs a CrossFileSource (efim_tools.training.crossfile)")
        self.crossfile = crossfile

    def sample(self, index: int) -> Sample:
        rng = random.Random(self.seed * 1_000_003 + index)
        cfg = self.config
        file = self.corpus.draw(rng)
        n_tokens = rng.randint(cfg.min_window_tokens, cfg.max_window_tokens)
        if cfg.next_edit_prob > 0 and rng.random() < cfg.next_edit_prob:
            return self.next_edit_sample(file, rng, n_tokens)
        window = draw_window(self.tokenizer, file.text, rng, n_tokens)
        r = rng.random()
        kind: SampleKind = "fim" if r < cfg.fim_rate else "efim" if r < cfg.fim_rate + cfg.efim_rate else "plain"
        if len(window) < 4:
            kind = "plain"
        if kind != "plain" and cfg.crossfile_prob > 0 and rng.random() < cfg.crossfile_prob:
            return self.crossfile_sample(kind, rng)
        return build_sample(self.segments, self.fim, window, kind, rng, cfg)

    def next_edit_sample(self, file, rng: random.Random, n_tokens: int) -> Sample:
        """A next-edit probe sample (`efim_tools.training.next_edit`); files without a change
        that has a candidate are passed over for others."""
        from efim_tools.training.next_edit import draw_question  # noqa: PLC0415

        for _ in range(64):
            question = draw_question(file.text, rng)
            if question is not None:
                return next_edit_sample(self.segments, self.fim, question, rng, self.config, n_tokens)
            file = self.corpus.draw(rng)
        raise RuntimeError("no next-edit sample found in 64 files")

    def crossfile_sample(self, kind: SampleKind, rng: random.Random) -> Sample:
        """A FIM/EFIM sample at a cross-file spot (`CrossFileSource.draw`), its chunks in front."""
        assert self.crossfile is not None
        spot = self.crossfile.draw(rng)
        chunks = []
        for chunk in spot.chunks:  # the chunk's text segment as serving writes it (a separator token stays in the template)
            (text,) = [seg.value for seg in self.fim.template.render_chunks((chunk,)) if isinstance(seg.value, str)]
            chunks.append(TextSegment("chunk", text, tuple(encode_text(self.segments, text))))
        span = (spot.start, spot.end) if spot.at_target else None
        return build_sample(self.segments, self.fim, spot.window, kind, rng, self.config, span=span, chunks=tuple(chunks))


def build_sample(tokenizer: SegmentTokenizer, fim: FimIds, window: str, kind: SampleKind, rng: random.Random, cfg: SampleConfig,
                 *, span: tuple[int, int] | None = None, chunks: tuple[TextSegment, ...] = ()) -> Sample:
    """A sample of `window`; `span` fixes the middle (else it is drawn), `chunks` go in
    front of the prompt as serving renders context."""
    # Draw the same numbers whether or not fragmenting is on, and cut fragments with their
    # own generator: runs with and without fragment tokenization see the same windows,
    # middles and increments, so they differ only in tokenization.
    frag_rng = random.Random(rng.getrandbits(64))
    fragmented = (rng.random() < cfg.fragment_prob) and cfg.fragment

    def seg(role: SegmentRole, text: str) -> TextSegment:
        if fragmented:
            ids = fragment_encode(tokenizer, text, frag_rng, cfg.fragment_mean_chars)
        else:
            ids = encode_text(tokenizer, text)
        return TextSegment(role, text, tuple(ids))

    if kind == "plain":
        text = seg("text", window)
        return Sample(kind, list(text.ids), [True] * len(text.ids), (text,), fragmented)

    start, end = span if span is not None else choose_middle(window, rng, cfg)
    prefix, middle, suffix = seg("prefix", window[:start]), window[start:end], seg("suffix", window[end:])
    if kind == "efim" and len(middle) >= 2:
        cut = rng.randint(1, len(middle) - 1)
        if cfg.fragment:
            inc, rest = seg("increment", middle[:cut]), seg("middle", middle[cut:])
            middle_segs = (inc, rest)
        else:
            # Baseline: the middle keeps its ordinary tokenization; no boundary at the cut.
            middle_segs = (seg("middle", middle),)
    else:
        kind = "fim"
        middle_segs = (seg("middle", middle),)
    healed = ""
    # No extra draw when the option is off: earlier runs keep their stream.
    increment = len(middle_segs) == 2
    if cfg.healed_prob > 0 and (increment or fim.layout == "spm") and rng.random() < cfg.healed_prob:
        # The prompt ends with the increment or, suffix first, with the prefix.
        *ahead, last = (prefix, middle_segs[0]) if increment else (prefix,)
        later = middle_segs[1:] if increment else middle_segs
        split = heal_split(tokenizer, last, "".join(s.text for s in (*ahead, last)), suffix.text)
        if split is not None:
            kept, removed = split
            text = removed + "".join(s.text for s in later)
            target = TextSegment("middle", text, tuple(encode_text(tokenizer, text)))
            if heal_allows(tokenizer, removed, target.ids):
                healed = removed
                if ahead:
                    middle_segs = (kept, target) if kept.text else (target,)
                else:
                    prefix, middle_segs = kept, (target,)
    head = fim.head(prefix, suffix, chunks)
    tail = [i for s in middle_segs for i in s.ids] + [fim.eot]
    ids = head + tail
    targets = [False] * len(head) + [True] * len(tail)
    return Sample(kind, ids, targets, (prefix, *middle_segs, suffix), fragmented, healed, chunks)


# Characters per token assumed when a next-edit sample's window is cut from its file.
CHARS_PER_TOKEN = 3.2


def next_edit_sample(tokenizer: SegmentTokenizer, fim: FimIds, question, rng: random.Random, cfg: SampleConfig,
                     n_tokens: int) -> Sample:
    """A next-edit sample of `question` (`efim_tools.training.next_edit.Question`):

        SUF suffix PRE prefix [increment] PROBE probe → answer EOT

    The window is about `n_tokens` of whole lines around the cursor (right after the changed
    token, which is the session's increment half the time, as an edit session holds what was
    typed). Loss on the answer and EOT only."""
    if fim.template is None or fim.template.probe_id is None:
        raise ValueError("next-edit samples need a layout with a probe sentinel (layout='spm')")
    changed, cursor = question.text, question.cursor
    budget = int(n_tokens * CHARS_PER_TOKEN)
    before = int(budget * rng.uniform(0.55, 0.8))
    lo = changed.rfind("\n", 0, max(0, cursor - before)) + 1 if cursor > before else 0
    hi_nl = changed.find("\n", min(len(changed), cursor + budget - before))
    hi = len(changed) if hi_nl < 0 else hi_nl + 1
    frag_rng = random.Random(rng.getrandbits(64))
    fragmented = cfg.fragment and rng.random() < cfg.fragment_prob

    def seg(role: SegmentRole, value: str) -> TextSegment:
        ids = fragment_encode(tokenizer, value, frag_rng, cfg.fragment_mean_chars) if fragmented else encode_text(tokenizer, value)
        return TextSegment(role, value, tuple(ids))

    typed = rng.random() < 0.5
    split = question.token_start if typed else cursor
    prefix, suffix = seg("prefix", changed[lo:split]), seg("suffix", changed[cursor:hi])
    increment = seg("increment", changed[split:cursor]) if typed else None
    asked = TextSegment("middle", question.probe, tuple(encode_text(tokenizer, question.probe)))
    target = TextSegment("middle", question.answer, tuple(encode_text(tokenizer, question.answer)))
    head = fim.head(prefix, suffix) + (list(increment.ids) if increment else []) + [fim.template.probe_id] + list(asked.ids)
    tail = [*target.ids, fim.eot]
    segments = (prefix, *((increment,) if increment else ()), suffix, asked, target)
    return Sample("next-edit", head + tail, [False] * len(head) + [True] * len(tail), segments, fragmented)


def heal_split(tokenizer: SegmentTokenizer, seg: TextSegment, before: str, after: str) -> tuple[TextSegment, str] | None:
    """`seg` (the prompt's last text segment; `before` is the text up to its end, `after`
    the suffix) without the tokens serving's healing drops (`SegmentTokenizer.heal_split`,
    the whole-indentation case decided as `PromptBuilder.encode` does), and their text;
    None when there is nothing to drop or the drop does not end on a character."""
    kept, removed_ids = tokenizer.heal_split(seg.text, seg.ids, whole_indent=whole_indentation(before, after))
    if not removed_ids:
        return None
    try:
        removed = b"".join(tokenizer.vocab.token_bytes[i] for i in removed_ids).decode("utf-8")
    except UnicodeDecodeError:
        return None
    if not seg.text.endswith(removed):
        return None
    return TextSegment(seg.role, seg.text[: len(seg.text) - len(removed)], kept), removed


def heal_allows(tokenizer: SegmentTokenizer, removed: str, ids: tuple[int, ...]) -> bool:
    """Whether healing's constraint at serving time (`HealingProgress`, step by step)
    admits `ids` as the answer's start, spelling `removed` out."""
    progress: HealingProgress | None = HealingProgress(tokenizer.vocab, removed.encode("utf-8"))
    for token in ids:
        if progress is None:
            return True
        if not bool((progress.allowed() == token).any()):
            return False
        progress = progress.after(token)
    return progress is None


__all__ = ["FIM_SENTINELS", "SPM_SENTINELS", "SENTINELS", "LAYOUT_FAMILY", "EOT_TOKEN", "FimIds", "TextSegment", "Sample", "SampleConfig", "SampleBuilder", "build_sample", "next_edit_sample", "heal_split", "heal_allows", "draw_window", "choose_middle", "suffix_informed_lines"]
