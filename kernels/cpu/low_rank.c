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
 * Returns 0, or -1 when R or N exceed the stack buffers (the caller checks before packing).
 * Reentrant: all scratch is on the stack. */
#include "efim_cpu.h"

#define EFIM_MAX_RANK 256
#define EFIM_MAX_OUT 16384

#define EFIM_LOW_RANK_BODY(WTYPE, LOAD)                                                        \
  if (R > EFIM_MAX_RANK || N > EFIM_MAX_OUT || R < 0 || N < 0 || K < 0) return -1;             \
  float t[EFIM_MAX_RANK];                                                                      \
  float acc[EFIM_MAX_OUT];                                                                     \
  for (int m = 0; m < M; m++) {                                                                \
    const uint16_t *xm = x + (long)m * ldx;                                                    \
    for (int r = 0; r < R; r++) t[r] = 0.f;                                                    \
    for (int k = 0; k < K; k++) {                                                              \
      const float xv = bf16_to_f32(xm[k]);                                                     \
      const WTYPE *ak = a + (long)k * R;                                                       \
      for (int r = 0; r < R; r++) t[r] += xv * LOAD(ak[r]);                                    \
    }                                                                                          \
    for (int n = 0; n < N; n++) acc[n] = 0.f;                                                  \
    const WTYPE *bs = b;                                                                       \
    for (int s = 0; s < nseg; s++) {                                                           \
      const int r0 = seg[4 * s], r1 = seg[4 * s + 1], n0 = seg[4 * s + 2], n1 = seg[4 * s + 3]; \
      const int w = n1 - n0;                                                                   \
      for (int r = r0; r < r1; r++) {                                                          \
        const float tv = t[r];                                                                 \
        const WTYPE *br = bs + (long)(r - r0) * w;                                             \
        float *out = acc + n0;                                                                 \
        for (int n = 0; n < w; n++) out[n] += tv * LOAD(br[n]);                                \
      }                                                                                        \
      bs += (long)(r1 - r0) * w;                                                               \
    }                                                                                          \
    uint16_t *ym = y + (long)m * ldy;                                                          \
    for (int n = 0; n < N; n++) ym[n] = f32_to_bf16(bf16_to_f32(ym[n]) + acc[n]);              \
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
