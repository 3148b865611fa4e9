/* Attention of the few query rows of a decode step (one row) or a speculation verify (2-16)
 * over the first rows of a bf16 KV cache (kernels/cpu/decode_attention.py says why).
 * Grouped-query attention: the (head, row) pairs that share a KV head are scored together in
 * blocks of EFIM_PAIRS, so each key and value row is read once per block; row t of T sees the
 * keys up to its own position. Two passes over the keys: scores (float32, kept), then softmax
 * and the weighted sum of values. exp is a polynomial (relative error below 7e-7 for x >= -10,
 * 4e-6 down to -87 where float32's rounding of x log2(e) dominates), so no vector math library
 * is needed.
 *
 * Long contexts are shared out over threads: each KV head's keys are cut into chunks of
 * EFIM_CHUNK_KEYS at fixed places, every (KV head, block, chunk) unit computes its
 * unnormalised share (flash-decoding's split over the keys), and the shares are combined with
 * the usual max rescaling. The chunks do not depend on the number of keys or threads, so a row
 * gets the same bits alone or among others, on one thread or several. With OpenMP the units
 * run on the process's OpenMP threads, the same runtime and threads as torch's
 * (kernels/cpu/build.py builds with it only where torch's runtime is the one the library links).
 *
 * Entry points: `efim_attention_rows` (q and k already rotated, K/V already in the cache) and
 * `efim_rope_attention_rows` (the fused projection's rows: q and k rotated here, K/V written to
 * the cache, then the attention — the whole attention half of a step in one call). Both return
 * 0, or -1 on sizes they do not take (D > 256, H not a multiple of H_kv, more than
 * EFIM_MAX_ROWS rows). scratch: caller's float32 scratch of efim_attention_rows_scratch(...)
 * floats; threads: how many to share over. */
#include <string.h>

#include "efim_cpu.h"

#define EFIM_MAX_HEAD_DIM 256
#define EFIM_MAX_GROUP 64
#define EFIM_CHUNK_KEYS 256 /* keys of a chunk (chunk_keys) */
#define EFIM_MAX_CHUNKS 128
#define EFIM_PAIRS 8     /* (head, row) pairs scored together, each key row read once for them */
#define EFIM_MAX_ROWS 16 /* query rows a call takes (efim_attention_rows) */

/* e^x for x <= 0 (softmax after subtracting the maximum): 2^(x log2 e) split into an integer
 * power (exponent bits) and 2^f, f in [-0.5, 0.5], by a degree-6 polynomial. Below -87 the
 * result is 0, as float32's exp underflows there. */
static inline float exp_nonpositive(float x) {
  const float xc = x < -87.0f ? -87.0f : x;
  const float t = xc * EFIM_LOG2E;         /* in [-125.6, 0] */
  const int32_t n = (int32_t)(t - 0.5f);   /* t rounded to nearest (truncation of a negative) */
  union { float f; int32_t i; } u = {exp2_fraction(t - (float)n)};
  u.i += (int32_t)((uint32_t)n << 23);     /* times 2^n: n >= -126, so the exponent stays normal */
  return x < -87.0f ? 0.0f : u.f;
}

/* q . k over D with LANES independent partial sums: the inner loop is elementwise, so the
 * compiler vectorises it without being allowed to reassociate a float reduction. */
#define LANES 16
static inline float dot_lanes(const float *q, const float *k, int D) {
  float part[LANES] = {0};
  int d = 0;
  for (; d + LANES <= D; d += LANES)
    for (int j = 0; j < LANES; j++) part[j] += q[d + j] * k[d + j];
  float sum = 0.f;
  for (int j = 0; j < LANES; j++) sum += part[j];
  for (; d < D; d++) sum += q[d] * k[d];
  return sum;
}

#if defined(__AVX512F__)
/* e^(x - max) of one row in place, 16 scores at a time (the tail under a mask), e^x as above,
 * the power of two applied by scalef; *mx_out gets the row's maximum, the return its sum. */
static float exp_row_avx512(float *sg, int n, float *mx_out) {
  __m512 mxv = _mm512_set1_ps(-3.0e38f);
  int s = 0;
  for (; s + 16 <= n; s += 16) mxv = _mm512_max_ps(mxv, _mm512_loadu_ps(sg + s));
  if (s < n) mxv = _mm512_mask_max_ps(mxv, (__mmask16)((1u << (n - s)) - 1u), mxv, _mm512_maskz_loadu_ps((__mmask16)((1u << (n - s)) - 1u), sg + s));
  *mx_out = _mm512_reduce_max_ps(mxv);
  const __m512 mx = _mm512_set1_ps(*mx_out);
  const __m512 log2e = _mm512_set1_ps(EFIM_LOG2E), lo = _mm512_set1_ps(-87.0f);
  __m512 sumv = _mm512_setzero_ps();
  for (s = 0; s < n; s += 16) {
    const __mmask16 m = n - s >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - s)) - 1u);
    const __m512 x = _mm512_sub_ps(_mm512_maskz_loadu_ps(m, sg + s), mx);
    const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, lo), log2e);
    const __m512 nf = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, nf);
    __m512 e = _mm512_scalef_ps(exp2_fraction_avx512(f), nf);
    e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ) & m, e);  /* below -87: 0; past n: 0 */
    _mm512_mask_storeu_ps(sg + s, m, e);
    sumv = _mm512_add_ps(sumv, e);
  }
  return _mm512_reduce_add_ps(sumv);
}
#endif

/* e^(x - max) of one row in place, max, exp and sum as elementwise loops over LANES partials;
 * *mx_out gets the row's maximum, the return its sum. */
static float exp_row(float *sg, int n, float *mx_out) {
#if defined(__AVX512F__)
  return exp_row_avx512(sg, n, mx_out);
#else
  float mxl[LANES], suml[LANES];
  for (int j = 0; j < LANES; j++) mxl[j] = sg[0], suml[j] = 0.f;
  int s = 0;
  for (; s + LANES <= n; s += LANES)
    for (int j = 0; j < LANES; j++) mxl[j] = sg[s + j] > mxl[j] ? sg[s + j] : mxl[j];
  float mx = mxl[0];
  for (int j = 1; j < LANES; j++) mx = mxl[j] > mx ? mxl[j] : mx;
  for (; s < n; s++) mx = sg[s] > mx ? sg[s] : mx;
  for (s = 0; s < n; s++) sg[s] = exp_nonpositive(sg[s] - mx);
  for (s = 0; s + LANES <= n; s += LANES)
    for (int j = 0; j < LANES; j++) suml[j] += sg[s + j];
  float sum = 0.f;
  for (int j = 0; j < LANES; j++) sum += suml[j];
  for (; s < n; s++) sum += sg[s];
  *mx_out = mx;
  return sum;
#endif
}

/* G query rows (float32, already scaled) of one KV head over key and value rows 0..n-1 of kh
 * and vh (one chunk of the head's keys), row g seeing only the chunk's first lim[g] keys (the
 * causal limit of a step's later rows): acc[g * D + d] gets sum_s e^(q_g.k_s - mx[g]) v_s,
 * mx[g] the row's maximum score and sum[g] the sum of its e^ terms — the chunk's share, not
 * yet normalised, so chunks computed apart combine exactly (`combine_chunks`); a row that
 * sees none of the chunk's keys gets a zero share. scores: G * n floats of scratch. */
static void attend_chunk(int G, int D, int n, const float *qf, const uint16_t *kh, const uint16_t *vh,
                         const int *lim, float *scores, float *acc, float *mx, float *sum) {
  /* pass 1: scores[g * n + s] = q_g . k_s */
#if defined(__AVX512F__)
  if (D == 64 && G <= 8) { /* the common head size: whole rows in four vectors */
    __m512 qv[8][4];
    for (int g = 0; g < G; g++)
      for (int j = 0; j < 4; j++) qv[g][j] = _mm512_loadu_ps(qf + g * D + 16 * j);
    for (int s = 0; s < n; s++) {
      const uint16_t *ks = kh + (long)s * D;
      __m512 kv[4];
      for (int j = 0; j < 4; j++)
        kv[j] = load_bf16x16(ks + 16 * j);
      for (int g = 0; g < G; g++) {
        __m512 a = _mm512_mul_ps(qv[g][0], kv[0]);
        a = _mm512_fmadd_ps(qv[g][1], kv[1], a);
        a = _mm512_fmadd_ps(qv[g][2], kv[2], a);
        a = _mm512_fmadd_ps(qv[g][3], kv[3], a);
        scores[(long)g * n + s] = _mm512_reduce_add_ps(a);
      }
    }
  } else
#endif
  for (int s = 0; s < n; s++) {
    const uint16_t *ks = kh + (long)s * D;
    float kf[EFIM_MAX_HEAD_DIM];
    for (int d = 0; d < D; d++) kf[d] = bf16_to_f32(ks[d]);
    for (int g = 0; g < G; g++) scores[(long)g * n + s] = dot_lanes(qf + g * D, kf, D);
  }
  for (int g = 0; g < G; g++) {
    float *sg = scores + (long)g * n;
    if (lim[g] <= 0) { /* no key of this chunk: a share that adds nothing */
      for (int s = 0; s < n; s++) sg[s] = 0.f;
      mx[g] = -3.0e38f, sum[g] = 0.f;
      continue;
    }
    for (int s = lim[g]; s < n; s++) sg[s] = -3.0e38f; /* past the row's own position: e^ -> 0 */
    sum[g] = exp_row(sg, n, mx + g);
  }
  /* pass 2: acc_g = sum_s p_gs v_s */
#if defined(__AVX512F__)
  if (D == 64 && G <= 8) { /* accumulators in registers, each value row read once */
    __m512 av[8][4];
    for (int g = 0; g < G; g++)
      for (int j = 0; j < 4; j++) av[g][j] = _mm512_setzero_ps();
    for (int s = 0; s < n; s++) {
      const uint16_t *vs = vh + (long)s * D;
      __m512 vv[4];
      for (int j = 0; j < 4; j++)
        vv[j] = load_bf16x16(vs + 16 * j);
      for (int g = 0; g < G; g++) {
        const __m512 p = _mm512_set1_ps(scores[(long)g * n + s]);
        for (int j = 0; j < 4; j++) av[g][j] = _mm512_fmadd_ps(p, vv[j], av[g][j]);
      }
    }
    for (int g = 0; g < G; g++)
      for (int j = 0; j < 4; j++) _mm512_storeu_ps(acc + g * D + 16 * j, av[g][j]);
    return;
  }
#endif
  for (int i = 0; i < G * D; i++) acc[i] = 0.f;
  for (int s = 0; s < n; s++) {
    const uint16_t *vs = vh + (long)s * D;
    float vf[EFIM_MAX_HEAD_DIM];
    for (int d = 0; d < D; d++) vf[d] = bf16_to_f32(vs[d]);
    for (int g = 0; g < G; g++) {
      const float p = scores[(long)g * n + s];
      float *ag = acc + g * D;
      for (int d = 0; d < D; d++) ag[d] += p * vf[d];
    }
  }
}

static int sizes_ok(int H, int H_kv, int D, int n) {
  return D <= EFIM_MAX_HEAD_DIM && D > 0 && H_kv > 0 && H % H_kv == 0 && H / H_kv <= EFIM_MAX_GROUP && n > 0;
}

/* The keys a chunk holds: EFIM_CHUNK_KEYS, so chunk boundaries sit at the same keys whatever
 * the number of keys or threads (a row's share is the same in a one-row call and in a call of
 * several rows, bit for bit), growing by whole EFIM_CHUNK_KEYS only past EFIM_MAX_CHUNKS of them. */
static int chunk_keys(int n) {
  int per = EFIM_CHUNK_KEYS;
  while ((n + per - 1) / per > EFIM_MAX_CHUNKS) per += EFIM_CHUNK_KEYS;
  return per;
}

/* The chunks' shares of np query rows, combined with the usual rescaling
 * (out_i = sum_c e^(mx_ci - M_i) acc_ci / sum_c e^(mx_ci - M_i) sum_ci), written as bf16 to
 * outs[i]. Shares: C blocks of part_stride floats (EFIM_PAIRS x D sums, EFIM_PAIRS maxima,
 * EFIM_PAIRS sums). */
static void combine_chunks(int np, int D, int C, const float *part, long part_stride, uint16_t *const *outs) {
  for (int i = 0; i < np; i++) {
    float m = -3.0e38f;
    for (int c = 0; c < C; c++) {
      const float mc = part[c * part_stride + EFIM_PAIRS * D + i];
      m = mc > m ? mc : m;
    }
    float w[EFIM_MAX_CHUNKS], total = 0.f;
    for (int c = 0; c < C; c++) {
      const float *pc = part + c * part_stride;
      w[c] = C == 1 ? 1.0f : exp_nonpositive(pc[EFIM_PAIRS * D + i] - m);
      total += w[c] * pc[EFIM_PAIRS * D + EFIM_PAIRS + i];
    }
    const float inv = 1.0f / total;
    uint16_t *o = outs[i];
    for (int d = 0; d < D; d++) {
      float v = 0.f;
      for (int c = 0; c < C; c++) v += w[c] * part[c * part_stride + i * D + d];
      o[d] = f32_to_bf16(v * inv);
    }
  }
}

/* x rotated by RoPE's neox rule (pairs i and i + D/2) at one position, in float32. */
static inline void rope_neox(const uint16_t *x, const uint16_t *cos, const uint16_t *sin, int D, float *outf) {
  const int half = D / 2;
  for (int i = 0; i < half; i++) {
    const float x1 = bf16_to_f32(x[i]), x2 = bf16_to_f32(x[i + half]);
    const float c = bf16_to_f32(cos[i]), s = bf16_to_f32(sin[i]);
    outf[i] = x1 * c - x2 * s;
    outf[i + half] = x2 * c + x1 * s;
  }
}

/* T query rows per head (row t at position n - T + t, seeing keys 0..n - T + t) over keys
 * 0..n-1. Each KV head's G x T (head, row) pairs go in blocks of EFIM_PAIRS (each key and value
 * row read once per block) and its keys in chunks; the (KV head, block, chunk) units are shared
 * out over `threads` OpenMP threads (torch's own runtime: kernels/cpu/build.py) when the build
 * has OpenMP. q rows are rotated here when cos is not NULL (else taken as they are).
 * scratch: efim_attention_rows_scratch(H, H_kv, D, n, T) floats. */
static void attend_all(int H, int H_kv, int D, int n, int T, float scale, const uint16_t *q, long q_hs, long q_rs,
                       const uint16_t *cos, const uint16_t *sin, const uint16_t *k, const uint16_t *v,
                       long head_stride, uint16_t *out, long o_hs, long o_rs, float *scratch, int threads) {
  const int G = H / H_kv, P = G * T, NB = (P + EFIM_PAIRS - 1) / EFIM_PAIRS, per = chunk_keys(n);
  const int C = (n + per - 1) / per;
  const int units = H_kv * NB * C;
  const long part_stride = (long)EFIM_PAIRS * D + 2 * EFIM_PAIRS;
  float *part = scratch + (long)H_kv * NB * EFIM_PAIRS * n;
#if defined(_OPENMP)
#pragma omp parallel for schedule(static) num_threads(threads) if (units > 1 && threads > 1)
#endif
  for (int u = 0; u < units; u++) {
    const int hk = u / (NB * C), blk = (u / C) % NB, c = u % C;
    const int p0 = blk * EFIM_PAIRS, np = P - p0 < EFIM_PAIRS ? P - p0 : EFIM_PAIRS;
    const int s0 = c * per, s1 = c == C - 1 ? n : s0 + per;
    float qf[EFIM_PAIRS * EFIM_MAX_HEAD_DIM];
    int lim[EFIM_PAIRS];
    for (int i = 0; i < np; i++) {
      const int g = (p0 + i) / T, t = (p0 + i) % T;
      const uint16_t *qr = q + (long)(hk * G + g) * q_hs + (long)t * q_rs;
      float *qg = qf + i * D;
      if (cos != NULL) rope_neox(qr, cos + (long)t * (D / 2), sin + (long)t * (D / 2), D, qg);
      else for (int d = 0; d < D; d++) qg[d] = bf16_to_f32(qr[d]);
      for (int d = 0; d < D; d++) qg[d] *= scale;
      lim[i] = n - T + t + 1 - s0;
    }
    float *pu = part + (long)u * part_stride;
    attend_chunk(np, D, s1 - s0, qf, k + hk * head_stride + (long)s0 * D, v + hk * head_stride + (long)s0 * D, lim,
                 scratch + (long)(hk * NB + blk) * EFIM_PAIRS * n + (long)np * s0, pu, pu + (long)EFIM_PAIRS * D,
                 pu + (long)EFIM_PAIRS * D + EFIM_PAIRS);
  }
  for (int hk = 0; hk < H_kv; hk++)
    for (int blk = 0; blk < NB; blk++) {
      const int p0 = blk * EFIM_PAIRS, np = P - p0 < EFIM_PAIRS ? P - p0 : EFIM_PAIRS;
      uint16_t *outs[EFIM_PAIRS];
      for (int i = 0; i < np; i++) {
        const int g = (p0 + i) / T, t = (p0 + i) % T;
        outs[i] = out + (long)(hk * G + g) * o_hs + (long)t * o_rs;
      }
      combine_chunks(np, D, C, part + (long)(hk * NB + blk) * C * part_stride, part_stride, outs);
    }
}

/* 1 when this build has the AVX-512 loops for D-dimensional heads (64 only), else 0. */
int efim_attention_vector_head(int D) {
#if defined(__AVX512F__)
  return D == 64;
#else
  (void)D;
  return 0;
#endif
}

/* 1 when this build shares its work over OpenMP threads, else 0. */
int efim_decode_attention_openmp(void) {
#if defined(_OPENMP)
  return 1;
#else
  return 0;
#endif
}

long efim_attention_rows_scratch(int H, int H_kv, int D, int n, int T) {
  if (H_kv <= 0 || H % H_kv || T <= 0) return -1;
  const long blocks = ((long)(H / H_kv) * T + EFIM_PAIRS - 1) / EFIM_PAIRS;
  return H_kv * blocks * EFIM_PAIRS * (long)n + H_kv * blocks * EFIM_MAX_CHUNKS * ((long)EFIM_PAIRS * D + 2 * EFIM_PAIRS);
}

/* The attention of a step's T rows (a speculation verify, a keystroke's few tokens), their K
 * and V already in the cache at rows n - T .. n - 1: q [H] heads at q_hs of T rows at q_rs,
 * out likewise at o_hs / o_rs. */
int efim_attention_rows(int H, int H_kv, int D, int n, int T, float scale, const uint16_t *q, long q_hs, long q_rs,
                        const uint16_t *k, const uint16_t *v, long head_stride, uint16_t *out, long o_hs, long o_rs,
                        float *scratch, int threads) {
  if (!sizes_ok(H, H_kv, D, n) || T < 1 || T > n || T > EFIM_MAX_ROWS) return -1;
  attend_all(H, H_kv, D, n, T, scale, q, q_hs, q_rs, NULL, NULL, k, v, head_stride, out, o_hs, o_rs, scratch, threads);
  return 0;
}

/* The attention half of a step of T rows at positions pos..pos+T-1: qkv [T] fused rows ([H +
 * 2 H_kv] heads of D: q, then k, then v), cos/sin [T] rows of D/2 (neox RoPE); each row's k
 * (rotated) and v written to its cache row of each KV head, then row t's heads attend over
 * rows 0..pos+t with q rotated in float32 and kept so. T one-row calls give the same bits,
 * which makes a speculation verify's tokens the ones plain decoding would give. out: [H] heads
 * at o_hs of T rows at o_rs. */
int efim_rope_attention_rows(int H, int H_kv, int D, int pos, int T, float scale, const uint16_t *qkv,
                             const uint16_t *cos, const uint16_t *sin, uint16_t *k, uint16_t *v, long head_stride,
                             uint16_t *out, long o_hs, long o_rs, float *scratch, int threads) {
  if (!sizes_ok(H, H_kv, D, pos + T) || D % 2 != 0 || T < 1 || T > EFIM_MAX_ROWS || pos < 0) return -1;
  const long row = (long)(H + 2 * H_kv) * D;
  for (int t = 0; t < T; t++)
    for (int hk = 0; hk < H_kv; hk++) {
      float kf[EFIM_MAX_HEAD_DIM];
      const uint16_t *r = qkv + t * row;
      rope_neox(r + (long)(H + hk) * D, cos + (long)t * (D / 2), sin + (long)t * (D / 2), D, kf);
      uint16_t *krow = k + hk * head_stride + (long)(pos + t) * D, *vrow = v + hk * head_stride + (long)(pos + t) * D;
      for (int d = 0; d < D; d++) krow[d] = f32_to_bf16(kf[d]);
      memcpy(vrow, r + (long)(H + H_kv + hk) * D, sizeof(uint16_t) * D);
    }
  attend_all(H, H_kv, D, pos + T, T, scale, qkv, D, row, cos, sin, k, v, head_stride, out, o_hs, o_rs, scratch, threads);
  return 0;
}
