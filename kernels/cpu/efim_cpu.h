/* What the C kernels of kernels/cpu share: bf16 <-> float32 (round to nearest even, as torch
 * rounds) and the polynomial behind their e^x, scalar and AVX-512. Included by each .c file;
 * kernels/cpu/build.py hashes this header into every library's cache key. */
#ifndef EFIM_CPU_H
#define EFIM_CPU_H

#include <stdint.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

static inline float bf16_to_f32(uint16_t v) {
  union { uint32_t u; float f; } x = {(uint32_t)v << 16};
  return x.f;
}

/* No NaN reaches here (finite sums), so no NaN case. */
static inline uint16_t f32_to_bf16(float f) {
  union { float f; uint32_t u; } x = {f};
  return (uint16_t)((x.u + 0x7FFFu + ((x.u >> 16) & 1u)) >> 16);
}

/* 2^f for f in [-0.5, 0.5] by a degree-6 polynomial; e^y = 2^n * 2^f with y log2(e) = n + f.
 * Relative error of the e^y built on it: below 7e-7 for |y| <= 10, 4e-6 at |y| ~ 87, where
 * float32's rounding of y log2(e) dominates. */
#define EFIM_LOG2E 1.44269504088896341f
static inline float exp2_fraction(float f) {
  float p = 1.5403530393381606e-4f;
  p = p * f + 1.3333558146428443e-3f;
  p = p * f + 9.6181291076284772e-3f;
  p = p * f + 5.5504108664821580e-2f;
  p = p * f + 2.4022650695910071e-1f;
  p = p * f + 6.9314718055994531e-1f;
  return p * f + 1.0f;
}

#if defined(__AVX512F__)
static inline __m512 exp2_fraction_avx512(__m512 f) {
  __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  return _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
}

/* e^y for y in [-87, 88] (clamped): an integer power of two (scalef) times 2^f, f in
 * [-0.5, 0.5], by a degree-6 polynomial (relative error below 7e-7 for |y| <= 10, 4e-6 at
 * the ends of the range). */
static inline __m512 exp_clamped(__m512 y) {
  y = _mm512_min_ps(_mm512_max_ps(y, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 t = _mm512_mul_ps(y, _mm512_set1_ps(EFIM_LOG2E));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm512_scalef_ps(exp2_fraction_avx512(_mm512_sub_ps(t, n)), n);
}

/* 16 bf16 values as float32. */
static inline __m512 load_bf16x16(const uint16_t *p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* The lanes below n (0..16) set. */
static inline __mmask16 first_lanes(int n) { return (__mmask16)(n >= 16 ? 0xFFFFu : (1u << n) - 1u); }

#if defined(__AVX512BW__) && defined(__AVX512VL__)
#define EFIM_AVX512_BW 1
/* The first n (0..16) of 16 bf16 values as float32, the rest 0. */
static inline __m512 load_bf16x16_n(const uint16_t *p, int n) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(first_lanes(n), p)), 16));
}
#endif

/* float32 -> bf16, round to nearest even (finite values), 16 at a time. */
static inline __m256i to_bf16x16(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb);
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}
#endif

#endif
