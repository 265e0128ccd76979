/* A Llama-family model's decode step in one native call (decode_stack.h): the embedding lookup,
 * every decoder layer (norm, QKV product, rotary, cache write, attention, output product, residual,
 * norm, gate/up product, SiLU, down product, residual) and the final norm.
 *
 * Why: one stream's step was ~150 operator calls through torch's dispatcher and inductor's wrapper
 * around the native products and attention, and that serial work between the kernels, not their
 * arithmetic, was what kept one stream at ~1.3x llama.cpp (docs/performance.md). Here the products
 * (q4_gemv.c for int4, packed_gemv.c for bfloat16) and the attention (paged_decode_attention.c) are
 * the same kernels the eager forward calls, called from C; the elementwise work between them is a
 * few thousand values a row, done by every thread of the team on its own copy when the layers run
 * in one parallel region (layers_in_one_region), else on the calling thread.
 *
 * Numerics follow the eager forward (engine_service/model/llama.py, layers.py): RMSNorm as
 * h * (1 / sqrt(mean(h^2) + eps)) then times the weight, rotary in the rotate_half convention from
 * the engine's cos/sin tables, SiLU as x / (1 + e^-x) (e^x by a
 * polynomial within 2 ulp of libm's), no fused multiply-adds. With bfloat16
 * activations every value is rounded to bfloat16 where torch's eager ops round it (each op's
 * output; the cos/sin tables as the forward casts them). Sums run in another order than torch's, so
 * outputs match to rounding, not bit for bit (tests/unit/test_native_decode.py). Each row is
 * computed independently of the others: a row's output does not depend on the batch. */
#include "decode_stack.h"

#include <math.h>
#include <omp.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "f16.h"
#include "fast_exp.h"
#include "kv_ahead.h"
#include "packed_gemv.h"
#include "paged_decode_attention.h"
#include "q4_gemv.h"
#include "q8_gemv.h"
#include "team_barrier.h"
#ifdef SLUICE_STACK_PHASES
#include "stack_phases.h"
#define STACK_PHASE(t, k) stack_phase(t, k)
#else
#define STACK_PHASE(t, k) ((void)0)
#endif

#define NOCONTRACT __attribute__((optimize("fp-contract=off")))
/* From this many rows the region-per-call step shares its per-row work (norms, rotary, SiLU,
 * residuals, conversions) out among the threads, row by row: a prefill chunk of a deterministic
 * stack. Each row's operations are the same whichever thread does them. */
#define PAR_MIN_ROWS 32

/* x rounded to bfloat16 when bf, else x */
static inline float rnd(float x, int bf) { return bf ? bf16_to_f32(f32_to_bf16(x)) : x; }

static inline float load(const void *p, int64_t i, int bf) {
    return bf ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* The sum of squares in 16 running sums (element i into sum i % 16), added in order at the end.
 * Why: one running sum is a chain of dependent adds the compiler may not reorder (~0.65 us for
 * SmolLM2's 576 on Zen 4, 61 norms a step); 16 are one vector's lanes. The bfloat16 step ran
 * 1.0027x as fast on one CCD (the median of seven runs' paired ratios, 1.0004-1.0071) and
 * 1.0004-1.0097 on two (three runs; scripts/bench_stack_ab.sh; docs/performance.md, "the last
 * block in halves"). */
NOCONTRACT static void rms_norm(const float *x, const void *weight, int64_t n, float eps, int bf, float *out) {
    float sums[16] = {0};
    int64_t at = 0;
    for (; at + 16 <= n; at += 16)
        for (int j = 0; j < 16; j++) sums[j] += x[at + j] * x[at + j];
    for (int j = 0; at < n; at++, j++) sums[j] += x[at] * x[at];
    float ss = 0.0f;
    for (int j = 0; j < 16; j++) ss += sums[j];
    const float inv = 1.0f / sqrtf(ss / (float)n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = rnd(load(weight, i, bf) * rnd(x[i] * inv, bf), bf);
}

/* rotate_half: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), per head, in place */
NOCONTRACT static void rotate(float *x, int64_t heads, int64_t head_dim, const float *cos, const float *sin, int bf) {
    const int64_t half = head_dim / 2;
    for (int64_t h = 0; h < heads; h++) {
        float *v = x + h * head_dim;
        for (int64_t i = 0; i < half; i++) {
            const float a = v[i], b = v[i + half];
            const float c1 = rnd(cos[i], bf), s1 = rnd(sin[i], bf);
            const float c2 = rnd(cos[i + half], bf), s2 = rnd(sin[i + half], bf);
            v[i] = rnd(rnd(a * c1, bf) + rnd(-b * s1, bf), bf);
            v[i + half] = rnd(rnd(b * c2, bf) + rnd(a * s2, bf), bf);
        }
    }
}

/* the conversion a float16 cache is written with, over n values (exported for its test against
 * torch's: tests/unit/test_native_decode.py) */
void stack_f32_to_f16(const float *src, uint16_t *dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = f32_to_f16(src[i]);
}

static void write_cache(void *cache, int cache_type, int64_t slot, const float *src, int64_t n) {
    if (cache_type == STACK_CACHE_BF16) {
        uint16_t *dst = (uint16_t *)cache + slot * n;
        for (int64_t i = 0; i < n; i++) dst[i] = f32_to_bf16(src[i]);
    } else if (cache_type == STACK_CACHE_F16) {
        stack_f32_to_f16(src, (uint16_t *)cache + slot * n, n);
    } else {
        memcpy((float *)cache + slot * n, src, sizeof(float) * (size_t)n);
    }
}

/* y[rows][n_out] += the bias (float32, the activations' dtype of an int4 stack): after the product, as
 * QuantizedLinear adds it */
NOCONTRACT static void add_bias_f32(float *y, const float *bias, int64_t rows, int64_t n) {
    for (int64_t r = 0; bias != NULL && r < rows; r++)
        for (int64_t i = 0; i < n; i++) y[r * n + i] += bias[i];
}

/* y[rows][n_out] = x[rows][k] W^T + bias (NULL: none; the activations' dtype); bfloat16 through the
 * bf16 scratch xb / yb, the bias added to the float32 sums before their rounding, as the packed
 * product's own bias */
static int product(const DecodeStack *s, const StackWeight *w, const void *bias, const float *x, float *y,
                   int64_t rows, uint16_t *xb, uint16_t *yb) {
    if (s->kind == STACK_INT4) {
        const int rc = q4_linear_f32((const uint8_t *)w->data, w->scales_zeros, x, y, rows, w->n_out, w->n_pad, w->k,
                                     w->extra);
        add_bias_f32(y, (const float *)bias, rows, w->n_out);
        return rc;
    }
    const int64_t in = rows * w->k, out = rows * w->n_out;
    _Pragma("omp parallel for schedule(static) if(rows >= PAR_MIN_ROWS)")
    for (int64_t i = 0; i < in; i++) xb[i] = f32_to_bf16(x[i]);
    const int rc = s->deterministic
        ? packed_gemm_bf16_flags((const uint16_t *)w->data, xb, (const uint16_t *)bias, yb, rows, w->n_out, w->k,
                                 w->n_pad, w->extra, PG_NO_TILES)
        : packed_gemm_bf16((const uint16_t *)w->data, xb, (const uint16_t *)bias, yb, rows, w->n_out, w->k, w->n_pad,
                           w->extra);
    _Pragma("omp parallel for schedule(static) if(rows >= PAR_MIN_ROWS)")
    for (int64_t i = 0; i < out; i++) y[i] = bf16_to_f32(yb[i]);
    return rc;
}

/* logits[rows][vocab] = x[rows][hidden] times the head, float32, from the calling thread */
static int head_product(const DecodeStack *s, const float *x, float *logits, int64_t rows, uint16_t *xb,
                        uint16_t *yb) {
    const StackWeight *w = &s->head;
    if (s->head_kind == STACK_HEAD_Q8)
        return q8_linear_f32((const uint8_t *)w->data, (const float *)w->scales_zeros, x, logits, rows, w->n_out,
                             w->n_pad, w->k, w->extra);
    return product(s, w, NULL, x, logits, rows, xb, yb);
}

static int weight_ok(int kind, const StackWeight *w, int64_t n_out, int64_t k) {
    if (w->n_out != n_out || w->k != k || w->data == NULL) return 0;
    if (kind == STACK_INT4) return w->scales_zeros != NULL;
    return packed_gemv_sizes_ok(w->n_out, w->k, w->n_pad, w->extra);
}

/* the head's weight is in the layout its kind says, n_out x hidden */
static int head_ok(const DecodeStack *s) {
    const StackWeight *w = &s->head;
    if (s->head_kind == STACK_HEAD_LAYERS) return weight_ok(s->kind, w, w->n_out, s->hidden);
    return s->head_kind == STACK_HEAD_Q8 && s->kind == STACK_INT4 && q8_gemv_supported() && w->data != NULL &&
           w->scales_zeros != NULL && w->k == s->hidden && q8_layout_ok(w->n_out, w->n_pad, w->k, w->extra);
}

/* Why here: after the step's weight stream, torch's argmax of one row found its code and data in
 * memory, not the caches, and cost ~0.2 ms of a ~10 ms step (docs/performance.md, twelfth round);
 * here the logits are still in this core's cache. */
int64_t stack_argmax(const float *v, int64_t n) {
    if (n <= 0) return -1;
    float best = -INFINITY;
    int nan = 0;
#pragma omp simd reduction(max : best) reduction(| : nan)
    for (int64_t i = 0; i < n; i++) {
        best = v[i] > best ? v[i] : best;
        nan |= v[i] != v[i];
    }
    for (int64_t i = 0; i < n; i++)
        if (nan ? v[i] != v[i] : v[i] == best) return i;
    return 0; /* every value -inf */
}

int64_t stack_team_barrier_check(int threads, int64_t rounds) {
    if (threads < 1 || threads > TEAM_BARRIER_MAX || rounds < 1) return -1;
    TeamBarrier sync = {0};
    TeamArrival slots[TEAM_BARRIER_MAX] = {{0}}; /* a line a thread, as the barrier's own */
    static char fetch[16384];
    int64_t wrong = 0;
#pragma omp parallel num_threads(threads) reduction(+ : wrong)
    {
        const int me = omp_get_thread_num(), n = omp_get_num_threads();
        for (int64_t r = 1; r <= rounds; r++) {
            __atomic_store_n(&slots[me].passed, (uint32_t)r, __ATOMIC_RELAXED);
            team_barrier_fetching(&sync, fetch, fetch + sizeof fetch); /* the waiting thread fetching meanwhile */
            for (int i = 0; i < n; i++) wrong += __atomic_load_n(&slots[i].passed, __ATOMIC_RELAXED) != (uint32_t)r;
            team_barrier(&sync);
        }
    }
    return wrong;
}

/* rotary on q and k (adjacent in q|k|v), q copied out, k and v written to the cache at each row's
 * slot: before any row attends, since a row may attend to a slot another row of this step wrote
 * (a draft chunk's tokens; prefix sharing), as the eager forward allows */
NOCONTRACT static void rotate_and_cache(const DecodeStack *s, const StackLayer *layer, float *qkv, float *q,
                                        int64_t rows, const int64_t *positions, const float *cos_table,
                                        const float *sin_table, const int64_t *slots, int write) {
    const int64_t d = s->head_dim, q_size = s->heads * d, kv_size = s->kv_heads * d, qkv_size = q_size + 2 * kv_size;
    const int bf = s->kind == STACK_BF16;
    for (int64_t r = 0; r < rows; r++) {
        float *row = qkv + r * qkv_size;
        const float *cos = cos_table + positions[r] * d, *sin = sin_table + positions[r] * d;
        for (int64_t h = 0; layer->q_norm != NULL && h < s->heads; h++) /* in place: a head's sum comes first */
            rms_norm(row + h * d, layer->q_norm, d, s->eps, bf, row + h * d);
        for (int64_t h = 0; layer->k_norm != NULL && h < s->kv_heads; h++)
            rms_norm(row + q_size + h * d, layer->k_norm, d, s->eps, bf, row + q_size + h * d);
        rotate(row, s->heads + s->kv_heads, d, cos, sin, bf);
        memcpy(q + r * q_size, row, sizeof(float) * (size_t)q_size);
        if (!write) continue;
        write_cache(layer->k_cache, s->cache_type, slots[r], row + q_size, kv_size);
        write_cache(layer->v_cache, s->cache_type, slots[r], row + q_size + kv_size, kv_size);
    }
}

/* 0, or decode_stack's return code for the attention kernel's refusal */
static int attention(const DecodeStack *s, const StackLayer *layer, const float *q, const int64_t *block_tables,
                     int64_t table_width, const int64_t *context_lens, int64_t rows, float *attn) {
    const int arc = s->cache_type == STACK_CACHE_BF16
        ? (s->deterministic ? paged_decode_attention_bf16_exact : paged_decode_attention_bf16)(
              q, (const uint16_t *)layer->k_cache, (const uint16_t *)layer->v_cache, block_tables, table_width,
              context_lens, attn, rows, s->heads, s->kv_heads, s->head_dim, s->block_size, s->scale)
        : s->cache_type == STACK_CACHE_F16
        ? paged_decode_attention_f16(q, (const uint16_t *)layer->k_cache, (const uint16_t *)layer->v_cache,
                                     block_tables, table_width, context_lens, attn, rows, s->heads, s->kv_heads,
                                     s->head_dim, s->block_size, s->scale)
        : paged_decode_attention_f32(q, (const float *)layer->k_cache, (const float *)layer->v_cache, block_tables,
                                     table_width, context_lens, attn, rows, s->heads, s->kv_heads, s->head_dim,
                                     s->block_size, s->scale);
    return arc == 0 ? 0 : arc == 1 ? 1 : 3;
}

NOCONTRACT static void silu_rows(const float *gate_up, int64_t rows, int64_t inter, int bf, float *act) {
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * inter, *u = g + inter;
        float *a = act + r * inter;
        if (bf)
            for (int64_t i = 0; i < inter; i++) a[i] = rnd(rnd(g[i] / (1.0f + fast_exp(-g[i])), 1) * u[i], 1);
        else
            for (int64_t i = 0; i < inter; i++) a[i] = g[i] / (1.0f + fast_exp(-g[i])) * u[i];
    }
}

/* silu_rows for a bfloat16 step, from the gate/up product's bfloat16 output straight into the down
 * product's bfloat16 input (rows ld wide), columns [lo, hi) of each row: the same operations on the
 * same values as converting the output, silu_rows and to_bf16_rows, so the same bits, without the
 * float copies between them. */
NOCONTRACT static void silu_bf16_rows(const uint16_t *gate_up, int64_t rows, int64_t inter, int64_t lo, int64_t hi,
                                      int64_t ld, uint16_t *act) {
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = gate_up + r * 2 * inter, *u = g + inter;
        uint16_t *a = act + r * ld;
        for (int64_t i = lo; i < hi; i++) {
            const float gv = bf16_to_f32(g[i]), uv = bf16_to_f32(u[i]);
            a[i] = f32_to_bf16(rnd(rnd(gv / (1.0f + fast_exp(-gv)), 1) * uv, 1));
        }
    }
}

/* the final norm into out, and the head's logits and their argmax */
static int finish(const DecodeStack *s, const float *x, float *normed, int64_t rows, void *out, float *logits,
                  int64_t *argmax, uint16_t *xb, uint16_t *yb) {
    const int64_t hidden = s->hidden;
    const int bf = s->kind == STACK_BF16;
    _Pragma("omp parallel for schedule(static) if(rows >= PAR_MIN_ROWS)")
    for (int64_t r = 0; r < rows; r++) {
        rms_norm(x + r * hidden, s->final_norm, hidden, s->eps, bf, normed + r * hidden);
        for (int64_t i = 0; out != NULL && i < hidden; i++) {
            if (bf) ((uint16_t *)out)[r * hidden + i] = f32_to_bf16(normed[r * hidden + i]);
            else ((float *)out)[r * hidden + i] = normed[r * hidden + i];
        }
    }
    /* in the same call: after the layers' stream the caches hold nothing of the caller's, and each
     * operator of the head's own call would first fetch its code and data from memory */
    if (logits == NULL) return 0;
    const int rc = head_product(s, normed, logits, rows, xb, yb);
    for (int64_t r = 0; rc == 0 && argmax != NULL && r < rows; r++)
        argmax[r] = stack_argmax(logits + r * s->head.n_out, s->head.n_out);
    return rc;
}

/* x[rows][k] -> bfloat16, each row k_pad wide with zeros past k */
static void to_bf16_rows(const float *x, int64_t rows, int64_t k, int64_t k_pad, uint16_t *xb) {
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t i = 0; i < k; i++) xb[r * k_pad + i] = f32_to_bf16(x[r * k + i]);
        for (int64_t i = k; i < k_pad; i++) xb[r * k_pad + i] = 0;
    }
}

/* a product inside the region, by the whole team: the input from this thread's own copy, the output
 * through a shared buffer (ys: bfloat16 bits for a bfloat16 product, float32 for int4) into this
 * thread's own float copy y. xb: this thread's scratch (the bfloat16 input; int4: its quantized
 * rows). A bfloat16 product may take x NULL, its input already in xb (a buffer shared or not), and
 * y NULL, its output left in ys. Every thread must call it. */
static void team_product(int kind, const StackWeight *w, const void *bias, const float *x, float *y, int64_t rows,
                         void *xb, void *ys, PgTeam *team, uint32_t *tag, const StackWeight *next) {
    if (kind == STACK_INT4) {
        q4_linear_f32_team((const uint8_t *)w->data, w->scales_zeros, x, (float *)ys, rows, w->n_out, w->n_pad, w->k,
                           w->extra, xb, team->barrier, team->ahead);
        if (y != NULL) memcpy(y, ys, sizeof(float) * (size_t)(rows * w->n_out));
        add_bias_f32(y, (const float *)bias, rows, w->n_out); /* each thread's own copy (a bias: y is given) */
        return;
    }
    if (x != NULL) to_bf16_rows(x, rows, w->k, w->extra, (uint16_t *)xb);
    uint16_t *yb = (uint16_t *)ys;
    const int fetch = next != NULL && rows == 1; /* one row's step: the next product's start, while waiting */
    packed_gemm_bf16_team((const uint16_t *)w->data, (const uint16_t *)xb, w->extra, (const uint16_t *)bias, yb, rows,
                          w->n_out, w->n_pad, w->extra, team, ++*tag, fetch ? (const uint16_t *)next->data : NULL,
                          fetch ? next->n_pad : 0, fetch ? next->extra : 0);
    for (int64_t i = 0; y != NULL && i < rows * w->n_out; i++) y[i] = bf16_to_f32(yb[i]);
}

/* the bytes of a thread's product scratch (team_product's xb) for a product of `rows` rows */
static int64_t product_scratch_bytes(int kind, const StackWeight *w, int64_t rows) {
    return kind == STACK_INT4 ? q4_team_scratch_bytes(rows, w->k, w->extra) : rows * w->extra * 2;
}

/* finish's final norm and head inside the region, by the whole team: the same logits and argmax
 * bit for bit. Every thread norms its own copy of the residual stream; the head's output goes
 * through ys (the shared buffer the layers' last product did not write), and thread 0 converts it
 * into logits (bfloat16; int4 writes logits itself) and takes each row's argmax, as finish does on
 * the calling thread. */
static void team_head(const DecodeStack *s, const float *x, float *normed, int64_t rows, void *xb, void *ys,
                      float *logits, int64_t *argmax, PgTeam *team, uint32_t *tag) {
    const int64_t hidden = s->hidden, vocab = s->head.n_out;
    const StackWeight *w = &s->head;
    for (int64_t r = 0; r < rows; r++)
        rms_norm(x + r * hidden, s->final_norm, hidden, s->eps, s->kind == STACK_BF16, normed + r * hidden);
    if (s->head_kind == STACK_HEAD_Q8) {
        q8_linear_f32_team((const uint8_t *)w->data, (const float *)w->scales_zeros, normed, logits, rows, vocab,
                           w->n_pad, w->k, w->extra, xb, team->barrier);
    } else if (s->kind == STACK_INT4) {
        q4_linear_f32_team((const uint8_t *)w->data, w->scales_zeros, normed, logits, rows, vocab, w->n_pad, w->k,
                           w->extra, xb, team->barrier, team->ahead);
    } else {
        to_bf16_rows(normed, rows, w->k, w->extra, (uint16_t *)xb);
        packed_gemm_bf16_team((const uint16_t *)w->data, (const uint16_t *)xb, w->extra, NULL, (uint16_t *)ys, rows, vocab,
                              w->n_pad, w->extra, team, ++*tag, NULL, 0, 0);
    }
    if (omp_get_thread_num() != 0) return;
    if (s->kind == STACK_BF16)
        for (int64_t i = 0; i < rows * vocab; i++) logits[i] = bf16_to_f32(((const uint16_t *)ys)[i]);
    for (int64_t r = 0; argmax != NULL && r < rows; r++) argmax[r] = stack_argmax(logits + r * vocab, vocab);
}

static int own_barrier = 1;

/* A one-region step's scratch of keep_min_bytes or more (32 MB: glibc's largest mmap threshold) is
 * kept by the calling thread from one call to the next, grown when a call needs more, and freed
 * when the thread exits; a smaller one is taken and freed each call. Why: glibc maps a buffer
 * above that threshold afresh on every call, and each page the step touches then faults in again.
 * A 64-row SmolLM2 step with its head once took ~50 MB (every thread's product output and both
 * shared ones as wide as the vocabulary, where only the bfloat16 head's output needs that, in one
 * shared buffer, at half the width: now ~11 MB) and ran 1.07x as fast with it kept
 * (scripts/bench_stack_ab.sh; docs/performance.md, "stop 60"); a big model's step at many threads
 * still takes hundreds of MB. Why not every size: a one-row step kept its buffer 0.5%
 * slower in the same A/B, for no reason found; below the threshold glibc serves the buffer from
 * its heap. */
typedef struct {
    float *data;
    size_t floats;
} KeptScratch;
static pthread_key_t kept_key;
static pthread_once_t kept_once = PTHREAD_ONCE_INIT;
static size_t keep_min_bytes = (size_t)32 << 20;
static int keep_poison; /* tests: fill a kept buffer with 0xff before each use */

static void kept_free(void *p) {
    free(((KeptScratch *)p)->data);
    free(p);
}

static void kept_key_make(void) { (void)pthread_key_create(&kept_key, kept_free); }

int64_t decode_stack_set_keep_scratch(int64_t min_bytes, int poison) {
    if (min_bytes >= 0) keep_min_bytes = (size_t)min_bytes;
    if (poison >= 0) keep_poison = poison != 0;
    return (int64_t)keep_min_bytes;
}

/* `floats` of scratch for a step, *kept set when it is the calling thread's kept buffer */
static float *step_scratch(size_t floats, int *kept) {
    *kept = 0;
    if (sizeof(float) * floats < keep_min_bytes || pthread_once(&kept_once, kept_key_make) != 0)
        return (float *)malloc(sizeof(float) * floats);
    KeptScratch *k = (KeptScratch *)pthread_getspecific(kept_key);
    if (k == NULL) {
        k = (KeptScratch *)calloc(1, sizeof *k);
        if (k == NULL || pthread_setspecific(kept_key, k) != 0) {
            free(k);
            return (float *)malloc(sizeof(float) * floats);
        }
    }
    if (floats > k->floats) {
        free(k->data);
        k->data = (float *)malloc(sizeof(float) * floats);
        k->floats = k->data != NULL ? floats : 0;
    }
    if (k->data == NULL) return NULL;
    *kept = 1;
    if (keep_poison) memset(k->data, 0xff, sizeof(float) * floats);
    return k->data;
}

/* the scratch step_scratch gave, once the step is done with it */
static void step_scratch_done(float *scratch, int kept) {
    if (!kept) free(scratch);
}

int decode_stack_set_own_barrier(int on) {
    own_barrier = on != 0;
    return own_barrier;
}

static int kv_ahead_lines = 8;
static int64_t kv_ahead_lists; /* lists thread 0 has made: what shows a test the lists are made */

int64_t decode_stack_kv_ahead_lists(void) { return __atomic_load_n(&kv_ahead_lists, __ATOMIC_RELAXED); }

int decode_stack_set_kv_ahead(int lines) {
    if (lines >= 0) kv_ahead_lines = lines;
    return kv_ahead_lines;
}

/* this thread's list of the K/V lines it will attend over in `layer` (its tasks, static_tasks: K,
 * then V, of each task in turn), for the products before that attention to fetch (kv_ahead.h) */
static void list_kv_ahead(const DecodeStack *s, const StackLayer *layer, const PdaPlan *plan, int thread, int threads,
                          const int64_t *block_tables, int64_t table_width, const int64_t *context_lens,
                          KvAhead *ahead) {
    const int64_t row_bytes = s->kv_heads * s->head_dim * (s->cache_type == STACK_CACHE_F32 ? 4 : 2);
    int64_t lo, hi;
    pda_thread_tasks(plan, thread, threads, &lo, &hi);
    kv_ahead_reset(ahead, kv_ahead_lines);
    if (thread == 0) __atomic_add_fetch(&kv_ahead_lists, 1, __ATOMIC_RELAXED);
    for (int64_t task = lo; task < hi; task++) {
        int64_t b, start, end;
        pda_task_span(plan, context_lens, task, &b, &start, &end);
        const int64_t *table = block_tables + b * table_width;
        for (int v = 0; v < 2; v++) {
            const char *cache = (const char *)(v ? layer->v_cache : layer->k_cache);
            for (int64_t t = start; t < end;) { /* a block's rows are contiguous, blocks are not */
                const int64_t blk = t / s->block_size, first = t % s->block_size;
                const int64_t run = s->block_size - first < end - t ? s->block_size - first : end - t;
                kv_ahead_add(ahead, cache + (table[blk] * s->block_size + first) * row_bytes, run * row_bytes);
                t += run;
            }
        }
    }
}

/* The layers in one parallel region, where they forked and joined the thread team for each product
 * and each attention: each product's blocks (bfloat16) or tasks (int4) and each attention's
 * partitions are shared out (packed_gemm_bf16_team, q4_linear_f32_team,
 * paged_decode_attention_*_team) with a barrier at the end, and, where the team shares tasks
 * dynamically, one more after the thread that writes the next layer's q and K/V has written them
 * (one row: none, each thread rotates its own q; below). Attention's combine is not shared: every
 * thread combines every head into its own copy of the output (a few hundred values a row), which
 * saves the barrier a shared output needs before the output projection reads it; the partitions'
 * barrier stays. The work between the products (residuals,
 * norms, SiLU, and int4's quantizing of each product's input: a few thousand values) is done by
 * every thread on its own copy of the residual stream and of the products' inputs, so it needs no
 * barrier and every copy holds the same values (but for a bfloat16 step of several rows, whose SiLU
 * and attention's combine the threads share out into the next product's input, and meet once more
 * for each); the products' outputs
 * alternate between two shared buffers, so that a product's writes cannot reach the one a slower
 * thread is still reading. The
 * numbers are those of decode_stack's region-per-call loop bit for bit: the same operations on the
 * same values. Why: forking and joining the team cost ~2 us each time (docs/performance.md,
 * twelfth round for bfloat16, fourteenth for int4). The team meets at its own barrier (`sync`,
 * team_barrier.h; `omp barrier` after decode_stack_set_own_barrier(0)), ~150-180 times a step, where
 * libgomp's cost a system call each and, in a served engine's passive wait policy, a sleep and a
 * wake-up each. */
NOCONTRACT static int layers_in_one_region(const DecodeStack *s, const int64_t *ids, const int64_t *positions,
                                           const float *cos_table, const float *sin_table, const int64_t *slots,
                                           const int64_t *block_tables, int64_t table_width,
                                           const int64_t *context_lens, int64_t rows, void *out, float *logits,
                                           int64_t *argmax) {
    const int64_t hidden = s->hidden, q_size = s->heads * s->head_dim, kv_size = s->kv_heads * s->head_dim;
    const int64_t qkv_size = q_size + 2 * kv_size, inter = s->intermediate;
    const int kind = s->kind, bf = kind == STACK_BF16;
    const int threads = omp_get_max_threads();
    /* the layers' widest product output (float-sized: int4 writes floats); the bfloat16 head's output
     * goes to the second shared buffer only (int4's head writes the logits themselves) */
    int64_t widest = 2 * inter > qkv_size ? 2 * inter : qkv_size;
    if (hidden > widest) widest = hidden;
    const int64_t head_floats = logits != NULL && bf ? (rows * s->head.n_out + 1) / 2 : 0;
    const int64_t ys1_floats = rows * widest > head_floats ? rows * widest : head_floats;
    int64_t xb_bytes = 0;
    const StackWeight *ws[4] = {&s->layers[0].qkv, &s->layers[0].o, &s->layers[0].gate_up, &s->layers[0].down};
    for (int i = 0; i < 4; i++) {
        const int64_t b = product_scratch_bytes(kind, ws[i], rows);
        xb_bytes = b > xb_bytes ? b : xb_bytes;
    }
    const int64_t head_bytes = logits == NULL ? 0
                             : s->head_kind == STACK_HEAD_Q8 ? q8_team_scratch_bytes(rows, s->head.k, s->head.extra)
                                                             : product_scratch_bytes(kind, &s->head, rows);
    if (head_bytes > xb_bytes) xb_bytes = head_bytes;
    /* per thread: the residual stream, a normed copy, a product's float output, the SiLU product, the
     * attention output, its own q, the product scratch; shared: q, two product outputs (float-sized,
     * whichever the kind; the second holds the bfloat16 head's output too) */
    const int64_t own = rows * (2 * hidden + widest + inter + 2 * q_size) + (xb_bytes + 3) / 4 + 16;
    /* + the PgTeam, from the next line */
    /* a bfloat16 step of several rows shares per-row work out among the threads (share_rows): the SiLU
     * product, shared, is the down product's bfloat16 input.
     * Why only there: one row's SiLU is ~1.5 us a layer, about what the barrier the sharing needs
     * costs; a verifying step of 7 rows spent ~10 us a layer on it in each thread, and ~6 on
     * attention's combine (docs/performance.md, stop 57). */
    const int share_rows = bf && rows > 1 && threads > 1;
    const int64_t act_ld = s->layers[0].down.extra, act_floats = share_rows ? (rows * act_ld + 1) / 2 + 16 : 0;
    /* and so is attention's combine, into a shared output and the o product's shared bfloat16 input */
    const int64_t o_ld = s->layers[0].o.extra;
    const int64_t combine_floats = share_rows ? rows * q_size + (rows * o_ld + 1) / 2 + 16 : 0;
    const int64_t shared = rows * q_size + rows * widest + ys1_floats + act_floats + combine_floats
                           + (int64_t)(sizeof(PgTeam) + 63) / 4;
    int kept;
    float *scratch = step_scratch((size_t)(threads * own + shared), &kept);
    if (scratch == NULL) return 1;
    float *q = scratch + threads * own;
    float *ys0 = q + rows * q_size, *ys1 = ys0 + rows * widest;
    /* shared by the products' claims, on a cache line of its own */
    uint16_t *act_shared = (uint16_t *)(ys1 + ys1_floats);
    float *attn_shared = ys1 + ys1_floats + act_floats;
    uint16_t *o_in_shared = (uint16_t *)(attn_shared + rows * q_size);
    if (share_rows) { /* the paddings stay 0 */
        memset(act_shared, 0, sizeof(uint16_t) * (size_t)(rows * act_ld));
        memset(o_in_shared, 0, sizeof(uint16_t) * (size_t)(rows * o_ld));
    }
    PgTeam *team = (PgTeam *)(((uintptr_t)(ys1 + ys1_floats + act_floats + combine_floats) + 63) & ~(uintptr_t)63);
#define OWN(t) (scratch + (int64_t)(t) * own)
#define X(t) OWN(t)
#define NORMED(t) (OWN(t) + rows * hidden)
#define TMP(t) (OWN(t) + 2 * rows * hidden)
#define ACT(t) (OWN(t) + rows * (2 * hidden + widest))
#define ATTN(t) (OWN(t) + rows * (2 * hidden + widest + inter))
#define QOWN(t) (OWN(t) + rows * (2 * hidden + widest + inter + q_size))
#define XB(t) ((void *)(OWN(t) + rows * (2 * hidden + widest + inter + 2 * q_size)))
    for (int t = 0; t < threads; t++)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t i = 0; i < hidden; i++) X(t)[r * hidden + i] = load(s->embed, ids[r] * hidden + i, bf);
    /* the first layer's qkv before the loop: each pass of the loop ends in the next layer's */
    for (int64_t r = 0; r < rows; r++)
        rms_norm(X(0) + r * hidden, s->layers[0].input_norm, hidden, s->eps, bf, NORMED(0) + r * hidden);
    TeamBarrier sync_barrier = {0}, *sync = own_barrier ? &sync_barrier : NULL; /* team_barrier.h */
    *team = (PgTeam){.barrier = sync, .no_tiles = s->deterministic};
    PdaPlan plan; /* the step's attention partitions, the same in every layer */
    const int prc = pda_plan(&plan, context_lens, rows, s->heads, s->kv_heads, s->head_dim, threads);
    if (prc != 0) {
        step_scratch_done(scratch, kept);
        return prc == 1 ? 1 : 3;
    }
    if (s->cache_type == STACK_CACHE_BF16 && !s->deterministic) /* its draft chunks (none: as before) */
        pda_plan_chunks(&plan, block_tables, table_width, context_lens, rows, s->heads, s->kv_heads, s->head_dim,
                        s->block_size);
    plan.barrier = sync;
    /* the next layer's K/V during the products (kv_ahead.h): one row, a team to share its attention
     * out, products whose one-row loop drains the list (no allocation, no list: attention as before) */
    KvAhead *aheads = NULL;
    if (kv_ahead_lines > 0 && rows == 1 && threads > 1 && pda_plan_shared(&plan) &&
        (kind == STACK_BF16 ? packed_gemv_one_row_streams() : q4_gemv_one_row_streams()))
        aheads = (KvAhead *)aligned_alloc(64, sizeof(KvAhead) * (size_t)threads);
    for (int t = 0; aheads != NULL && t < threads; t++) kv_ahead_reset(aheads + t, 0);
    plan.static_tasks = aheads != NULL;
    team->ahead = aheads;
    uint16_t *yb = (uint16_t *)ys0; /* the region-per-call product's bfloat16 output (product) */
    const int rc = product(s, &s->layers[0].qkv, s->layers[0].qkv_bias, NORMED(0), TMP(0), rows, (uint16_t *)XB(0),
                           yb);
    if (rc == 0) rotate_and_cache(s, &s->layers[0], TMP(0), q, rows, positions, cos_table, sin_table, slots, 1);
    if (rc == 0) {
      _Pragma("omp parallel num_threads(threads)")
      {
        const int t = omp_get_thread_num();
        float *x = X(t), *normed = NORMED(t), *tmp = TMP(t), *act = ACT(t), *attn = ATTN(t);
        void *xb = XB(t);
        /* Where each thread attends over its own run of tasks (static_tasks: one row), every thread
         * rotates its own q, and the last thread, whose run holds the row's newest token, writes
         * that token's K/V: no other thread reads those lines, so no thread waits for another
         * before it attends. Elsewhere thread 0 writes q and the cache, and the team meets first.
         * Why: that barrier was one of six a layer, and the other thread's wait at it ~1-2 us a
         * layer while the two sat on two CCDs (docs/performance.md, "the q barrier"). */
        const int own_q = plan.static_tasks && rows == 1;
        float *qt = own_q ? QOWN(t) : q;
        if (own_q) memcpy(qt, q, sizeof(float) * (size_t)(rows * q_size));
        uint32_t tag = 0; /* this thread's count of the team's products: the same in every thread */
        for (int64_t l = 0; l < s->num_layers; l++) {
            const StackLayer *layer = &s->layers[l], *next = l + 1 < s->num_layers ? layer + 1 : NULL;
            if (aheads != NULL && next != NULL) /* drained by the o, gate/up, down and next qkv products */
                list_kv_ahead(s, next, &plan, t, omp_get_num_threads(), block_tables, table_width, context_lens,
                              aheads + t);
            else if (aheads != NULL) /* the last layer: what is left of the list is of no use now */
                kv_ahead_reset(aheads + t, 0);
            STACK_PHASE(t, PHASE_ATTENTION);
            /* several bfloat16 rows: each thread combines its share of the (row, head)s into a shared
             * output and converts that share into the o product's shared input; then the team meets */
            float *attn_out = share_rows ? attn_shared : attn;
            const int out_mode = share_rows ? 2 : 1;
            if (s->cache_type == STACK_CACHE_F16)
                paged_decode_attention_f16_team(&plan, qt, (const uint16_t *)layer->k_cache,
                                                (const uint16_t *)layer->v_cache, block_tables, table_width,
                                                context_lens, attn_out, rows, s->heads, s->kv_heads, s->head_dim,
                                                s->block_size, s->scale, out_mode);
            else if (s->cache_type == STACK_CACHE_BF16)
                paged_decode_attention_bf16_team(&plan, qt, (const uint16_t *)layer->k_cache,
                                                 (const uint16_t *)layer->v_cache, block_tables, table_width,
                                                 context_lens, attn_out, rows, s->heads, s->kv_heads, s->head_dim,
                                                 s->block_size, s->scale, out_mode);
            else
                paged_decode_attention_f32_team(&plan, qt, (const float *)layer->k_cache,
                                                (const float *)layer->v_cache, block_tables, table_width,
                                                context_lens, attn_out, rows, s->heads, s->kv_heads, s->head_dim,
                                                s->block_size, s->scale, out_mode);
            /* bfloat16: attn rounds to bfloat16 as the product converts it */
            STACK_PHASE(t, PHASE_O);
            if (share_rows) {
                int64_t lo2, hi2;
                pda_share(rows * s->heads, t, omp_get_num_threads(), &lo2, &hi2);
                for (int64_t bh = lo2; bh < hi2; bh++) {
                    const int64_t r = bh / s->heads, h = bh % s->heads, d = s->head_dim;
                    for (int64_t i = 0; i < d; i++)
                        o_in_shared[r * o_ld + h * d + i] = f32_to_bf16(attn_shared[bh * d + i]);
                }
                team_barrier(sync);
                team_product(kind, &layer->o, layer->o_bias, NULL, tmp, rows, o_in_shared, ys0, team, &tag,
                             &layer->gate_up);
            } else {
                team_product(kind, &layer->o, layer->o_bias, attn, tmp, rows, xb, ys0, team, &tag, &layer->gate_up);
            }
            STACK_PHASE(t, PHASE_NORM);
            for (int64_t i = 0; i < rows * hidden; i++) x[i] = rnd(x[i] + tmp[i], bf);
            for (int64_t r = 0; r < rows; r++)
                rms_norm(x + r * hidden, layer->post_norm, hidden, s->eps, bf, normed + r * hidden);
            STACK_PHASE(t, PHASE_GATE_UP);
            const StackWeight *after_down = next != NULL ? &next->qkv : logits != NULL ? &s->head : NULL;
            if (share_rows) { /* SiLU from the product's bfloat16 output into the down product's shared
                               * input, each thread its share of the columns; then the team meets */
                team_product(kind, &layer->gate_up, NULL, normed, NULL, rows, xb, ys1, team, &tag, &layer->down);
                STACK_PHASE(t, PHASE_SILU);
                const int n = omp_get_num_threads();
                const int64_t per = (inter + 16 * n - 1) / (16 * n) * 16;
                const int64_t lo = t * per < inter ? t * per : inter, hi = lo + per < inter ? lo + per : inter;
                silu_bf16_rows((const uint16_t *)ys1, rows, inter, lo, hi, act_ld, act_shared);
                team_barrier(sync);
                STACK_PHASE(t, PHASE_DOWN);
                team_product(kind, &layer->down, NULL, NULL, tmp, rows, act_shared, ys0, team, &tag, after_down);
            } else {
                team_product(kind, &layer->gate_up, NULL, normed, tmp, rows, xb, ys1, team, &tag, &layer->down);
                STACK_PHASE(t, PHASE_SILU);
                silu_rows(tmp, rows, inter, bf, act);
                STACK_PHASE(t, PHASE_DOWN);
                team_product(kind, &layer->down, NULL, act, tmp, rows, xb, ys0, team, &tag, after_down);
            }
            STACK_PHASE(t, PHASE_QKV);
            for (int64_t i = 0; i < rows * hidden; i++) x[i] = rnd(x[i] + tmp[i], bf);
            if (next != NULL) {
                for (int64_t r = 0; r < rows; r++)
                    rms_norm(x + r * hidden, next->input_norm, hidden, s->eps, bf, normed + r * hidden);
                team_product(kind, &next->qkv, next->qkv_bias, normed, tmp, rows, xb, ys1, team, &tag, &next->o);
                if (own_q) { /* the newest token's K/V by the thread that attends over it (above) */
                    rotate_and_cache(s, next, tmp, qt, rows, positions, cos_table, sin_table, slots,
                                     t == omp_get_num_threads() - 1);
                } else {
                    /* each thread its share of the rows (its copy of the product is every thread's) */
                    int64_t r0, r1;
                    pda_share(rows, t, omp_get_num_threads(), &r0, &r1);
                    if (r1 > r0)
                        rotate_and_cache(s, next, tmp + r0 * qkv_size, q + r0 * q_size, r1 - r0, positions + r0,
                                         cos_table, sin_table, slots + r0, 1);
                    team_barrier(sync); /* q and the cache, before anyone attends */
                }
                STACK_PHASE(t, PHASE_END); /* the last layer, with no qkv after it, is not counted */
            }
        }
        if (logits != NULL) /* the head here, not in a region of its own: a fork and a join fewer */
            team_head(s, x, normed, rows, xb, ys1, logits, argmax, team, &tag);
      }
    }
    pda_plan_free(&plan);
    free(aheads);
    /* out, where asked for beside logits or instead of them (team_head did the head and argmax) */
    const int frc = rc != 0 ? rc
                  : out != NULL ? finish(s, X(0), NORMED(0), rows, out, NULL, NULL, (uint16_t *)XB(0), yb) : 0;
#undef OWN
#undef X
#undef NORMED
#undef TMP
#undef ACT
#undef ATTN
#undef XB
#undef QOWN
    step_scratch_done(scratch, kept);
    return frc;
}

static int one_region = 1;

int decode_stack_set_one_region(int on) {
    one_region = on != 0;
    return one_region;
}

NOCONTRACT int decode_stack(const DecodeStack *s, const int64_t *ids, const int64_t *positions,
                            const float *cos_table, const float *sin_table, int64_t num_positions,
                            const int64_t *slots, const int64_t *block_tables, int64_t table_width,
                            const int64_t *context_lens, int64_t rows, void *out, float *logits,
                            int64_t *argmax) {
    const int64_t hidden = s->hidden, d = s->head_dim, q_size = s->heads * d, kv_size = s->kv_heads * d;
    const int64_t qkv_size = q_size + 2 * kv_size, inter = s->intermediate;
    const int kind = s->kind, bf = kind == STACK_BF16;
    if (rows <= 0 || d % 2 != 0) return 2;
    if (kind == STACK_INT4 ? !q4_gemv_supported() : (kind != STACK_BF16 || !packed_gemv_bf16_supported())) return 2;
    if (rows > (s->deterministic ? STACK_DETERMINISTIC_MAX_ROWS
                                 : kind == STACK_INT4 ? Q4_MAX_ROWS : packed_gemm_bf16_max_rows()))
        return 2;
    for (int64_t r = 0; r < rows; r++)
        if (ids[r] < 0 || ids[r] >= s->vocab || positions[r] < 0 || positions[r] >= num_positions) return 2;
    if (logits != NULL ? !head_ok(s) : out == NULL || argmax != NULL) return 2;
    for (int64_t l = 0; l < s->num_layers; l++) {
        const StackLayer *layer = &s->layers[l];
        if (!weight_ok(kind, &layer->qkv, qkv_size, hidden) || !weight_ok(kind, &layer->o, hidden, q_size) ||
            !weight_ok(kind, &layer->gate_up, 2 * inter, hidden) || !weight_ok(kind, &layer->down, hidden, inter))
            return 2;
    }
    /* one region up to the most rows a product pass takes (a decode step's, a verifying step's);
     * a deterministic stack's prefill chunk shares its per-row work out instead (PAR_MIN_ROWS) */
    if (omp_get_max_threads() > 1 && one_region && rows <= PG_MAX_ROWS)
        return layers_in_one_region(s, ids, positions, cos_table, sin_table, slots, block_tables, table_width,
                                    context_lens, rows, out, logits, argmax);
    /* scratch, per row: the residual stream, a normed copy, q|k|v, q, the attention output, gate|up,
     * the SiLU product; and the bfloat16 products' input and output */
    const int64_t per_row = 2 * hidden + qkv_size + 2 * q_size + 3 * inter;
    int64_t widest = 2 * inter > qkv_size ? 2 * inter : qkv_size;
    if (logits != NULL && bf && s->head.n_out > widest) widest = s->head.n_out; /* the head's bfloat16 outputs */
    float *scratch = (float *)malloc(sizeof(float) * (size_t)(rows * per_row) +
                                     sizeof(uint16_t) * (size_t)(2 * rows * widest));
    if (scratch == NULL) return 1;
    float *x = scratch, *normed = x + rows * hidden, *qkv = normed + rows * hidden, *q = qkv + rows * qkv_size;
    float *attn = q + rows * q_size, *gate_up = attn + rows * q_size, *act = gate_up + rows * 2 * inter;
    uint16_t *xb = (uint16_t *)(act + rows * inter), *yb = xb + rows * widest;
    int rc = 0;

    const int par = rows >= PAR_MIN_ROWS; /* the per-row work shared out among the threads, row by row */
    _Pragma("omp parallel for schedule(static) if(par)")
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < hidden; i++) x[r * hidden + i] = load(s->embed, ids[r] * hidden + i, bf);
    for (int64_t l = 0; l < s->num_layers && rc == 0; l++) {
        const StackLayer *layer = &s->layers[l];
        _Pragma("omp parallel for schedule(static) if(par)")
        for (int64_t r = 0; r < rows; r++)
            rms_norm(x + r * hidden, layer->input_norm, hidden, s->eps, bf, normed + r * hidden);
        if ((rc = product(s, &layer->qkv, layer->qkv_bias, normed, qkv, rows, xb, yb)) != 0) break;
        /* every row's K/V in the cache before any row attends (a row may attend to another's) */
        _Pragma("omp parallel for schedule(static) if(par)")
        for (int64_t r = 0; r < rows; r++)
            rotate_and_cache(s, layer, qkv + r * qkv_size, q + r * q_size, 1, positions + r, cos_table, sin_table,
                             slots + r, 1);
        if ((rc = attention(s, layer, q, block_tables, table_width, context_lens, rows, attn)) != 0) break;
        if (bf) {
            _Pragma("omp parallel for schedule(static) if(par)")
            for (int64_t i = 0; i < rows * q_size; i++) attn[i] = rnd(attn[i], 1);
        }
        if ((rc = product(s, &layer->o, layer->o_bias, attn, normed, rows, xb, yb)) != 0) break;
        _Pragma("omp parallel for schedule(static) if(par)")
        for (int64_t r = 0; r < rows; r++) {
            for (int64_t i = r * hidden; i < (r + 1) * hidden; i++) x[i] = rnd(x[i] + normed[i], bf);
            rms_norm(x + r * hidden, layer->post_norm, hidden, s->eps, bf, normed + r * hidden);
        }
        if ((rc = product(s, &layer->gate_up, NULL, normed, gate_up, rows, xb, yb)) != 0) break;
        _Pragma("omp parallel for schedule(static) if(par)")
        for (int64_t r = 0; r < rows; r++) silu_rows(gate_up + r * 2 * inter, 1, inter, bf, act + r * inter);
        if ((rc = product(s, &layer->down, NULL, act, normed, rows, xb, yb)) != 0) break;
        _Pragma("omp parallel for schedule(static) if(par)")
        for (int64_t i = 0; i < rows * hidden; i++) x[i] = rnd(x[i] + normed[i], bf);
    }
    if (rc == 0) rc = finish(s, x, normed, rows, out, logits, argmax, xb, yb);
    free(scratch);
    return rc;
}

/* Why several steps in one call: between two steps of one stream the engine's Python (scheduling,
 * the runner's inputs, sampling, the outputs) cost ~0.6 ms of a ~10.6 ms bfloat16 step, and it runs
 * slowly because the step before has just streamed the weights through every cache; here the
 * next step starts at once (docs/performance.md, thirteenth round). */
int decode_stack_steps(const DecodeStack *s, const int64_t *ids, const int64_t *positions, const float *cos_table,
                       const float *sin_table, int64_t num_positions, const int64_t *slots, const int64_t *block_tables,
                       int64_t table_width, const int64_t *context_lens, int64_t rows, int64_t steps, float *logits,
                       int64_t *tokens) {
    if (steps < 1 || rows <= 0 || logits == NULL || tokens == NULL || s->head.data == NULL) return 2;
    for (int64_t j = 0; j < steps; j++) {
        const int64_t *in = j == 0 ? ids : tokens + (j - 1) * rows;
        const int rc = decode_stack(s, in, positions + j * rows, cos_table, sin_table, num_positions, slots + j * rows,
                                    block_tables, table_width, context_lens + j * rows, rows, NULL, logits,
                                    tokens + j * rows);
        if (rc != 0) return rc;
    }
    return 0;
}
