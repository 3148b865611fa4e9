/* The two passes around an int8 GEMM of many rows (kernels/cpu/int8_rows.py says why):
 * bf16 rows to int8 with one scale per row, each channel first multiplied by a float factor
 * (the smoothing that moves activation outliers into the weights), and the GEMM's int32
 * sums back to bf16 with the row's and the output channel's scales. One pass over the rows
 * each, where torch needs five or six. Rows split over the OpenMP threads where built so. */
#include <math.h>
#include <stddef.h>

#include "efim_cpu.h"

/* q[m, k] = round(x[m, k] * mul[k] / scale[m]), scale[m] = max_k |x[m, k] * mul[k]| / 127
 * (1 for a row of zeros), ties to even. mul may be NULL (all ones). Returns -1 for K <= 0. */
int efim_quantize_rows(int M, int K, const uint16_t *x, long ldx, const float *mul, int8_t *q, long ldq,
                       float *scale) {
  if (K <= 0) return -1;
#pragma omp parallel for schedule(static)
  for (int m = 0; m < M; m++) {
    const uint16_t *xm = x + (long)m * ldx;
    int8_t *qm = q + (long)m * ldq;
    int k = 0;
    float amax = 0.f;
#if defined(EFIM_AVX512_BW)
    __m512 vmax = _mm512_setzero_ps();
    for (; k < K; k += 16) {
      const int n = K - k < 16 ? K - k : 16;
      __m512 v = load_bf16x16_n(xm + k, n);
      if (mul != NULL) v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(first_lanes(n), mul + k));
      vmax = _mm512_max_ps(vmax, _mm512_abs_ps(v));
    }
    amax = _mm512_reduce_max_ps(vmax);
#else
    for (; k < K; k++) {
      const float v = fabsf(bf16_to_f32(xm[k]) * (mul != NULL ? mul[k] : 1.f));
      if (v > amax) amax = v;
    }
#endif
    const float s = amax > 0.f ? amax / 127.f : 1.f;
    const float inv = 1.f / s;
    scale[m] = s;
    k = 0;
#if defined(EFIM_AVX512_BW)
    const __m512 vinv = _mm512_set1_ps(inv);
    for (; k < K; k += 16) {
      const int n = K - k < 16 ? K - k : 16;
      const __mmask16 lanes = first_lanes(n);
      __m512 v = _mm512_mul_ps(load_bf16x16_n(xm + k, n), vinv);
      if (mul != NULL) v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(lanes, mul + k));
      const __m512i r = _mm512_cvt_roundps_epi32(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      _mm_mask_storeu_epi8(qm + k, lanes, _mm512_cvtsepi32_epi8(r));
    }
#else
    for (; k < K; k++) {
      float v = nearbyintf(bf16_to_f32(xm[k]) * inv * (mul != NULL ? mul[k] : 1.f));
      v = v > 127.f ? 127.f : (v < -127.f ? -127.f : v);
      qm[k] = (int8_t)v;
    }
#endif
  }
  return 0;
}

/* out[m, n] = bf16(acc[m, n] * row_scale[m] * col_scale[n]). Returns -1 for N <= 0. */
int efim_dequantize_rows(int M, int N, const int32_t *acc, long lda, const float *row_scale, const float *col_scale,
                         uint16_t *out, long ldo) {
  if (N <= 0) return -1;
#pragma omp parallel for schedule(static)
  for (int m = 0; m < M; m++) {
    const int32_t *am = acc + (long)m * lda;
    uint16_t *om = out + (long)m * ldo;
    const float rs = row_scale[m];
    int n = 0;
#if defined(EFIM_AVX512_BW)
    const __m512 vrs = _mm512_set1_ps(rs);
    for (; n + 16 <= N; n += 16) {
      const __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(am + n)), vrs),
                                     _mm512_loadu_ps(col_scale + n));
      _mm256_storeu_si256((__m256i *)(om + n), to_bf16x16(v));
    }
#endif
    for (; n < N; n++) om[n] = f32_to_bf16((float)am[n] * rs * col_scale[n]);
  }
  return 0;
}
