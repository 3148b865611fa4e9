/* Causal attention of a prefill step's many query rows (kernels/cpu/prefill_attention.py says
 * why): T query rows at positions start..start+T-1, each over keys 0..its own position, GQA
 * (H query heads share H_kv KV heads). bf16 in and out, float32 inside.
 *
 * Work is split in units of (KV head, block of QB query rows); a unit takes the block's rows of
 * every query head of its KV head, so the keys it reads serve G = H / H_kv heads. Scores come
 * from AVX512-BF16 dot products against keys laid out in pairs (`efim_prefill_attention`'s
 * first pass): one broadcast query pair against 16 keys per instruction, no horizontal sums.
 * The softmax and the weighted sum of values are float32; each row is divided by its sum
 * once, at the end, and rounded to bf16 once. */
#include <math.h>
#include <stddef.h>

#include "efim_cpu.h"

#define QB 16        /* query rows per unit */
#define MAX_D 128    /* head dim */
#define MAX_G 16     /* query heads per KV head */
#define KEYS 16      /* keys per score vector */

/* Floats of scratch a call needs: the paired keys of every KV head (as bf16 pairs, counted in
 * floats) and, per thread, the scores of one unit. */
long efim_prefill_attention_scratch(int H, int H_kv, int D, int n, int threads) {
  const long n_pad = (n + KEYS - 1) / KEYS * KEYS;
  const long keys = (long)H_kv * (D / 2) * n_pad;  /* one float holds a pair of bf16 */
  const long unit = (long)(H / (H_kv > 0 ? H_kv : 1)) * QB * n_pad;
  return keys + (long)(threads > 0 ? threads : 1) * unit;
}

int efim_prefill_attention_bf16(void) {
#if defined(__AVX512BF16__) && defined(EFIM_AVX512_BW)
  return 1;
#else
  return 0;
#endif
}

#if defined(__AVX512BF16__) && defined(EFIM_AVX512_BW)
#ifdef _OPENMP
#include <omp.h>
#endif

/* Keys of one KV head k [n rows of D at stride D] -> pairs[d2][s] = (k[s][2 d2], k[s][2 d2 + 1])
 * as one 32-bit lane, keys n..n_pad-1 zero. */
static void pair_keys(const uint16_t *k, int n, int n_pad, int D, uint32_t *pairs) {
  const int full = n / KEYS * KEYS;
  /* 16 keys at a time: a gather of the same pair from 16 rows is one output vector. */
  const __m512i rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                          _mm512_set1_epi32(D / 2));
  for (int s0 = 0; s0 < full; s0 += KEYS) {
    const int *base = (const int *)(k + (long)s0 * D);
    for (int d2 = 0; d2 < D / 2; d2++)
      _mm512_storeu_si512(pairs + (long)d2 * n_pad + s0, _mm512_i32gather_epi32(_mm512_add_epi32(rows, _mm512_set1_epi32(d2)), base, 4));
  }
  for (int d2 = 0; d2 < D / 2; d2++) {
    uint32_t *row = pairs + (long)d2 * n_pad;
    for (int s = full; s < n; s++) {
      uint32_t lo = k[(long)s * D + 2 * d2], hi = k[(long)s * D + 2 * d2 + 1];
      row[s] = lo | (hi << 16);
    }
    for (int s = n; s < n_pad; s++) row[s] = 0;
  }
}

/* One unit: query rows r0..r1-1 (positions start + r) of the G query heads h0.. of one KV head. */
static inline __attribute__((always_inline)) void unit(
    const int D, int G, int start, int r0, int r1, float scale, const uint16_t *q, long q_hs, long q_rs, int h0,
    const uint32_t *pairs, int n_pad, const uint16_t *v, uint16_t *out, long o_hs, long o_rs, float *sc) {
  const int rows = r1 - r0;
  float sums[MAX_G * QB]; /* each row's sum of softmax numerators */
  const int n_unit = start + r1; /* keys the unit's last row sees */
  const int c_unit = (n_unit + KEYS - 1) / KEYS;
  /* Scores, scaled: sc[(g * QB + i) * n_pad + s], then replaced by the softmax numerators. */
  for (int g = 0; g < G; g++)
    for (int i = 0; i < rows; i++) {
      const uint16_t *qr = q + (long)(h0 + g) * q_hs + (long)(r0 + i) * q_rs;
      float *srow = sc + (long)(g * QB + i) * n_pad;
      const int n_row = start + r0 + i + 1;
      const int c_row = (n_row + KEYS - 1) / KEYS;
      int c = 0;
      for (; c + 4 <= c_row; c += 4) {
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int d2 = 0; d2 < D / 2; d2++) {
          const __m512bh qp = (__m512bh)_mm512_set1_epi32((int)((const uint32_t *)qr)[d2]);
          const uint32_t *kp = pairs + (long)d2 * n_pad + c * KEYS;
          a0 = _mm512_dpbf16_ps(a0, qp, (__m512bh)_mm512_loadu_si512(kp));
          a1 = _mm512_dpbf16_ps(a1, qp, (__m512bh)_mm512_loadu_si512(kp + KEYS));
          a2 = _mm512_dpbf16_ps(a2, qp, (__m512bh)_mm512_loadu_si512(kp + 2 * KEYS));
          a3 = _mm512_dpbf16_ps(a3, qp, (__m512bh)_mm512_loadu_si512(kp + 3 * KEYS));
        }
        const __m512 sv = _mm512_set1_ps(scale);
        _mm512_storeu_ps(srow + c * KEYS, _mm512_mul_ps(a0, sv));
        _mm512_storeu_ps(srow + (c + 1) * KEYS, _mm512_mul_ps(a1, sv));
        _mm512_storeu_ps(srow + (c + 2) * KEYS, _mm512_mul_ps(a2, sv));
        _mm512_storeu_ps(srow + (c + 3) * KEYS, _mm512_mul_ps(a3, sv));
      }
      for (; c < c_row; c++) {
        __m512 a0 = _mm512_setzero_ps();
        for (int d2 = 0; d2 < D / 2; d2++) {
          const __m512bh qp = (__m512bh)_mm512_set1_epi32((int)((const uint32_t *)qr)[d2]);
          a0 = _mm512_dpbf16_ps(a0, qp, (__m512bh)_mm512_loadu_si512(pairs + (long)d2 * n_pad + c * KEYS));
        }
        _mm512_storeu_ps(srow + c * KEYS, _mm512_mul_ps(a0, _mm512_set1_ps(scale)));
      }
      /* Softmax numerators in place: e^(s - max) for keys < n_row, 0 after, up to the unit's last
       * row's keys (the weighted sums below run every row of a group that far). */
      __m512 mx = _mm512_set1_ps(-INFINITY);
      for (c = 0; c < c_row; c++) {
        const __mmask16 live = first_lanes(n_row - c * KEYS);
        mx = _mm512_mask_max_ps(mx, live, mx, _mm512_loadu_ps(srow + c * KEYS));
      }
      const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
      __m512 sum = _mm512_setzero_ps();
      for (c = 0; c < c_row; c++) {
        const __mmask16 live = first_lanes(n_row - c * KEYS);
        const __m512 e = _mm512_maskz_mov_ps(live, exp_clamped(_mm512_sub_ps(_mm512_loadu_ps(srow + c * KEYS), m)));
        sum = _mm512_add_ps(sum, e);
        _mm512_storeu_ps(srow + c * KEYS, e);
      }
      for (; c < c_unit; c++) _mm512_storeu_ps(srow + c * KEYS, _mm512_setzero_ps()); /* masked: weight 0 */
      sums[g * QB + i] = _mm512_reduce_add_ps(sum);
    }
  /* Weighted sums of the values, 4 rows at a time: every row of the group runs to the
   * group's last key, with weight 0 past its own (the numerators above). A short last group
   * repeats its first row and drops the copies. */
  const int total = G * rows;
  for (int base = 0; base < total; base += 4) {
    const int cnt = total - base < 4 ? total - base : 4;
    const float *p[4];
    int n_hi = 0;
    for (int j = 0; j < 4; j++) {
      const int idx = base + (j < cnt ? j : 0);
      const int g = idx / rows, i = idx % rows;
      p[j] = sc + (long)(g * QB + i) * n_pad;
      if (start + r0 + i + 1 > n_hi) n_hi = start + r0 + i + 1;
    }
    __m512 acc[4][MAX_D / 16];
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++)
#pragma GCC unroll 8
      for (int e = 0; e < D / 16; e++) acc[j][e] = _mm512_setzero_ps();
    for (int s = 0; s < n_hi; s++) {
      __m512 vv[MAX_D / 16];
      const uint16_t *vs = v + (long)s * D;
#pragma GCC unroll 8
      for (int e = 0; e < D / 16; e++) vv[e] = load_bf16x16(vs + 16 * e);
#pragma GCC unroll 4
      for (int j = 0; j < 4; j++) {
        const __m512 w = _mm512_set1_ps(p[j][s]);
#pragma GCC unroll 8
        for (int e = 0; e < D / 16; e++) acc[j][e] = _mm512_fmadd_ps(w, vv[e], acc[j][e]);
      }
    }
    for (int j = 0; j < cnt; j++) {
      const int idx = base + j;
      const int g = idx / rows, i = idx % rows;
      const __m512 inv = _mm512_set1_ps(1.0f / sums[g * QB + i]);
      uint16_t *o = out + (long)(h0 + g) * o_hs + (long)(r0 + i) * o_rs;
      for (int e = 0; e < D / 16; e++) _mm256_storeu_si256((__m256i *)(o + 16 * e), to_bf16x16(_mm512_mul_ps(acc[j][e], inv)));
    }
  }
}
#endif

/* q [H] heads at q_hs of T rows at q_rs (D contiguous; already rotated), k and v [H_kv] heads
 * at kv_hs of rows 0..start+T-1 at stride D (the step's own rows last), out [H] heads at o_hs
 * of T rows at o_rs. Row t attends keys 0..start+t. scratch: efim_prefill_attention_scratch
 * floats. Returns 0, or -1 for sizes it does not take, -2 without AVX512-BF16. */
int efim_prefill_attention(int H, int H_kv, int D, int start, int T, float scale, const uint16_t *q, long q_hs,
                           long q_rs, const uint16_t *k, const uint16_t *v, long kv_hs, uint16_t *out, long o_hs,
                           long o_rs, float *scratch, int threads) {
  if (H < 1 || H_kv < 1 || H % H_kv || H / H_kv > MAX_G || D < 32 || D > MAX_D || D % 32 || T < 1 || start < 0)
    return -1;
#if defined(__AVX512BF16__) && defined(EFIM_AVX512_BW)
  const int n = start + T, G = H / H_kv;
  const int n_pad = (n + KEYS - 1) / KEYS * KEYS;
  if (threads < 1) threads = 1;
  uint32_t *pairs = (uint32_t *)scratch;
  float *scores = scratch + (long)H_kv * (D / 2) * n_pad;
  const long unit_floats = (long)G * QB * n_pad;
  const int blocks = (T + QB - 1) / QB;
  const int units = H_kv * blocks;
#pragma omp parallel num_threads(threads) if (threads > 1 && units > 1)
  {
#ifdef _OPENMP
    const int me = omp_get_thread_num();
#else
    const int me = 0;
#endif
#pragma omp for schedule(static)
    for (int hk = 0; hk < H_kv; hk++) pair_keys(k + (long)hk * kv_hs, n, n_pad, D, pairs + (long)hk * (D / 2) * n_pad);
    float *sc = scores + (long)me * unit_floats;
    /* Later blocks see more keys: hand them out first. */
#pragma omp for schedule(dynamic, 1)
    for (int u = 0; u < units; u++) {
      const int b = blocks - 1 - u / H_kv, hk = u % H_kv;
      const int r0 = b * QB, r1 = r0 + QB < T ? r0 + QB : T;
      const uint32_t *kp = pairs + (long)hk * (D / 2) * n_pad;
      const uint16_t *vh = v + (long)hk * kv_hs;
      if (D == 64)
        unit(64, G, start, r0, r1, scale, q, q_hs, q_rs, hk * G, kp, n_pad, vh, out, o_hs, o_rs, sc);
      else
        unit(D, G, start, r0, r1, scale, q, q_hs, q_rs, hk * G, kp, n_pad, vh, out, o_hs, o_rs, sc);
    }
  }
  return 0;
#else
  (void)scale; (void)q; (void)q_hs; (void)q_rs; (void)k; (void)v; (void)kv_hs; (void)out; (void)o_hs; (void)o_rs;
  (void)scratch; (void)threads;
  return -2;
#endif
}
