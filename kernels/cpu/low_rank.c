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
 * Returns 0, or -1 when R, N or M exceed the buffers (the caller checks before packing).
 * Reentrant: the sums are on the stack or in a per-thread buffer (M x N floats, up to 1 MB). */
#include "efim_cpu.h"

#define EFIM_MAX_RANK 256
#define EFIM_MAX_OUT 16384
#define EFIM_MAX_ROWS 16

/* The per-row sums (M x N floats), one buffer per thread for both entry points. */
static _Thread_local float efim_low_rank_sums[EFIM_MAX_ROWS * EFIM_MAX_OUT];

/* Each weight row is read once for all M rows (the rows of a verify step share it from L1):
 * t[m] = x[m] A for every m, then acc[m] += t[m][r] B[r] row by row of B. */
#define EFIM_LOW_RANK_BODY(WTYPE, LOAD)                                                        \
  if (R > EFIM_MAX_RANK || N > EFIM_MAX_OUT || M > EFIM_MAX_ROWS || R < 0 || N < 0 || K < 0 || M < 0) \
    return -1;                                                                                 \
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

int efim_low_rank_add_f32(int M, int K, int R, int N, const uint16_t *x, long ldx, const float *a,
                          const float *b, uint16_t *y, long ldy, int nseg, const int *seg) {
  EFIM_LOW_RANK_BODY(float, EFIM_AS_FLOAT)
}

int efim_low_rank_add_bf16(int M, int K, int R, int N, const uint16_t *x, long ldx, const uint16_t *a,
                           const uint16_t *b, uint16_t *y, long ldy, int nseg, const int *seg) {
  EFIM_LOW_RANK_BODY(uint16_t, bf16_to_f32)
}
