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
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* One task per (sequence, kv head): the group of query heads that share a kv head is done together,
 * so each K and V row is read from memory once for all of them. */
#define MAX_GROUP 16
#define DEFINE_KERNEL(NAME, T, LOAD)                                                              \
int NAME(const float *q, const T *k_cache, const T *v_cache, const int64_t *block_tables,         \
         int64_t table_width, const int64_t *context_lens, float *out, int64_t batch,             \
         int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size, float scale) {    \
    const int64_t group = heads / kv_heads;                                                       \
    const int64_t token_stride = kv_heads * head_dim;                                             \
    if (group > MAX_GROUP || group * kv_heads != heads) return 2;                                 \
    int failed = 0;                                                                               \
    _Pragma("omp parallel for collapse(2) schedule(dynamic, 1)")                                  \
    for (int64_t b = 0; b < batch; b++) {                                                         \
        for (int64_t kvh = 0; kvh < kv_heads; kvh++) {                                            \
            const int64_t len = context_lens[b];                                                  \
            const int64_t offset = kvh * head_dim;                                                \
            const float *qg = q + (b * heads + kvh * group) * head_dim;                           \
            float *og = out + (b * heads + kvh * group) * head_dim;                               \
            float *scores = (float *)malloc(sizeof(float) * group * (len > 0 ? len : 1));         \
            if (scores == NULL) { failed = 1; continue; }                                         \
            const int64_t *table = block_tables + b * table_width;                                \
            const int64_t blocks = (len + block_size - 1) / block_size;                           \
            float max_score[MAX_GROUP], total[MAX_GROUP];                                         \
            for (int64_t g = 0; g < group; g++) { max_score[g] = -INFINITY; total[g] = 0.f; }     \
            for (int64_t m = 0; m < blocks; m++) {                                                \
                const int64_t n = len - m * block_size < block_size ? len - m * block_size : block_size; \
                const T *kp = k_cache + table[m] * block_size * token_stride + offset;            \
                for (int64_t i = 0; i < n; i++, kp += token_stride) {                             \
                    const int64_t t = m * block_size + i;                                         \
                    for (int64_t g = 0; g < group; g++) {                                         \
                        const float *qv = qg + g * head_dim;                                      \
                        float acc = 0.f;                                                          \
                        _Pragma("omp simd reduction(+:acc)")                                      \
                        for (int64_t d = 0; d < head_dim; d++) acc += qv[d] * LOAD(kp[d]);        \
                        acc *= scale;                                                             \
                        scores[g * len + t] = acc;                                                \
                        if (acc > max_score[g]) max_score[g] = acc;                               \
                    }                                                                             \
                }                                                                                 \
            }                                                                                     \
            for (int64_t g = 0; g < group; g++) {                                                 \
                float *s = scores + g * len;                                                      \
                const float mx = max_score[g];                                                    \
                float sum = 0.f;                                                                  \
                for (int64_t t = 0; t < len; t++) { s[t] = expf(s[t] - mx); sum += s[t]; }        \
                total[g] = sum;                                                                   \
                for (int64_t d = 0; d < head_dim; d++) og[g * head_dim + d] = 0.f;               \
            }                                                                                     \
            for (int64_t m = 0; m < blocks; m++) {                                                \
                const int64_t n = len - m * block_size < block_size ? len - m * block_size : block_size; \
                const T *vp = v_cache + table[m] * block_size * token_stride + offset;            \
                for (int64_t i = 0; i < n; i++, vp += token_stride) {                             \
                    const int64_t t = m * block_size + i;                                         \
                    for (int64_t g = 0; g < group; g++) {                                         \
                        const float p = scores[g * len + t];                                      \
                        float *o = og + g * head_dim;                                             \
                        _Pragma("omp simd")                                                       \
                        for (int64_t d = 0; d < head_dim; d++) o[d] += p * LOAD(vp[d]);           \
                    }                                                                             \
                }                                                                                 \
            }                                                                                     \
            for (int64_t g = 0; g < group; g++) {                                                 \
                const float inv = len > 0 ? 1.f / total[g] : 0.f;                                 \
                for (int64_t d = 0; d < head_dim; d++) og[g * head_dim + d] *= inv;               \
            }                                                                                     \
            free(scores);                                                                         \
        }                                                                                         \
    }                                                                                             \
    return failed;                                                                                \
}

#define LOAD_F32(x) (x)
#define LOAD_BF16(x) bf16_to_f32(x)
DEFINE_KERNEL(paged_decode_attention_f32, float, LOAD_F32)
DEFINE_KERNEL(paged_decode_attention_bf16, uint16_t, LOAD_BF16)
