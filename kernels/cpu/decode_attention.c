/* Attention of one query row per head over the first n rows of a bf16 KV cache: the decode
 * step (kernels/cpu/decode_attention.py says why). Grouped-query attention: the G = H / H_kv
 * query heads that share a KV head are scored together, so each key and value row is read
 * once per step. Two passes over the keys: scores (float32, kept), then softmax and the
 * weighted sum of values. exp is a polynomial (relative error below 7e-7 for x >= -10, 4e-6
 * down to -87 where float32's rounding of x log2(e) dominates), so no vector math library is needed.
 *
 * q: [H, D] rows at stride ldq; k, v: [H_kv] heads at stride head_stride, rows of D at
 * stride D; out: [H, D] rows at stride ldo, bf16. scores: caller's float32 scratch of G * n.
 * Both entry points return 0, or -1 on sizes they do not take (D > 256, H not a multiple of
 * H_kv); `efim_decode_rope_attention` also rotates the token's q and k and writes its k and v
 * into the cache first (the whole attention half of a decode step in one call). */
#include <string.h>

#include "efim_cpu.h"

#define EFIM_MAX_HEAD_DIM 256
#define EFIM_MAX_GROUP 64

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
/* The softmax of one row in place, 16 scores at a time (the tail under a mask); e^x as above,
 * the power of two applied by scalef. */
static void softmax_row_avx512(float *sg, int n) {
  __m512 mxv = _mm512_set1_ps(-3.0e38f);
  int s = 0;
  for (; s + 16 <= n; s += 16) mxv = _mm512_max_ps(mxv, _mm512_loadu_ps(sg + s));
  if (s < n) mxv = _mm512_mask_max_ps(mxv, (__mmask16)((1u << (n - s)) - 1u), mxv, _mm512_maskz_loadu_ps((__mmask16)((1u << (n - s)) - 1u), sg + s));
  const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(mxv));
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
  const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sumv));
  for (s = 0; s < n; s += 16) {
    const __mmask16 m = n - s >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - s)) - 1u);
    _mm512_mask_storeu_ps(sg + s, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, sg + s), inv));
  }
}
#endif

/* One KV head's G query rows (float32, already scaled) over its first n key and value rows:
 * out rows g = 0..G-1 at stride ldo. acc: G * D floats of scratch. */
static void attend_group(int G, int D, int n, const float *qf, const uint16_t *kh, const uint16_t *vh,
                         uint16_t *out, long ldo, float *scores, float *acc) {
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
  /* softmax per query row; max, exp and sum as elementwise loops over LANES partials */
  for (int g = 0; g < G; g++) {
#if defined(__AVX512F__)
    softmax_row_avx512(scores + (long)g * n, n);
    continue;
#endif
    float *sg = scores + (long)g * n;
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
    const float inv = 1.0f / sum;
    for (s = 0; s < n; s++) sg[s] *= inv;
  }
  /* pass 2: out_g = sum_s p_gs v_s */
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
  } else
#endif
  {
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
  for (int g = 0; g < G; g++) {
    uint16_t *o = out + (long)g * ldo;
    for (int d = 0; d < D; d++) o[d] = f32_to_bf16(acc[g * D + d]);
  }
}

static int sizes_ok(int H, int H_kv, int D, int n) {
  return D <= EFIM_MAX_HEAD_DIM && D > 0 && H_kv > 0 && H % H_kv == 0 && H / H_kv <= EFIM_MAX_GROUP && n > 0;
}

int efim_decode_attention(int H, int H_kv, int D, int n, float scale, const uint16_t *q, long ldq,
                          const uint16_t *k, const uint16_t *v, long head_stride, uint16_t *out,
                          long ldo, float *scores) {
  if (!sizes_ok(H, H_kv, D, n)) return -1;
  const int G = H / H_kv;
  float qf[EFIM_MAX_GROUP * EFIM_MAX_HEAD_DIM];
  float acc[EFIM_MAX_GROUP * EFIM_MAX_HEAD_DIM];
  for (int hk = 0; hk < H_kv; hk++) {
    for (int g = 0; g < G; g++) {
      const uint16_t *qr = q + (long)(hk * G + g) * ldq;
      for (int d = 0; d < D; d++) qf[g * D + d] = bf16_to_f32(qr[d]) * scale;
    }
    attend_group(G, D, n, qf, k + hk * head_stride, v + hk * head_stride, out + (long)hk * G * ldo, ldo, scores, acc);
  }
  return 0;
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

/* The whole attention half of a decode step for one token at position pos: qkv is the fused
 * projection's row ([H + 2 H_kv] heads of D: q, then k, then v); q and k are rotated (neox
 * RoPE, cos/sin rows of D/2), k and v written to cache row pos of each KV head, and the query
 * heads attend over rows 0..pos. out: [H, D] rows at stride ldo. */
int efim_decode_rope_attention(int H, int H_kv, int D, int pos, float scale, const uint16_t *qkv,
                               const uint16_t *cos, const uint16_t *sin, uint16_t *k, uint16_t *v,
                               long head_stride, uint16_t *out, long ldo, float *scores) {
  if (!sizes_ok(H, H_kv, D, pos + 1) || D % 2 != 0) return -1;
  const int G = H / H_kv;
  float qf[EFIM_MAX_GROUP * EFIM_MAX_HEAD_DIM];
  float acc[EFIM_MAX_GROUP * EFIM_MAX_HEAD_DIM];
  for (int hk = 0; hk < H_kv; hk++) {
    float kf[EFIM_MAX_HEAD_DIM];
    rope_neox(qkv + (long)(H + hk) * D, cos, sin, D, kf);
    uint16_t *krow = k + hk * head_stride + (long)pos * D, *vrow = v + hk * head_stride + (long)pos * D;
    for (int d = 0; d < D; d++) krow[d] = f32_to_bf16(kf[d]);
    memcpy(vrow, qkv + (long)(H + H_kv + hk) * D, sizeof(uint16_t) * D);
  }
  for (int hk = 0; hk < H_kv; hk++) {
    for (int g = 0; g < G; g++) {
      float *qg = qf + g * D;
      rope_neox(qkv + (long)(hk * G + g) * D, cos, sin, D, qg);
      for (int d = 0; d < D; d++) qg[d] *= scale;
    }
    attend_group(G, D, pos + 1, qf, k + hk * head_stride, v + hk * head_stride, out + (long)hk * G * ldo, ldo, scores, acc);
  }
  return 0;
}
