/* The row operations of a step, one call each instead of torch's 3-9 (kernels/cpu/row_ops.py
 * says why): RMSNorm (optionally after adding a residual in place) and SiLU(gate) * up. bf16 in
 * and out, float32 inside; rows at a stride; a prefill's many rows over OpenMP threads. */
#include <math.h>
#include <stddef.h>

#include "efim_cpu.h"

#define LANES 16

/* Both calls share their rows over `threads` OpenMP threads (the caller passes 1 for a decode
 * step's few rows). Rows are independent: the same bits on any number of threads. */

/* h[m] += delta[m] (rounded to bf16, as torch's add_), when delta is not NULL; then
 * out[m] = h[m] / sqrt(mean(h[m]^2) + eps) * w. Returns -1 for K <= 0. */
int efim_add_rms_norm(int M, int K, uint16_t *h, long ldh, const uint16_t *delta, long ldd,
                      const uint16_t *w, float eps, uint16_t *out, long ldo, int threads) {
  if (K <= 0) return -1;
  (void)threads;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int m = 0; m < M; m++) {
    uint16_t *hm = h + (long)m * ldh;
    if (delta != NULL) {
      const uint16_t *dm = delta + (long)m * ldd;
      for (int k = 0; k < K; k++) hm[k] = f32_to_bf16(bf16_to_f32(hm[k]) + bf16_to_f32(dm[k]));
    }
    float part[LANES] = {0};
    int k = 0;
    for (; k + LANES <= K; k += LANES)
      for (int j = 0; j < LANES; j++) {
        const float v = bf16_to_f32(hm[k + j]);
        part[j] += v * v;
      }
    float ss = 0.f;
    for (int j = 0; j < LANES; j++) ss += part[j];
    for (; k < K; k++) ss += bf16_to_f32(hm[k]) * bf16_to_f32(hm[k]);
    const float inv = 1.0f / sqrtf(ss / (float)K + eps);
    uint16_t *om = out + (long)m * ldo;
    for (k = 0; k < K; k++) om[k] = f32_to_bf16(bf16_to_f32(hm[k]) * inv * bf16_to_f32(w[k]));
  }
  return 0;
}

#if defined(__AVX512F__)
/* x rounded to bf16's precision (nearest even), kept in float32 lanes. */
static inline __m512 round_bf16(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb);
  return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32((int)0xFFFF0000u)));
}

#endif

/* out[m, i] = silu(gu[m, i]) * gu[m, I + i]: the gated MLP's activation on its fused
 * gate-up row (gate first). silu(x) = x / (1 + e^-x) in float32, rounded to bf16 before the
 * product as torch's two ops round it. */
int efim_silu_mul(int M, int I, const uint16_t *gu, long ldg, uint16_t *out, long ldo, int threads) {
  if (I <= 0) return -1;
  (void)threads;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int m = 0; m < M; m++) {
    const uint16_t *g = gu + (long)m * ldg, *u = g + I;
    uint16_t *om = out + (long)m * ldo;
    int i = 0;
#if defined(__AVX512F__)
    const __m512 one = _mm512_set1_ps(1.0f);
    for (; i + 16 <= I; i += 16) {
      const __m512 x = load_bf16x16(g + i);
      const __m512 silu = _mm512_div_ps(x, _mm512_add_ps(one, exp_clamped(_mm512_sub_ps(_mm512_setzero_ps(), x))));
      const __m512 s = round_bf16(silu);
      _mm256_storeu_si256((__m256i *)(om + i), to_bf16x16(_mm512_mul_ps(s, load_bf16x16(u + i))));
    }
#endif
    for (; i < I; i++) {
      const float x = bf16_to_f32(g[i]);
      const float s = bf16_to_f32(f32_to_bf16(x / (1.0f + expf(-x))));
      om[i] = f32_to_bf16(s * bf16_to_f32(u[i]));
    }
  }
  return 0;
}
