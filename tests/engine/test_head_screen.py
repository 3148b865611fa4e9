"""The output head in two passes (`engine.model.head_screen.ScreenedHead`): a 4-bit screen
over the whole vocabulary, the best candidates recomputed on the int8 rows."""

from __future__ import annotations

import pytest
import torch

from engine.model.head_screen import SCREEN_MAX_ROWS, SCREEN_TOP, ScreenedHead
from engine.model.quant import Int8Linear

V, K = 8_230, 128  # not a multiple of 64: the screen pads its rows


def _head(seed: int = 0) -> Int8Linear:
    torch.manual_seed(seed)
    return Int8Linear.quantize(torch.randn(V, K) * 0.05, None, torch.bfloat16)


def _rows(head: Int8Linear, m: int, seed: int = 1) -> torch.Tensor:
    """Hidden states that each point at one vocabulary row (a clear winner, as a trained
    model's confident steps have), plus noise."""
    gen = torch.Generator().manual_seed(seed)
    targets = torch.randint(0, V, (m,), generator=gen)
    w = head.dequantize().float()
    x = w[targets] * 20 + torch.randn(m, K, generator=gen) * 0.3
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("m", [1, 3, SCREEN_MAX_ROWS])
def test_candidates_carry_the_int8_values_and_the_argmax_is_exact(m):
    head = _head()
    screened = ScreenedHead(head)
    x = _rows(head, m)
    got, want = screened(x).float(), head(x).float()  # [M, V]
    assert got.shape == want.shape == (m, V)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    # Each row's candidates are exactly the int8 head's values; the rest are 4-bit estimates.
    same = (got == want).sum(-1)
    assert bool((same >= SCREEN_TOP).all()), same
    # The estimates are close to the int8 values, not garbage: the screen is the same matrix in 4 bits.
    assert (got - want).abs().max() < 0.25 * want.abs().max()


def test_padding_rows_are_never_chosen_even_when_every_logit_is_negative():
    """The screen's zero padding rows give logit 0: if every real logit is below 0, a
    padded block must still not win (nor be returned)."""
    torch.manual_seed(2)
    w = -(torch.rand(V, K) + 0.1)  # every weight negative
    head = Int8Linear.quantize(w, None, torch.bfloat16)
    x = torch.rand(2, K).to(torch.bfloat16) + 0.1  # every input positive: every logit < 0
    got, want = ScreenedHead(head)(x).float(), head(x).float()
    assert bool((want < 0).all())
    assert got.shape == (2, V)
    assert bool(torch.isfinite(got).all())
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_many_rows_and_other_dtypes_run_the_int8_head_itself():
    head = _head()
    screened = ScreenedHead(head)
    x = _rows(head, SCREEN_MAX_ROWS + 1)
    assert torch.equal(screened(x), head(x))  # a prefill's rows: the exact head
    assert screened(x[:0]).shape == (0, V)


def test_worth_it_only_for_a_large_int8_head_in_bf16():
    head = _head()
    assert ScreenedHead.worth_it(head, torch.bfloat16)
    assert not ScreenedHead.worth_it(head, torch.float32)
    small = Int8Linear.quantize(torch.randn(512, K), None, torch.bfloat16)
    assert not ScreenedHead.worth_it(small, torch.bfloat16)
    odd_k = Int8Linear.quantize(torch.randn(V, 72), None, torch.bfloat16)
    assert not ScreenedHead.worth_it(odd_k, torch.bfloat16)  # the int4 kernel takes groups of 32


def test_step_bytes_are_about_half_of_the_int8_head():
    head = _head()
    screened = ScreenedHead(head)
    assert screened.nbytes() > head.nbytes()  # both forms are resident
    assert screened.step_nbytes() < 0.7 * head.nbytes()  # a decode step reads the screen + the candidates


def _large_vocab_model():
    """A one-layer bf16 Llama with an 8,256-entry vocabulary and an int8 head: screened."""
    import transformers  # noqa: PLC0415

    from engine.model import ModelConfig, Transformer  # noqa: PLC0415

    cfg = transformers.LlamaConfig(
        vocab_size=8_256, hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=256, tie_word_embeddings=True,
    ).to_dict()
    torch.manual_seed(3)
    w = {"model.embed_tokens.weight": torch.randn(8_256, 128) * 0.5, "model.norm.weight": torch.ones(128)}
    p = "model.layers.0."
    for name, shape in (("self_attn.q_proj", (128, 128)), ("self_attn.k_proj", (64, 128)), ("self_attn.v_proj", (64, 128)),
                        ("self_attn.o_proj", (128, 128)), ("mlp.gate_proj", (256, 128)), ("mlp.up_proj", (256, 128)),
                        ("mlp.down_proj", (128, 256))):
        w[p + name + ".weight"] = torch.randn(*shape) * 0.05
    w[p + "input_layernorm.weight"] = torch.ones(128)
    w[p + "post_attention_layernorm.weight"] = torch.ones(128)
    return Transformer(ModelConfig.from_hf(cfg), w, dtype=torch.bfloat16, quant="int8")


def test_a_model_screens_its_decode_steps_and_computes_every_logit_on_request():
    model = _large_vocab_model()
    assert isinstance(model.lm_head, ScreenedHead)
    ids = torch.tensor([5, 900, 4_000, 8_000, 17])
    with torch.inference_mode():
        kv = model.new_kv(16)
        model.forward(ids[:4], kv, 0, "none")
        screened = model.forward(ids[4:], kv, 4, "all")  # one decode row: the screen
        exact = model.forward(ids[4:], kv, 4, "all", exact_head=True)
        batch = model.decode_batch(ids[4:], [kv], [4], exact_head=True)
    assert screened.shape == exact.shape == (1, 8_256)
    assert screened.argmax() == exact.argmax()
    assert int((screened == exact).sum()) >= SCREEN_TOP
    assert not torch.equal(screened, exact)  # the rest are 4-bit estimates
    assert torch.equal(batch, exact)


def test_steps_that_read_more_than_the_argmax_ask_for_the_exact_head():
    from types import SimpleNamespace  # noqa: PLC0415

    from engine.scheduling.model_runner import needs_exact_head  # noqa: PLC0415
    from engine.text.sampler import Sampler  # noqa: PLC0415

    assert not needs_exact_head(SimpleNamespace(healing=None, sampler=Sampler()))
    assert needs_exact_head(SimpleNamespace(healing=None, sampler=Sampler(temperature=0.7)))
    assert needs_exact_head(SimpleNamespace(healing=object(), sampler=Sampler()))


def test_the_head_form_is_named_for_model_info():
    from engine.model.head_screen import head_form  # noqa: PLC0415

    head = _head()
    assert head_form(ScreenedHead(head)) == "int8, 4-bit screen"
    assert head_form(head) == "int8"
    assert head_form(object()) == "dense"
