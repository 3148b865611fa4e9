"""The engine's forward pass equals transformers' on tiny random models (fp32, tight
tolerance): full prefill, prefill in steps through one SequenceKV, prefix reuse from a
copied KV, batched decode, and the layer-level API CacheBlend uses."""

from __future__ import annotations

import pytest
import torch

from engine.model import load_model
from engine.model.transformer import rope_inv_freq
from tiny_models import stdlib_sources

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
    "rope_theta": 10000.0,
}
LINEAR_ROPE = {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}
VARIANTS = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "starcoder2": ("starcoder2", {}),
    "llama-untied-llama3rope": ("llama", {"rope_parameters": LLAMA3_ROPE, "tie_word_embeddings": False}),
    "llama-linear-rope": ("llama", {"rope_parameters": LINEAR_ROPE}),
}
ATOL, RTOL = 2e-5, 2e-5
N_TOKENS = 160


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request, tiny_model_factory):
    """(engine model, transformers model, token ids) for one variant."""
    import transformers

    arch, overrides = VARIANTS[request.param]
    folder = tiny_model_factory(arch, **overrides)
    loaded = load_model(folder, dtype="fp32")
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    text = stdlib_sources(("textwrap.py",))[0]
    ids = torch.tensor(loaded.tokenizer.encode(text).ids[:N_TOKENS])
    assert ids.shape[0] == N_TOKENS
    return loaded.model, ref, ids


def ref_logits(ref, ids: torch.Tensor) -> torch.Tensor:  # [T, V]
    with torch.no_grad():
        return ref(ids.unsqueeze(0)).logits[0].float()


def test_full_prefill_matches_transformers(pair):
    model, ref, ids = pair
    expected = ref_logits(ref, ids)
    kv = model.new_kv(N_TOKENS)
    got = model.forward(ids, kv, 0, "all")
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)
    last = model.forward(ids, model.new_kv(N_TOKENS), 0, "last")
    torch.testing.assert_close(last, expected[-1:], atol=ATOL, rtol=RTOL)


def test_three_step_prefill_matches_transformers(pair):
    model, ref, ids = pair
    expected = ref_logits(ref, ids)
    kv = model.new_kv(N_TOKENS + 8)  # spare capacity: rows past the sequence must not matter
    none = model.forward(ids[:50], kv, 0, "none")
    assert none.shape == (0, model.vocab_size)
    rows = torch.tensor([0, 7, 69])
    mid = model.forward(ids[50:120], kv, 50, rows)
    last = model.forward(ids[120:], kv, 120, "last")
    torch.testing.assert_close(mid, expected[50 + rows], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(last, expected[-1:], atol=ATOL, rtol=RTOL)


def test_second_sequence_reuses_copied_prefix(pair):
    model, ref, ids = pair
    expected = ref_logits(ref, ids)
    first = model.new_kv(N_TOKENS)
    model.forward(ids[:100], first, 0, "none")
    second = model.new_kv(N_TOKENS)
    second.k[:, :, :100].copy_(first.k[:, :, :100])
    second.v[:, :, :100].copy_(first.v[:, :, :100])
    got = model.forward(ids[100:], second, 100, "all")
    torch.testing.assert_close(got, expected[100:], atol=ATOL, rtol=RTOL)


def test_a_prefill_that_pauses_between_layers_computes_what_one_step_would(pair):
    """`prefill_pausable`: paused after layer 1 (and again, resumed), then finished — the KV
    rows equal an unbroken forward's, and a step after them gives transformers' logits."""
    model, ref, ids = pair
    expected = ref_logits(ref, ids)
    whole = model.new_kv(N_TOKENS)
    model.forward(ids[:120], whole, 0, "none")
    kv = model.new_kv(N_TOKENS)
    model.forward(ids[:40], kv, 0, "none")
    calls = []

    def stop() -> bool:
        calls.append(1)
        return len(calls) in (1, 2)  # after the first layer, and after the first resumed layer

    pause = model.prefill_pausable(ids[40:120], kv, 40, stop=stop)
    assert pause is not None and pause.layer == 1 and (pause.start, pause.rows) == (40, 80)
    pause = model.prefill_pausable(ids[40:120], kv, 40, resume=pause, stop=stop)
    assert pause is not None and pause.layer == 2
    assert model.prefill_pausable(ids[40:120], kv, 40, resume=pause, stop=stop) is None
    assert len(model.layers) >= 3 and len(calls) == len(model.layers) - 1  # asked after every layer but the last
    torch.testing.assert_close(kv.k[:, :, :120], whole.k[:, :, :120], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(kv.v[:, :, :120], whole.v[:, :, :120], atol=ATOL, rtol=RTOL)
    got = model.forward(ids[120:], kv, 120, "all")
    torch.testing.assert_close(got, expected[120:], atol=ATOL, rtol=RTOL)
    with pytest.raises(ValueError, match="resuming"):
        model.prefill_pausable(ids[40:100], kv, 40, resume=pause._replace(layer=1))


def test_decode_batch_matches_individual_forwards(pair):
    model, ref, ids = pair
    expected = ref_logits(ref, ids)
    lengths = (37, 121, 5)
    kvs = [model.new_kv(N_TOKENS) for _ in lengths]
    for kv, n in zip(kvs, lengths):
        model.forward(ids[:n], kv, 0, "none")
    got = model.decode_batch(ids[list(lengths)], kvs, list(lengths))  # token n at position n
    assert got.shape == (len(lengths), model.vocab_size)
    torch.testing.assert_close(got, expected[list(lengths)], atol=ATOL, rtol=RTOL)
    # a second step continues every sequence
    nxt = [n + 1 for n in lengths]
    got2 = model.decode_batch(ids[nxt], kvs, nxt)
    torch.testing.assert_close(got2, expected[nxt], atol=ATOL, rtol=RTOL)


def test_keystroke_tail_after_long_prefix(pair):
    """A few tokens after a long cached prefix (an EFIM keystroke) take the split
    prefix/tail attention path; still transformers' logits."""
    model, ref, _ = pair
    text = stdlib_sources(("shlex.py",))[0]
    ids = torch.tensor(load_tokens(text, model, 300))
    expected = ref_logits(ref, ids)
    kv = model.new_kv(300)
    model.forward(ids[:290], kv, 0, "none")
    for start, end in ((290, 293), (293, 294), (294, 300)):
        got = model.forward(ids[start:end], kv, start, "all")
        torch.testing.assert_close(got, expected[start:end], atol=ATOL, rtol=RTOL)


def load_tokens(text: str, model, n: int) -> list[int]:
    """The first n ids of text under the tiny models' tokenizer (all variants share it)."""
    from tokenizers import Tokenizer

    from tiny_models import tiny_tokenizer_json

    ids = Tokenizer.from_str(tiny_tokenizer_json(True)).encode(text).ids[:n]
    assert len(ids) == n and max(ids) < model.vocab_size
    return ids


def test_layer_api_with_explicit_positions(pair):
    """Rows recomputed out of order through `layer` see exactly the keys at positions <=
    their own — the CacheBlend contract — and give transformers' logits."""
    model, ref, ids = pair
    expected = ref_logits(ref, ids)
    kv = model.new_kv(N_TOKENS)
    model.forward(ids, kv, 0, "none")  # every row of kv now holds the exact K/V
    positions = torch.tensor([159, 3, 77, 78, 120])  # scattered, unsorted
    h = model.embed(ids[positions])  # [5, hidden]
    for i in range(model.config.n_layers):
        k_fresh, v_fresh = model.project_kv(i, h, positions)  # [5, H_kv, D]
        torch.testing.assert_close(k_fresh.transpose(0, 1), kv.k[i][:, positions], atol=ATOL, rtol=RTOL)
        h = model.layer(i, h, positions, kv, key_positions=torch.arange(N_TOKENS))
    torch.testing.assert_close(model.norm_logits(h), expected[positions], atol=ATOL, rtol=RTOL)


def test_rope_scaling_is_applied(pair):
    model, _, _ = pair
    from dataclasses import replace

    plain = rope_inv_freq(replace(model.config, rope_scaling=None))
    if model.config.rope_scaling is None:
        torch.testing.assert_close(model.inv_freq, plain)
    else:
        assert not torch.allclose(model.inv_freq, plain)  # the variant really exercises scaling


def test_capacity_overflow_is_an_error(pair):
    model, _, ids = pair
    with pytest.raises(ValueError, match="capacity"):
        model.forward(ids[:10], model.new_kv(8), 0)


@pytest.mark.parametrize("quant", ["int8", None])
def test_bf16_and_int8_stay_close_to_fp32(tiny_model_factory, quant):
    folder = tiny_model_factory("llama")
    exact = load_model(folder, dtype="fp32").model
    approx = load_model(folder, dtype="bf16", quant=quant).model
    text = stdlib_sources(("heapq.py",))[0]
    loaded = load_model(folder, dtype="fp32")
    ids = torch.tensor(loaded.tokenizer.encode(text).ids[:128])
    want = exact.forward(ids, exact.new_kv(128), 0, "all")
    got = approx.forward(ids, approx.new_kv(128), 0, "all")
    # relative to the logit spread; bf16 activations alone give ~1e-2
    err = (got - want).abs().max() / want.std()
    assert err < (0.25 if quant else 0.1), float(err)  # max over 128 x 1536 logits
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean()
    assert agree > 0.85, float(agree)
    # decode path (the int8 GEMV kernel) agrees with the prefill path (dequantised GEMM)
    kv = approx.new_kv(128)
    approx.forward(ids[:100], kv, 0, "none")
    step = approx.forward(ids[100:101], kv, 100, "last")
    assert (step - got[100:101]).abs().max() / want.std() < 0.1


def test_int8_weights_are_int8(tiny_model_factory):
    model = load_model(tiny_model_factory("qwen2"), dtype="bf16", quant="int8").model
    dense = load_model(tiny_model_factory("qwen2"), dtype="bf16").model
    assert model.layers[0].qkv.weight.dtype == torch.int8
    assert model.lm_head.weight.dtype == torch.int8
    assert model.weight_bytes() < 0.6 * dense.weight_bytes()
