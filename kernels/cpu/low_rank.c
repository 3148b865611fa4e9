/* y[m, :] += (x[m, :] A) B for the rows of a decode step: a LoRA adapter kept beside packed
 * weights (kernels/cpu/low_rank.py says why). bf16 activations in and out, float32 sums.
 *
 * A is [K, R] (row k holds the R coefficients input k feeds); B is stored by segment: for
 * segment s = (r0, r1, n0, n1), a [(r1 - r0), (n1 - n0)] row-major block that maps t[r0:r1]
 * onto output columns n0..n1-1, blocks in segment order. Columns no segment names get nothing
 * added: a block-diagonal B (the low-rank terms of q, k and v side by side) costs only its
 * blocks. Two weight types: float32 (any adapter) and bf16 (an adapter whose values bf16
 * holds exactly, as the shipped one: half the bytes a step reads).
 *
 * Two loops compute it. The vector loop (AVX-512 with BW/VL, segments over disjoint columns):
 * t = x A with 16 ranks per register and up to four independent sums over k, then each
 * segment's columns 64 at a time, summed over its ranks and added to y (one bf16 rounding per
 * output, as the portable loop). The portable loop (any CPU, overlapping segments) keeps every
 * sum in a buffer. Both sum in float32; they differ from each other and from torch's mm only
 * in the order of the float32 additions.
 *
 * Returns 0, or -1 when R, N or M exceed the buffers (the caller checks before packing).
 * Reentrant: the sums are on the stack or in a per-thread buffer (M x N floats, up to 1 MB). */
#include "efim_cpu.h"

#define EFIM_MAX_RANK 256
#define EFIM_MAX_OUT 16384
#define EFIM_MAX_ROWS 16

/* The per-row sums (M x N floats), one buffer per thread for both entry points. */
static _Thread_local float efim_low_rank_sums[EFIM_MAX_ROWS * EFIM_MAX_OUT];

#define EFIM_LOW_RANK_CHECK                                                                    \
  if (R > EFIM_MAX_RANK || N > EFIM_MAX_OUT || M > EFIM_MAX_ROWS || R < 0 || N < 0 || K < 0 || M < 0) \
    return -1;

/* The portable loop. Each weight row is read once for all M rows (the rows of a verify step
 * share it from L1): t[m] = x[m] A for every m, then acc[m] += t[m][r] B[r] row by row of B. */
#define EFIM_LOW_RANK_BODY(WTYPE, LOAD)                                                        \
  float t[EFIM_MAX_ROWS][EFIM_MAX_RANK];                                                       \
  for (int m = 0; m < M; m++)                                                                  \
    for (int r = 0; r < R; r++) t[m][r] = 0.f;                                                 \
  for (int k = 0; k < K; k++) {                                                                \
    const WTYPE *ak = a + (long)k * R;                                                         \
    for (int m = 0; m < M; m++) {                                                              \
      const float xv = bf16_to_f32(x[(long)m * ldx + k]);                                      \
      float *tm = t[m];                                                                        \
      for (int r = 0; r < R; r++) tm[r] += xv * LOAD(ak[r]);                                   \
    }                                                                                          \
  }                                                                                            \
  float *acc = efim_low_rank_sums;                                                             \
  for (int m = 0; m < M; m++)                                                                  \
    for (int n = 0; n < N; n++) acc[(long)m * N + n] = 0.f;                                    \
  const WTYPE *bs = b;                                                                         \
  for (int s = 0; s < nseg; s++) {                                                             \
    const int r0 = seg[4 * s], r1 = seg[4 * s + 1], n0 = seg[4 * s + 2], n1 = seg[4 * s + 3];  \
    const int w = n1 - n0;                                                                     \
    for (int r = r0; r < r1; r++) {                                                            \
      const WTYPE *br = bs + (long)(r - r0) * w;                                               \
      for (int m = 0; m < M; m++) {                                                            \
        const float tv = t[m][r];                                                              \
        float *out = acc + (long)m * N + n0;                                                   \
        for (int n = 0; n < w; n++) out[n] += tv * LOAD(br[n]);                                \
      }                                                                                        \
    }                                                                                          \
    bs += (long)(r1 - r0) * w;                                                                 \
  }                                                                                            \
  for (int m = 0; m < M; m++) {                                                                \
    uint16_t *ym = y + (long)m * ldy;                                                          \
    const float *am = acc + (long)m * N;                                                       \
    for (int n = 0; n < N; n++) ym[n] = f32_to_bf16(bf16_to_f32(ym[n]) + am[n]);               \
  }                                                                                            \
  return 0;

#define EFIM_AS_FLOAT(v) (v)

/* Whether no two segments share an output column (the vector loop adds each segment to y). */
static int disjoint_columns(int nseg, const int *seg) {
  for (int s = 0; s < nseg; s++)
    for (int u = s + 1; u < nseg; u++)
      if (seg[4 * s + 2] < seg[4 * u + 3] && seg[4 * u + 2] < seg[4 * s + 3]) return 0;
  return 1;
}

#if defined(EFIM_AVX512_BW)
/* Weight loads, n (0..16) of them, the rest 0: float32 and bf16. */
static inline __m512 load_w_f32(const float *p, int n) { return _mm512_maskz_loadu_ps(first_lanes(n), p); }
static inline __m512 load_w_bf16(const uint16_t *p, int n) { return load_bf16x16_n(p, n); }

/* t[rb .. rb + 16*G) = x A over all k for G blocks of 16 ranks, U sums per block over k
 * (G * U independent chains); `live` lanes of the last block. Inlined with constant G, U. */
#define EFIM_T_BLOCKS(NAME, WTYPE, LOADW)                                                      \
  static inline __attribute__((always_inline)) void NAME(int K, int R, const uint16_t *xm,     \
      const WTYPE *a, int rb, int G, int U, int live, float *t) {                              \
    __m512 acc[4][4];                                                                          \
    for (int u = 0; u < U; u++)                                                                \
      for (int g = 0; g < G; g++) acc[u][g] = _mm512_setzero_ps();                             \
    int k = 0;                                                                                 \
    for (; k + U <= K; k += U)                                                                 \
      for (int u = 0; u < U; u++) {                                                            \
        const __m512 xv = _mm512_set1_ps(bf16_to_f32(xm[k + u]));                              \
        const WTYPE *ak = a + (long)(k + u) * R + rb;                                          \
        for (int g = 0; g < G; g++)                                                            \
          acc[u][g] = _mm512_fmadd_ps(xv, LOADW(ak + 16 * g, g == G - 1 ? live : 16), acc[u][g]); \
      }                                                                                        \
    for (; k < K; k++) {                                                                       \
      const __m512 xv = _mm512_set1_ps(bf16_to_f32(xm[k]));                                    \
      const WTYPE *ak = a + (long)k * R + rb;                                                  \
      for (int g = 0; g < G; g++)                                                              \
        acc[0][g] = _mm512_fmadd_ps(xv, LOADW(ak + 16 * g, g == G - 1 ? live : 16), acc[0][g]); \
    }                                                                                          \
    for (int g = 0; g < G; g++) {                                                              \
      __m512 s = acc[0][g];                                                                    \
      for (int u = 1; u < U; u++) s = _mm512_add_ps(s, acc[u][g]);                             \
      _mm512_mask_storeu_ps(t + rb + 16 * g, first_lanes(g == G - 1 ? live : 16), s);          \
    }                                                                                          \
  }

/* The vector loop for one weight type: t per row, then each segment's columns 64 at a time. */
#define EFIM_LOW_RANK_VECTOR(NAME, TBLOCKS, WTYPE, LOADW)                                       \
  static void NAME(int M, int K, int R, const uint16_t *x, long ldx, const WTYPE *a,           \
                   const WTYPE *b, uint16_t *y, long ldy, int nseg, const int *seg) {          \
    float t[EFIM_MAX_RANK + 16];                                                               \
    for (int m = 0; m < M; m++) {                                                              \
      const uint16_t *xm = x + (long)m * ldx;                                                  \
      int rb = 0;                                                                              \
      for (; rb + 64 <= R; rb += 64) TBLOCKS(K, R, xm, a, rb, 4, 1, 16, t);                    \
      const int left = R - rb;                                                                 \
      if (left > 48) TBLOCKS(K, R, xm, a, rb, 4, 1, left - 48, t);                             \
      else if (left > 32) TBLOCKS(K, R, xm, a, rb, 3, 1, left - 32, t);                        \
      else if (left > 16) TBLOCKS(K, R, xm, a, rb, 2, 2, left - 16, t);                        \
      else if (left > 0) TBLOCKS(K, R, xm, a, rb, 1, 4, left, t);                              \
      uint16_t *ym = y + (long)m * ldy;                                                        \
      const WTYPE *bs = b;                                                                     \
      for (int s = 0; s < nseg; s++) {                                                         \
        const int r0 = seg[4 * s], r1 = seg[4 * s + 1], n0 = seg[4 * s + 2], n1 = seg[4 * s + 3]; \
        const int w = n1 - n0;                                                                 \
        for (int c = 0; c < w; c += 64) {                                                      \
          const int cols = w - c < 64 ? w - c : 64;                                            \
          const int nv = (cols + 15) / 16;                                                     \
          __m512 o[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()}; \
          for (int r = r0; r < r1; r++) {                                                      \
            const __m512 tv = _mm512_set1_ps(t[r]);                                            \
            const WTYPE *br = bs + (long)(r - r0) * w + c;                                     \
            for (int v = 0; v < nv; v++)                                                       \
              o[v] = _mm512_fmadd_ps(tv, LOADW(br + 16 * v, cols - 16 * v), o[v]);             \
          }                                                                                    \
          for (int v = 0; v < nv; v++) {                                                       \
            const int lanes = cols - 16 * v < 16 ? cols - 16 * v : 16;                         \
            uint16_t *yo = ym + n0 + c + 16 * v;                                               \
            const __m512 sum = _mm512_add_ps(load_bf16x16_n(yo, lanes), o[v]);                 \
            _mm256_mask_storeu_epi16(yo, first_lanes(lanes), to_bf16x16(sum));                 \
          }                                                                                    \
        }                                                                                      \
        bs += (long)(r1 - r0) * w;                                                             \
      }                                                                                        \
    }                                                                                          \
  }

EFIM_T_BLOCKS(t_blocks_f32, float, load_w_f32)
EFIM_T_BLOCKS(t_blocks_bf16, uint16_t, load_w_bf16)
EFIM_LOW_RANK_VECTOR(low_rank_vector_f32, t_blocks_f32, float, load_w_f32)
EFIM_LOW_RANK_VECTOR(low_rank_vector_bf16, t_blocks_bf16, uint16_t, load_w_bf16)
#define EFIM_VECTOR_LOOP(FN)                                                                   \
  if (disjoint_columns(nseg, seg)) {                                                           \
    FN(M, K, R, x, ldx, a, b, y, ldy, nseg, seg);                                              \
    return 0;                                                                                  \
  }
#else
#define EFIM_VECTOR_LOOP(FN)
#endif

int efim_low_rank_add_f32(int M, int K, int R, int N, const uint16_t *x, long ldx, const float *a,
                          const float *b, uint16_t *y, long ldy, int nseg, const int *seg) {
  EFIM_LOW_RANK_CHECK
  EFIM_VECTOR_LOOP(low_rank_vector_f32)
  EFIM_LOW_RANK_BODY(float, EFIM_AS_FLOAT)
}

int efim_low_rank_add_bf16(int M, int K, int R, int N, const uint16_t *x, long ldx, const uint16_t *a,
                           const uint16_t *b, uint16_t *y, long ldy, int nseg, const int *seg) {
  EFIM_LOW_RANK_CHECK
  EFIM_VECTOR_LOOP(low_rank_vector_bf16)
  EFIM_LOW_RANK_BODY(uint16_t, bf16_to_f32)
}

/* Whether this build has the vector loop (the tests compare both loops). */
int efim_low_rank_vector(void) {
#if defined(EFIM_AVX512_BW)
  return 1;
#else
  return 0;
#endif
}
