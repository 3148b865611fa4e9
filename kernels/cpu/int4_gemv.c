/* y = x Wᵀ for the few rows of a decode step on 4-bit weights (kernels/cpu/int4_gemv.py says
 * why): bf16 rows in, bf16 rows out, float32 sums, each weight w = (q - 8) * scale + zero with
 * one bf16 scale and zero per output row and group of G inputs (the layout torch's int4 kernel
 * takes, repacked).
 *
 * Layout (`efim_int4_pack` writes it): output rows in blocks of 16; a block is K/4 chunks of
 * 32 bytes, chunk c for inputs k0 = 4c .. 4c + 3: byte 2i + e holds q[16b + i][k0 + e] in its
 * low nibble and q[16b + i][k0 + 2 + e] in its high nibble. Widened to 16-bit lanes, a chunk's
 * low nibbles are then the 32 (row, input) pairs that one AVX512-BF16 dot product
 * (`vdpbf16ps`) takes with the input pair (x[k0], x[k0 + 1]), its high nibbles those for
 * (x[k0 + 2], x[k0 + 3]). A nibble becomes a bf16 number without a table: 0x4300 | q is
 * exactly 128 + q, so the sums are of (128 + q) x and each group's correction is folded into
 * its zero: y += scale * sum + (zero - 136 * scale) * sum(x over the group).
 * Scales and zeros: per block and group, 16 bf16 scales then 16 bf16 zeros.
 *
 * Output rows are shared over OpenMP threads (torch's runtime, kernels/cpu/build.py) in whole
 * blocks; each output's arithmetic is the same on any number of threads and for any number of
 * rows in the call. The portable loop (no AVX512-BF16) computes the same sums per output and
 * group, in one chain where the vector loop keeps four. */
#include <stddef.h>

#include "efim_cpu.h"

#define EFIM_GEMV_MAX_ROWS 8
#define EFIM_GEMV_MAX_GROUPS 1024
#define EFIM_GEMV_MAX_RANK 256

/* An adapter's low-rank term added inside the product, before the output's one rounding:
 * y += (x A) B. A is [K, R] bf16; B is kept per block of 16 output rows as the block's ranks
 * r0 .. r0 + count - 1, count rows of 16 bf16 values (zero where a row takes no part of a rank):
 * blk[3 b] = r0, blk[3 b + 1] = count, blk[3 b + 2] = offset of the block's values in bv.
 * t = x A (M x R floats) is computed once per call, before the blocks. */
typedef struct {
  const float *t; /* [M][R] */
  int R;
  const int *blk;
  const uint16_t *bv;
} low_rank_t;

/* Repack codes q [N, K] (one byte each, 0..15) and scale/zero [N, K/G] bf16 into the layout
 * above. Returns 0, or -1 for shapes it does not take (N % 16, K % G, G % 8, groups). */
int efim_int4_pack(int N, int K, int G, const uint8_t *q, const uint16_t *scale, const uint16_t *zero,
                   uint8_t *packed, uint16_t *sz) {
  if (N <= 0 || K <= 0 || G <= 0 || N % 16 || K % G || G % 8 || K / G > EFIM_GEMV_MAX_GROUPS) return -1;
  const int groups = K / G;
  for (int b = 0; b < N / 16; b++) {
    uint8_t *pb = packed + (long)b * 16 * K / 2;
    for (int c = 0; c < K / 4; c++) {
      const int k0 = 4 * c;
      for (int i = 0; i < 16; i++)
        for (int e = 0; e < 2; e++) {
          const uint8_t *row = q + (long)(16 * b + i) * K;
          pb[32 * c + 2 * i + e] = (uint8_t)((row[k0 + e] & 15) | ((row[k0 + 2 + e] & 15) << 4));
        }
    }
    uint16_t *sb = sz + (long)b * groups * 32;
    for (int g = 0; g < groups; g++)
      for (int i = 0; i < 16; i++) {
        sb[32 * g + i] = scale[(long)(16 * b + i) * groups + g];
        sb[32 * g + 16 + i] = zero[(long)(16 * b + i) * groups + g];
      }
  }
  return 0;
}

/* The sums of x over each group of each row, float32: xsum[m * groups + g]. */
static void group_sums(int M, int K, int G, const uint16_t *x, long ldx, float *xsum) {
  const int groups = K / G;
  for (int m = 0; m < M; m++)
    for (int g = 0; g < groups; g++) {
      float s = 0.f;
      for (int k = g * G; k < (g + 1) * G; k++) s += bf16_to_f32(x[(long)m * ldx + k]);
      xsum[m * groups + g] = s;
    }
}

#if defined(__AVX512BF16__) && defined(EFIM_AVX512_BW)
/* One block of 16 output rows for M rows (constant M after inlining). Each row keeps 2 * P
 * independent sums per group (the low and high nibbles of P chunks in turn), so that a one-row
 * call is not bound by `vdpbf16ps`'s wait for its accumulator (a one-chain version measured
 * level with this one: the one-row call is bound by memory). */
static inline __attribute__((always_inline)) void block_bf16(int M, int P, int K, int G, const uint8_t *pb,
                                                            const uint16_t *sb, const uint16_t *x, long ldx,
                                                            const float *xsum, uint16_t *y, long ldy,
                                                            const low_rank_t *lr, int b, int m0) {
  const int groups = K / G;
  const __m512i low = _mm512_set1_epi16(0x000F), bias = _mm512_set1_epi16(0x4300);
  __m512 out[EFIM_GEMV_MAX_ROWS];
  for (int m = 0; m < M; m++) out[m] = _mm512_setzero_ps();
  for (int g = 0; g < groups; g++) {
    __m512 acc[EFIM_GEMV_MAX_ROWS][4];
    for (int m = 0; m < M; m++)
      for (int a = 0; a < 2 * P; a++) acc[m][a] = _mm512_setzero_ps();
    for (int k0 = g * G; k0 < (g + 1) * G; k0 += 4 * P)
      for (int u = 0; u < P; u++) {
        const int k = k0 + 4 * u;
        const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(pb + (long)k * 8)));
        const __m512bh lo = (__m512bh)_mm512_ternarylogic_epi32(w, low, bias, 0xEA); /* (w & 15) | 0x4300 */
        const __m512bh hi = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(w, 4), bias);
        for (int m = 0; m < M; m++) {
          const uint16_t *xm = x + (long)m * ldx + k;
          uint32_t p0, p1;
          __builtin_memcpy(&p0, xm, 4);
          __builtin_memcpy(&p1, xm + 2, 4);
          acc[m][2 * u] = _mm512_dpbf16_ps(acc[m][2 * u], lo, (__m512bh)_mm512_set1_epi32((int)p0));
          acc[m][2 * u + 1] = _mm512_dpbf16_ps(acc[m][2 * u + 1], hi, (__m512bh)_mm512_set1_epi32((int)p1));
        }
      }
    const __m512 s = load_bf16x16(sb + 32 * g);
    const __m512 off = _mm512_fnmadd_ps(_mm512_set1_ps(136.f), s, load_bf16x16(sb + 32 * g + 16));
    for (int m = 0; m < M; m++) {
      __m512 sum = _mm512_add_ps(acc[m][0], acc[m][1]);
      if (P == 2) sum = _mm512_add_ps(sum, _mm512_add_ps(acc[m][2], acc[m][3]));
      out[m] = _mm512_fmadd_ps(s, sum, out[m]);
      out[m] = _mm512_fmadd_ps(off, _mm512_set1_ps(xsum[m * groups + g]), out[m]);
    }
  }
  if (lr != NULL) {
    const int r0 = lr->blk[3 * b], count = lr->blk[3 * b + 1];
    const uint16_t *bv = lr->bv + lr->blk[3 * b + 2];
    for (int r = 0; r < count; r++) {
      const __m512 w = load_bf16x16(bv + 16 * r);
      for (int m = 0; m < M; m++)
        out[m] = _mm512_fmadd_ps(_mm512_set1_ps(lr->t[(m0 + m) * lr->R + r0 + r]), w, out[m]);
    }
  }
  for (int m = 0; m < M; m++) _mm256_storeu_si256((__m256i *)(y + (long)m * ldy), to_bf16x16(out[m]));
}
#endif

/* The portable loop: per output, per group, the same (128 + q) x sums and correction. */
static void block_portable(int M, int K, int G, const uint8_t *pb, const uint16_t *sb, const uint16_t *x,
                           long ldx, const float *xsum, uint16_t *y, long ldy, const low_rank_t *lr, int b) {
  const int groups = K / G;
  for (int m = 0; m < M; m++)
    for (int i = 0; i < 16; i++) {
      float out = 0.f;
      for (int g = 0; g < groups; g++) {
        float acc = 0.f;
        for (int k0 = g * G; k0 < (g + 1) * G; k0 += 4) {
          const uint8_t b0 = pb[(long)k0 * 8 + 2 * i], b1 = pb[(long)k0 * 8 + 2 * i + 1];
          const uint16_t *xm = x + (long)m * ldx + k0;
          acc += (128.f + (b0 & 15)) * bf16_to_f32(xm[0]) + (128.f + (b1 & 15)) * bf16_to_f32(xm[1]);
          acc += (128.f + (b0 >> 4)) * bf16_to_f32(xm[2]) + (128.f + (b1 >> 4)) * bf16_to_f32(xm[3]);
        }
        const float s = bf16_to_f32(sb[32 * g + i]);
        const float off = bf16_to_f32(sb[32 * g + 16 + i]) - 136.f * s;
        out += s * acc;
        out += off * xsum[m * groups + g];
      }
      if (lr != NULL) {
        const int r0 = lr->blk[3 * b], count = lr->blk[3 * b + 1];
        const uint16_t *bv = lr->bv + lr->blk[3 * b + 2];
        for (int r = 0; r < count; r++) out += lr->t[m * lr->R + r0 + r] * bf16_to_f32(bv[16 * r + i]);
      }
      y[(long)m * ldy + i] = f32_to_bf16(out);
    }
}

static int gemv(int M, int N, int K, int G, const uint16_t *x, long ldx, const uint8_t *packed, const uint16_t *sz,
                uint16_t *y, long ldy, int threads, int vector, const low_rank_t *lr) {
  if (M <= 0 || M > EFIM_GEMV_MAX_ROWS || N <= 0 || K <= 0 || G <= 0 || N % 16 || K % G || G % 8 ||
      K / G > EFIM_GEMV_MAX_GROUPS)
    return -1;
  const int groups = K / G, blocks = N / 16;
  float xsum[EFIM_GEMV_MAX_ROWS * EFIM_GEMV_MAX_GROUPS];
  group_sums(M, K, G, x, ldx, xsum);
  (void)threads;
  (void)vector;
#pragma omp parallel for schedule(static) num_threads(threads) if (blocks >= 4 && threads > 1)
  for (int b = 0; b < blocks; b++) {
    const uint8_t *pb = packed + (long)b * 8 * K;
    const uint16_t *sb = sz + (long)b * groups * 32;
    uint16_t *yb = y + 16 * b;
#if defined(__AVX512BF16__) && defined(EFIM_AVX512_BW)
    if (vector) {
      /* Rows in fours, each with the same four sums: a row's bits do not depend on the rows
       * beside it (a speculation verify's row is the decode step's). */
      for (int m0 = 0; m0 < M; m0 += 4) {
        const uint16_t *xm = x + (long)m0 * ldx;
        uint16_t *ym = yb + (long)m0 * ldy;
        const float *sm = xsum + m0 * groups;
        switch (M - m0 < 4 ? M - m0 : 4) {
          case 1: block_bf16(1, 2, K, G, pb, sb, xm, ldx, sm, ym, ldy, lr, b, m0); break;
          case 2: block_bf16(2, 2, K, G, pb, sb, xm, ldx, sm, ym, ldy, lr, b, m0); break;
          case 3: block_bf16(3, 2, K, G, pb, sb, xm, ldx, sm, ym, ldy, lr, b, m0); break;
          default: block_bf16(4, 2, K, G, pb, sb, xm, ldx, sm, ym, ldy, lr, b, m0); break;
        }
      }
      continue;
    }
#endif
    block_portable(M, K, G, pb, sb, x, ldx, xsum, yb, ldy, lr, b);
  }
  return 0;
}

/* y [M, N] (row stride ldy) = x [M, K] (row stride ldx) times the packed weight's transpose.
 * M <= EFIM_GEMV_MAX_ROWS. `vector` 0 forces the portable loop (the tests compare both).
 * Returns 0, or -1 for shapes it does not take. */
int efim_int4_gemv(int M, int N, int K, int G, const uint16_t *x, long ldx, const uint8_t *packed,
                   const uint16_t *sz, uint16_t *y, long ldy, int threads, int vector) {
  return gemv(M, N, K, G, x, ldx, packed, sz, y, ldy, threads, vector, NULL);
}

/* The same product plus an adapter's low-rank term (see low_rank_t): A [K, R] bf16, the blocks'
 * rank ranges `blk` [N / 16][3] and values `bv`. R <= EFIM_GEMV_MAX_RANK. */
int efim_int4_gemv_low_rank(int M, int N, int K, int G, const uint16_t *x, long ldx, const uint8_t *packed,
                            const uint16_t *sz, uint16_t *y, long ldy, int threads, int vector, int R,
                            const uint16_t *a, const int *blk, const uint16_t *bv) {
  if (R <= 0 || R > EFIM_GEMV_MAX_RANK || M <= 0 || M > EFIM_GEMV_MAX_ROWS) return -1;
  float t[EFIM_GEMV_MAX_ROWS * EFIM_GEMV_MAX_RANK];
  for (int m = 0; m < M; m++) {
    float *tm = t + m * R;
    for (int r = 0; r < R; r++) tm[r] = 0.f;
    const uint16_t *xm = x + (long)m * ldx;
#if defined(EFIM_AVX512_BW)
    if (vector) {
      int rb = 0;
      for (; rb < R; rb += 16) {
        const int live = R - rb < 16 ? R - rb : 16;
        __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
        int k = 0;
        for (; k + 2 <= K; k += 2) {
          acc0 = _mm512_fmadd_ps(_mm512_set1_ps(bf16_to_f32(xm[k])), load_bf16x16_n(a + (long)k * R + rb, live), acc0);
          acc1 = _mm512_fmadd_ps(_mm512_set1_ps(bf16_to_f32(xm[k + 1])), load_bf16x16_n(a + (long)(k + 1) * R + rb, live), acc1);
        }
        for (; k < K; k++)
          acc0 = _mm512_fmadd_ps(_mm512_set1_ps(bf16_to_f32(xm[k])), load_bf16x16_n(a + (long)k * R + rb, live), acc0);
        _mm512_mask_storeu_ps(tm + rb, first_lanes(live), _mm512_add_ps(acc0, acc1));
      }
      continue;
    }
#endif
    for (int k = 0; k < K; k++) {
      const float xv = bf16_to_f32(xm[k]);
      const uint16_t *ak = a + (long)k * R;
      for (int r = 0; r < R; r++) tm[r] += xv * bf16_to_f32(ak[r]);
    }
  }
  const low_rank_t lr = {t, R, blk, bv};
  return gemv(M, N, K, G, x, ldx, packed, sz, y, ldy, threads, vector, &lr);
}

/* The dequantised weight, transposed: out [K, N] bf16 (row stride ldo) = (q - 8) * scale + zero,
 * with torch's roundings (the offset zero - 8 * scale rounded to bf16, then offset + q * scale
 * rounded once): a prefill of many rows multiplies it as a GEMM. Returns 0, or -1 for shapes it
 * does not take. */
int efim_int4_dequantize_t(int N, int K, int G, const uint8_t *packed, const uint16_t *sz, uint16_t *out,
                           long ldo, int threads) {
  if (N <= 0 || K <= 0 || G <= 0 || N % 16 || K % G || G % 8 || K / G > EFIM_GEMV_MAX_GROUPS) return -1;
  const int groups = K / G, blocks = N / 16;
  (void)threads;
#pragma omp parallel for schedule(static) num_threads(threads) if (blocks >= 4 && threads > 1)
  for (int b = 0; b < blocks; b++) {
    const uint8_t *pb = packed + (long)b * 8 * K;
    const uint16_t *sb = sz + (long)b * groups * 32;
    for (int g = 0; g < groups; g++) {
      float s[16], off[16];
      for (int i = 0; i < 16; i++) {
        s[i] = bf16_to_f32(sb[32 * g + i]);
        off[i] = bf16_to_f32(f32_to_bf16(bf16_to_f32(sb[32 * g + 16 + i]) - 8.f * s[i]));
      }
      for (int k0 = g * G; k0 < (g + 1) * G; k0 += 4) {
        const uint8_t *chunk = pb + (long)k0 * 8;
        for (int e = 0; e < 4; e++) {
          uint16_t *o = out + (long)(k0 + e) * ldo + 16 * b;
          for (int i = 0; i < 16; i++) {
            const uint8_t byte = chunk[2 * i + (e & 1)];
            const int q = e < 2 ? byte & 15 : byte >> 4;
            o[i] = f32_to_bf16(off[i] + (float)q * s[i]);
          }
        }
      }
    }
  }
  return 0;
}

/* Whether this build has the AVX512-BF16 loop. */
int efim_int4_gemv_vector(void) {
#if defined(__AVX512BF16__) && defined(EFIM_AVX512_BW)
  return 1;
#else
  return 0;
#endif
}
