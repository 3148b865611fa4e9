"""A decode step's attention in C (kernels/cpu/decode_attention.py) against exact attention,
on the AVX-512 loops (head size 64, where this machine has them) and the portable ones (other
head sizes, and a build without -march=native), and inside a bf16 model's decode step."""

from __future__ import annotations

import ctypes

import pytest
import torch

from kernels.cpu import build
from kernels.cpu.decode_attention import DecodeAttention
from tests.kernels.threads import torch_threads

pytestmark = pytest.mark.skipif(build.compiler() is None, reason="no C compiler on this machine")


def exact(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:  # float64 [H, 1, D]
    h, h_kv = q.shape[0], k.shape[0]
    kk = k.double().repeat_interleave(h // h_kv, 0)
    vv = v.double().repeat_interleave(h // h_kv, 0)
    p = torch.softmax(q.double() @ kk.transpose(1, 2) * scale, -1)
    return p @ vv


def cache_views(h_kv: int, n: int, d: int, capacity: int, seed: int):
    """Keys and values as the model hands them over: the first n rows of a larger cache."""
    g = torch.Generator().manual_seed(seed)
    kc = (torch.randn(h_kv, capacity, d, generator=g) * 2).bfloat16()
    vc = torch.randn(h_kv, capacity, d, generator=g).bfloat16()
    return kc.narrow(1, 0, n), vc.narrow(1, 0, n)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize(
    ("h", "h_kv", "d", "n"),
    [(9, 3, 64, 1), (9, 3, 64, 17), (9, 3, 64, 1031), (8, 8, 64, 40), (16, 2, 64, 300), (4, 2, 32, 77), (6, 3, 128, 2050)],
)
def test_matches_exact_attention(kernel_cache, native, h, h_kv, d, n):
    attend = DecodeAttention.load(kernel_cache, native=native)
    assert attend is not None
    k, v = cache_views(h_kv, n, d, n + 13, seed=n + d)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, h, d, generator=g).bfloat16().transpose(0, 1)  # [H, 1, D], as _qkv slices it
    scale = d**-0.5
    got = attend.attend(q, k, v, scale)
    assert got is not None and got.shape == (h, 1, d) and got.dtype == torch.bfloat16
    want = exact(q, k, v, scale)
    # bf16 output: one rounding of a float32 result.
    torch.testing.assert_close(got.double(), want, atol=4e-3, rtol=1e-2)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.float().unsqueeze(0), k.float().unsqueeze(0), v.float().unsqueeze(0), scale=scale, enable_gqa=h != h_kv
    )[0]
    assert (got.double() - want).abs().max() <= (sdpa.bfloat16().double() - want).abs().max() * 2 + 1e-3


def test_scores_far_below_the_maximum_underflow_to_zero_weight(kernel_cache):
    """A key the query all but ignores (score ~ -200 below the best) gets weight 0, not a NaN."""
    attend = DecodeAttention.load(kernel_cache)
    d = 64
    k = torch.zeros(1, 40, d)
    k[0, :, 0] = -1.0
    k[0, 7, 0] = 400.0  # the one key that counts
    v = torch.arange(40, dtype=torch.float32).view(1, 40, 1).expand(1, 40, d).contiguous()
    q = torch.zeros(1, 1, d)
    q[0, 0, 0] = 0.5
    got = attend.attend(q.bfloat16(), k.bfloat16(), v.bfloat16(), 1.0)
    assert torch.isfinite(got.float()).all()
    assert torch.equal(got.float(), torch.full((1, 1, d), 7.0))


def test_calls_it_does_not_take_are_declined(kernel_cache):
    attend = DecodeAttention.load(kernel_cache)
    k, v = cache_views(2, 10, 64, 16, seed=0)
    q = torch.randn(4, 1, 64).bfloat16()
    assert attend.attend(torch.randn(4, 2, 64).bfloat16(), k, v, 0.1) is None  # two query rows: a prefill's
    assert attend.attend(q.float(), k.float(), v.float(), 0.1) is None  # float32
    assert attend.attend(torch.randn(3, 1, 64).bfloat16(), k, v, 0.1) is None  # 3 heads on 2 KV heads
    assert attend.attend(q, k.transpose(1, 2).contiguous().transpose(1, 2), v, 0.1) is None  # rows not contiguous
    assert attend.attend(q, k[:, :0], v[:, :0], 0.1) is None  # no keys


def test_off_gives_no_kernel(kernel_cache, monkeypatch):
    monkeypatch.setenv("EFIM_C_KERNELS", "0")
    assert DecodeAttention.load(kernel_cache) is None


def test_a_bf16_models_decode_steps_in_c_agree_with_torchs(tmp_path, kernel_cache, monkeypatch):
    """The same tiny bf16 model loaded with the C kernels and with EFIM_C_KERNELS=0, fed the same
    tokens: ten decode steps after one prefill, then steps of 3 and 2 rows, give the same logits
    up to bf16 rounding and (near-ties aside) the same greedy choices."""
    from engine.model import load_model
    from tests.tiny_models import make_tiny_model

    # 64-dimensional heads, the size the C loops are the faster ones for (DecodeAttention.faster)
    tiny_model_dir = make_tiny_model(tmp_path / "m", "llama", hidden_size=256, intermediate_size=256,
                                     num_attention_heads=4, num_key_value_heads=2)
    monkeypatch.setenv("EFIM_CACHE_DIR", str(kernel_cache.parent))
    with_c = load_model(tiny_model_dir, dtype="bf16", quant="none").model
    # (and the prefill's attention in C where this CPU has AVX512-BF16: the 40-token prompt)
    assert set(with_c.c_kernels()) - {"prefill_attention"} == {"decode_attention", "row_ops"}
    build.library.cache_clear()
    monkeypatch.setenv("EFIM_C_KERNELS", "0")
    plain = load_model(tiny_model_dir, dtype="bf16", quant="none").model
    assert plain.c_kernels() == ()
    prompt = torch.arange(5, 45)
    fed = [int(t) for t in torch.randint(0, 300, (15,), generator=torch.Generator().manual_seed(3))]
    runs = []
    with torch.inference_mode():
        for model in (with_c, plain):  # the same tokens fed to both (teacher-forced): logits compared
            kv = model.new_kv(64)
            out = [model.forward(prompt, kv, 0, "last")]
            pos = len(prompt)
            for rows in (1,) * 10 + (3, 2):  # ten decode steps, then steps of a few rows (speculation verifies)
                out.append(model.forward(torch.tensor(fed[:rows]), kv, pos, "all"))
                fed = fed[rows:] + fed[:rows]
                pos += rows
            logits = torch.cat(out)
            runs.append((logits.argmax(-1), logits))
    assert (runs[0][0] == runs[1][0]).float().mean() >= 0.9  # greedy choices: near-ties of a random model may flip
    # Logits up to ~6 in size: the paths round q and the attention's sums at other places, and
    # the bf16 residual stream carries that on (seen: 0.07-0.14 per row, T=1 and T>1 alike).
    torch.testing.assert_close(runs[0][1], runs[1][1], atol=0.2, rtol=0.05)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize(("h", "h_kv", "d", "pos"), [(9, 3, 64, 0), (9, 3, 64, 700), (4, 2, 32, 33)])
def test_rope_attend_is_rope_then_the_kv_write_then_attention(kernel_cache, native, h, h_kv, d, pos):
    """The fused step against torch's three: the written K row is the rotated k (bf16), the V
    row the projection's v, and the output attention over rows 0..pos with the rotated q."""
    from kernels.reference import rope_apply, rope_cos_sin

    attend = DecodeAttention.load(kernel_cache, native=native)
    g = torch.Generator().manual_seed(pos + d)
    capacity = pos + 9
    k_cache = torch.randn(h_kv, capacity, d, generator=g).bfloat16()
    v_cache = torch.randn(h_kv, capacity, d, generator=g).bfloat16()
    qkv = torch.randn(1, (h + 2 * h_kv) * d, generator=g).bfloat16()
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    cos, sin = rope_cos_sin(torch.tensor([pos]), inv_freq, torch.bfloat16)  # [1, D/2]
    heads = qkv.view(h + 2 * h_kv, 1, d)
    q = rope_apply(heads[:h].float(), cos.float(), sin.float())  # [H, 1, D]
    k = rope_apply(heads[h : h + h_kv].float(), cos.float(), sin.float())
    v = heads[h + h_kv :]
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want_k[:, pos] = k[:, 0].bfloat16()
    want_v[:, pos] = v[:, 0]
    scale = d**-0.5
    got = attend.rope_attend(qkv, cos, sin, k_cache, v_cache, pos, scale, h)
    assert got is not None
    torch.testing.assert_close(k_cache.float(), want_k.float(), atol=0.02, rtol=0.01)
    assert torch.equal(v_cache, want_v)
    assert torch.equal(k_cache[:, :pos], want_k[:, :pos]) and torch.equal(k_cache[:, pos + 1 :], want_k[:, pos + 1 :])
    want = exact(q.double(), want_k[:, : pos + 1], want_v[:, : pos + 1], scale)
    torch.testing.assert_close(got.double(), want, atol=4e-3, rtol=1e-2)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("h", "h_kv", "d", "pos", "t"), [(9, 3, 64, 0, 2), (9, 3, 64, 1300, 3), (4, 2, 32, 40, 8), (9, 3, 64, 600, 16)])
def test_rope_attend_of_a_few_rows_is_those_rows_one_at_a_time(kernel_cache, threads, h, h_kv, d, pos, t):
    """A verify step's T rows in one call write the same cache rows and give bit for bit the
    output of T one-row calls in order: speculation's tokens are plain decoding's."""
    from kernels.reference import rope_cos_sin

    attend = DecodeAttention.load(kernel_cache)
    g = torch.Generator().manual_seed(pos + t)
    capacity = pos + t + 5
    k0 = torch.randn(h_kv, capacity, d, generator=g).bfloat16()
    v0 = torch.randn(h_kv, capacity, d, generator=g).bfloat16()
    qkv = torch.randn(t, (h + 2 * h_kv) * d, generator=g).bfloat16()
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    cos, sin = rope_cos_sin(torch.arange(pos, pos + t), inv_freq, torch.bfloat16)  # [T, D/2]
    with torch_threads(threads):
        k_all, v_all = k0.clone(), v0.clone()
        got = attend.rope_attend(qkv, cos, sin, k_all, v_all, pos, d**-0.5, h)
        k_one, v_one = k0.clone(), v0.clone()
        one = [attend.rope_attend(qkv[r : r + 1], cos[r : r + 1], sin[r : r + 1], k_one, v_one, pos + r, d**-0.5, h)
               for r in range(t)]
    assert got is not None and got.shape == (h, t, d)
    assert torch.equal(k_all, k_one) and torch.equal(v_all, v_one)
    assert torch.equal(got, torch.cat(one, 1))


def test_rope_attend_declines_without_writing(kernel_cache):
    attend = DecodeAttention.load(kernel_cache)
    k_cache, v_cache = torch.zeros(2, 8, 64).bfloat16(), torch.zeros(2, 8, 64).bfloat16()
    cos, sin = torch.ones(1, 32).bfloat16(), torch.zeros(1, 32).bfloat16()
    qkv = torch.randn(1, 8 * 64).bfloat16()
    assert attend.rope_attend(qkv, cos, sin, k_cache, v_cache, 8, 0.1, 4) is None  # past the capacity
    assert attend.rope_attend(qkv, cos, sin, k_cache, v_cache, 3, 0.1, 3) is None  # 3 heads on 2 KV heads
    assert attend.rope_attend(qkv.float(), cos, sin, k_cache, v_cache, 3, 0.1, 4) is None  # float32
    assert attend.rope_attend(qkv, cos[:, :16], sin[:, :16], k_cache, v_cache, 3, 0.1, 4) is None  # partial RoPE
    assert not k_cache.any() and not v_cache.any()
    assert attend.rope_attend(qkv, cos, sin, k_cache, v_cache, 3, 0.1, 4) is not None
    assert k_cache[:, 3].any() and not k_cache[:, 4:].any()


@pytest.mark.parametrize("n", [255, 256, 257, 511, 767, 2049, 3000, 40000])
def test_keys_shared_over_threads_give_the_one_threads_answer(kernel_cache, n):
    """Each KV head's keys are cut into chunks at fixed places and the chunks' shares combined
    by max rescaling: the threaded build on two threads, on one, and the build without OpenMP
    give the same bits (the chunks do not depend on the threads), and exact attention."""
    threaded = DecodeAttention.load(kernel_cache)
    single = DecodeAttention.load(kernel_cache, openmp=False)
    assert threaded is not None and single is not None and not single.threaded
    if build.torch_openmp_runtime() is not None:
        assert threaded.threaded  # torch's runtime is libgomp here: the build shares its work
    k, v = cache_views(3, n, 64, n + 5, seed=n)
    q = torch.randn(9, 1, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    with torch_threads(2):
        got = threaded.attend(q, k, v, 0.125)
    with torch_threads(1):
        one = threaded.attend(q, k, v, 0.125)
    ref = single.attend(q, k, v, 0.125)
    assert torch.equal(one, ref) and torch.equal(got, ref)
    torch.testing.assert_close(got.double(), exact(q, k, v, 0.125), atol=4e-3, rtol=1e-2)


def test_a_chunk_the_query_ignores_adds_nothing(kernel_cache):
    """The one key that counts sits in the last chunk; every other chunk's maximum is ~400 below
    it, so its share is weighted e^-400 = 0 when the chunks combine, never a NaN."""
    attend = DecodeAttention.load(kernel_cache)
    d, n = 64, 2048
    k = torch.zeros(1, n, d)
    k[0, :, 0] = -1.0
    k[0, n - 3, 0] = 400.0
    v = torch.arange(n, dtype=torch.float32).view(1, n, 1).expand(1, n, d).contiguous()
    q = torch.zeros(1, 1, d)
    q[0, 0, 0] = 0.5
    with torch_threads(2):
        got = attend.attend(q.bfloat16(), k.bfloat16(), v.bfloat16(), 1.0)
    assert torch.equal(got.float(), torch.full((1, 1, d), float(torch.tensor(n - 3.0).bfloat16())))


def test_scratch_size_agrees_with_the_c_side(kernel_cache):
    from kernels.cpu.decode_attention import scratch_floats  # noqa: PLC0415

    lib = build.library("decode_attention", kernel_cache, openmp=True)
    lib.efim_attention_rows_scratch.restype = ctypes.c_long
    for h, h_kv, d, n in [(9, 3, 64, 1), (9, 3, 64, 4096), (16, 2, 128, 777), (14, 2, 64, 30000)]:
        for t in (1, 2, 3, 8, 16):
            assert lib.efim_attention_rows_scratch(h, h_kv, d, n, t) == scratch_floats(h, h_kv, d, n, t)


def test_the_threaded_build_uses_torchs_openmp_runtime_only(kernel_cache):
    """The library's parallel regions run on torch's OpenMP threads: after it loads, one OpenMP
    runtime is mapped in the process, the one torch brought."""
    runtime = build.torch_openmp_runtime()
    if runtime is None:
        pytest.skip("torch's OpenMP runtime is not the one -fopenmp links here: the kernel builds single-threaded")
    attend = DecodeAttention.load(kernel_cache)
    assert attend is not None and attend.threaded
    with open("/proc/self/maps", encoding="utf-8") as f:
        mapped = {line.split()[-1] for line in f if "omp" in line.rsplit("/", 1)[-1] and "/lib" in line}
    assert mapped == {runtime}


def exact_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:  # float64 [H, T, D]
    """Row t of q's T rows attends keys 0..S - T + t."""
    h, t = q.shape[0], q.shape[1]
    s = k.shape[1]
    kk = k.double().repeat_interleave(h // k.shape[0], 0)
    vv = v.double().repeat_interleave(h // k.shape[0], 0)
    scores = q.double() @ kk.transpose(1, 2) * scale  # [H, T, S]
    allowed = torch.arange(s).view(1, s) <= (s - t + torch.arange(t)).view(t, 1)  # [T, S]
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ vv


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    ("h", "h_kv", "d", "n", "t"),
    [(9, 3, 64, 2, 2), (9, 3, 64, 70, 2), (9, 3, 64, 1400, 2), (9, 3, 64, 600, 3), (9, 3, 64, 2100, 8),
     (14, 2, 64, 520, 5), (4, 2, 32, 77, 4), (6, 3, 128, 1030, 16), (8, 8, 64, 300, 1)],
)
def test_a_few_rows_each_attend_their_own_keys(kernel_cache, native, threads, h, h_kv, d, n, t):
    """A step of T rows (a speculation verify): row t sees the keys up to its own position —
    blocks of (head, row) pairs, chunks over threads and the causal limit inside the last chunk
    — against exact attention, and no worse than torch's kernel with the same mask."""
    attend = DecodeAttention.load(kernel_cache, native=native)
    k, v = cache_views(h_kv, n, d, n + 9, seed=n + t)
    g = torch.Generator().manual_seed(t)
    q = torch.randn(t, h, d, generator=g).bfloat16().transpose(0, 1)  # [H, T, D] with a row stride of H*D
    scale = d**-0.5
    with torch_threads(threads):
        got = attend.attend_rows(q, k, v, scale)
    assert got is not None and got.shape == (h, t, d) and got.dtype == torch.bfloat16
    want = exact_causal(q, k, v, scale)
    torch.testing.assert_close(got.double(), want, atol=4e-3, rtol=1e-2)
    mask = torch.arange(n).view(1, n) <= (n - t + torch.arange(t)).view(t, 1)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.float().unsqueeze(0), k.float().unsqueeze(0), v.float().unsqueeze(0), attn_mask=mask, scale=scale,
        enable_gqa=h != h_kv,
    )[0]
    assert (got.double() - want).abs().max() <= (sdpa.bfloat16().double() - want).abs().max() * 2 + 1e-3
    if t == 1:
        assert torch.equal(got, attend.attend(q, k, v, scale))  # one row: the decode call's answer


def test_the_c_loops_run_only_where_they_beat_torchs_kernel(kernel_cache):
    """The policy the model follows (measured: docs/model.md "Long contexts"): the AVX-512
    loops (64-dim heads) for 1-16 rows; on a CPU without them the portable loops for one row;
    never more than MAX_ROWS rows, nor the portable loops for other head sizes on an AVX-512 CPU."""
    attend = DecodeAttention.load(kernel_cache)
    portable = DecodeAttention.load(kernel_cache, native=False)
    assert not attend.faster(0, 64) and not attend.faster(17, 64)
    avx512 = attend.faster(2, 64)
    assert avx512 == ("avx512f" in build._cpu_flags().split())
    assert attend.faster(1, 64) and attend.faster(16, 64) == avx512
    assert attend.faster(1, 128) == (not avx512) and not attend.faster(2, 128)
    assert portable.faster(1, 64) and not portable.faster(2, 64)


def test_rows_it_does_not_take_are_declined(kernel_cache):
    attend = DecodeAttention.load(kernel_cache)
    k, v = cache_views(2, 40, 64, 48, seed=0)
    assert attend.attend_rows(torch.randn(4, 17, 64).bfloat16(), k, v, 0.1) is None  # past MAX_ROWS
    assert attend.attend_rows(torch.randn(4, 3, 64).bfloat16(), k[:, :2], v[:, :2], 0.1) is None  # more rows than keys
    assert attend.attend_rows(torch.randn(4, 3, 64), k.float(), v.float(), 0.1) is None  # float32
