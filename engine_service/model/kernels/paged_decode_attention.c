/* Decode attention over the paged KV cache, on CPU: one query per sequence, K and V read where they
 * lie in the cache (through the block table), once, with no padded copy.
 *
 * Built at first use by engine_service/model/native.py (gcc -O3 -march=native -fopenmp) and called
 * as the torch operator sluice::paged_decode_attention (paged_decode_attention_op.cpp). It links
 * the OpenMP runtime torch already loaded (same soname, libgomp.so.1), so it shares torch's thread
 * pool instead of starting a second one. A caller already inside a parallel region (decode_stack.c's
 * bfloat16 step) plans the step's partitions once (pda_plan) and calls the team body, which its
 * threads share out, instead of the entry points, which fork a region of their own.
 *
 * Layouts (contiguous):
 *   q, out        [batch, heads, head_dim]                       float32
 *   k/v cache     [num_blocks, block_size, kv_heads, head_dim]   float32, bfloat16 or float16
 *   block_tables  [batch, table_width]                            int64
 *   context_lens  [batch]                                         int64
 *
 * Each sequence's context is cut into partitions of 64 or 128 tokens (split-K, "flash decoding").
 * A task is one (sequence, partition) with all of its heads: it streams the partition's K and V rows
 * (every head of a token is adjacent in the cache) once, and leaves per head the partition's score
 * maximum m, its sum of exp(score - m) l and its unnormalised output o = Σ exp(score - m)·v. A
 * sequence of one partition is finished by out = o / l; longer ones are combined with the
 * log-sum-exp rescaling, out = Σ_p e^(m_p - M) o_p / Σ_p e^(m_p - M) l_p with M = max m_p.
 *
 * Why partitions: one stream (batch 1) has only kv_heads tasks otherwise (3 for SmolLM2, on 2
 * cores: one core idles half the time), and a (sequence, head) task reads a third of each cached
 * token with a stride. The partitions depend only on the context length, never on the batch or the
 * thread count, so a sequence's output is bitwise the same alone or batched, on any number of
 * threads. float32 accumulation throughout.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "f16.h"
#include "fast_exp.h"
#include "paged_decode_attention.h"
#include "team_barrier.h"

#define PARTITION 128 /* the longest partition (the scratch row per head) */
/* Up to this many context tokens in all (one partition: one task), the call runs on the calling
 * thread alone. It was 256, from a bench of the kernel alone, warm, where waking the pool and two
 * barriers cost what a second core saved at context 128. Inside a decode step the weights stream
 * through the caches between two attention calls, and there two threads were faster from two
 * partitions up: at context 128, 19 against 22 µs a layer, at 256, 25 against 40, serial and
 * parallel alternating in one process; at 64 the one task ran 13 µs alone and 17 with the pool
 * woken (docs/performance.md, eleventh round). Results do not depend on it: the partitions never
 * do. */
#define SERIAL_TOKENS 64

/* Tokens per partition, a function of the context length only (batch invariance): short contexts
 * get shorter partitions, so one stream still has a task per core; and one sequence's partitions
 * are an even count of near-equal lengths (the last one the shortest), so that a team of two
 * splits one stream's attention evenly. Why: with at most 128 tokens a partition, context 300 was
 * three tasks (128, 128, 44) and 384 three of 128, so one thread attended over up to twice the
 * other's tokens while the other waited at the barrier; now they are four of 75 and four of 96.
 * Partitions in whole 16-token blocks (80, 80, 80, 60) leave the halves uneven; in the step they
 * read within 0.6% of these either way (docs/performance.md, "the next layer's K/V during the
 * products"). Past ~16,000 tokens, a hundred tasks and more, the count can come out odd. */
static inline int64_t partition_len(int64_t len) {
    const int64_t most = len <= 256 ? 64 : PARTITION;
    int64_t parts = (len + most - 1) / most;
    parts += parts > 1 && parts % 2 != 0;
    return len > 0 ? (len + parts - 1) / parts : most;
}
#define MAX_HEADS PDA_MAX_HEADS
#define HEAD_DIM_MAX PDA_MAX_HEAD_DIM


#if defined(__AVX512F__)
#include <immintrin.h>
#define PDA_VECTOR 1

static inline __m512 vload_f32(const float *p) { return _mm512_loadu_ps(p); }
static inline __m512 vload_f16(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline __m512 vload_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* 16 vectors of partial sums -> one vector of their 16 totals, in order. Why: a horizontal sum
 * per (token, head) score cost more than the dot product itself (one stream, context 300: 54 µs a
 * layer on two threads, ~4 GB/s of cache read); here 16 scores cost ~50 shuffles and adds. */
static inline __m512 sum16(const __m512 a[16]) {
    __m512 s[8], u[4];
    for (int j = 0; j < 8; j++)  /* lanes 0-1: token 2j's halves summed; lanes 2-3: token 2j+1's */
        s[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * j], a[2 * j + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * j], a[2 * j + 1], 0xEE));
    for (int j = 0; j < 4; j++)  /* 128-bit lane l: token 4j + l, four partial sums */
        u[j] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * j], s[2 * j + 1], 0x88),
                             _mm512_shuffle_f32x4(s[2 * j], s[2 * j + 1], 0xDD));
    const __m512 v0 = _mm512_add_ps(_mm512_unpacklo_ps(u[0], u[1]), _mm512_unpackhi_ps(u[0], u[1]));
    const __m512 v1 = _mm512_add_ps(_mm512_unpacklo_ps(u[2], u[3]), _mm512_unpackhi_ps(u[2], u[3]));
    /* element 4l + j holds token 4j + l */
    const __m512 x = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(v0), _mm512_castps_pd(v1))),
                                   _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(v0), _mm512_castps_pd(v1))));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(order, x);
}

/* scores[h * PARTITION + i] = scale * q_h . k_i for the run's n <= 16 tokens (rows token_stride
 * apart from kp), every head */
#define DEFINE_SCORES16(NAME, T, VLOAD)                                                           \
static inline __attribute__((always_inline)) void NAME(                                          \
        const float *restrict q, const T *restrict kp, int64_t n, int64_t token_stride,           \
        int64_t heads, const int32_t *kv_of, const int64_t head_dim, float scale,                \
        float *restrict scores, int q_bf16) {                                                     \
    (void)q_bf16;                                                                                 \
    const __mmask16 mask = (__mmask16)((1u << n) - 1u);                                           \
    const __m512 vscale = _mm512_set1_ps(scale);                                                  \
    for (int64_t h = 0; h < heads; h++) {                                                         \
        __m512 qv[PDA_MAX_VEC];                                                                   \
        for (int64_t c = 0; c < head_dim / 16; c++) qv[c] = _mm512_loadu_ps(q + h * head_dim + 16 * c); \
        const T *kh = kp + kv_of[h] * head_dim;                                                   \
        __m512 acc[16];                                                                           \
        for (int i = 0; i < 16; i++) {                                                            \
            acc[i] = _mm512_setzero_ps();                                                         \
            if (i < n)                                                                            \
                for (int64_t c = 0; c < head_dim / 16; c++)                                       \
                    acc[i] = _mm512_fmadd_ps(qv[c], VLOAD(kh + i * token_stride + 16 * c), acc[i]); \
        }                                                                                         \
        _mm512_mask_storeu_ps(scores + h * PARTITION, mask, _mm512_mul_ps(sum16(acc), vscale));   \
    }                                                                                             \
}
#define PDA_MAX_VEC (HEAD_DIM_MAX / 16)
DEFINE_SCORES16(scores16_f32, float, vload_f32)
DEFINE_SCORES16(scores16_lanes_bf16, uint16_t, vload_bf16)
/* float16 K: 16 scores summed across lanes at once, as float32's (no transposed fast path) */
DEFINE_SCORES16(scores16_f16, uint16_t, vload_f16)

/* r[j] lane i <- r[i] lane j: a 16 x 16 matrix of 32-bit values, transposed in registers */
static inline __attribute__((always_inline)) void transpose16(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_i32x4(u[i], u[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_i32x4(u[i], u[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_i32x4(u[i + 8], u[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(u[i + 8], u[i + 12], 0xdd);
    }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    }
}

/* NH (1-3) query heads' scores over a run's transposed K (kt[p]: the 16 tokens' input pair p, one
 * token a lane): sum over the pairs of q[2p] k[2p] and q[2p+1] k[2p+1], even and odd inputs in two
 * sums added at the end, into scores[j * PARTITION ...] for the n tokens */
#define DEFINE_SCORES_T(NAME, NH)                                                                 \
static inline __attribute__((always_inline)) void NAME(                                          \
        const float *restrict q, const __m512i *restrict kt, __mmask16 mask, const int64_t head_dim, \
        __m512 vscale, float *restrict scores) {                                                  \
    const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);                                     \
    __m512 even[NH], odd[NH];                                                                     \
    for (int j = 0; j < NH; j++) even[j] = _mm512_setzero_ps(), odd[j] = _mm512_setzero_ps();     \
    for (int64_t p = 0; p < head_dim / 2; p++) {                                                  \
        const __m512 ke = _mm512_castsi512_ps(_mm512_slli_epi32(kt[p], 16));                      \
        const __m512 ko = _mm512_castsi512_ps(_mm512_and_si512(kt[p], high));                     \
        for (int j = 0; j < NH; j++) {                                                            \
            even[j] = _mm512_fmadd_ps(_mm512_set1_ps(q[j * head_dim + 2 * p]), ke, even[j]);      \
            odd[j] = _mm512_fmadd_ps(_mm512_set1_ps(q[j * head_dim + 2 * p + 1]), ko, odd[j]);    \
        }                                                                                         \
    }                                                                                             \
    for (int j = 0; j < NH; j++)                                                                  \
        _mm512_mask_storeu_ps(scores + j * PARTITION, mask,                                       \
                              _mm512_mul_ps(_mm512_add_ps(even[j], odd[j]), vscale));             \
}
DEFINE_SCORES_T(scores_t1, 1)
DEFINE_SCORES_T(scores_t2, 2)
DEFINE_SCORES_T(scores_t3, 3)

/* scores16_bf16 where every q value is exactly a bfloat16 (a bfloat16 model's): each token's 32
 * input pairs of one query head as VDPBF16PS on the K row as it lies, and the 16 tokens' lanes
 * summed at once (sum16), with no transpose. The products are exact either way; the sums round in
 * another order than the transposed path's, so the scores are not its bit for bit. Why: the
 * transposes and the widening were about half the scores' instructions; attention alone ran
 * 1.05-1.12x as fast at context 300, one row, and 1.02-1.07x for batches of 4-64 and at 1500
 * (docs/performance.md, "a bfloat16 q's scores as VDPBF16PS"). */
#if defined(__AVX512BF16__)
#define PDA_DP_BF16 1
static inline __attribute__((always_inline)) void scores16_dp_bf16(
        const float *restrict q, const uint16_t *restrict kp, int64_t n, int64_t token_stride,
        int64_t heads, const int32_t *kv_of, const int64_t head_dim, float scale, float *restrict scores) {
    const __mmask16 mask = (__mmask16)((1u << n) - 1u);
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t h = 0; h < heads; h++) {
        __m512bh qv[HEAD_DIM_MAX / 32];
        for (int64_t c = 0; c < head_dim / 32; c++)
            qv[c] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + h * head_dim + 32 * c + 16),
                                        _mm512_loadu_ps(q + h * head_dim + 32 * c));
        const uint16_t *kh = kp + kv_of[h] * head_dim;
        __m512 acc[16];
        for (int i = 0; i < 16; i++) {
            acc[i] = _mm512_setzero_ps();
            if (i < n)
                for (int64_t c = 0; c < head_dim / 32; c++)
                    acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_loadu_si512(kh + i * token_stride + 32 * c), qv[c]);
        }
        _mm512_mask_storeu_ps(scores + h * PARTITION, mask, _mm512_mul_ps(sum16(acc), vscale));
    }
}
#endif

/* scores[h * PARTITION + i] = scale * q_h . k_i for the run's n <= 16 tokens, bfloat16 K. Where
 * head_dim is whole runs of 32 and q is a bfloat16 one (q_bf16, bf16_exact): scores16_dp_bf16.
 * Under a float32 q: each kv head's 16 K rows are transposed once, in registers, so a
 * token is a lane; then each query head's 16 scores are FMAs with its q broadcast, one input at a
 * time, shared by up to three query heads, with no per-token horizontal sum. Why: summing each
 * token's products across lanes (scores16_lanes) and widening K once per query head took most of
 * the kernel's instructions (docs/performance.md, seventh round). */
static inline __attribute__((always_inline)) void scores16_bf16(
        const float *restrict q, const uint16_t *restrict kp, int64_t n, int64_t token_stride,
        int64_t heads, const int32_t *kv_of, const int64_t head_dim, float scale, float *restrict scores,
        int q_bf16) {
    if (head_dim % 32 != 0) {
        scores16_lanes_bf16(q, kp, n, token_stride, heads, kv_of, head_dim, scale, scores, 0);
        return;
    }
#if defined(PDA_DP_BF16)
    if (q_bf16) {
        scores16_dp_bf16(q, kp, n, token_stride, heads, kv_of, head_dim, scale, scores);
        return;
    }
#endif
    const __mmask16 mask = (__mmask16)((1u << n) - 1u);
    const __m512 vscale = _mm512_set1_ps(scale);
    const int64_t kv_heads = token_stride / head_dim, group = heads / kv_heads;
    for (int64_t g = 0; g < kv_heads; g++) {
        __m512i kt[HEAD_DIM_MAX / 2];
        for (int64_t b = 0; b < head_dim / 32; b++) {
            __m512i r[16];
            for (int i = 0; i < 16; i++)
                r[i] = i < n ? _mm512_loadu_si512(kp + i * token_stride + g * head_dim + 32 * b) : _mm512_setzero_si512();
            transpose16(r);
            for (int j = 0; j < 16; j++) kt[16 * b + j] = r[j];
        }
        for (int64_t h = g * group; h < (g + 1) * group;) {
            const int64_t left = (g + 1) * group - h;
            const float *qh = q + h * head_dim;
            float *sh = scores + h * PARTITION;
            if (left >= 3) scores_t3(qh, kt, mask, head_dim, vscale, sh);
            else if (left == 2) scores_t2(qh, kt, mask, head_dim, vscale, sh);
            else scores_t1(qh, kt, mask, head_dim, vscale, sh);
            h += left >= 3 ? 3 : left;
        }
    }
}
#endif

#if defined(PDA_VECTOR)
/* o_h = sum_t p_h,t v_t over the partition for NH (1-3) query heads h0.. of one kv head, their
 * outputs in registers. Why several heads at once: one head's sum is head_dim / 16 chains of
 * dependent FMAs, which leave the FMA units waiting on their latency; NH heads make NH times as
 * many chains, and read (and widen) each V row once for all of them. Each head's terms are still
 * added in token order, so its output is the one-head loop's. */
#define DEFINE_VALUES(NAME, NH, T, VLOAD)                                                         \
static inline __attribute__((always_inline)) void NAME(                                          \
        const float *restrict scores, const T *restrict v_cache, const int64_t *restrict table,   \
        int64_t start, int64_t end, int64_t block_size, int64_t token_stride, int64_t head_off,   \
        const int64_t head_dim, float *restrict o) {                                              \
    __m512 acc[NH][PDA_MAX_VEC];                                                                  \
    for (int j = 0; j < NH; j++)                                                                  \
        for (int64_t c = 0; c < head_dim / 16; c++) acc[j][c] = _mm512_setzero_ps();              \
    for (int64_t t = start; t < end;) {                                                           \
        const int64_t blk = t / block_size, first = t % block_size;                               \
        const int64_t run = block_size - first < end - t ? block_size - first : end - t;          \
        const T *vp0 = v_cache + (table[blk] * block_size + first) * token_stride + head_off;     \
        const float *sp = scores + t - start;                                                     \
        for (int64_t i = 0; i < run; i++) {                                                       \
            __m512 p[NH];                                                                         \
            for (int j = 0; j < NH; j++) p[j] = _mm512_set1_ps(sp[j * PARTITION + i]);            \
            for (int64_t c = 0; c < head_dim / 16; c++) {                                         \
                const __m512 v = VLOAD(vp0 + i * token_stride + 16 * c);                          \
                for (int j = 0; j < NH; j++) acc[j][c] = _mm512_fmadd_ps(p[j], v, acc[j][c]);     \
            }                                                                                     \
        }                                                                                         \
        t += run;                                                                                 \
    }                                                                                             \
    for (int j = 0; j < NH; j++)                                                                  \
        for (int64_t c = 0; c < head_dim / 16; c++) _mm512_storeu_ps(o + j * head_dim + 16 * c, acc[j][c]); \
}
DEFINE_VALUES(values1_f32, 1, float, vload_f32)
DEFINE_VALUES(values2_f32, 2, float, vload_f32)
DEFINE_VALUES(values3_f32, 3, float, vload_f32)
DEFINE_VALUES(values1_bf16, 1, uint16_t, vload_bf16)
DEFINE_VALUES(values2_bf16, 2, uint16_t, vload_bf16)
DEFINE_VALUES(values3_bf16, 3, uint16_t, vload_bf16)
DEFINE_VALUES(values1_f16, 1, uint16_t, vload_f16)
DEFINE_VALUES(values2_f16, 2, uint16_t, vload_f16)
DEFINE_VALUES(values3_f16, 3, uint16_t, vload_f16)
/* every head's output: each kv head's query heads three at a time */
#define VECTOR_VALUES(SUFFIX, scores, v_cache, table, start, end, block_size, token_stride, heads,  \
                      group, head_dim, o)                                                         \
    do {                                                                                          \
        for (int64_t h = 0; h < (heads);) {                                                       \
            const int64_t kv = h / (group), left = (kv + 1) * (group) - h;                        \
            const int64_t off = kv * (head_dim);                                                  \
            const float *sh = (scores) + h * PARTITION;                                           \
            float *oh = (o) + h * (head_dim);                                                     \
            if (left >= 3) values3_##SUFFIX(sh, v_cache, table, start, end, block_size, token_stride, off, head_dim, oh); \
            else if (left == 2) values2_##SUFFIX(sh, v_cache, table, start, end, block_size, token_stride, off, head_dim, oh); \
            else values1_##SUFFIX(sh, v_cache, table, start, end, block_size, token_stride, off, head_dim, oh); \
            h += left >= 3 ? 3 : left;                                                            \
        }                                                                                         \
    } while (0)
#define VECTOR_OK(head_dim) ((head_dim) % 16 == 0)
#define VECTOR_SCORES(FN, ...) FN(__VA_ARGS__)
#else
#define VECTOR_OK(head_dim) 0
#define VECTOR_SCORES(FN, ...) ((void)0)
#define VECTOR_VALUES(...) ((void)0)
#define vload_f32 0
#define vload_bf16 0
#define vload_f16 0
#define scores16_f32 0
#define scores16_bf16 0
#define scores16_f16 0
#endif

/* Whether q's n values are all bfloat16 numbers (their low 16 bits zero), as a bfloat16 model's q
 * is; only the VDPBF16PS scores (scores16_dp_bf16) ask, and only where the CPU has them. */
static inline int bf16_exact(const float *q, int64_t n) {
#if defined(PDA_DP_BF16)
    uint32_t low = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t bits;
        memcpy(&bits, q + i, sizeof bits);
        low |= bits & 0xFFFFu;
    }
    return low == 0;
#else
    (void)q, (void)n;
    return 0;
#endif
}

/* The largest of s[0..n), NaNs passed over, -INFINITY for none. Why vector code: the scalar loop
 * was one dependent chain of vmaxss (GCC keeps a NaN-ignoring select serial), 17% of the kernel's
 * time under perf. A maximum does not round, so the result is the scalar loop's. */
static inline float scores_max(const float *s, int64_t n) {
#if defined(PDA_VECTOR)
    __m512 mv = _mm512_set1_ps(-INFINITY);
    int64_t c = 0;
    for (; c + 16 <= n; c += 16) mv = _mm512_max_ps(_mm512_loadu_ps(s + c), mv); /* NaN in s: keeps mv */
    if (c < n) {
        const __mmask16 tail = (__mmask16)((1u << (n - c)) - 1u);
        mv = _mm512_mask_max_ps(mv, tail, _mm512_maskz_loadu_ps(tail, s + c), mv);
    }
    return _mm512_reduce_max_ps(mv);
#else
    float mx = -INFINITY;
    for (int64_t c = 0; c < n; c++) mx = s[c] > mx ? s[c] : mx;
    return mx;
#endif
}

/* One partition [start, end) of one sequence, all heads. reach >= end: the token before which its
 * K/V may be prefetched (the sequence's tokens [end, reach) are the calling thread's next).
 * scores: [heads][PARTITION] scratch; o: [heads][head_dim] out; m, l: [heads] out. HEAD_DIM is a
 * compile-time constant in the specialised copies (64, 128), which lets the compiler unroll the
 * row loops. */
#define DEFINE_PARTITION(NAME, T, LOAD, SCORES16, SUFFIX)                                          \
static inline __attribute__((always_inline)) void NAME(                                          \
        const float *restrict q, const T *restrict k_cache, const T *restrict v_cache,            \
        const int64_t *restrict table, int64_t start, int64_t end, int64_t reach, int64_t heads, \
        int64_t group, int64_t kv_heads, int64_t block_size, const int64_t head_dim, float scale,\
        float *restrict scores, float *restrict o, float *restrict m, float *restrict l, int fetch, \
        const float *restrict pre, int64_t pre_stride) {                                          \
    const int64_t token_stride = kv_heads * head_dim;                                             \
    int32_t kv_of[MAX_HEADS];  /* the kv head of each query head, without a division per token */ \
    for (int64_t h = 0; h < heads; h++) kv_of[h] = (int32_t)(h / group);                          \
    const int q_bf16 = bf16_exact(q, heads * head_dim);                                           \
    (void)q_bf16;                                                                                 \
    /* token by token, every head: a cached token's K row is read once for all of its query heads;  \
     * the same token of the next block's K and this block's V are prefetched on the way (a block's \
     * rows are contiguous, but blocks are not, and the hardware prefetcher stops at each one), and \
     * into L2 the K two and three blocks ahead and the V one and two ahead, as far as `reach` (the \
     * end of this partition, or of the calling thread's last partition of the sequence, which     \
     * follow it in token order). Why that far: inside a decode step the layer's weights have just \
     * flushed the caches, so every K/V line comes from memory; two ahead made attention 1-11%     \
     * faster there than one (docs/performance.md, eleventh round); three ahead and across the   \
     * thread's partitions made the one-row step 1.004x (two CCDs) and 1.009x (one) as fast at     \
     * context 300, 1.04-1.06x at 1500, and the attention of batches of 4-64 rows 1.06-1.09x       \
     * (docs/performance.md, "attention's K/V three blocks ahead"); four ahead on top read         \
     * 0.99-1.01x at 300 and 1.00-1.01x at 1500, so it stays at three. */                          \
    for (int64_t t = start; t < end;) {                                                           \
        const int64_t blk = t / block_size, first = t % block_size;                               \
        const int64_t run = block_size - first < end - t ? block_size - first : end - t;          \
        const T *kp = k_cache + (table[blk] * block_size + first) * token_stride;                 \
        const int64_t after = t + run; /* the next block's first token */                         \
        const int more = after < reach, two_more = after + block_size < reach;                    \
        const int three_more = after + 2 * block_size < reach;                                    \
        const T *ahead = more ? k_cache + table[blk + 1] * block_size * token_stride : kp;        \
        const T *v_ahead = more ? v_cache + table[blk + 1] * block_size * token_stride : NULL;    \
        const T *k_ahead2 = two_more ? k_cache + table[blk + 2] * block_size * token_stride : NULL; \
        const T *v_ahead2 = two_more ? v_cache + table[blk + 2] * block_size * token_stride : NULL; \
        const T *k_ahead3 = three_more ? k_cache + table[blk + 3] * block_size * token_stride : NULL; \
        const T *vp = v_cache + (table[blk] * block_size + first) * token_stride;                 \
        for (int64_t i = 0; fetch && i < run; i++) {                                              \
            for (int64_t c = 0; c < token_stride * (int64_t)sizeof(T); c += 64) {                 \
                __builtin_prefetch((const char *)(ahead + i * token_stride) + c);                 \
                __builtin_prefetch((const char *)(vp + i * token_stride) + c);                    \
                if (v_ahead) __builtin_prefetch((const char *)(v_ahead + i * token_stride) + c, 0, 2); \
                if (k_ahead2) __builtin_prefetch((const char *)(k_ahead2 + i * token_stride) + c, 0, 2); \
                if (k_ahead3) __builtin_prefetch((const char *)(k_ahead3 + i * token_stride) + c, 0, 2); \
                if (v_ahead2) __builtin_prefetch((const char *)(v_ahead2 + i * token_stride) + c, 0, 2); \
            }                                                                                     \
        }                                                                                         \
        if (pre != NULL) {                                                                        \
            /* the scores are the chunk's, computed before the partitions (chunk_scores) */       \
        } else if (VECTOR_OK(head_dim)) {                                                         \
            for (int64_t i = 0; i < run; i += 16)                                                 \
                VECTOR_SCORES(SCORES16, q, kp + i * token_stride, run - i < 16 ? run - i : 16,    \
                              token_stride, heads, kv_of, head_dim, scale, scores + t - start + i, \
                              q_bf16);                                                            \
        } else {                                                                                  \
            for (int64_t i = 0; i < run; i++, kp += token_stride) {                               \
                float *sp = scores + t - start + i;                                               \
                for (int64_t h = 0; h < heads; h++) {                                             \
                    const float *qv = q + h * head_dim;                                           \
                    const T *kv = kp + kv_of[h] * head_dim;                                       \
                    float acc = 0.f;                                                              \
                    _Pragma("omp simd reduction(+:acc)")                                          \
                    for (int64_t d = 0; d < head_dim; d++) acc += qv[d] * LOAD(kv[d]);            \
                    sp[h * PARTITION] = acc * scale;                                              \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
        t += run;                                                                                 \
    }                                                                                             \
    const int64_t n = end - start;                                                                \
    for (int64_t h = 0; pre != NULL && h < heads; h++)                                            \
        memcpy(scores + h * PARTITION, pre + h * pre_stride + start, sizeof(float) * (size_t)n);  \
    for (int64_t h = 0; h < heads; h++) {                                                         \
        float *s = scores + h * PARTITION;                                                        \
        const float mx = scores_max(s, n);                                                        \
        float total = 0.f;                                                                        \
        _Pragma("omp simd reduction(+:total)")                                                    \
        for (int64_t c = 0; c < n; c++) {                                                         \
            s[c] = fast_exp(s[c] - mx);                                                    \
            total += s[c];                                                                        \
        }                                                                                         \
        m[h] = mx;                                                                                \
        l[h] = total;                                                                             \
    }                                                                                             \
    /* the partition's V rows were prefetched during the score pass */                           \
    if (VECTOR_OK(head_dim)) {                                                                    \
        VECTOR_VALUES(SUFFIX, scores, v_cache, table, start, end, block_size, token_stride, heads,\
                      group, head_dim, o);                                                        \
        return;                                                                                   \
    }                                                                                             \
    for (int64_t h = 0; h < heads; h++) {                                                         \
        const float *sp = scores + h * PARTITION;                                                 \
        float acc[HEAD_DIM_MAX];                                                                  \
        for (int64_t d = 0; d < head_dim; d++) acc[d] = 0.f;                                      \
        for (int64_t t = start; t < end;) {                                                       \
            const int64_t blk = t / block_size, first = t % block_size;                           \
            const int64_t run = block_size - first < end - t ? block_size - first : end - t;      \
            const T *vp = v_cache + (table[blk] * block_size + first) * token_stride              \
                          + kv_of[h] * head_dim;                                                  \
            for (int64_t i = 0; i < run; i++, vp += token_stride) {                               \
                const float p = sp[t - start + i];                                                \
                _Pragma("omp simd")                                                               \
                for (int64_t d = 0; d < head_dim; d++) acc[d] += p * LOAD(vp[d]);                 \
            }                                                                                     \
            t += run;                                                                             \
        }                                                                                         \
        for (int64_t d = 0; d < head_dim; d++) o[h * head_dim + d] = acc[d];                      \
    }                                                                                             \
}

#define RUN_PARTITION(FN, HD)                                                                     \
    FN(qb, k_cache, v_cache, table, start, end, reach, heads, group, kv_heads, block_size, HD, scale, \
       scores, o, m, l, fetch, pre, pre ? plan->score_stride : 0)

int pda_plan(PdaPlan *plan, const int64_t *context_lens, int64_t batch, int64_t heads, int64_t kv_heads,
             int64_t head_dim, int threads) {
    memset(plan, 0, sizeof *plan);
    if (kv_heads <= 0 || heads % kv_heads != 0 || heads > MAX_HEADS || head_dim > HEAD_DIM_MAX || threads < 1)
        return 2;
    /* first_task[b]: index of sequence b's first partition; task_seq[task]: its sequence */
    plan->first_task = (int64_t *)malloc(sizeof(int64_t) * (batch + 1));
    if (plan->first_task == NULL) return 1;
    int64_t tasks = 0, total_len = 0;
    for (int64_t b = 0; b < batch; b++) {
        plan->first_task[b] = tasks;
        const int64_t len = context_lens[b];
        total_len += len > 0 ? len : 0;
        tasks += len > 0 ? (len + partition_len(len) - 1) / partition_len(len) : 0;
    }
    plan->first_task[batch] = tasks;
    plan->tasks = tasks;
    plan->total_len = total_len;
    plan->task_seq = (int64_t *)malloc(sizeof(int64_t) * (tasks + 1));
    plan->partials = (float *)malloc(sizeof(float) * (tasks * heads * (head_dim + 2) + 1)); /* o, m, l a task */
    plan->scores = (float *)malloc(sizeof(float) * threads * heads * PARTITION); /* a partition's, a thread */
    if (plan->task_seq == NULL || plan->partials == NULL || plan->scores == NULL) {
        pda_plan_free(plan);
        return 1;
    }
    for (int64_t b = 0; b < batch; b++)
        for (int64_t task = plan->first_task[b]; task < plan->first_task[b + 1]; task++) plan->task_seq[task] = b;
    return 0;
}

void pda_task_span(const PdaPlan *plan, const int64_t *context_lens, int64_t task, int64_t *seq, int64_t *start,
                   int64_t *end) {
    const int64_t b = plan->task_seq[task], len = context_lens[b], span = partition_len(len);
    *seq = b;
    *start = (task - plan->first_task[b]) * span;
    *end = *start + span < len ? *start + span : len;
}

void pda_share(int64_t total, int thread, int threads, int64_t *lo, int64_t *hi) {
    *lo = thread * total / threads;
    *hi = (thread + 1) * total / threads;
}

void pda_thread_tasks(const PdaPlan *plan, int thread, int threads, int64_t *lo, int64_t *hi) {
    pda_share(plan->tasks, thread, threads, lo, hi);
}

void pda_plan_free(PdaPlan *plan) {
    free(plan->first_task);
    free(plan->task_seq);
    free(plan->partials);
    free(plan->scores);
    free(plan->row_chunk);
    free(plan->chunk_first);
    free(plan->chunk_rows);
    free(plan->chunk_scores);
    memset(plan, 0, sizeof *plan);
}

int pda_plan_shared(const PdaPlan *plan) { return plan->total_len > SERIAL_TOKENS; }

/* Draft chunks: the rows of one sequence at consecutive positions that a verifying step runs (its
 * last token and its drafts), each attending over its own length of the same cache. Where the CPU
 * has AMX, a bfloat16 cache and q (a bfloat16 model's) and heads of 64, their scores are computed
 * before the partitions, by AMX tiles, for every row of the chunk at once: each 16 tokens' K rows
 * are one tile, straight from the cache, and the chunk's query heads (its rows times a kv head's
 * group, up to 32) the columns of the other, so K is read once for all of them; each thread takes
 * a share of the chunk's tokens, and then runs the chunk rows' partitions over that share, whose K
 * it has just read and whose V it prefetched; the partitions take their scores from there. Why:
 * the VDPBF16PS scores (scores16_dp_bf16) cost a row what they cost it alone, about half of a row's attention, and a verifying step's rows' attention was
 * most of what a step of seven rows cost more than a step of one (docs/performance.md, stop 56
 * and stop 57). Each score is one tile element, the sum of its own products only, so a row's
 * scores do not depend on the other rows of its chunk, on the batch or on the threads; they round
 * apart from a lone row's VDPBF16PS scores, as AMX's products already do a verifying step's. */
#define PDA_MAX_CHUNKS 64
#define CHUNK_K_AHEAD 2 /* runs: 1, 3 and 4 read the same within 1-2% (docs/performance.md, stop 57) */
static int chunk_scores_on = 1;

static int64_t chunk_passes; /* chunk_scores calls that computed some: what shows a test the path ran */

int paged_decode_attention_set_chunk_scores(int on) { return chunk_scores_on = on != 0; }

int64_t paged_decode_attention_chunk_passes(void) { return __atomic_load_n(&chunk_passes, __ATOMIC_RELAXED); }

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(PDA_VECTOR)
#define PDA_AMX 1
#include "amx.h"
#endif

int pda_plan_chunks(PdaPlan *plan, const int64_t *block_tables, int64_t table_width, const int64_t *context_lens,
                    int64_t batch, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size) {
#if defined(PDA_AMX)
    const int64_t group = kv_heads > 0 ? heads / kv_heads : 0, most = group > 0 ? 32 / group : 0;
    if (!chunk_scores_on || head_dim != 64 || block_size % 16 != 0 || batch < 2 || most < 2 || !amx_usable())
        return 0;
    int64_t n = 0, longest = 0;
    plan->row_chunk = (int64_t *)malloc(sizeof(int64_t) * (size_t)batch);
    plan->chunk_first = (int64_t *)malloc(sizeof(int64_t) * (size_t)batch);
    plan->chunk_rows = (int64_t *)malloc(sizeof(int64_t) * (size_t)batch);
    if (plan->row_chunk == NULL || plan->chunk_first == NULL || plan->chunk_rows == NULL) goto none;
    for (int64_t b = 0; b < batch;) {
        const int64_t len = context_lens[b], *table = block_tables + b * table_width;
        int64_t m = 1;
        /* the next row is the chunk's next position, and its table holds the same blocks */
        while (len > 0 && b + m < batch && m < most && context_lens[b + m] == len + m) {
            const int64_t *next = block_tables + (b + m) * table_width, blocks = (len + m - 1) / block_size + 1;
            if (blocks > table_width || memcmp(next, table, sizeof(int64_t) * (size_t)blocks) != 0) break;
            m++;
        }
        const int chunked = m >= 2 && n < PDA_MAX_CHUNKS;
        for (int64_t i = 0; i < m; i++) plan->row_chunk[b + i] = chunked ? n : -1;
        if (chunked) {
            plan->chunk_first[n] = b, plan->chunk_rows[n] = m, n++;
            longest = len + m - 1 > longest ? len + m - 1 : longest;
        }
        b += m;
    }
    if (n == 0) goto none;
    plan->score_stride = (longest + 15) / 16 * 16;
    plan->chunk_scores = (float *)aligned_alloc(64, sizeof(float) * (size_t)(batch * heads * plan->score_stride));
    if (plan->chunk_scores == NULL) goto none;
    plan->num_chunks = n;
    return 0;
none:
    free(plan->row_chunk), free(plan->chunk_first), free(plan->chunk_rows);
    plan->row_chunk = plan->chunk_first = plan->chunk_rows = NULL;
    return n > 0 ? 1 : 0;
#else
    (void)plan, (void)block_tables, (void)table_width, (void)context_lens, (void)batch, (void)heads, (void)kv_heads;
    (void)head_dim, (void)block_size;
    return 0;
#endif
}

#if defined(PDA_AMX)
/* The chunks' scores (those with use[c]) over this thread's share of each chunk's 16-token runs,
 * every kv head. Tiles: 0-1 the 16 tokens' K, a head's two halves of 32; 2-5 the chunk's q for this kv head,
 * [half][columns 0-15, 16-31], as pairs; 6-7 the scores of columns 0-15 and 16-31, [token][column]. */
static void chunk_scores(const PdaPlan *plan, const float *q, const uint16_t *k_cache, const uint16_t *v_cache,
                         const int64_t *block_tables, int64_t table_width, const int64_t *context_lens, int64_t heads,
                         int64_t kv_heads, int64_t block_size, float scale, const char *use) {
    const int64_t head_dim = 64, group = heads / kv_heads, token_stride = kv_heads * head_dim;
    const int thread = omp_get_thread_num(), threads = omp_get_num_threads();
    int configured = 0;
    uint16_t bq[2][2][16 * 32] __attribute__((aligned(64)));
    float cb[2][16 * 16] __attribute__((aligned(64)));
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t c = 0; c < plan->num_chunks; c++) {
        if (!use[c]) continue;
        const int64_t first = plan->chunk_first[c], cols = plan->chunk_rows[c] * group;
        const int64_t runs = (context_lens[first + plan->chunk_rows[c] - 1] + 15) / 16;
        /* this thread's share of the chunk's tokens, every kv head: the partitions over them are
         * its own too (DEFINE_TEAM), and find their K and V in this core's caches */
        int64_t lo, hi;
        pda_share(runs, thread, threads, &lo, &hi);
        if (lo >= hi) continue;
        if (!configured) {
            __atomic_add_fetch(&chunk_passes, 1, __ATOMIC_RELAXED);
            amx_configure(16, 64, 16); /* every tile 16 rows of 64 bytes, whatever amx.h names them for */
            configured = 1;
        }
        const int64_t *table = block_tables + first * table_width;
        for (int64_t g = 0; g < kv_heads; g++) {
            /* B [half][column tile]: row p the 16 columns' inputs 2p, 2p + 1 of that half, as bfloat16
             * pairs: each column's 32 inputs converted (q's values are bfloat16s: exactly), then the 16
             * columns' pairs transposed, one column a lane */
            for (int64_t half = 0; half < 2; half++)
                for (int64_t ct = 0; ct * 16 < cols; ct++) {
                    __m512i r[16];
                    for (int64_t j = 0; j < 16; j++) {
                        const int64_t col = ct * 16 + j;
                        if (col >= cols) {
                            r[j] = _mm512_setzero_si512();
                            continue;
                        }
                        const float *qh = q + ((first + col / group) * heads + g * group + col % group) * head_dim
                                          + half * 32;
                        r[j] = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(qh + 16), _mm512_loadu_ps(qh));
                    }
                    transpose16(r);
                    for (int p = 0; p < 16; p++) _mm512_store_si512(bq[half][ct] + p * 32, r[p]);
                }
            __asm__ volatile("" ::: "memory"); /* GCC's _tile_loadd names no memory: bq must be written */
            _tile_loadd(2, bq[0][0], 64);
            _tile_loadd(3, bq[1][0], 64);
            if (cols > 16) {
                _tile_loadd(4, bq[0][1], 64);
                _tile_loadd(5, bq[1][1], 64);
            }
            for (int64_t run = lo; run < hi; run++) {
                const int64_t t0 = run * 16; /* 16 tokens of one block: block_size is a multiple of 16 */
                const uint16_t *kp = k_cache + (table[t0 / block_size] * block_size + t0 % block_size) * token_stride
                                     + g * head_dim;
                /* from memory (a step's weights have flushed the caches): this kv head's K two runs ahead,
                 * and the V lines its partitions will read next, into L2 */
                if (run + CHUNK_K_AHEAD < hi) {
                    const int64_t ta = t0 + 16 * CHUNK_K_AHEAD;
                    const char *ka = (const char *)(k_cache + (table[ta / block_size] * block_size + ta % block_size)
                                                    * token_stride + g * head_dim);
                    for (int i = 0; i < 16; i++) {
                        __builtin_prefetch(ka + i * token_stride * 2);
                        __builtin_prefetch(ka + i * token_stride * 2 + 64);
                    }
                }
                const char *va = (const char *)(v_cache + (table[t0 / block_size] * block_size + t0 % block_size)
                                                * token_stride + g * head_dim);
                for (int i = 0; i < 16; i++) {
                    __builtin_prefetch(va + i * token_stride * 2, 0, 2);
                    __builtin_prefetch(va + i * token_stride * 2 + 64, 0, 2);
                }
                _tile_loadd(0, kp, token_stride * 2);
                _tile_loadd(1, kp + 32, token_stride * 2);
                _tile_zero(6);
                _tile_dpbf16ps(6, 0, 2);
                _tile_dpbf16ps(6, 1, 3);
                _tile_stored(6, cb[0], 64);
                if (cols > 16) {
                    _tile_zero(7);
                    _tile_dpbf16ps(7, 0, 4);
                    _tile_dpbf16ps(7, 1, 5);
                    _tile_stored(7, cb[1], 64);
                }
                __asm__ volatile("" ::: "memory"); /* and cb read after the tiles stored it */
                for (int64_t ct = 0; ct * 16 < cols; ct++) {
                    __m512i r[16];
                    for (int i = 0; i < 16; i++) r[i] = _mm512_load_si512(cb[ct] + 16 * i);
                    transpose16(r); /* r[j]: column j's 16 tokens */
                    for (int64_t j = 0; j < 16 && ct * 16 + j < cols; j++) {
                        const int64_t col = ct * 16 + j, row = first + col / group, h = g * group + col % group;
                        _mm512_storeu_ps(plan->chunk_scores + (row * heads + h) * plan->score_stride + t0,
                                         _mm512_mul_ps(_mm512_castsi512_ps(r[j]), vscale));
                    }
                }
            }
        }
    }
    if (configured) _tile_release();
}
#endif

/* A bfloat16 team's chunks before its partitions: use[c] for each (its q all bfloat16s: a float32
 * q's values would round), the scores, and the team meets. Every thread must call it. */
static void chunk_prepass(const PdaPlan *plan, const float *q, const uint16_t *k_cache, const uint16_t *v_cache,
                          const int64_t *block_tables,
                          int64_t table_width, const int64_t *context_lens, int64_t heads, int64_t kv_heads,
                          int64_t head_dim, int64_t block_size, float scale, char *use) {
    if (plan->num_chunks == 0) return;
#if defined(PDA_AMX)
    for (int64_t c = 0; c < plan->num_chunks; c++)
        use[c] = (char)bf16_exact(q + plan->chunk_first[c] * heads * head_dim, plan->chunk_rows[c] * heads * head_dim);
    chunk_scores(plan, q, k_cache, v_cache, block_tables, table_width, context_lens, heads, kv_heads, block_size, scale,
                 use);
    team_barrier(plan->barrier); /* every chunk's scores before any partition */
#else
    (void)q, (void)k_cache, (void)v_cache, (void)block_tables, (void)table_width, (void)context_lens, (void)heads;
    (void)kv_heads, (void)head_dim, (void)block_size, (void)scale, (void)use;
#endif
}

/* out's row bh (a sequence's head) from its partitions' o, m and l: their log-sum-exp rescaling */
static inline __attribute__((always_inline)) void combine(const PdaPlan *plan, int64_t bh, int64_t heads,
                                                          const int64_t head_dim, float *out) {
    const int64_t b = bh / heads, h = bh % heads;
    const int64_t first = plan->first_task[b], parts = plan->first_task[b + 1] - first;
    const int64_t per_task = heads * (head_dim + 2);
    const float *partials = plan->partials;
    float *ob = out + bh * head_dim;
    float acc[HEAD_DIM_MAX];
    for (int64_t d = 0; d < head_dim; d++) acc[d] = 0.f;
    float mx = -INFINITY, total = 0.f;
    for (int64_t p = 0; p < parts; p++) {
        const float mp = partials[(first + p) * per_task + heads * head_dim + h];
        mx = mp > mx ? mp : mx;
    }
    for (int64_t p = 0; p < parts; p++) {
        const float *part = partials + (first + p) * per_task;
        const float w = fast_exp(part[heads * head_dim + h] - mx);
        total += w * part[heads * head_dim + heads + h];
        const float *op = part + h * head_dim;
        _Pragma("omp simd")
        for (int64_t d = 0; d < head_dim; d++) acc[d] += w * op[d];
    }
    const float inv = parts > 0 ? 1.f / total : 0.f;
    for (int64_t d = 0; d < head_dim; d++) ob[d] = acc[d] * inv;
}

/* Whether a row that follows another row of its own sequence prefetches its K/V (0: it does not,
 * the default). Such rows are a draft chunk's: one sequence at consecutive positions, whose K/V
 * the row before has just read. Why not: the prefetch loop issues six prefetches a cache line,
 * ~36 instructions a token at SmolLM2's sizes, which bought nothing for lines already fetched and
 * were a fifth of the work of a row whose attention runs on cached lines. Without them a step of
 * seven draft rows ran 0.99-1.04x as fast at context 300 and 1.05-1.07x at 600 in bfloat16, and
 * 1.09-1.11x and 1.12-1.15x in int4 (a float32 cache), on an Intel Xeon VM, the two alternating in
 * one engine, the same outputs bit for bit (scripts/bench_draft_rows_ab.py; docs/performance.md,
 * stop 55). A row is taken to follow the row before it when both
 * hold the same block at the second-last of its own blocks (a prefix shared with another sequence
 * that reaches that far also counts; then only the last block goes unfetched). */
static int follower_fetch = 0;

int paged_decode_attention_set_follower_fetch(int on) { return follower_fetch = on != 0; }

/* tasks [lo, hi) of DEFINE_TEAM's body */
#define PDA_TASKS(PART)                                                                           \
    for (int64_t t = lo; t < hi; t++) {                                                           \
        int64_t b, start, end;                                                                    \
        pda_task_span(plan, context_lens, t, &b, &start, &end);                                   \
        const int64_t chunk = plan->num_chunks ? plan->row_chunk[b] : -1;                         \
        if ((chunk >= 0 && use[chunk]) != chunk_pass) continue; /* a chunk's row: its own loop */ \
        /* the prefetches' reach: the end of the last of tasks [t, hi) that is b's (a sequence's   \
         * tasks are its partitions in token order) */                                            \
        const int64_t last = (hi < plan->first_task[b + 1] ? hi : plan->first_task[b + 1]) - 1;   \
        int64_t reach = end, last_b, last_start;                                                  \
        if (last > t) pda_task_span(plan, context_lens, last, &last_b, &last_start, &reach);      \
        const float *qb = q + b * heads * head_dim;                                               \
        const int64_t *table = block_tables + b * table_width;                                    \
        const int64_t both = context_lens[b] > block_size ? (context_lens[b] - 1) / block_size - 1 : 0; \
        const int fetch = follower_fetch || b == 0 || context_lens[b - 1] <= both * block_size ||     \
                          (table - table_width)[both] != table[both]; /* follower_fetch, above */    \
        float *o = partials + t * per_task, *m = o + heads * head_dim, *l = m + heads;            \
        const float *pre = chunk_pass ? plan->chunk_scores + b * heads * plan->score_stride : NULL; \
        if (head_dim == 64) RUN_PARTITION(PART, 64);                                              \
        else if (head_dim == 128) RUN_PARTITION(PART, 128);                                       \
        else RUN_PARTITION(PART, head_dim);                                                       \
    }

/* The kernel's work, shared out over the calling team: a bfloat16 step's draft chunks' scores
 * (chunk_prepass) and a barrier; the partitions (omp for, or one thread when the context is too
 * short to share; a chunk's rows each thread over its share of the tokens) and a barrier; then the
 * combine, shared out (omp for) with a barrier after it, or with own_out 1 done whole by every
 * thread into its own out, or with own_out 2 each thread's share, with none. */
#define DEFINE_TEAM(NAME, T, PART, PRE)                                                           \
void NAME(const PdaPlan *plan, const float *q, const T *k_cache, const T *v_cache,                \
          const int64_t *block_tables, int64_t table_width, const int64_t *context_lens,          \
          float *out, int64_t batch, int64_t heads, int64_t kv_heads, int64_t head_dim,           \
          int64_t block_size, float scale, int own_out) {                                         \
    /* use[c]: chunk c's scores were computed ahead (chunk_prepass); the team meets after it */   \
    char use[PDA_MAX_CHUNKS] = {0};                                                               \
    PRE(plan, q, k_cache, v_cache, block_tables, table_width, context_lens, heads, kv_heads,      \
        head_dim, block_size, scale, use);                                                        \
    const int64_t group = heads / kv_heads, tasks = plan->tasks;                                  \
    const int64_t per_task = heads * (head_dim + 2);      /* o, m, l of one partition */           \
    float *partials = plan->partials;                                                             \
    float *scores = plan->scores + (int64_t)omp_get_thread_num() * heads * PARTITION;             \
    const int shared = pda_plan_shared(plan) && omp_get_num_threads() > 1;                         \
    /* static_tasks: this thread's own run (pda_thread_tasks); else one task at a time, to whichever \
     * thread is free (short contexts: one thread takes every task, the others none) */           \
    const int fixed = shared && plan->static_tasks;                                               \
    int64_t lo = 0, hi = 0;                                                                       \
    int chunk_pass = 0; /* PDA_TASKS runs the tasks of rows outside chunks, then (1) of chunks' */ \
    if (fixed) pda_thread_tasks(plan, omp_get_thread_num(), omp_get_num_threads(), &lo, &hi);     \
    _Pragma("omp for schedule(dynamic, 1) nowait")                                                \
    for (int64_t task = 0; task < (fixed ? 0 : shared ? tasks : 1); task++) {                     \
        lo = shared ? task : 0, hi = shared ? task + 1 : tasks;                                   \
        PDA_TASKS(PART);                                                                          \
    }                                                                                             \
    if (fixed) PDA_TASKS(PART);                                                                   \
    /* a draft chunk's rows: each thread the partitions over the tokens whose scores it computed  \
     * (chunk_scores: the runs in the same share), whose K and V it has just read */              \
    chunk_pass = 1;                                                                               \
    const int chunk_threads = shared ? omp_get_num_threads() : 1;  /* short: thread 0 alone */    \
    const int chunk_me = shared ? omp_get_thread_num() : 0;                                       \
    for (int64_t b = 0; plan->num_chunks && (shared || omp_get_thread_num() == 0) && b < batch; b++) { \
        if (plan->row_chunk[b] < 0 || !use[plan->row_chunk[b]]) continue;                         \
        const int64_t f = plan->first_task[b];                                                    \
        pda_share(plan->first_task[b + 1] - f, chunk_me, chunk_threads, &lo, &hi);                \
        lo += f, hi += f;                                                                         \
        PDA_TASKS(PART);                                                                          \
    }                                                                                             \
    team_barrier(plan->barrier); /* every partition done before any combine */                   \
    /* combine each (sequence, head) over its partitions: shared out, or all of it by every thread */ \
    if (own_out == 1) {                                                                           \
        for (int64_t bh = 0; bh < batch * heads; bh++)                                            \
            combine(plan, bh, heads, head_dim, out);                                              \
    } else if (own_out == 2) { /* this thread's share (pda_share), no barrier */                  \
        int64_t lo2, hi2;                                                                         \
        pda_share(batch * heads, omp_get_thread_num(), omp_get_num_threads(), &lo2, &hi2);        \
        for (int64_t bh = lo2; bh < hi2; bh++)                                                    \
            combine(plan, bh, heads, head_dim, out);                                              \
    } else {                                                                                      \
        _Pragma("omp for schedule(static)")                                                       \
        for (int64_t bh = 0; bh < batch * heads; bh++)                                            \
            combine(plan, bh, heads, head_dim, out);                                              \
    }                                                                                             \
}

/* The entry point: a plan, then a parallel region of its own (the calling thread alone for a short
 * context), then the plan freed. */
#define DEFINE_KERNEL(NAME, TEAM, T, CHUNKS)                                                      \
int NAME(const float *q, const T *k_cache, const T *v_cache, const int64_t *block_tables,         \
         int64_t table_width, const int64_t *context_lens, float *out, int64_t batch,             \
         int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size, float scale) {    \
    PdaPlan plan;                                                                                 \
    const int rc = pda_plan(&plan, context_lens, batch, heads, kv_heads, head_dim,                \
                            omp_get_max_threads());                                               \
    if (rc != 0) return rc;                                                                       \
    if (CHUNKS) pda_plan_chunks(&plan, block_tables, table_width, context_lens, batch, heads,     \
                                kv_heads, head_dim, block_size);                                  \
    _Pragma("omp parallel if(pda_plan_shared(&plan))")                                             \
    TEAM(&plan, q, k_cache, v_cache, block_tables, table_width, context_lens, out, batch, heads,  \
         kv_heads, head_dim, block_size, scale, 0);                                               \
    pda_plan_free(&plan);                                                                         \
    return 0;                                                                                     \
}

#define LOAD_F32(x) (x)
#define LOAD_BF16(x) bf16_to_f32(x)
#define LOAD_F16(x) f16_to_f32(x)
DEFINE_PARTITION(partition_f32, float, LOAD_F32, scores16_f32, f32)
DEFINE_PARTITION(partition_bf16, uint16_t, LOAD_BF16, scores16_bf16, bf16)
DEFINE_PARTITION(partition_f16, uint16_t, LOAD_F16, scores16_f16, f16)
#define NO_PREPASS(...) ((void)0)
DEFINE_TEAM(paged_decode_attention_f32_team, float, partition_f32, NO_PREPASS)
DEFINE_TEAM(paged_decode_attention_bf16_team, uint16_t, partition_bf16, chunk_prepass)
DEFINE_TEAM(paged_decode_attention_f16_team, uint16_t, partition_f16, NO_PREPASS)
DEFINE_KERNEL(paged_decode_attention_f32, paged_decode_attention_f32_team, float, 0)
DEFINE_KERNEL(paged_decode_attention_bf16, paged_decode_attention_bf16_team, uint16_t, 1)
DEFINE_KERNEL(paged_decode_attention_bf16_exact, paged_decode_attention_bf16_team, uint16_t, 0)
DEFINE_KERNEL(paged_decode_attention_f16, paged_decode_attention_f16_team, uint16_t, 0)
