/* Decode attention over the paged KV cache, on CPU: one query per sequence, K and V read where they
 * lie in the cache (through the block table), once, with no padded copy.
 *
 * Built at first use by engine_service/model/native.py (gcc -O3 -march=native -fopenmp) and called
 * through ctypes. It links the OpenMP runtime torch already loaded (same soname, libgomp.so.1), so
 * it shares torch's thread pool instead of starting a second one.
 *
 * Layouts (contiguous):
 *   q, out        [batch, heads, head_dim]                       float32
 *   k/v cache     [num_blocks, block_size, kv_heads, head_dim]   float32 or bfloat16
 *   block_tables  [batch, table_width]                            int64
 *   context_lens  [batch]                                         int64
 * Per (sequence, query head): scores = q·k * scale over the visible positions, softmax with the max
 * subtracted (as the reference SDPA does), out = Σ p·v / Σ p. float32 accumulation throughout.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* exp(x) for x <= 0 in plain arithmetic (Cephes' expf: range reduction by ln 2, a degree-6
 * polynomial; within 2 ulp of expf), so the softmax loop vectorises: a scalar libm call per score
 * was a third of the kernel's time at batch 64. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float k = __builtin_rintf(x * 1.44269504088896341f);
    const float r = x - k * 0.693359375f + k * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const float y = p * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)k + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return y * scale;
}

/* One (sequence, kv head): the `group` query heads that share the kv head are done together, so each
 * K and V row is read from memory once for all of them. HEAD_DIM is a compile-time constant in the
 * specialised copies (64, 128), which lets the compiler keep a head's output in registers. */
#define MAX_GROUP 16
#define DEFINE_ATTEND(NAME, T, LOAD)                                                              \
static inline __attribute__((always_inline)) void NAME(                                          \
        const float *restrict qg, const T *restrict k_cache, const T *restrict v_cache,           \
        const int64_t *restrict table, int64_t len, float *restrict og, float *restrict scores,   \
        int64_t group, int64_t token_stride, int64_t offset, int64_t block_size,                  \
        const int64_t head_dim, float scale) {                                                    \
    const int64_t blocks = (len + block_size - 1) / block_size;                                   \
    float max_score[MAX_GROUP];                                                                   \
    for (int64_t g = 0; g < group; g++) max_score[g] = -INFINITY;                                 \
    for (int64_t m = 0; m < blocks; m++) {                                                        \
        const int64_t n = len - m * block_size < block_size ? len - m * block_size : block_size; \
        const T *kp = k_cache + table[m] * block_size * token_stride + offset;                    \
        for (int64_t i = 0; i < n; i++, kp += token_stride) {                                     \
            const int64_t t = m * block_size + i;                                                 \
            for (int64_t g = 0; g < group; g++) {                                                 \
                const float *qv = qg + g * head_dim;                                              \
                float acc = 0.f;                                                                  \
                _Pragma("omp simd reduction(+:acc)")                                              \
                for (int64_t d = 0; d < head_dim; d++) acc += qv[d] * LOAD(kp[d]);                \
                acc *= scale;                                                                     \
                scores[g * len + t] = acc;                                                        \
                if (acc > max_score[g]) max_score[g] = acc;                                       \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
    for (int64_t g = 0; g < group; g++) {                                                         \
        float *s = scores + g * len;                                                              \
        const float mx = max_score[g];                                                            \
        float total = 0.f;                                                                        \
        _Pragma("omp simd reduction(+:total)")                                                    \
        for (int64_t t = 0; t < len; t++) {                                                       \
            s[t] = exp_nonpositive(s[t] - mx);                                                    \
            total += s[t];                                                                        \
        }                                                                                         \
        const float inv = 1.f / total;                                                            \
        _Pragma("omp simd")                                                                       \
        for (int64_t t = 0; t < len; t++) s[t] *= inv;                                            \
    }                                                                                             \
    for (int64_t g = 0; g < group; g++) {                                                         \
        float o[HEAD_DIM_MAX];                                                                    \
        for (int64_t d = 0; d < head_dim; d++) o[d] = 0.f;                                        \
        const float *s = scores + g * len;                                                        \
        for (int64_t m = 0; m < blocks; m++) {                                                    \
            const int64_t n = len - m * block_size < block_size ? len - m * block_size : block_size; \
            const T *vp = v_cache + table[m] * block_size * token_stride + offset;                \
            const float *sp = s + m * block_size;                                                 \
            for (int64_t i = 0; i < n; i++, vp += token_stride) {                                 \
                const float p = sp[i];                                                            \
                _Pragma("omp simd")                                                               \
                for (int64_t d = 0; d < head_dim; d++) o[d] += p * LOAD(vp[d]);                   \
            }                                                                                     \
        }                                                                                         \
        for (int64_t d = 0; d < head_dim; d++) og[g * head_dim + d] = o[d];                       \
    }                                                                                             \
}

#define HEAD_DIM_MAX 256

#define DEFINE_KERNEL(NAME, T, ATTEND)                                                            \
int NAME(const float *q, const T *k_cache, const T *v_cache, const int64_t *block_tables,         \
         int64_t table_width, const int64_t *context_lens, float *out, int64_t batch,             \
         int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size, float scale) {    \
    const int64_t group = heads / kv_heads;                                                       \
    const int64_t token_stride = kv_heads * head_dim;                                             \
    if (group > MAX_GROUP || group * kv_heads != heads || head_dim > HEAD_DIM_MAX) return 2;      \
    int failed = 0;                                                                               \
    /* Enough sequences to share out: one task per sequence, its kv heads in turn, so the task      \
     * streams each block of the sequence (all heads of a token are adjacent) through one core and   \
     * the second and later heads find it in that core's L2. Fewer: one task per (sequence, head). */\
    const int64_t per_task = batch >= 2 * (int64_t)omp_get_max_threads() ? kv_heads : 1;          \
    const int64_t tasks = batch * kv_heads / per_task;                                            \
    _Pragma("omp parallel for schedule(dynamic, 1)")                                              \
    for (int64_t task = 0; task < tasks; task++) {                                                \
        for (int64_t j = 0; j < per_task; j++) {                                                  \
            const int64_t b = task * per_task / kv_heads;                                         \
            const int64_t kvh = (task * per_task + j) % kv_heads;                                 \
            const int64_t len = context_lens[b];                                                  \
            float *og = out + (b * heads + kvh * group) * head_dim;                               \
            if (len <= 0) {                                                                       \
                for (int64_t i = 0; i < group * head_dim; i++) og[i] = 0.f;                       \
                continue;                                                                         \
            }                                                                                     \
            float *scores = (float *)malloc(sizeof(float) * group * len);                         \
            if (scores == NULL) { failed = 1; continue; }                                         \
            const float *qg = q + (b * heads + kvh * group) * head_dim;                           \
            const int64_t *table = block_tables + b * table_width;                                \
            const int64_t offset = kvh * head_dim;                                                \
            if (head_dim == 64)                                                                   \
                ATTEND(qg, k_cache, v_cache, table, len, og, scores, group, token_stride, offset, \
                       block_size, 64, scale);                                                    \
            else if (head_dim == 128)                                                             \
                ATTEND(qg, k_cache, v_cache, table, len, og, scores, group, token_stride, offset, \
                       block_size, 128, scale);                                                   \
            else                                                                                  \
                ATTEND(qg, k_cache, v_cache, table, len, og, scores, group, token_stride, offset, \
                       block_size, head_dim, scale);                                              \
            free(scores);                                                                         \
        }                                                                                         \
    }                                                                                             \
    return failed;                                                                                \
}

#define LOAD_F32(x) (x)
#define LOAD_BF16(x) bf16_to_f32(x)
DEFINE_ATTEND(attend_f32, float, LOAD_F32)
DEFINE_ATTEND(attend_bf16, uint16_t, LOAD_BF16)
DEFINE_KERNEL(paged_decode_attention_f32, float, attend_f32)
DEFINE_KERNEL(paged_decode_attention_bf16, uint16_t, attend_bf16)
