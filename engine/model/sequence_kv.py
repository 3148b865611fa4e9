"""A sequence's KV as the model reads and writes it: `SequenceKV` (two dense tensors
`[L, H_kv, cap, D]` in the model dtype, heads first, so `k[i, :, :n]` is the `[H_kv, n, D]`
view SDPA wants with no copy) or `Int8SequenceKV` (int8 rows, one scale per token and kv
head; `kv_dtype="int8"`). Both offer the same row methods (read / write / copy_rows /
nbytes), which is all the code outside the model uses; row r holds the key (after RoPE) /
value of the token at position r. `quantize_rows` is the int8 rounding the KV pool uses
too; `kv_dtype_name` checks a `kv_dtype` setting.

The model (`engine.model.transformer`) makes them (`Transformer.new_kv`) and fills them;
the runtime owns them and decides what to prefill.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

import kernels

KV_DTYPES = ("auto", "model", "bf16", "fp16", "fp32", "int8")
"""Values of the engine's `kv_dtype`: auto / model / the model's own dtype name = KV in the
model dtype (`SequenceKV`); int8 = `Int8SequenceKV`."""

_W8 = torch._weight_int8pack_mm  # aten._weight_int8pack_mm (this binding dispatches ~1 us faster): A [M, K] x int8 B [N, K]^T * scales [N] -> [M, N]
_W8_ALIGN = 16  # its bf16 kernel segfaults unless K % 16 == 0 (measured: 48, 80 fine; 57 crashes)


class SequenceKV(NamedTuple):
    """Keys (after RoPE) and values of one sequence in the model dtype; row r = the token at
    position r. Callers outside the model move rows through the methods below (the same
    ones `Int8SequenceKV` has), never through `.k` / `.v`, so either format serves them."""

    k: torch.Tensor  # [L, H_kv, cap, D]
    v: torch.Tensor  # [L, H_kv, cap, D]

    quantized = False

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    @property
    def dtype(self) -> torch.dtype:
        """The dtype rows are read in (the model's compute dtype)."""
        return self.k.dtype

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def read(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:  # ([L, H_kv, n, D], [L, H_kv, n, D])
        """Rows lo..hi-1 of every layer in the compute dtype. Views here: clone to keep them."""
        return self.k[:, :, lo:hi], self.v[:, :, lo:hi]

    def write(self, lo: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [L, H_kv, n, D] (any float dtype) at rows lo..lo+n-1 of every layer."""
        n = k.shape[2]
        self.k[:, :, lo : lo + n].copy_(k)
        self.v[:, :, lo : lo + n].copy_(v)

    def write_layer(self, i: int, rows: int | torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store layer i's k, v [H_kv, T, D] at rows `rows` (an int: rows..rows+T-1; or [T] int64)."""
        if isinstance(rows, int):
            self.k[i].narrow(1, rows, k.shape[1]).copy_(k)
            self.v[i].narrow(1, rows, v.shape[1]).copy_(v)
        else:
            self.k[i].index_copy_(1, rows, k)
            self.v[i].index_copy_(1, rows, v)

    def layer_kv(self, i: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:  # ([H_kv, n, D], [H_kv, n, D])
        """Layer i's rows 0..n-1 in the compute dtype, as attention reads them (views)."""
        return self.k[i, :, :n], self.v[i, :, :n]

    def copy_rows(self, src: SequenceKV, n: int, src_lo: int = 0, dst_lo: int = 0) -> None:
        """Copy rows src_lo..src_lo+n-1 of `src` (the same format) to rows dst_lo.. of this KV."""
        _same_format(self, src)
        self.k[:, :, dst_lo : dst_lo + n].copy_(src.k[:, :, src_lo : src_lo + n])
        self.v[:, :, dst_lo : dst_lo + n].copy_(src.v[:, :, src_lo : src_lo + n])


class Int8SequenceKV(NamedTuple):
    """A sequence's KV in int8 with one scale per (layer, kv head, token): symmetric absmax,
    quantised when a row is written (`quantize_rows`), so a row reads about half the bytes
    of bf16 (D + 2 bytes per head instead of 2 D). V is stored transposed per head
    ([D, cap]) so decode attention's P x V is one `aten._weight_int8pack_mm` with a
    contiguous B operand (docs/model.md "int8 KV cache"). Same methods as `SequenceKV`;
    no `.k` / `.v`, so code that would index the dense layout fails loudly here."""

    k8: torch.Tensor  # [L, H_kv, cap, D] int8
    k_scale: torch.Tensor  # [L, H_kv, cap] compute dtype
    vt8: torch.Tensor  # [L, H_kv, D, cap rounded up to 16] int8 (the padding is never written)
    v_scale: torch.Tensor  # [L, H_kv, cap] compute dtype

    quantized = True

    @property
    def capacity(self) -> int:
        return self.k8.shape[2]

    @property
    def dtype(self) -> torch.dtype:
        return self.k_scale.dtype

    def nbytes(self) -> int:
        """Bytes of its `capacity` rows: int8 K and V plus their scales (V^T's padding to a
        multiple of 16 rows, < 16 rows per sequence, is left out so that bytes are
        proportional to rows, as the KV budget's accounting assumes)."""
        l, h, cap, d = self.k8.shape
        return 2 * l * h * cap * (d + self.k_scale.element_size())

    def read(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows lo..hi-1 of every layer, dequantised: new tensors [L, H_kv, n, D]."""
        k = self.k8[:, :, lo:hi].to(self.dtype).mul_(self.k_scale[:, :, lo:hi, None])
        v = self.vt8[:, :, :, lo:hi].transpose(2, 3).to(self.dtype).mul_(self.v_scale[:, :, lo:hi, None])
        return k, v

    def write(self, lo: int, k: torch.Tensor, v: torch.Tensor) -> None:
        n = k.shape[2]
        k8, ks = quantize_rows(k, self.dtype)
        v8, vs = quantize_rows(v, self.dtype)
        self.k8[:, :, lo : lo + n].copy_(k8)
        self.k_scale[:, :, lo : lo + n].copy_(ks)
        self.vt8[:, :, :, lo : lo + n].copy_(v8.transpose(2, 3))
        self.v_scale[:, :, lo : lo + n].copy_(vs)

    def write_layer(self, i: int, rows: int | torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        q8, qs = quantize_rows(torch.stack((k, v)), self.dtype)  # [2, H_kv, T, D], [2, H_kv, T]
        if isinstance(rows, int):
            t = k.shape[1]
            self.k8[i].narrow(1, rows, t).copy_(q8[0])
            self.k_scale[i].narrow(1, rows, t).copy_(qs[0])
            self.vt8[i].narrow(2, rows, t).copy_(q8[1].transpose(1, 2))
            self.v_scale[i].narrow(1, rows, t).copy_(qs[1])
        else:
            self.k8[i].index_copy_(1, rows, q8[0])
            self.k_scale[i].index_copy_(1, rows, qs[0])
            self.vt8[i].index_copy_(2, rows, q8[1].transpose(1, 2))
            self.v_scale[i].index_copy_(1, rows, qs[1])

    def layer_kv(self, i: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's rows 0..n-1 dequantised into contiguous [H_kv, n, D] tensors (prefill,
        verify and CacheBlend attend through SDPA over these; decode does not dequantise)."""
        h, d = self.k8.shape[1], self.k8.shape[3]
        k = torch.empty(h, n, d, dtype=self.dtype, device=self.k8.device)
        v = torch.empty(h, n, d, dtype=self.dtype, device=self.k8.device)
        torch.mul(self.k8[i, :, :n], self.k_scale[i, :, :n, None], out=k)
        torch.mul(self.vt8[i, :, :, :n].transpose(1, 2), self.v_scale[i, :, :n, None], out=v)
        return k, v

    def copy_rows(self, src: Int8SequenceKV, n: int, src_lo: int = 0, dst_lo: int = 0) -> None:
        """Copy int8 rows and their scales as they are (no requantisation)."""
        _same_format(self, src)
        a, b = slice(dst_lo, dst_lo + n), slice(src_lo, src_lo + n)
        self.k8[:, :, a].copy_(src.k8[:, :, b])
        self.k_scale[:, :, a].copy_(src.k_scale[:, :, b])
        self.vt8[:, :, :, a].copy_(src.vt8[:, :, :, b])
        self.v_scale[:, :, a].copy_(src.v_scale[:, :, b])

    def decode_attention(self, i: int, q: torch.Tensor, n: int, scale: float) -> torch.Tensor:  # [H, 1, D]
        """One query token per head q [H, 1, D] over layer i's rows 0..n-1, on the int8 rows:
        per kv head, scores = `_weight_int8pack_mm(q_g * scale, K8_h, k_scale_h)` (its
        per-row scales are exactly per-token scales), an fp32 softmax, V's per-token scale
        folded into the probabilities, and P' x V^T_h by the same op with unit scales. The
        V^T operand must be contiguous, so P' spans the whole capacity with zeros past n
        (rows past n are read, never used: int8 holds no NaN). bench/kv_int8.py chose this op."""
        h_kv, d, cap = self.k8.shape[1], self.k8.shape[3], self.vt8.shape[3]  # cap: V^T's padded rows
        if d % _W8_ALIGN or cap % _W8_ALIGN:  # the op's kernel cannot take these: dequantise (correct, slower)
            return kernels.reference.attention(q, *self.layer_kv(i, n), None, None, scale)
        g = q.shape[0] // h_kv
        qs = (q.reshape(h_kv, g, d) * scale).unbind(0)  # H_kv x [G, D]
        # unbind: one call for all heads' views (per-head indexing costs ~3 view calls each)
        k8, ks = self.k8[i, :, :n].unbind(0), self.k_scale[i, :, :n].unbind(0)  # H_kv x [n, D], [n]
        scores = torch.stack([_W8(a, b, c) for a, b, c in zip(qs, k8, ks)])  # [H_kv, G, n]
        p = torch.softmax(scores, -1, dtype=torch.float32)  # [H_kv, G, n]
        pv = torch.zeros(h_kv, g, cap, dtype=self.dtype, device=q.device)
        torch.mul(p, self.v_scale[i, :, None, :n], out=pv[:, :, :n])
        ones = _ones(d, self.dtype, q.device)
        out = torch.stack([_W8(a, b, ones) for a, b in zip(pv.unbind(0), self.vt8[i].unbind(0))])  # [H_kv, G, D]
        return out.view(h_kv * g, 1, d)


_ONES: dict = {}


# A sequence's KV in either format (the model dtype, or int8 rows with scales).
KV = SequenceKV | Int8SequenceKV


def _ones(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    key = (n, dtype, device)
    t = _ONES.get(key)
    if t is None:
        t = _ONES[key] = torch.ones(n, dtype=dtype, device=device)
    return t


def _same_format(a, b) -> None:
    if type(a) is not type(b):
        raise TypeError(f"cannot copy rows between a {type(b).__name__} and a {type(a).__name__}")


def quantize_rows(x: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric absmax int8 over the last dim: x [..., D] -> (int8 [..., D], scale [...]).
    The scale is rounded to `scale_dtype` first and x divided by the rounded scale, so
    q * scale is the best int8 approximation under the scale actually stored."""
    x32 = x.float()  # x itself when x is fp32: nothing below writes into it
    amax = torch.linalg.vector_norm(x32, float("inf"), dim=-1, keepdim=True)  # one op for abs + amax
    scale = amax.div_(127.0).clamp_min_(torch.finfo(scale_dtype).tiny).to(scale_dtype)
    # The scale rounded down to scale_dtype can put a row's absmax at 127.5: clamp, or it wraps.
    q = torch.div(x32, scale).round_().clamp_(-127, 127).to(torch.int8)
    return q, scale.squeeze(-1)


def kv_dtype_name(kv_dtype: str | None, model_dtype: torch.dtype) -> str:
    """Check a `kv_dtype` value: "int8", or "model" for every way of saying the model's dtype
    (None, auto, model, its own name). ValueError names the choices otherwise."""
    names = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
    value = "auto" if kv_dtype is None else str(kv_dtype).strip().lower()
    if value in ("auto", "model", names.get(model_dtype, "")):
        return "model"
    if value == "int8":
        return "int8"
    if value in KV_DTYPES:
        raise ValueError(
            f"kv_dtype {kv_dtype!r}: the KV cache is kept in the model dtype ({names.get(model_dtype, model_dtype)}) "
            f"or int8; load the model with dtype={value} to keep the KV in {value}"
        )
    raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, not {kv_dtype!r}")


__all__ = ["SequenceKV", "Int8SequenceKV", "KV", "KV_DTYPES", "kv_dtype_name", "quantize_rows"]
