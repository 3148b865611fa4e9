/* A step of a few rows (a decode step's one, a speculation verify's or a keystroke's 2-8) through
 * every decoder layer in one call (kernels/cpu/decode_layers.py says why): per layer the
 * RMSNorm, the fused q/k/v product, RoPE + the KV rows written + attention, the output product,
 * the residual add + RMSNorm, the fused gate/up product, SiLU(gate) * up and the down product,
 * each by the same C function the model calls one at a time (the three libraries below are
 * compiled into this one), in the same order, with the same roundings: the step's numbers are
 * those of the calls made from Python, bit for bit. What goes is the Python between them: ~240
 * ctypes calls, their output tensors and the views around them, ~1.1 ms of a ~4 ms step.
 *
 * The plan: per layer, EFIM_PLAN_FIELDS int64 values (plan_layer_t), every one a number or an
 * address that stays valid while the model lives (the caller keeps the tensors). A step's rows
 * may belong to several sequences (segment_t): a decode step of several windows at once. */
#include "int4_gemv.c"
#include "decode_attention.c"
#include "row_ops.c"

/* One packed int4 linear: its shape, its layout's addresses (int4_gemv.c), where R > 0 an
 * adapter's low-rank term inside the product (A [K, R], blk, bv as low_rank_t describes), and
 * where bias is not 0 a bf16 bias [N] added to the product's rounded output (torch's add_). */
typedef struct {
  int64_t n, k, g, r;
  int64_t packed, sz, a, blk, bv, bias;
} plan_linear_t;

typedef struct {
  int64_t norm1, norm2; /* the RMSNorms' bf16 weights [hidden] */
  plan_linear_t qkv, o, up, down;
} plan_layer_t;

#define EFIM_PLAN_FIELDS ((int)(sizeof(plan_layer_t) / sizeof(int64_t)))

int efim_decode_layers_plan_fields(void) { return EFIM_PLAN_FIELDS; }

/* bf16 scratch a step of T rows needs (`work`): the normed rows, the q/k/v rows, the attention
 * rows, the output product, the gate/up rows, the activation and the down product. */
long efim_decode_layers_work(int T, int hidden, int H, int H_kv, int D, int I) {
  return (long)T * (3L * hidden + (long)(H + 2 * H_kv) * D + (long)H * D + 3L * I);
}

static int linear(const plan_linear_t *w, int T, const uint16_t *x, uint16_t *y, int threads, int vector) {
  const uint8_t *packed = (const uint8_t *)(intptr_t)w->packed;
  const uint16_t *sz = (const uint16_t *)(intptr_t)w->sz;
  const int n = (int)w->n, k = (int)w->k, g = (int)w->g;
  const int rc = w->r == 0 ? efim_int4_gemv(T, n, k, g, x, k, packed, sz, y, n, threads, vector)
                           : efim_int4_gemv_low_rank(T, n, k, g, x, k, packed, sz, y, n, threads, vector, (int)w->r,
                                                     (const uint16_t *)(intptr_t)w->a, (const int *)(intptr_t)w->blk,
                                                     (const uint16_t *)(intptr_t)w->bv);
  if (rc != 0 || w->bias == 0) return rc;
  const uint16_t *b = (const uint16_t *)(intptr_t)w->bias;
  for (int m = 0; m < T; m++)
    for (int i = 0; i < n; i++) y[(long)m * n + i] = f32_to_bf16(bf16_to_f32(y[(long)m * n + i]) + bf16_to_f32(b[i]));
  return 0;
}

/* A segment of the step's rows: `rows` consecutive rows of one sequence at positions pos..,
 * its [L, H_kv, capacity, D] bf16 key and value caches. A decode step of several sequences has
 * one segment per sequence. */
typedef struct {
  int64_t rows, pos, k, v, capacity;
} segment_t;

#define EFIM_SEGMENT_FIELDS ((int)(sizeof(segment_t) / sizeof(int64_t)))

/* h [T, hidden] (rows contiguous) through layers 0..L-1, in place: on return h holds the last
 * layer's output (residual added, before the final norm). The rows are S segments in order
 * (segs: S segment_t, their rows summing to T); each segment's rows attend over its own
 * sequence's keys, and rows pos..pos+rows-1 of every layer of its caches are written. cos/sin:
 * [T, D/2] neox RoPE rows, one per row. work: efim_decode_layers_work(...) bf16 values;
 * scratch: the attention's float32 scratch for the largest segment
 * (efim_attention_rows_scratch). gemv_threads / attention_threads: what the model passes those
 * calls. Returns 0, or -1 for sizes it does not take, or the 1-based layer whose call refused
 * its sizes (nothing is computed past it; the caller's own path then runs the step again from
 * the step's input). */
int efim_decode_layers(int L, const int64_t *plan, int S, const int64_t *segs, int T, int hidden, int H, int H_kv,
                       int D, int I, float eps, float scale, uint16_t *h, const uint16_t *cos, const uint16_t *sin,
                       uint16_t *work, float *scratch, int gemv_threads, int attention_threads, int vector) {
  if (L <= 0 || S < 1 || T < 1 || T > EFIM_GEMV_MAX_ROWS || hidden <= 0 || I <= 0) return -1;
  int total = 0;
  for (int s = 0; s < S; s++) {
    const segment_t *sg = (const segment_t *)(segs + (long)s * EFIM_SEGMENT_FIELDS);
    if (sg->rows < 1 || sg->pos < 0 || sg->pos + sg->rows > sg->capacity) return -1;
    total += (int)sg->rows;
  }
  if (total != T) return -1;
  const int qkv_n = (H + 2 * H_kv) * D;
  uint16_t *x = work, *qkv = x + (long)T * hidden, *attn = qkv + (long)T * qkv_n, *o = attn + (long)T * H * D;
  uint16_t *up = o + (long)T * hidden, *act = up + 2L * T * I, *down = act + (long)T * I;
  for (int l = 0; l < L; l++) {
    const plan_layer_t *p = (const plan_layer_t *)(plan + (long)l * EFIM_PLAN_FIELDS);
    /* h += the previous layer's down product (torch's add_ rounding), then the input norm */
    if (efim_add_rms_norm(T, hidden, h, hidden, l ? down : NULL, hidden, (const uint16_t *)(intptr_t)p->norm1, eps,
                          x, hidden, 1) != 0 ||
        linear(&p->qkv, T, x, qkv, gemv_threads, vector) != 0)
      return l + 1;
    for (int s = 0, r0 = 0; s < S; s++) {
      const segment_t *sg = (const segment_t *)(segs + (long)s * EFIM_SEGMENT_FIELDS);
      const long head_stride = sg->capacity * D, layer_stride = (long)H_kv * head_stride;
      uint16_t *k = (uint16_t *)(intptr_t)sg->k + l * layer_stride, *v = (uint16_t *)(intptr_t)sg->v + l * layer_stride;
      if (efim_rope_attention_rows(H, H_kv, D, (int)sg->pos, (int)sg->rows, scale, qkv + (long)r0 * qkv_n,
                                   cos + (long)r0 * (D / 2), sin + (long)r0 * (D / 2), k, v, head_stride,
                                   attn + (long)r0 * H * D, D, (long)H * D, scratch, attention_threads) != 0)
        return l + 1;
      r0 += (int)sg->rows;
    }
    if (linear(&p->o, T, attn, o, gemv_threads, vector) != 0 ||
        efim_add_rms_norm(T, hidden, h, hidden, o, hidden, (const uint16_t *)(intptr_t)p->norm2, eps, x, hidden, 1) != 0 ||
        linear(&p->up, T, x, up, gemv_threads, vector) != 0 ||
        efim_silu_mul(T, I, up, 2L * I, act, I, 1) != 0 ||
        linear(&p->down, T, act, down, gemv_threads, vector) != 0)
      return l + 1;
  }
  for (long i = 0; i < (long)T * hidden; i++) h[i] = f32_to_bf16(bf16_to_f32(h[i]) + bf16_to_f32(down[i]));
  return 0;
}
