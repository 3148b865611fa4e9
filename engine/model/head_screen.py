"""The output head of a decode step in two passes: a 4-bit screen, then the exact int8 rows
of its best candidates.

The lm_head of the embedded model (49,152 vocabulary entries x 576, the GGUF's Q8_0 rows
kept as int8) is 28 MB, a third of what a decode step reads; on a 2-core machine it cost
~2 ms of a ~10 ms step. A 4-bit copy of it (groups of 32, 14 MB) reads half the bytes but
ranks tokens worse (top-1 0.88 against the int8 head, KL 0.043 on real code). So a step
with few rows runs the 4-bit copy over the whole vocabulary, takes each row's
`SCREEN_TOP` best entries there, and recomputes exactly those with the int8 rows: the
returned logits are the int8 head's for the candidates and the 4-bit estimate elsewhere.
Greedy decoding (argmax) is exact whenever the int8 head's best token is among the
screen's candidates: on 4,096 rows of stdlib code it was for every row from 16 candidates
up (docs/model.md "The head in two passes"). The tail of the distribution is the 4-bit
estimate (KL 0.0075 against the int8 head at 64 candidates), which sampling with a
temperature sees; many-row steps (prefill) run the int8 head as before.
"""

from __future__ import annotations

import torch

from engine.model.quant import Int4Linear, Int8Linear

SCREEN_TOP = 64
"""Candidates per row recomputed exactly (the int8 head's argmax was among the screen's best
16 on every one of 4,096 code rows; 64 leaves a margin and costs ~1 % of the screen)."""
SCREEN_MAX_ROWS = 8
"""Rows up to which the screen is used (decode, a speculation verify); more rows run the int8 head."""
SCREEN_MIN_VOCAB = 8192
"""A smaller head is cheap already: no screen."""

_ROW_MULTIPLE = 64  # the int4 kernel's row blocking: the screen's rows are padded to it
_BLOCK = 64  # entries per block of the candidate search (the padded vocabulary is a whole number of them)
_BLOCKS = 16  # blocks kept per row: they hold at least the screen's 16 best entries


class ScreenedHead:
    """An int8 head with a 4-bit screen for few-row steps. Called like a linear layer:
    x [M, K] -> logits [M, V] in the activation dtype (the caller takes `.float()`)."""

    __slots__ = ("exact", "screen", "out_features", "in_features", "top", "max_rows", "_offsets")

    def __init__(self, exact: Int8Linear, *, top: int = SCREEN_TOP, max_rows: int = SCREEN_MAX_ROWS) -> None:
        if exact.bias is not None:
            raise ValueError("a screened head has no bias (no checkpoint this engine loads gives its lm_head one)")
        self.exact = exact
        self.out_features, self.in_features = exact.out_features, exact.in_features
        self.top = min(top, _BLOCKS * _BLOCK)
        self.max_rows = max_rows
        w = exact.dequantize().float()  # [V, K]
        pad = -w.shape[0] % _ROW_MULTIPLE
        if pad:
            w = torch.cat((w, w.new_zeros(pad, w.shape[1])))  # zero rows: never among a row's best (sliced off first)
        self.screen = Int4Linear.quantize(w, None, exact.scales.dtype)  # [V + pad, K]
        self._offsets = torch.arange(_BLOCK, device=w.device)  # [64]

    @staticmethod
    def worth_it(head: object, dtype: torch.dtype) -> bool:
        """A screen pays for an int8 head of a large vocabulary in a 16-bit model whose
        reduction length the int4 kernel takes."""
        return (
            isinstance(head, Int8Linear)
            and head.bias is None
            and head.in_features % 16 == 0  # `_weight_int8pack_mm`'s reduction length
            and head.out_features >= SCREEN_MIN_VOCAB
            and dtype == torch.bfloat16
            and Int4Linear.supports(head.out_features + (-head.out_features % _ROW_MULTIPLE), head.in_features)
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, V]
        m = x.shape[0]
        if m > self.max_rows or m == 0 or x.dtype != self.exact.scales.dtype:
            return self.exact(x)
        v = self.out_features
        full = self.screen(x)  # [M, V + pad] 4-bit estimates
        if full.shape[1] > v:
            full[:, v:] = float("-inf")  # the padding's zero rows are never candidates
        # Candidates in two cheap steps (a topk over the whole vocabulary costs ~0.1-0.25 ms):
        # the blocks of 64 entries with the highest maxima hold at least the screen's best
        # `_BLOCKS` entries, then the best `top` of those blocks' entries.
        blocks = full.view(m, -1, _BLOCK).amax(-1).topk(_BLOCKS, -1, sorted=False).indices  # [M, B]
        cand = (blocks.unsqueeze(-1) * _BLOCK + self._offsets).view(m, -1)  # [M, B * 64]
        pick = full.gather(1, cand).topk(self.top, -1, sorted=False).indices  # [M, top]
        best = cand.gather(1, pick).clamp_(max=v - 1)  # [M, top] (a padded block's tail -> a real row)
        flat = best.view(-1)  # [M top]
        rows = self.exact.weight.index_select(0, flat)  # [M top, K] int8
        scales = self.exact.scales.index_select(0, flat)  # [M top]
        exact = torch.ops.aten._weight_int8pack_mm(x.contiguous(), rows, scales)  # [M, M top]: every row x every candidate
        if m > 1:
            exact = exact.view(m, m, self.top).diagonal(dim1=0, dim2=1).t()  # [M, top]: each row's own candidates
        return full[:, :v].scatter_(1, best, exact)

    def nbytes(self) -> int:
        """Both forms: the exact int8 rows and the 4-bit screen."""
        return self.exact.nbytes() + self.screen.nbytes()

    def step_nbytes(self) -> int:
        """Bytes a decode step reads: the screen and the candidates' int8 rows."""
        return self.screen.step_nbytes() + self.top * (self.in_features + self.exact.scales.element_size())


def head_form(head: object) -> str:
    """How a model's lm_head is kept, for `EngineInfo.head` (`efim/stats` model.info)."""
    if isinstance(head, ScreenedHead):
        return "int8, 4-bit screen"
    return {"Int8Linear": "int8", "Int4Linear": "int4"}.get(type(head).__name__, "dense")


__all__ = ["ScreenedHead", "SCREEN_TOP", "SCREEN_MAX_ROWS", "SCREEN_MIN_VOCAB", "head_form"]
