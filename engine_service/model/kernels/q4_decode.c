/* An int4 Llama-family model's decode step in one native call (q4_decode.h): the embedding lookup,
 * every decoder layer (norm, QKV product, rotary, cache write, attention, output product, residual,
 * norm, gate/up product, SiLU, down product, residual) and the final norm.
 *
 * Why: one stream's step was ~150 operator calls through torch's dispatcher and inductor's wrapper
 * around the native products and attention, and that serial work between the kernels, not their
 * arithmetic, was what kept one stream at ~1.3x llama.cpp (docs/performance.md). Here the products
 * (q4_gemv.c) and the attention (paged_decode_attention.c) are the same kernels, called from C; the
 * elementwise work between them is a few thousand floats a row, done in place on the calling thread.
 *
 * Numerics are those of the eager forward (engine_service/model/llama.py, layers.py), in float32:
 * RMSNorm as h * (1 / sqrt(mean(h^2) + eps)) then times the weight, rotary in the rotate_half
 * convention from the engine's own cos/sin tables, SiLU as x / (1 + e^-x). Sums are taken in another
 * order than torch's, so outputs match to rounding, not bit for bit (tests/unit/test_q4_decode.py).
 * Every row is computed independently of the others: a row's output does not depend on the batch. */
#include "q4_decode.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "paged_decode_attention.h"
#include "q4_gemv.h"

static void rms_norm(const float *x, const float *weight, int64_t n, float eps, float *out) {
    float ss = 0.0f;
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    const float inv = 1.0f / sqrtf(ss / (float)n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = weight[i] * (x[i] * inv);
}

/* rotate_half: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), per head, in place */
static void rotate(float *x, int64_t heads, int64_t head_dim, const float *cos, const float *sin) {
    const int64_t half = head_dim / 2;
    for (int64_t h = 0; h < heads; h++) {
        float *v = x + h * head_dim;
        for (int64_t i = 0; i < half; i++) {
            const float a = v[i], b = v[i + half];
            v[i] = a * cos[i] - b * sin[i];
            v[i + half] = b * cos[i + half] + a * sin[i + half];
        }
    }
}

static void write_cache(void *cache, int cache_bf16, int64_t slot, const float *src, int64_t n) {
    if (cache_bf16) {
        uint16_t *dst = (uint16_t *)cache + slot * n;
        for (int64_t i = 0; i < n; i++) dst[i] = f32_to_bf16(src[i]);
    } else {
        memcpy((float *)cache + slot * n, src, sizeof(float) * (size_t)n);
    }
}

static int product(const Q4Weight *w, const float *x, float *y, int64_t rows) {
    return q4_linear_f32(w->codes, w->scales_zeros, x, y, rows, w->n_out, w->n_pad, w->k, w->group);
}

int q4_decode_stack(const Q4Stack *s, const int64_t *ids, const int64_t *positions, const float *cos_table,
                    const float *sin_table, int64_t num_positions, const int64_t *slots,
                    const int64_t *block_tables, int64_t table_width, const int64_t *context_lens, int64_t rows,
                    float *out) {
    const int64_t hidden = s->hidden, d = s->head_dim, q_size = s->heads * d, kv_size = s->kv_heads * d;
    const int64_t qkv_size = q_size + 2 * kv_size, inter = s->intermediate;
    if (rows <= 0 || !q4_gemv_supported() || d % 2 != 0) return 2;
    for (int64_t r = 0; r < rows; r++)
        if (ids[r] < 0 || ids[r] >= s->vocab || positions[r] < 0 || positions[r] >= num_positions) return 2;
    for (int64_t l = 0; l < s->num_layers; l++) {
        const Q4Layer *layer = &s->layers[l];
        if (layer->qkv.n_out != qkv_size || layer->qkv.k != hidden || layer->o.n_out != hidden ||
            layer->o.k != q_size || layer->gate_up.n_out != 2 * inter || layer->gate_up.k != hidden ||
            layer->down.n_out != hidden || layer->down.k != inter)
            return 2;
    }
    /* scratch, per row: the residual stream, a normed copy, q|k|v, the attention output, gate|up */
    const int64_t per_row = 2 * hidden + qkv_size + q_size + 2 * inter;
    float *scratch = (float *)malloc(sizeof(float) * (size_t)(rows * per_row));
    if (scratch == NULL) return 1;
    float *x = scratch, *normed = x + rows * hidden, *qkv = normed + rows * hidden, *attn = qkv + rows * qkv_size;
    float *gate_up = attn + rows * q_size;
    float *q = (float *)malloc(sizeof(float) * (size_t)(rows * (q_size + inter)));
    if (q == NULL) {
        free(scratch);
        return 1;
    }
    float *act = q + rows * q_size;
    int rc = 0;

    for (int64_t r = 0; r < rows; r++) memcpy(x + r * hidden, s->embed + ids[r] * hidden, sizeof(float) * (size_t)hidden);
    for (int64_t l = 0; l < s->num_layers && rc == 0; l++) {
        const Q4Layer *layer = &s->layers[l];
        for (int64_t r = 0; r < rows; r++) rms_norm(x + r * hidden, layer->input_norm, hidden, s->eps, normed + r * hidden);
        if ((rc = product(&layer->qkv, normed, qkv, rows)) != 0) break;
        for (int64_t r = 0; r < rows; r++) {
            float *row = qkv + r * qkv_size;
            const float *cos = cos_table + positions[r] * d, *sin = sin_table + positions[r] * d;
            rotate(row, s->heads + s->kv_heads, d, cos, sin); /* q and k are adjacent */
            memcpy(q + r * q_size, row, sizeof(float) * (size_t)q_size);
            /* written before any row attends: a row may attend to a slot another row of this step
             * wrote (a draft chunk's tokens; prefix sharing), as the eager forward allows */
            write_cache(layer->k_cache, s->cache_bf16, slots[r], row + q_size, kv_size);
            write_cache(layer->v_cache, s->cache_bf16, slots[r], row + q_size + kv_size, kv_size);
        }
        const int arc = s->cache_bf16
            ? paged_decode_attention_bf16(q, (const uint16_t *)layer->k_cache, (const uint16_t *)layer->v_cache,
                                          block_tables, table_width, context_lens, attn, rows, s->heads,
                                          s->kv_heads, d, s->block_size, s->scale)
            : paged_decode_attention_f32(q, (const float *)layer->k_cache, (const float *)layer->v_cache,
                                         block_tables, table_width, context_lens, attn, rows, s->heads, s->kv_heads,
                                         d, s->block_size, s->scale);
        if (arc != 0) {
            rc = arc == 1 ? 1 : 3;
            break;
        }
        if ((rc = product(&layer->o, attn, normed, rows)) != 0) break;
        for (int64_t i = 0; i < rows * hidden; i++) x[i] += normed[i];
        for (int64_t r = 0; r < rows; r++) rms_norm(x + r * hidden, layer->post_norm, hidden, s->eps, normed + r * hidden);
        if ((rc = product(&layer->gate_up, normed, gate_up, rows)) != 0) break;
        for (int64_t r = 0; r < rows; r++) {
            const float *g = gate_up + r * 2 * inter, *u = g + inter;
            float *a = act + r * inter;
            for (int64_t i = 0; i < inter; i++) a[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
        }
        if ((rc = product(&layer->down, act, normed, rows)) != 0) break;
        for (int64_t i = 0; i < rows * hidden; i++) x[i] += normed[i];
    }
    if (rc == 0)
        for (int64_t r = 0; r < rows; r++) rms_norm(x + r * hidden, s->final_norm, hidden, s->eps, out + r * hidden);
    free(q);
    free(scratch);
    return rc;
}
