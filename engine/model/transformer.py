"""The decoder forward pass: Llama family (Llama, CodeLlama, DeepSeek-Coder, SmolLM2,
Qwen2) and StarCoder2, in plain torch plus the ops of `kernels`.

Layout choices, all for a CPU where decode is memory-bound and every torch call costs
microseconds of dispatch:
- q/k/v are one matmul (`qkv`), gate/up one matmul (`gate_up`); RoPE rotates q and k
  in one call; the residual stream is updated in place.
- A sequence's KV is a `SequenceKV` (or `Int8SequenceKV`), `engine.model.sequence_kv`.
- Kernel implementations are resolved once per model (`kernels.resolve`), not per call.

Nothing here knows about tokens as text, caches shared between sequences, or requests:
the runtime owns `SequenceKV` objects and decides what to prefill.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

import kernels
from engine.model import cpu_kernels
from engine.model.config import ModelConfig
from engine.model.head_screen import ScreenedHead
from engine.model.quant import Int8Linear, Linear, MixedLinear, make_linear
from engine.model.sequence_kv import _W8_ALIGN, KV, Int8SequenceKV, SequenceKV, kv_dtype_name
from kernels.cpu.decode_layers import Segment


class LayerPause(NamedTuple):
    """Where a pausable prefill step stopped (`Transformer.prefill_pausable`): the hidden
    states of its rows after `layer - 1` layers, and which rows they are."""

    h: torch.Tensor  # [rows, hidden]
    layer: int  # the next layer to run
    start: int  # the step's first position
    rows: int


# Up to this many rows, RMSNorm runs as one fused LayerNorm over [x, -x] (see _Norm).
_SMALL_ROWS = 16
# Up to this many rows a step's attention runs in C where the model has the kernel (the C
# loop beat torch's flash kernel from 2 to 16 rows at 64-2,048 keys: docs/model.md).
_C_ATTENTION_ROWS = 16


class _Norm:
    """RMSNorm or LayerNorm with its parameters in the compute dtype.

    RMSNorm has no fused CPU kernel in torch (it is ~9 small ops), LayerNorm does. For
    the few rows of a decode step, RMSNorm runs as LayerNorm over `[x, -x]`: that row
    has mean 0 and variance mean(x^2), so its first half is exactly x / rms(x) * w —
    three cheap calls instead of nine. Larger inputs, and any non-reference (Triton)
    `kernels.rms_norm`, which is fused already, go through `kernels.rms_norm`. A bf16 model on
    the CPU runs every RMSNorm in one C call instead (`row_ops`), where it has the library."""

    __slots__ = ("w", "b", "w2", "eps", "rms", "rms_norm", "small_rows", "row_ops")

    def __init__(self, w: torch.Tensor, b: torch.Tensor | None, eps: float, rms: bool, rms_norm, row_ops=None) -> None:
        self.w, self.b, self.eps, self.rms, self.rms_norm = w, b, eps, rms, rms_norm
        self.w2 = torch.cat((w, w)) if rms else None  # [2 hidden]
        self.small_rows = _SMALL_ROWS if rms_norm is kernels.reference.rms_norm else 0
        # RMSNorm of a step's rows in one C call (kernels/cpu/row_ops.py); None: torch.
        self.row_ops = row_ops if rms else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        d = x.shape[-1]
        if not self.rms:
            return F.layer_norm(x, (d,), self.w, self.b, self.eps)
        out = None if self.row_ops is None else self.row_ops.rms_norm(x, self.w, self.eps)
        if out is not None:
            return out
        if x.shape[0] <= self.small_rows:
            return F.layer_norm(torch.cat((x, x.neg()), -1), (2 * d,), self.w2, None, self.eps)[:, :d]
        return self.rms_norm(x, self.w, self.eps)

    def add_then_norm(self, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """h += residual (in place), then this norm of h: one C call where the model has it."""
        if self.row_ops is not None:
            out = self.row_ops.rms_norm(h, self.w, self.eps, residual)
            if out is not None:
                return out
        h.add_(residual)
        return self(h)


class _Layer:
    """One decoder block's weights."""

    __slots__ = ("norm1", "qkv", "o", "norm2", "up", "down")

    def __init__(self, norm1: _Norm, qkv: Linear, o: Linear, norm2: _Norm, up: Linear, down: Linear) -> None:
        self.norm1 = norm1
        self.qkv = qkv  # [(H + 2 H_kv) D, hidden]
        self.o = o  # [hidden, H D]
        self.norm2 = norm2
        self.up = up  # gated: [2 I, hidden] (gate rows first); gelu: [I, hidden]
        self.down = down  # [hidden, I]


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:  # [D/2] float32
    """Inverse RoPE frequencies with the config's scaling, computed as transformers does."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))  # [D/2]
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    if scaling["rope_type"] == "llama3":
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv_freq  # [D/2]
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_ctx / high) * ~(wavelen > old_ctx / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope scaling {scaling['rope_type']!r}")


class Transformer:
    """A decoder-only model over token ids. Not thread-safe: one engine thread owns it."""

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        quant: str | None = None,
        kv_dtype: str | None = None,
        dense_prefill: bool = False,
    ) -> None:
        """`weights`: Hugging Face parameter names -> tensors (any float dtype). Consumed:
        entries are popped as they are converted, so peak memory stays near one copy.
        `kv_dtype`: the format of the KV `new_kv` makes (`set_kv_dtype`). `dense_prefill`: the
        layers' packed (int8 / int4) weights also keep a bf16 copy that many-row steps use
        (`engine.model.quant.MixedLinear`: quant "mixed")."""
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.quant = quant
        self.dense_prefill = dense_prefill
        self.scale = 1.0 / math.sqrt(config.head_dim)
        self.inv_freq = rope_inv_freq(config).to(self.device)  # [D/2] float32
        self._rms_norm = kernels.resolve("rms_norm", self.inv_freq)
        self.gated = config.mlp == "gated_silu"
        # The C kernels of a bf16 CPU model's steps (engine/model/cpu_kernels.py); None: torch's ops.
        loaded = cpu_kernels.load(dtype, self.device, self.inv_freq, config.head_dim)
        self._row_ops = loaded.row_ops  # the norms and SiLU * up of a step
        self._build(weights)
        self._cos = torch.empty(0, config.head_dim // 2, dtype=dtype, device=self.device)
        self._sin = self._cos
        self._grow_rope(min(config.max_position, 4096))
        probe = self.inv_freq
        self._attention = kernels.resolve("attention", probe)
        self._decode_attention = loaded.decode_attention  # a step of up to 16 rows: RoPE, KV rows, attention
        self._prefill_attention = loaded.prefill_attention  # a step of 17 rows and more
        self._rope_apply = kernels.resolve("rope_apply", probe)
        self.kv_dtype = "model"
        self.set_kv_dtype(kv_dtype)
        # A step of up to `_decode_layers_rows` rows through all layers in one C call, where every
        # layer is what that call runs (kernels/cpu/decode_layers.py), checked once against the
        # calls it replaces.
        self.decode_layers, self._decode_layers_rows = None, 0
        self.decode_layers, self._decode_layers_rows = cpu_kernels.decode_layer_plan(self) or (None, 0)

    @property
    def cpu_kernels(self) -> cpu_kernels.CpuKernels:
        """The C kernels this model's steps call one at a time (None: torch's ops)."""
        return cpu_kernels.CpuKernels(self._row_ops, self._decode_attention, self._prefill_attention)

    def set_kv_dtype(self, kv_dtype: str | None) -> None:
        """The KV format of the sequences `new_kv` makes from now on: "model" (None, auto,
        model or the model's dtype name: dense, `SequenceKV`) or "int8" (`Int8SequenceKV`,
        CPU only: its decode attention is a CPU op). ValueError for anything else."""
        name = kv_dtype_name(kv_dtype, self.dtype)
        if name == "int8" and self.device.type != "cpu":
            raise ValueError(f"kv_dtype int8 runs on the CPU only (this model is on {self.device.type})")
        self.kv_dtype = name

    # ----------------------------------------------------------------- weights

    def _build(self, w: dict[str, torch.Tensor]) -> None:
        c, dt, dev = self.config, self.dtype, self.device

        def take(name: str, required: bool = True) -> torch.Tensor | None:
            t = w.pop(name, None)
            if t is None and required:
                raise KeyError(name)
            return None if t is None else t.to(dev)

        def param(name: str, required: bool = True) -> torch.Tensor | None:
            t = take(name, required)
            return None if t is None else t.to(dt)

        def linear(weight: torch.Tensor, bias: torch.Tensor | None, *, dense_copy: bool = self.dense_prefill) -> Linear:
            return make_linear(weight, bias, dt, self.quant, dense_copy=dense_copy)

        def norm(prefix: str) -> _Norm:
            rms = c.norm == "rms"
            bias = None if rms else param(prefix + ".bias")
            return _Norm(param(prefix + ".weight"), bias, c.norm_eps, rms, self._rms_norm, self._row_ops)

        layers = []
        for i in range(c.n_layers):
            p = f"model.layers.{i}."
            qkv_w = torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"])  # [(H+2Hkv)D, hidden]
            qkv_b = (
                torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"]) if c.qkv_bias else None
            )  # [(H+2Hkv)D]
            o = linear(take(p + "self_attn.o_proj.weight"), take(p + "self_attn.o_proj.bias") if c.o_bias else None)
            if c.mlp == "gated_silu":
                up_w = torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])  # [2I, hidden]
                up_b = (
                    torch.cat([take(p + "mlp.gate_proj.bias"), take(p + "mlp.up_proj.bias")]) if c.mlp_bias else None
                )
                down = linear(take(p + "mlp.down_proj.weight"), take(p + "mlp.down_proj.bias") if c.mlp_bias else None)
            else:
                up_w = take(p + "mlp.c_fc.weight")  # [I, hidden]
                up_b = take(p + "mlp.c_fc.bias") if c.mlp_bias else None
                down = linear(take(p + "mlp.c_proj.weight"), take(p + "mlp.c_proj.bias") if c.mlp_bias else None)
            layers.append(
                _Layer(
                    norm(p + "input_layernorm"),
                    linear(qkv_w, qkv_b),
                    o,
                    norm(p + "post_attention_layernorm"),
                    linear(up_w, up_b),
                    down,
                )
            )
        self.layers = layers
        self.norm = norm("model.norm")

        embed = take("model.embed_tokens.weight")  # [V, hidden]
        head = take("lm_head.weight", required=False)
        if head is None or c.tie_embeddings:
            head = embed
        # No bf16 copy of the head: a prefill computes logits for a few rows only.
        self.lm_head: Linear = linear(head, None, dense_copy=False)
        if isinstance(self.lm_head, Int8Linear) and head is embed:
            # Tied int8: the embedding lookup reads rows of the lm_head's int8 matrix
            # (its per-row scale is exactly a per-vocabulary-entry scale), so the table
            # is stored once, at one byte per weight.
            self.embed_weight = None
            self._embed_rows: Int8Linear | None = self.lm_head
        else:
            self.embed_weight = embed.to(dt)  # [V, hidden]
            self._embed_rows = None
        self.vocab_size = self.lm_head.out_features
        if ScreenedHead.worth_it(self.lm_head, dt):
            # Few-row steps rank the vocabulary on a 4-bit copy and recompute the best
            # candidates on the int8 rows (engine/model/head_screen.py).
            self.lm_head = ScreenedHead(self.lm_head)

    def c_kernels(self) -> tuple[str, ...]:
        """The CPU kernels in C this model runs (kernels/cpu), for `EngineInfo.c_kernels`."""
        return cpu_kernels.names(self)

    def weight_bytes(self) -> int:
        """Bytes of parameters a decode step reads (all linear layers incl. lm_head, norms)."""
        n = sum(
            lin.step_nbytes() if isinstance(lin, MixedLinear) else lin.nbytes()
            for layer in self.layers for lin in (layer.qkv, layer.o, layer.up, layer.down)
        )
        n += self.lm_head.step_nbytes() if isinstance(self.lm_head, ScreenedHead) else self.lm_head.nbytes()
        return n

    def resident_bytes(self) -> int:
        """Bytes of every weight kept (a mixed model's two forms, the embedding table)."""
        n = sum(lin.nbytes() for layer in self.layers for lin in (layer.qkv, layer.o, layer.up, layer.down))
        n += self.lm_head.nbytes()
        if self.embed_weight is not None:
            n += self.embed_weight.numel() * self.embed_weight.element_size()
        return n

    # ------------------------------------------------------------------- RoPE

    def _grow_rope(self, n: int) -> None:
        """cos/sin tables for positions 0..n-1 in the compute dtype (as transformers rounds them)."""
        n = max(n, 2 * self._cos.shape[0])
        positions = torch.arange(n, device=self.device)
        cos, sin = kernels.rope_cos_sin(positions, self.inv_freq, self.dtype)  # [n, D/2]
        self._cos, self._sin = cos, sin

    def rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, D/2], [T, D/2])
        """cos/sin rows for arbitrary positions [T] (int64)."""
        hi = int(positions.max()) + 1 if positions.numel() else 0
        if hi > self._cos.shape[0]:
            self._grow_rope(hi)
        return self._cos.index_select(0, positions), self._sin.index_select(0, positions)

    def _rope_range(self, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:  # ([n, D/2], [n, D/2])
        if start + n > self._cos.shape[0]:
            self._grow_rope(start + n)
        return self._cos[start : start + n], self._sin[start : start + n]

    # --------------------------------------------------------------- building blocks

    def new_kv(self, capacity: int) -> SequenceKV | Int8SequenceKV:
        """A KV workspace for `capacity` tokens in this model's `kv_dtype`: int8 zeroed (its
        V^T padding is read by the int8 matmul), the model dtype's left unwritten."""
        c = self.config
        shape = (c.n_layers, c.n_kv_heads, capacity, c.head_dim)
        if self.kv_dtype == "int8":
            # The int8 op's bf16 kernel needs its reduction length (for P' x V^T: V^T's row
            # length) to be a multiple of 16; it crashes the process otherwise (torch 2.13).
            # So V^T's rows are padded; the capacity stays what was asked for.
            padded = -(-capacity // _W8_ALIGN) * _W8_ALIGN
            scales = shape[:3]
            return Int8SequenceKV(
                torch.zeros(shape, dtype=torch.int8, device=self.device),
                torch.zeros(scales, dtype=self.dtype, device=self.device),
                torch.zeros((c.n_layers, c.n_kv_heads, c.head_dim, padded), dtype=torch.int8, device=self.device),
                torch.zeros(scales, dtype=self.dtype, device=self.device),
            )
        # Not zeroed: every reader takes rows below those written (attention over [:position + 1],
        # CacheBlend's spans, copies of [:n]) — checked by running the engine, kernel and LSP
        # end-to-end tests with these rows filled with NaN. A window's KV is tens of MB:
        # zeroing it was ~10 % of the engine thread under a burst of jumps (py-spy), on the
        # engine thread between another window's decode steps, and touched rows never used.
        return SequenceKV(
            torch.empty(shape, dtype=self.dtype, device=self.device),
            torch.empty(shape, dtype=self.dtype, device=self.device),
        )

    def embed(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        if self.embed_weight is not None:
            return self.embed_weight.index_select(0, ids)
        head = self._embed_rows
        rows = head.weight.index_select(0, ids).to(self.dtype)  # [T, hidden]
        return rows * head.scales.index_select(0, ids).unsqueeze(1)

    def _qkv(self, layer: _Layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Normed projections with RoPE applied: (q [H, T, D], k [H_kv, T, D], v [H_kv, T, D])."""
        return self._split_qkv(layer.qkv(layer.norm1(h)), cos, sin)

    def _split_qkv(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """The fused projection's rows [T, (H + 2 H_kv) D] as rotated q, k and v (see `_qkv`)."""
        c = self.config
        t = qkv.shape[0]
        qkv = qkv.view(t, c.n_heads + 2 * c.n_kv_heads, c.head_dim).transpose(0, 1)  # [H + 2 H_kv, T, D]
        n_qk = c.n_heads + c.n_kv_heads
        qk = self._rope_apply(qkv[:n_qk], cos, sin, c.rope_style)  # [H + H_kv, T, D]
        return qk[: c.n_heads], qk[c.n_heads :], qkv[n_qk:]

    def _finish(self, layer: _Layer, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Output projection + MLP, residuals added into h in place. attn: [H, T, D]."""
        t = h.shape[0]
        o = layer.o(attn.transpose(0, 1).reshape(t, self.config.q_size))  # [T, hidden]
        up = layer.up(layer.norm2.add_then_norm(h, o))  # h += o; [T, 2I] or [T, I]
        if self.gated:
            act = None if self._row_ops is None else self._row_ops.silu_mul(up)  # [T, I]
            if act is None:
                i = self.config.intermediate_size
                act = F.silu(up[:, :i]).mul_(up[:, i:])  # [T, I]
        else:
            act = F.gelu(up, approximate="tanh")  # [T, I]
        h.add_(layer.down(act))
        return h

    # ------------------------------------------------------------------ forward

    def forward(
        self,
        ids: torch.Tensor,
        kv: SequenceKV,
        start: int,
        logits: str | torch.Tensor = "last",
        *,
        exact_head: bool = False,
    ) -> torch.Tensor:
        """Run tokens `ids` [T] at positions start..start+T-1 of the sequence `kv`.

        Writes their K (after RoPE) and V into rows start..start+T-1 of every layer of
        `kv`; each token attends to rows 0..its own position (rows < start must already
        hold this sequence's prefix). Returns float32 logits: "last" -> [1, V],
        "all" -> [T, V], "none" -> [0, V] (no lm_head: a non-final prefill step), or a
        LongTensor of row indices into 0..T-1 -> [n, V]. `exact_head`: every logit from the
        head's exact rows even when a 4-bit screen would rank them (`ScreenedHead`; for a
        step that samples with a temperature or inside token healing's set, which read more
        than the argmax).
        """
        t = ids.shape[0]
        if start + t > kv.capacity:
            raise ValueError(f"sequence of {start + t} tokens exceeds its KV capacity of {kv.capacity}")
        cos, sin = self._rope_range(start, t)  # [T, D/2]
        h, _ = self._layers(self.embed(ids), kv, start, cos, sin)
        return self._select_logits(h, logits, exact_head)

    def prefill_pausable(
        self,
        ids: torch.Tensor,
        kv: SequenceKV,
        start: int,
        *,
        resume: LayerPause | None = None,
        stop: Callable[[], bool] | None = None,
    ) -> LayerPause | None:
        """A prefill step with no logits (a warm-up's) that may pause between layers: `ids` [T]
        at positions start..start+T-1 as in `forward`, but after each layer but the last, when
        `stop()` is true, it returns where it stands (the rows' hidden states and the next
        layer; the KV rows of the layers run so far are written). Called again with that
        `resume` (same ids, kv and start) it goes on from there. None: every layer ran."""
        t = ids.shape[0]
        if start + t > kv.capacity:
            raise ValueError(f"sequence of {start + t} tokens exceeds its KV capacity of {kv.capacity}")
        if resume is not None and (resume.start, resume.rows) != (start, t):
            raise ValueError(f"resuming rows {resume.start}+{resume.rows} with rows {start}+{t}")
        cos, sin = self._rope_range(start, t)  # [T, D/2]
        h, first = (self.embed(ids), 0) if resume is None else (resume.h, resume.layer)
        h, paused_at = self._layers(h, kv, start, cos, sin, first, stop)
        return None if paused_at is None else LayerPause(h, paused_at, start, t)

    def _layers(
        self,
        h: torch.Tensor,
        kv: SequenceKV,
        start: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        first: int = 0,
        stop: Callable[[], bool] | None = None,
    ) -> tuple[torch.Tensor, int | None]:
        """Layers first.. over hidden states h [T, hidden] at positions start..: (h after the
        last layer run, None) or, when `stop()` turns true between layers, (h, the next layer)."""
        t = h.shape[0]
        end = start + t
        attention, scale = self._attention, self.scale
        prefill = self._prefill_attention if t >= _C_ATTENTION_ROWS + 1 else None
        last = len(self.layers) - 1
        if kv.quantized:
            for i in range(first, last + 1):
                layer = self.layers[i]
                q, k, v = self._qkv(layer, h, cos, sin)
                kv.write_layer(i, start, k, v)
                if t == 1:
                    attn = kv.decode_attention(i, q, end, scale)  # [H, 1, D]
                else:
                    keys, values = kv.layer_kv(i, end)
                    attn = None if prefill is None else prefill.attend(q, keys, values, scale)
                    if attn is None:
                        attn = attention(q, keys, values, None, None, scale)  # [H, T, D]
                h = self._finish(layer, h, attn)
                if stop is not None and i < last and stop():
                    return h, i + 1
            return h, None
        plan = self.decode_layers
        if plan is not None and t <= self._decode_layers_rows and first == 0 and stop is None:
            # The whole step in one C call (kernels/cpu/decode_layers.py): the same calls as below.
            h_in = h.clone()
            if plan.run(h, cos, sin, [Segment(kv.k, kv.v, start, t)], scale):
                return h, None
            h = h_in
        # A decode step's attention half — RoPE, the KV row written, attention — in one C call
        # where the model has it (kernels/cpu/decode_attention.py); else torch's ops below. A
        # step of a few rows (a speculation verify, a keystroke's tokens) has its attention in C
        # too: 2 rows at 1,400 keys 63 µs a layer against torch's 160.
        decode = self._decode_attention
        if decode is not None and (t > _C_ATTENTION_ROWS or not decode.faster(t, self.config.head_dim)):
            decode = None
        fused = decode if decode is not None and self.config.rope_style == "neox" else None
        n_heads = self.config.n_heads
        for i in range(first, last + 1):
            layer = self.layers[i]
            attn = None
            if fused is not None:
                qkv = layer.qkv(layer.norm1(h))  # [T, (H + 2 H_kv) D]
                attn = fused.rope_attend(qkv, cos, sin, kv.k[i], kv.v[i], start, scale, n_heads)  # [H, T, D]
                if attn is None:
                    q, k, v = self._split_qkv(qkv, cos, sin)
            else:
                q, k, v = self._qkv(layer, h, cos, sin)  # [H, T, D], [H_kv, T, D], [H_kv, T, D]
            if attn is None:
                k_cache, v_cache = kv.k[i], kv.v[i]  # [H_kv, cap, D]
                k_cache.narrow(1, start, t).copy_(k)
                v_cache.narrow(1, start, t).copy_(v)
                keys, values = k_cache.narrow(1, 0, end), v_cache.narrow(1, 0, end)
                if decode is not None:
                    attn = decode.attend_rows(q, keys, values, scale)  # [H, T, D]
                elif prefill is not None:
                    attn = prefill.attend(q, keys, values, scale)  # [H, T, D]
                if attn is None:
                    attn = attention(q, keys, values, None, None, scale)  # [H, T, D]
            h = self._finish(layer, h, attn)
            if stop is not None and i < last and stop():
                return h, i + 1
        return h, None

    def decode_batch(
        self, ids: torch.Tensor, kvs: list[SequenceKV], starts: list[int], *, exact_head: bool = False
    ) -> torch.Tensor:  # [B, V]
        """One token per sequence: ids[b] sits at position starts[b] of kvs[b] (rows
        < starts[b] hold its prefix). Linear layers run once over the batch; attention
        runs per sequence. Returns float32 logits [B, V]; `exact_head` as in `forward`."""
        b_count = ids.shape[0]
        if len(kvs) != b_count or len(starts) != b_count:
            raise ValueError("decode_batch: ids, kvs and starts must have the same length")
        for kv, s in zip(kvs, starts):
            if s >= kv.capacity:
                raise ValueError(f"position {s} is outside a KV capacity of {kv.capacity}")
        if b_count == 1:
            return self.forward(ids, kvs[0], starts[0], "all", exact_head=exact_head)
        c = self.config
        cos, sin = self.rope_tables(torch.tensor(starts, device=self.device))  # [B, D/2]
        h = self.embed(ids)  # [B, hidden]
        plan = self.decode_layers
        if plan is not None and b_count <= self._decode_layers_rows and not any(kv.quantized for kv in kvs):
            # Every sequence's row through all layers in one C call: each row gets the bits of its
            # own one-row `forward` (the rows of a product do not depend on each other).
            if plan.run(h, cos, sin, [Segment(kv.k, kv.v, s, 1) for kv, s in zip(kvs, starts)], self.scale):
                return self._select_logits(h, "all", exact_head)
            h = self.embed(ids)
        attention, scale = self._attention, self.scale
        decode = self._decode_attention
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, h, cos, sin)  # [H, B, D], [H_kv, B, D], [H_kv, B, D]
            attn = torch.empty(c.n_heads, b_count, c.head_dim, dtype=q.dtype, device=q.device)  # [H, B, D]
            for b, (kv, s) in enumerate(zip(kvs, starts)):
                if kv.quantized:
                    kv.write_layer(i, s, k[:, b : b + 1], v[:, b : b + 1])
                    attn[:, b : b + 1] = kv.decode_attention(i, q[:, b : b + 1], s + 1, scale)
                    continue
                kv.k[i, :, s].copy_(k[:, b])
                kv.v[i, :, s].copy_(v[:, b])
                qb, keys, values = q[:, b : b + 1], kv.k[i, :, : s + 1], kv.v[i, :, : s + 1]
                one = None if decode is None else decode.attend(qb, keys, values, scale)
                attn[:, b : b + 1] = attention(qb, keys, values, None, None, scale) if one is None else one  # [H, 1, D]
            h = self._finish(layer, h, attn)
        return self._select_logits(h, "all", exact_head)

    # ------------------------------------------------- layer-level API (CacheBlend)

    def project_kv(
        self, i: int, h: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, H_kv, D], [T, H_kv, D])
        """K (after RoPE at `positions`) and V that layer i computes from its input h
        [T, hidden], without writing anything (CacheBlend's deviation check)."""
        cos, sin = self.rope_tables(positions)  # [T, D/2]
        _, k, v = self._qkv(self.layers[i], h, cos, sin)  # [H_kv, T, D]
        return k.transpose(0, 1), v.transpose(0, 1)

    def layer(
        self,
        i: int,
        h: torch.Tensor,
        positions: torch.Tensor,
        kv: SequenceKV,
        rows: torch.Tensor | None = None,
        key_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run decoder layer i on hidden states h [T, hidden] of tokens at RoPE positions
        `positions` [T] (int64, any order, gaps allowed). Their K/V are written to kv rows
        `rows` [T] (default: `positions`). Attention keys are kv rows 0..S-1 of layer i,
        where S = len(key_positions) if given, else max(rows) + 1; row s has position
        `key_positions[s]` (default: s), and token t sees exactly the rows whose position
        is <= positions[t] (never a bottom-right causal mask). Returns the new h [T, hidden]
        (h is updated in place)."""
        rows = positions if rows is None else rows
        cos, sin = self.rope_tables(positions)  # [T, D/2]
        layer = self.layers[i]
        q, k, v = self._qkv(layer, h, cos, sin)  # [H, T, D], [H_kv, T, D], [H_kv, T, D]
        kv.write_layer(i, rows, k, v)
        n_keys = key_positions.shape[0] if key_positions is not None else int(rows.max()) + 1
        if key_positions is None:
            key_positions = torch.arange(n_keys, device=self.device)
        attn = self._attention(q, *kv.layer_kv(i, n_keys), positions, key_positions, self.scale)  # [H, T, D]
        return self._finish(layer, h, attn)

    def norm_logits(self, h: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, V] float32
        """Final norm + lm_head over every row of h."""
        return self._select_logits(h, "all")

    def _select_logits(self, h: torch.Tensor, logits: str | torch.Tensor, exact_head: bool = False) -> torch.Tensor:
        if isinstance(logits, torch.Tensor):
            h = h.index_select(0, logits.to(h.device))
        elif logits == "last":
            h = h[-1:]
        elif logits == "none":
            return torch.empty(0, self.vocab_size, dtype=torch.float32, device=h.device)
        elif logits != "all":
            raise ValueError(f"logits must be 'last', 'all', 'none' or a LongTensor, not {logits!r}")
        head = self.lm_head.exact if exact_head and isinstance(self.lm_head, ScreenedHead) else self.lm_head
        return head(self.norm(h)).float()  # [n, V]


__all__ = ["Transformer", "LayerPause", "rope_inv_freq"]
