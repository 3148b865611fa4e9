"""int8 KV cache (kv_dtype="int8"): agreement with the model-dtype KV, rows and scales kept
intact by every copy (runner, pool, blend store), bytes per slot, bad values."""

from __future__ import annotations

import pytest
import torch

from engine.kv.radix import RadixCache
from engine.model import Int8SequenceKV, SequenceKV, load_model
from engine.model.sequence_kv import kv_dtype_name, quantize_rows

# int8 rows with per-(token, head) absmax scales: each K/V element is off by at most half a
# step (absmax / 254); through 3 layers of a random tiny model that moves a logit by well
# under 2 % of the logits' range (measured: 0.3-0.9 % in fp32 and bf16).
LOGIT_TOL = 0.02


def _model(path, dtype: str, kv_dtype: str | None = None):
    model = load_model(str(path), dtype=dtype).model
    model.set_kv_dtype(kv_dtype)
    return model


def _prompts(vocab: int, n: int = 4, length: int = 48) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (length,), generator=gen) for _ in range(n)]


def _greedy(model, ids: torch.Tensor, steps: int) -> tuple[list[int], torch.Tensor]:
    """Prefill `ids` in two steps, then `steps` greedy decode steps; (tokens, all logits)."""
    kv = model.new_kv(len(ids) + steps + 1)
    half = len(ids) // 2
    model.forward(ids[:half], kv, 0, "none")
    logits = [model.forward(ids[half:], kv, half, "last")]
    out = []
    pos = len(ids)
    for _ in range(steps):
        tok = int(logits[-1][-1].argmax())
        out.append(tok)
        logits.append(model.forward(torch.tensor([tok]), kv, pos, "last"))
        pos += 1
    return out, torch.cat(logits)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("tiny_model_dir", ["llama", "qwen2"], indirect=True)
def test_int8_kv_decode_agrees_with_model_dtype_kv(tiny_model_dir, dtype):
    ref_model = _model(tiny_model_dir, dtype)
    q_model = _model(tiny_model_dir, dtype, "int8")
    assert isinstance(q_model.new_kv(4), Int8SequenceKV) and isinstance(ref_model.new_kv(4), SequenceKV)
    same = total = 0
    for ids in _prompts(ref_model.vocab_size):
        ref_tokens, ref_logits = _greedy(ref_model, ids, 8)
        # Teacher-forced on the reference's tokens, so one flipped near-tie does not
        # change every later comparison.
        kv = q_model.new_kv(len(ids) + 9)
        got = [q_model.forward(ids, kv, 0, "last")]
        for j, tok in enumerate(ref_tokens):
            got.append(q_model.forward(torch.tensor([tok]), kv, len(ids) + j, "last"))
        got = torch.cat(got)
        span = float(ref_logits.max() - ref_logits.min())
        assert float((got - ref_logits).abs().max()) <= LOGIT_TOL * span
        same += int((got.argmax(-1) == ref_logits.argmax(-1)).sum())
        total += got.shape[0]
    assert same / total >= 0.9, f"top-1 agreement {same}/{total}"


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_int8_decode_batch_and_layer_api_match_forward(tiny_model_dir, dtype):
    model = _model(tiny_model_dir, dtype, "int8")
    a, b = _prompts(model.vocab_size, 2, 30)
    kv_a, kv_b = model.new_kv(40), model.new_kv(40)
    model.forward(a, kv_a, 0, "none")
    model.forward(b[:20], kv_b, 0, "none")
    kv_a2, kv_b2 = model.new_kv(40), model.new_kv(40)
    kv_a2.copy_rows(kv_a, 30)
    kv_b2.copy_rows(kv_b, 20)
    batch = model.decode_batch(torch.tensor([5, 9]), [kv_a, kv_b], [30, 20])  # [2, V]
    one_a = model.forward(torch.tensor([5]), kv_a2, 30, "last")
    one_b = model.forward(torch.tensor([9]), kv_b2, 20, "last")
    tol = 1e-4 if dtype == "fp32" else 0.05
    assert torch.allclose(batch[0], one_a[0], atol=tol) and torch.allclose(batch[1], one_b[0], atol=tol)
    # The layer-level API (CacheBlend) over int8 rows: the same logits as forward.
    kv_c = model.new_kv(40)
    h = model.embed(a)
    pos = torch.arange(30)
    for i in range(model.config.n_layers):
        h = model.layer(i, h, pos, kv_c)
    full = model.forward(a, model.new_kv(40), 0, "all")
    assert torch.allclose(model.norm_logits(h), full, atol=tol * 4)
    assert torch.equal(kv_c.k8[:, :, :30], kv_a.k8[:, :, :30]) or dtype == "bf16"


def test_quantize_rows_roundtrip_and_zero_rows():
    x = torch.randn(3, 5, 64) * torch.logspace(-3, 2, 5)[None, :, None]
    x[0, 0] = 0.0
    q, s = quantize_rows(x, torch.float32)
    assert q.dtype == torch.int8 and s.shape == (3, 5)
    back = q.float() * s[..., None]
    assert torch.isfinite(back).all() and float(back[0, 0].abs().max()) == 0.0
    step = x.abs().amax(-1, keepdim=True) / 127
    assert bool(((back - x).abs() <= step * 0.5 + 1e-7).all())
    assert int(q.abs().max()) <= 127


def test_rows_and_scales_survive_copies(tiny_model_dir):
    model = _model(tiny_model_dir, "fp32", "int8")
    ids = _prompts(model.vocab_size, 1, 24)[0]
    kv = model.new_kv(32)
    model.forward(ids, kv, 0, "none")
    # copy_rows (load_kv / fork / grow): bit-identical int8 rows and scales
    big = model.new_kv(64)
    big.copy_rows(kv, 24)
    assert torch.equal(kv.k8[:, :, :24], big.k8[:, :, :24]) and torch.equal(kv.vt8[..., :24], big.vt8[..., :24])
    assert torch.equal(kv.k_scale[:, :, :24], big.k_scale[:, :, :24]) and torch.equal(kv.v_scale[:, :, :24], big.v_scale[:, :, :24])
    # read -> write round trip keeps the same int8 rows (requantising a dequantised row is exact)
    k, v = kv.read(0, 24)
    again = model.new_kv(24)
    assert again.capacity == 24 and again.vt8.shape[-1] == 32  # V^T padded to 16 rows (the int8 op's kernel needs it)
    again.write(0, k, v)
    assert torch.equal(again.k8[:, :, :24], kv.k8[:, :, :24]) and torch.equal(again.vt8[..., :24], kv.vt8[..., :24])
    assert torch.allclose(again.k_scale[:, :, :24], kv.k_scale[:, :, :24], rtol=1e-6, atol=0)
    with pytest.raises(TypeError):
        model_dense = _model(tiny_model_dir, "fp32")
        model_dense.new_kv(32).copy_rows(kv, 4)


def _pool(model, kv_dtype, budget=1 << 20):
    c = model.config
    return RadixCache(n_layers=c.n_layers, n_kv_heads=c.n_kv_heads, head_dim=c.head_dim, dtype=model.dtype,
                      budget_bytes=budget, kv_dtype=kv_dtype)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_pool_gather_commit_keep_int8_rows_intact(tiny_model_dir, dtype):
    model = _model(tiny_model_dir, dtype, "int8")
    pool = _pool(model, "int8")
    ids = _prompts(model.vocab_size, 1, 40)[0]
    kv = model.new_kv(48)
    model.forward(ids, kv, 0, "none")
    res = pool.commit(ids.tolist(), kv, 40, key="doc")
    assert res.n_stored == 40
    pool.check_integrity()
    m = pool.match(ids.tolist())
    assert m.n_tokens == 40
    out = model.new_kv(64)
    pool.gather(m.slots[:25], out, 0)
    pool.gather(m.slots[25:], out, 25)
    for name in ("k8", "k_scale", "v_scale"):
        assert torch.equal(getattr(out, name)[:, :, :40], getattr(kv, name)[:, :, :40]), name
    assert torch.equal(out.vt8[..., :40], kv.vt8[..., :40])
    # The blend store's rows go through the pool's row API: dense in, dense out, int8 inside.
    k, v = kv.read(0, 40)
    slots = pool.alloc(40)
    pool.write_slots(slots, k.transpose(1, 2), v.transpose(1, 2))
    k2, v2 = pool.read_slots(slots)
    assert torch.allclose(k2.transpose(1, 2), k) and torch.allclose(v2.transpose(1, 2), v)
    pool.free(slots)
    pool.check_integrity()


def test_pool_bytes_per_slot_halve_with_int8(tiny_model_dir):
    model = _model(tiny_model_dir, "bf16")
    dense, q8 = _pool(model, None), _pool(model, "int8")
    c = model.config
    assert dense.bytes_per_slot == 2 * c.n_layers * c.n_kv_heads * c.head_dim * 2
    # D int8 bytes + one bf16 scale per head, for K and V: (D + 2) / (2 D) of bf16
    assert q8.bytes_per_slot == 2 * c.n_layers * c.n_kv_heads * (c.head_dim + 2)
    d = c.head_dim  # 16 in the tiny model: a scale costs more here than at real head sizes
    assert q8.n_slots == (1 << 20) // q8.bytes_per_slot >= dense.n_slots * 2 * d / (d + 2) - 1
    kv16 = model.new_kv(128)
    model.set_kv_dtype("int8")
    kv8 = model.new_kv(128)
    assert kv8.nbytes() == kv16.nbytes() * (d + 2) // (2 * d)
    assert model.new_kv(1).nbytes() * 128 == kv8.nbytes()  # proportional to rows (the KV budget's accounting)
    # The default model's shape (30 layers, 3 kv heads, head_dim 64): twice the tokens, nearly.
    shape = dict(n_layers=30, n_kv_heads=3, head_dim=64, dtype=torch.bfloat16, budget_bytes=64 << 20)
    assert RadixCache(**shape, kv_dtype="int8").n_slots >= 1.93 * RadixCache(**shape).n_slots


@pytest.mark.parametrize("bad", ["int4", "fp8", "", "INT9", 8])
def test_bad_kv_dtype_is_a_clear_error(tiny_model_dir, bad):
    model = _model(tiny_model_dir, "fp32")
    with pytest.raises(ValueError, match="kv_dtype"):
        model.set_kv_dtype(bad)
    assert model.kv_dtype == "model"


def test_kv_dtype_names():
    assert kv_dtype_name(None, torch.bfloat16) == "model"
    assert kv_dtype_name("auto", torch.bfloat16) == "model"
    assert kv_dtype_name("bf16", torch.bfloat16) == "model"
    assert kv_dtype_name(" INT8 ", torch.float32) == "int8"
    with pytest.raises(ValueError, match="dtype=bf16"):
        kv_dtype_name("bf16", torch.float32)


# ------------------------------------------------------------------ through the engine


def _engine_run(eng, **kw):
    from engine.api import InfillRequest

    kw.setdefault("max_tokens", 8)
    return eng.submit(InfillRequest(**kw)).result(120)


def test_engine_with_int8_kv_serves_every_path_and_agrees_with_the_dense_engine(tiny_model_factory, tmp_path):
    """Keystrokes (retained KV, radix gather), alternatives (fork), context chunks as a
    prefix and by CacheBlend, document pieces, growth past a small KV, and the disk tier
    across a restart: all on int8 rows, the pool and the retained store intact, and the
    greedy text mostly the dense engine's."""
    from engine.api import ContextChunk
    from engine.local import load_engine
    from tiny_models import settle, stdlib_sources

    path = str(tiny_model_factory("llama"))
    src = stdlib_sources(("textwrap.py",))[0]
    opts = dict(dtype="fp32", kv_budget="32M", check_integrity=True)
    dense = load_engine(path, kv_disk=False, **opts)
    q8 = load_engine(path, kv_dtype="int8", kv_disk=str(tmp_path / "kv"), **opts)
    try:
        assert q8.kv_dtype == "int8" and q8.cache.int8 and not dense.cache.int8
        assert q8.cache.n_slots > 1.7 * dense.cache.n_slots  # same budget, (D + 4) / 2D bytes per row at fp32
        same = 0
        cuts = [900, 1500, 2100, 2700, 3300]
        for at in cuts:
            base = dict(key="doc", prefix=src[at - 800 : at], suffix=src[at : at + 300])
            a, b = _engine_run(dense, **base), _engine_run(q8, **base)
            same += a.text == b.text
            typed = _engine_run(q8, **base, increment=src[at : at + 2])  # the next keystroke
            assert typed.stats.reused_tokens > 0
        assert same >= len(cuts) - 1, f"{same}/{len(cuts)} greedy texts equal"
        # Alternatives fork the prompt's int8 rows; a long generation grows the KV.
        alt = _engine_run(q8, key="alt", prefix=src[:500], n=3, max_tokens=6)
        assert len(alt.alternatives) >= 1
        long = _engine_run(q8, key="long", prefix=src[:200], max_tokens=300)
        assert long.finish_reason in ("length", "stop")
        # Context chunks: stored in the int8 pool, as a prefix and blended.
        chunks = (ContextChunk("a.py", src[4000:4600]), ContextChunk("b.py", src[5000:5600]))
        for mode in ("prefix", "blend"):
            out = _engine_run(q8, key=f"ctx-{mode}", prefix=src[900:1500], chunks=chunks, context=mode)
            assert out.finish_reason != "error", out.error
        # Document pieces (computed in the background into the pool) and a jump assembled from them.
        q8.keep_document_pieces("doc2", src[:6000], 3000)
        settle(q8)
        assert q8.scheduler.blend_store.entries_of("doc2")
        jump = _engine_run(q8, key="doc2", prefix=src[2200:3000], suffix=src[3000:3200], document_kv=True)
        assert jump.finish_reason != "error", jump.error
        settle(q8)
        q8.scheduler.retained.check_integrity()
        q8.check_integrity().result(30)
    finally:
        dense.close()
        q8.close()  # writes the retained documents' rows (dequantised) to disk
    # A restarted int8 engine loads them into its int8 pool and continues from them.
    again = load_engine(path, kv_dtype="int8", kv_disk=str(tmp_path / "kv"), **opts)
    try:
        assert again.disk_tier.wait_loaded(30)
        assert again.stats().kv_disk_loaded_tokens > 0
        at = cuts[-1]
        warm = _engine_run(again, key="doc", prefix=src[at - 800 : at], suffix=src[at : at + 300])
        assert warm.stats.reused_tokens > 0
        again.check_integrity().result(30)
    finally:
        again.close()
    # A dense engine does not take the files an int8 engine wrote (its own fingerprint).
    plain = load_engine(path, kv_disk=str(tmp_path / "kv"), **opts)
    try:
        assert plain.disk_tier.wait_loaded(30)
        assert plain.stats().kv_disk_loaded_tokens == 0
    finally:
        plain.close()


def test_engine_refuses_a_bad_kv_dtype(tiny_model_factory):
    from engine.api import EngineError
    from engine.local import load_engine

    with pytest.raises(EngineError, match="kv_dtype"):
        load_engine(str(tiny_model_factory("llama")), dtype="fp32", kv_budget="8M", kv_dtype="int4", kv_disk=False)
    with pytest.raises(EngineError, match="dtype=bf16"):
        load_engine(str(tiny_model_factory("llama")), dtype="fp32", kv_budget="8M", kv_dtype="bf16", kv_disk=False)


def test_int8_kv_is_refused_off_the_cpu(tiny_model_dir):
    """The decode op is a CPU op and the GPU kernels read dense rows: a model on another
    device refuses int8 KV (LocalEngine turns it into an EngineError at load)."""
    model = _model(tiny_model_dir, "fp32")
    model.device = torch.device("cuda")  # only the check reads it; nothing is moved
    with pytest.raises(ValueError, match="CPU only"):
        model.set_kv_dtype("int8")
    model.set_kv_dtype("auto")  # the dense KV is fine anywhere
