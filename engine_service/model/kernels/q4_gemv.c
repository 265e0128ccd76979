/* int4 products for decode: the packed weights are read in place, four bits a weight, and
 * multiplied in integers, as llama.cpp multiplies its Q4_1 weights with Q8 activations.
 *
 * Why not torch's _weight_int4pack_mm_for_cpu: it widens every code to float and spends most of
 * its time on that arithmetic (compute-bound: one row through SmolLM2's 121 projections streams
 * its weights at a quarter of the machine's read bandwidth; docs/performance.md). Here a 64-byte
 * load holds 16 rows x 8 inputs; a mask and a shift split it into two VPDPBUSD operands (16 rows x
 * 4 inputs each, unsigned codes times signed int8 activations, summed into int32 per row), so 128
 * multiply-adds cost five instructions.
 *
 * Numerics: each activation row is quantized to int8 per 32 inputs (scale max|x| / 127), xhat its
 * rounded values. Per row and group: sum_k w xhat = scale * sum_k code * xhat + min * sum_k xhat,
 * where the first sum is the integer dot product times the activation scale, the second the
 * activation scale times the integer sum of its codes (quantize_row says why). (scale, min) are
 * float16, as GGUF's Q4_1 blocks keep them: a Q4_0, Q4_1 block is this layout's group exactly.
 * The error against the dequantized weights' product is therefore that of the activation rounding,
 * at most sum_k |w_k| * xscale / 2 per output (tests/unit/test_q4_gemv.py holds it to that bound).
 *
 * A task is up to four blocks of 16 rows (64 rows: four independent accumulator chains hide
 * VPDPBUSD's latency), the activation rows up to four at a time: each load is split into its two
 * operands once for the rows of that pass, and a block's codes are read from memory once and from
 * L1 for the other passes. Tasks run on torch's OpenMP pool (native.py links libgomp). */
#include "q4_gemv.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "f16.h"
#include "one_row_prefetch.h"
#include "kv_ahead.h"
#include "team_barrier.h"

#define NOCONTRACT __attribute__((optimize("fp-contract=off")))
#define TASK_BLOCKS 4

static inline int sizes_ok(int64_t rows, int64_t n_out, int64_t n_pad, int64_t k, int64_t group) {
    return rows > 0 && rows <= Q4_MAX_ROWS && n_out > 0 && n_pad % Q4_BLOCK_N == 0 && n_pad >= n_out &&
           n_pad - n_out < Q4_BLOCK_N && k > 0 && group > 0 && group % Q4_XBLOCK == 0 && k % group == 0;
}

/* dequantization: portable C (the dense path runs it for prefill chunks) */
#define DEFINE_DEQ(NAME, OUT_T, STORE)                                                                  \
    NOCONTRACT void NAME(const uint8_t *codes, const uint16_t *sz, int64_t n_pad, int64_t k, int64_t group, \
                         OUT_T *out) {                                                                  \
        const int64_t blocks = n_pad / Q4_BLOCK_N, groups = k / group;                                  \
        _Pragma("omp parallel for schedule(static)")                                                    \
        for (int64_t b = 0; b < blocks; b++) {                                                          \
            const uint8_t *blk = codes + b * (k / Q4_STEP_K) * 64;                                      \
            for (int r = 0; r < Q4_BLOCK_N; r++) {                                                      \
                OUT_T *dst = out + (b * Q4_BLOCK_N + r) * k;                                            \
                for (int64_t g = 0; g < groups; g++) {                                                  \
                    const uint16_t *gsz = sz + (b * groups + g) * 2 * Q4_BLOCK_N;                       \
                    const float scale = f16_to_f32(gsz[r]), min = f16_to_f32(gsz[Q4_BLOCK_N + r]);      \
                    for (int64_t c = g * group; c < (g + 1) * group; c++) {                             \
                        const int64_t s = c / Q4_STEP_K, j = c % Q4_STEP_K;                             \
                        const uint8_t byte = blk[s * 64 + r * 4 + (j & 3)];                             \
                        const float code = (float)(j < 4 ? byte & 15 : byte >> 4);                      \
                        dst[c] = STORE(code * scale + min);                                             \
                    }                                                                                   \
                }                                                                                       \
            }                                                                                           \
        }                                                                                               \
    }

#define AS_IS(x) (x)
DEFINE_DEQ(dequantize_q4_f32, float, AS_IS)
DEFINE_DEQ(dequantize_q4_bf16, uint16_t, f32_to_bf16)

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)

#include <immintrin.h>

int q4_gemv_supported(void) { return 1; }

/* One activation row, quantized: int8 codes, a scale per 32 inputs, and per group the sum of the
 * rounded inputs (sum over its 32-blocks of scale * sum of codes). */
typedef struct {
    int8_t *q;
    float *scale;
    float *sum;
} QRow;

/* Vectorised: the scalar loops called libm's fmaxf per input (GCC keeps its NaN rules out of
 * line) and summed each group in one dependent chain, ~0.1 ms a row per decode step of SmolLM2.
 * The codes are the scalar loop's (the same product, rounded to nearest even by VCVTPS2DQ under
 * the default rounding mode, as nearbyintf).
 *
 * Why the group sum is of the rounded inputs, not of x: the product is then sum_k w_k * xhat_k
 * for the weights w = code * scale + min themselves, as llama.cpp's Q4_1 x Q8_1 product is (Q8_1
 * keeps d * sum of codes for the min term). With x's own sum the rounding error multiplied code
 * * scale, which runs over [0, 15 scale] where w is centred on zero: about four times the
 * error's variance, and +1.4% perplexity on SmolLM2's Q4_1 file where llama.cpp loses 0.2%
 * (sluice bench quality --modes float32,gguf --anchor). */
static void quantize_row(const float *x, int64_t k, int64_t group, QRow out) {
    const int64_t sub = group / Q4_XBLOCK;
    const __m512 sign = _mm512_set1_ps(-0.0f);
    for (int64_t g = 0; g < k / group; g++) {
        float gsum = 0.0f;
        for (int64_t sb = 0; sb < sub; sb++) {
            const int64_t b = g * sub + sb;
            const __m512 x0 = _mm512_loadu_ps(x + b * Q4_XBLOCK), x1 = _mm512_loadu_ps(x + b * Q4_XBLOCK + 16);
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, x0), _mm512_andnot_ps(sign, x1)));
            const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            const float scale = amax / 127.0f;
            out.scale[b] = scale;
            const __m512 vinv = _mm512_set1_ps(inv);
            const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, vinv)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, vinv));
            _mm_storeu_si128((__m128i *)(out.q + b * Q4_XBLOCK), _mm512_cvtepi32_epi8(q0));
            _mm_storeu_si128((__m128i *)(out.q + b * Q4_XBLOCK + 16), _mm512_cvtepi32_epi8(q1));
            gsum += scale * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
        }
        out.sum[g] = gsum;
    }
}

static inline __m512 load_f16x16(const uint16_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}

/* Whether the one-row loop prefetches its codes (several rows always do): the CPU's default
 * (one_row_prefetch.h: not on AMD, where SmolLM2's one-row int4 products ran 1.10-1.21x faster
 * without them, the builds before and after alternating in one C harness; scripts/bench_q4.c
 * switches them in one build), unless q4_gemv_set_prefetch overrides it. */
ONE_ROW_PREFETCH_SETTING(q4_gemv_set_prefetch)

int q4_gemv_one_row_streams(void) { return !stream_prefetch(); }

/* the sums of up to TASK_BLOCKS blocks (nb) for one quantized row, into out[nb * 16]: the
 * arithmetic of task_sums below for one row, kept as its own loop because task_sums instantiated
 * for one row ran slower, one stream's case (5-8% in one run, 1-6% in another, the two alternating
 * in one C harness; hoisting the row sums out of task_sums' block loop did not close it). Inlined into
 * a call with nb = TASK_BLOCKS, a constant, so the loops over blocks unroll and the accumulators
 * live in registers (with nb only known at run time they lived on the stack, and every VPDPBUSD
 * waited on a store and a reload: 1.3x slower in cache) */
static inline __attribute__((always_inline)) void task_sums_row(const uint8_t *codes, const uint16_t *sz, int64_t b0, int nb, int64_t k, int64_t group,
                      QRow x, const int stream, float *out, KvAhead *ahead) {
    const int64_t steps = k / Q4_STEP_K, groups = k / group, sub = group / Q4_XBLOCK;
    const __m512i low = _mm512_set1_epi8(15);
    const uint8_t *blk[TASK_BLOCKS];
    __m512 acc[TASK_BLOCKS];
    for (int i = 0; i < nb; i++) {
        blk[i] = codes + (b0 + i) * steps * 64;
        acc[i] = _mm512_setzero_ps();
    }
    for (int64_t g = 0; g < groups; g++) {
        __m512 gacc[TASK_BLOCKS];
        for (int i = 0; i < nb; i++) gacc[i] = _mm512_setzero_ps();
        kv_ahead_step(ahead); /* the next attention's K/V, a few lines a group (kv_ahead.h) */
        for (int64_t sb = 0; sb < sub; sb++) {
            const int64_t xb = g * sub + sb;
            const int8_t *xq = x.q + xb * Q4_XBLOCK;
            __m512i isum[TASK_BLOCKS];
            for (int i = 0; i < nb; i++) isum[i] = _mm512_setzero_si512();
            for (int t = 0; t < Q4_XBLOCK / Q4_STEP_K; t++) {
                int32_t lo4, hi4;
                memcpy(&lo4, xq + t * Q4_STEP_K, 4);
                memcpy(&hi4, xq + t * Q4_STEP_K + 4, 4);
                const __m512i xa = _mm512_set1_epi32(lo4), xh = _mm512_set1_epi32(hi4);
                const int64_t off = (xb * (Q4_XBLOCK / Q4_STEP_K) + t) * 64;
                for (int i = 0; i < nb; i++) {
                    if (stream) _mm_prefetch((const char *)(blk[i] + off + 1024), _MM_HINT_T0);
                    const __m512i w = _mm512_loadu_si512(blk[i] + off);
                    isum[i] = _mm512_dpbusd_epi32(isum[i], _mm512_and_si512(w, low), xa);
                    isum[i] = _mm512_dpbusd_epi32(isum[i], _mm512_and_si512(_mm512_srli_epi16(w, 4), low), xh);
                }
            }
            const __m512 xs = _mm512_set1_ps(x.scale[xb]);
            for (int i = 0; i < nb; i++) gacc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[i]), xs, gacc[i]);
        }
        const __m512 xsum = _mm512_set1_ps(x.sum[g]);
        for (int i = 0; i < nb; i++) {
            const uint16_t *gsz = sz + ((b0 + i) * groups + g) * 2 * Q4_BLOCK_N;
            const __m512 scale = load_f16x16(gsz), min = load_f16x16(gsz + Q4_BLOCK_N);
            acc[i] = _mm512_fmadd_ps(scale, gacc[i], acc[i]);
            acc[i] = _mm512_fmadd_ps(min, xsum, acc[i]);
        }
    }
    for (int i = 0; i < nb; i++) _mm512_storeu_ps(out + i * Q4_BLOCK_N, acc[i]);
}

/* the sums of up to TASK_BLOCKS blocks (nb) for up to TASK_ROWS quantized rows (nrows), row r's
 * into out[r * TASK_BLOCKS * 16 ...]. Each 64-byte load is split into its two VPDPBUSD operands
 * once and multiplied with every row: a row after the first costs its two dot products per load,
 * not the load, the mask and the shifts again (a verifying step's k + 1 rows, a small batch).
 * Every row's arithmetic is the same whatever nrows (exact integer sums, then the same float
 * operations in the same order), so a row's output does not depend on the rows beside it.
 * Inlined into calls with nb and nrows constants, so the loops unroll and the integer
 * accumulators live in registers (with nb only known at run time they lived on the stack, and
 * every VPDPBUSD waited on a store and a reload: 1.3x slower in cache). */
#define TASK_ROWS 4
static inline __attribute__((always_inline)) void task_sums(const uint8_t *codes, const uint16_t *sz, int64_t b0, int nb,
                                                            int64_t k, int64_t group, const QRow *xs_in, int nrows,
                                                            float *out) {
    QRow x[TASK_ROWS];
    for (int r = 0; r < nrows; r++) x[r] = xs_in[r];
    const int64_t steps = k / Q4_STEP_K, groups = k / group, sub = group / Q4_XBLOCK;
    const __m512i low = _mm512_set1_epi8(15);
    const uint8_t *blk[TASK_BLOCKS];
    __m512 acc[TASK_ROWS][TASK_BLOCKS];
    for (int i = 0; i < nb; i++) {
        blk[i] = codes + (b0 + i) * steps * 64;
        for (int r = 0; r < nrows; r++) acc[r][i] = _mm512_setzero_ps();
    }
    for (int64_t g = 0; g < groups; g++) {
        __m512 gacc[TASK_ROWS][TASK_BLOCKS];
        for (int r = 0; r < nrows; r++)
            for (int i = 0; i < nb; i++) gacc[r][i] = _mm512_setzero_ps();
        for (int64_t sb = 0; sb < sub; sb++) {
            const int64_t xb = g * sub + sb;
            __m512i isum[TASK_ROWS][TASK_BLOCKS];
            for (int r = 0; r < nrows; r++)
                for (int i = 0; i < nb; i++) isum[r][i] = _mm512_setzero_si512();
            for (int t = 0; t < Q4_XBLOCK / Q4_STEP_K; t++) {
                __m512i xa[TASK_ROWS], xh[TASK_ROWS];
                for (int r = 0; r < nrows; r++) {
                    int32_t lo4, hi4;
                    memcpy(&lo4, x[r].q + xb * Q4_XBLOCK + t * Q4_STEP_K, 4);
                    memcpy(&hi4, x[r].q + xb * Q4_XBLOCK + t * Q4_STEP_K + 4, 4);
                    xa[r] = _mm512_set1_epi32(lo4), xh[r] = _mm512_set1_epi32(hi4);
                }
                const int64_t off = (xb * (Q4_XBLOCK / Q4_STEP_K) + t) * 64;
                for (int i = 0; i < nb; i++) {
                    _mm_prefetch((const char *)(blk[i] + off + 1024), _MM_HINT_T0);
                    const __m512i w = _mm512_loadu_si512(blk[i] + off);
                    const __m512i wl = _mm512_and_si512(w, low), wh = _mm512_and_si512(_mm512_srli_epi16(w, 4), low);
                    for (int r = 0; r < nrows; r++) {
                        isum[r][i] = _mm512_dpbusd_epi32(isum[r][i], wl, xa[r]);
                        isum[r][i] = _mm512_dpbusd_epi32(isum[r][i], wh, xh[r]);
                    }
                }
            }
            for (int r = 0; r < nrows; r++) {
                const __m512 xs = _mm512_set1_ps(x[r].scale[xb]);
                for (int i = 0; i < nb; i++) gacc[r][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r][i]), xs, gacc[r][i]);
            }
        }
        for (int i = 0; i < nb; i++) {
            const uint16_t *gsz = sz + ((b0 + i) * groups + g) * 2 * Q4_BLOCK_N;
            const __m512 scale = load_f16x16(gsz), zterm = load_f16x16(gsz + Q4_BLOCK_N);
            for (int r = 0; r < nrows; r++) {
                const __m512 xsum = _mm512_set1_ps(x[r].sum[g]);
                acc[r][i] = _mm512_fmadd_ps(scale, gacc[r][i], acc[r][i]);
                acc[r][i] = _mm512_fmadd_ps(zterm, xsum, acc[r][i]);
            }
        }
    }
    for (int r = 0; r < nrows; r++)
        for (int i = 0; i < nb; i++) _mm512_storeu_ps(out + (r * TASK_BLOCKS + i) * Q4_BLOCK_N, acc[r][i]);
}

/* task_sums with nb and nrows as constants in each call (see above), and one row's `stream` */
static void task_rows(const uint8_t *codes, const uint16_t *sz, int64_t b0, int nb, int64_t k, int64_t group,
                      const QRow *x, int nrows, int stream, float *out, KvAhead *ahead) {
    if (nb == TASK_BLOCKS) {
        if (nrows == 4) task_sums(codes, sz, b0, TASK_BLOCKS, k, group, x, 4, out);
        else if (nrows == 3) task_sums(codes, sz, b0, TASK_BLOCKS, k, group, x, 3, out);
        else if (nrows == 2) task_sums(codes, sz, b0, TASK_BLOCKS, k, group, x, 2, out);
        else if (stream) task_sums_row(codes, sz, b0, TASK_BLOCKS, k, group, x[0], 1, out, NULL);
        else task_sums_row(codes, sz, b0, TASK_BLOCKS, k, group, x[0], 0, out, ahead);
    } else if (nrows == 1) {
        task_sums_row(codes, sz, b0, nb, k, group, x[0], stream, out, stream ? NULL : ahead);
    } else {
        task_sums(codes, sz, b0, nb, k, group, x, nrows, out);
    }
}


#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
/* Several rows through AMX's tile multiply (TDPBSUD: signed int8 activations times unsigned int8
 * codes, summed into int32): one instruction takes up to 16 rows x 32 inputs x 16 outputs. Each
 * 64-byte load of codes is split into its two operands as above and stored as two rows of the B
 * tile (VPDPBUSD's operand layout is AMX's B layout: each 32-bit lane one output's four
 * consecutive inputs), so a pass of up to AMX_ROWS rows costs the code unpacking of one row plus,
 * per row, the float scaling of each 32 inputs' integer sums, instead of two VPDPBUSD per row and
 * load. The integer sums are exact, and the float operations on them are task_sums' in the same
 * order, so a row's output is bitwise the VPDPBUSD path's and independent of the rows beside it. */
#include "amx.h"
#define Q4_AMX 1
#define AMX_ROWS 16

/* tiles 0-3: the blocks' int32 sums (nrows x 16); 4: the activations (nrows x 32 bytes); 5-7:
 * blocks' codes (8 x 64 bytes) */
#define Q4_AMX_CONFIGURE(nrows) amx_configure((nrows), Q4_XBLOCK, Q4_XBLOCK / 4)

/* block i's codes for activation block xb, unpacked into B buffer bb[i] */
#define AMX_UNPACK(bb, i, xb)                                                                            \
    for (int t = 0; t < Q4_XBLOCK / Q4_STEP_K; t++) {                                                    \
        const __m512i w = _mm512_loadu_si512(blk[i] + ((xb) * (Q4_XBLOCK / Q4_STEP_K) + t) * 64);        \
        _mm512_store_si512(bb[i] + 128 * t, _mm512_and_si512(w, low));                                   \
        _mm512_store_si512(bb[i] + 128 * t + 64, _mm512_and_si512(_mm512_srli_epi16(w, 4), low));        \
    }
/* tile C = A x B buffer bb[i] (through B tile T), stored to is[i] */
#define AMX_MULTIPLY(C, T, bb, is, i)                                                                    \
    do {                                                                                                 \
        _tile_zero(C);                                                                                   \
        _tile_loadd(T, bb[i], 64);                                                                       \
        _tile_dpbsud(C, 4, T);                                                                           \
        _tile_stored(C, is[i], 64);                                                                      \
    } while (0)

/* task_sums for nrows <= AMX_ROWS rows whose int8 codes lie k bytes apart (run's buffer: row r's
 * at x[0].q + r * k), the tiles configured for nrows (amx_configure). Software-pipelined: the tiles of 32 inputs are computed
 * while the float work of the 32 before them runs, so neither waits for the other's memory round
 * trip (a tile load waits for the stores it reads to reach the cache, and so do the vector loads
 * of a stored tile). */
static void task_sums_amx(const uint8_t *codes, const uint16_t *sz, int64_t b0, int nb, int64_t k, int64_t group,
                          const QRow *x, int nrows, float *out) {
    const int64_t steps = k / Q4_STEP_K, groups = k / group, sub = group / Q4_XBLOCK, xblocks = k / Q4_XBLOCK;
    const __m512i low = _mm512_set1_epi8(15);
    const uint8_t *blk[TASK_BLOCKS];
    for (int i = 0; i < nb; i++) blk[i] = codes + (b0 + i) * steps * 64;
    _Alignas(64) uint8_t bbuf[2][TASK_BLOCKS][Q4_XBLOCK / 4 * 64];
    _Alignas(64) int32_t isums[2][TASK_BLOCKS][AMX_ROWS * Q4_BLOCK_N];
    _Alignas(64) float gacc[AMX_ROWS * TASK_BLOCKS * Q4_BLOCK_N];
    for (int64_t step = 0; step <= xblocks; step++) {
        if (step < xblocks) {  /* the tiles of block `step` */
            uint8_t (*bb)[Q4_XBLOCK / 4 * 64] = bbuf[step & 1];
            int32_t (*is)[AMX_ROWS * Q4_BLOCK_N] = isums[step & 1];
            for (int i = 0; i < nb; i++) AMX_UNPACK(bb, i, step)
            _tile_loadd(4, x[0].q + step * Q4_XBLOCK, k);
            AMX_MULTIPLY(0, 5, bb, is, 0);
            if (nb > 1) AMX_MULTIPLY(1, 6, bb, is, 1);
            if (nb > 2) AMX_MULTIPLY(2, 7, bb, is, 2);
            if (nb > 3) AMX_MULTIPLY(3, 5, bb, is, 3);
        }
        if (step == 0) continue;
        /* the float work of block xb = step - 1: task_sums' operations in its order, gacc += sums
         * * xs per 32 inputs; at the group's end acc += scale * gacc, then acc += min * sum(x) */
        const int64_t xb = step - 1, g = xb / sub, sb = xb % sub;
        int32_t (*is)[AMX_ROWS * Q4_BLOCK_N] = isums[xb & 1];
        const int last = sb == sub - 1;
        __m512 scale[TASK_BLOCKS], zterm[TASK_BLOCKS];
        if (last)
            for (int i = 0; i < nb; i++) {
                const uint16_t *gsz = sz + ((b0 + i) * groups + g) * 2 * Q4_BLOCK_N;
                scale[i] = load_f16x16(gsz);
                zterm[i] = load_f16x16(gsz + Q4_BLOCK_N);
            }
        for (int r = 0; r < nrows; r++) {
            const __m512 xs = _mm512_set1_ps(x[r].scale[xb]);
            for (int i = 0; i < nb; i++) {
                float *ga = gacc + (r * TASK_BLOCKS + i) * Q4_BLOCK_N;
                float *a = out + (r * TASK_BLOCKS + i) * Q4_BLOCK_N;
                const __m512i v32 = _mm512_load_si512(is[i] + r * Q4_BLOCK_N);
                const __m512 sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v32), xs,
                                                   sb == 0 ? _mm512_setzero_ps() : _mm512_load_ps(ga));
                if (!last) {
                    _mm512_store_ps(ga, sum);
                    continue;
                }
                const __m512 v = _mm512_fmadd_ps(scale[i], sum, g == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(a));
                _mm512_storeu_ps(a, _mm512_fmadd_ps(zterm[i], _mm512_set1_ps(x[r].sum[g]), v));
            }
        }
    }
}
#endif

#if defined(Q4_AMX)
#define MAX_PASS_ROWS AMX_ROWS
/* from this many rows on, a product takes the AMX passes. Below it the VPDPBUSD passes are as fast
 * or faster: AMX's passes pay a fixed cost (the codes unpacked through memory into B tiles, the
 * sums stored from C tiles) that a few rows do not repay. SmolLM2's four products of a layer,
 * the two builds alternating in one run: AMX 1.7-2.5x slower at 2 rows, level at 8-10, 1.2-1.8x
 * faster at 16-48 */
#define AMX_MIN_ROWS 12
#else
#define MAX_PASS_ROWS TASK_ROWS
#endif

int q4_amx_usable(void) {
#if defined(Q4_AMX)
    return amx_usable();
#else
    return 0;
#endif
}

/* rows of x, each quantized into q (rows x k) and scales (rows x (k / 32 + k / group): the
 * activation scales, then the groups' sums) */
static void quantize_rows(const float *x, int64_t rows, int64_t k, int64_t group, int8_t *q, float *scales) {
    const int64_t xblocks = k / Q4_XBLOCK, groups = k / group;
    for (int64_t m = 0; m < rows; m++) {
        QRow r = {q + m * k, scales + m * (xblocks + groups), scales + m * (xblocks + groups) + xblocks};
        quantize_row(x + m * k, k, group, r);
    }
}

/* The tasks of a product of quantized rows, shared out over the calling team (an orphaned omp for,
 * without its barrier: the caller's region ends in one, or the caller meets at team_barrier):
 * inside a parallel region each thread takes its tasks, outside one the caller takes them all.
 * Outputs to yf (float32) or yb (bfloat16 bits). */
static void team_tasks(const uint8_t *codes, const uint16_t *sz, const int8_t *q, const float *scales, int64_t rows,
                       int64_t n_out, int64_t n_pad, int64_t k, int64_t group, int stream, float *yf, uint16_t *yb,
                       KvAhead *ahead) {
    const int64_t xblocks = k / Q4_XBLOCK, groups = k / group;
    const int64_t blocks = n_pad / Q4_BLOCK_N, tasks = (blocks + TASK_BLOCKS - 1) / TASK_BLOCKS;
#if defined(Q4_AMX)
    const int amx = rows >= AMX_MIN_ROWS && amx_usable();
    const int64_t pass_rows = amx ? AMX_ROWS : TASK_ROWS;
#else
    const int64_t pass_rows = TASK_ROWS;
#endif
    int configured = 0; /* the row count this thread's tiles are configured for */
    _Pragma("omp for schedule(static) nowait")
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t b0 = t * TASK_BLOCKS;
        const int nb = (int)(blocks - b0 < TASK_BLOCKS ? blocks - b0 : TASK_BLOCKS);
        float sums[MAX_PASS_ROWS * TASK_BLOCKS * Q4_BLOCK_N];
        for (int64_t m0 = 0; m0 < rows; m0 += pass_rows) {
            const int nrows = (int)(rows - m0 < pass_rows ? rows - m0 : pass_rows);
            QRow r[MAX_PASS_ROWS];
            for (int j = 0; j < nrows; j++) {
                float *rs = (float *)scales + (m0 + j) * (xblocks + groups);
                r[j] = (QRow){(int8_t *)q + (m0 + j) * k, rs, rs + xblocks};
            }
#if defined(Q4_AMX)
            if (amx && nrows > 1) {
                if (configured != nrows) Q4_AMX_CONFIGURE(nrows), configured = nrows;
                task_sums_amx(codes, sz, b0, nb, k, group, r, nrows, sums);
            } else
#endif
            task_rows(codes, sz, b0, nb, k, group, r, nrows, stream, sums, ahead);
            const int64_t first = b0 * Q4_BLOCK_N;
            const int64_t count = n_out - first < nb * Q4_BLOCK_N ? n_out - first : nb * Q4_BLOCK_N;
            for (int j = 0; j < nrows; j++) {
                const int64_t m = m0 + j;
                const float *rsum = sums + j * TASK_BLOCKS * Q4_BLOCK_N;
                for (int64_t c = 0; c < count; c++) {
                    if (yf != NULL) yf[m * n_out + first + c] = rsum[c];
                    else yb[m * n_out + first + c] = f32_to_bf16(rsum[c]);
                }
            }
        }
    }
#if defined(Q4_AMX)
    if (configured) _tile_release(); /* so the kernel need not save this thread's tiles */
#endif
    (void)configured;
}

/* x rows as float32 (bf16 input widened), quantized; then the tasks */
static int run(const uint8_t *codes, const uint16_t *sz, const float *xf, int64_t rows, int64_t n_out, int64_t n_pad,
               int64_t k, int64_t group, float *yf, uint16_t *yb) {
    int8_t *q = (int8_t *)malloc((size_t)(rows * k));
    float *scales = (float *)malloc(sizeof(float) * (size_t)(rows * (k / Q4_XBLOCK + k / group)));
    if (q == NULL || scales == NULL) {
        free(q), free(scales);
        return 1;
    }
    quantize_rows(xf, rows, k, group, q, scales);
    const int stream = stream_prefetch();
    _Pragma("omp parallel")
    team_tasks(codes, sz, q, scales, rows, n_out, n_pad, k, group, stream, yf, yb, NULL);
    free(q), free(scales);
    return 0;
}

int64_t q4_team_scratch_bytes(int64_t rows, int64_t k, int64_t group) {
    return rows * k + (int64_t)sizeof(float) * rows * (k / Q4_XBLOCK + k / group);
}

void q4_linear_f32_team(const uint8_t *codes, const uint16_t *scales_zeros, const float *x, float *y, int64_t rows,
                        int64_t n_out, int64_t n_pad, int64_t k, int64_t group, void *scratch,
                        TeamBarrier *barrier, KvAhead *ahead) {
    float *scales = (float *)scratch;
    int8_t *q = (int8_t *)(scales + rows * (k / Q4_XBLOCK + k / group));
    quantize_rows(x, rows, k, group, q, scales);
    team_tasks(codes, scales_zeros, q, scales, rows, n_out, n_pad, k, group, stream_prefetch(), y, NULL,
               ahead != NULL ? ahead + omp_get_thread_num() : NULL);
    team_barrier(barrier);
}

int q4_linear_f32(const uint8_t *codes, const uint16_t *scales_zeros, const float *x, float *y, int64_t rows,
                  int64_t n_out, int64_t n_pad, int64_t k, int64_t group) {
    if (!sizes_ok(rows, n_out, n_pad, k, group)) return 2;
    return run(codes, scales_zeros, x, rows, n_out, n_pad, k, group, y, NULL);
}

int q4_linear_bf16(const uint8_t *codes, const uint16_t *scales_zeros, const uint16_t *x, uint16_t *y,
                   int64_t rows, int64_t n_out, int64_t n_pad, int64_t k, int64_t group) {
    if (!sizes_ok(rows, n_out, n_pad, k, group)) return 2;
    float *xf = (float *)malloc(sizeof(float) * (size_t)(rows * k));
    if (xf == NULL) return 1;
    for (int64_t i = 0; i < rows * k; i++) xf[i] = bf16_to_f32(x[i]);
    const int rc = run(codes, scales_zeros, xf, rows, n_out, n_pad, k, group, NULL, y);
    free(xf);
    return rc;
}

#else

int q4_gemv_supported(void) { return 0; }

int q4_amx_usable(void) { return 0; }

int q4_gemv_set_prefetch(int mode) {
    (void)mode;
    return 0;
}

int64_t q4_team_scratch_bytes(int64_t rows, int64_t k, int64_t group) {
    (void)rows, (void)k, (void)group;
    return 0;
}

void q4_linear_f32_team(const uint8_t *codes, const uint16_t *scales_zeros, const float *x, float *y, int64_t rows,
                        int64_t n_out, int64_t n_pad, int64_t k, int64_t group, void *scratch,
                        TeamBarrier *barrier, KvAhead *ahead) {
    (void)codes, (void)scales_zeros, (void)x, (void)y, (void)rows, (void)n_out, (void)n_pad, (void)k, (void)group,
        (void)scratch, (void)barrier, (void)ahead;
}

int q4_gemv_one_row_streams(void) { return 0; }

int q4_linear_f32(const uint8_t *codes, const uint16_t *scales_zeros, const float *x, float *y, int64_t rows,
                  int64_t n_out, int64_t n_pad, int64_t k, int64_t group) {
    (void)codes, (void)scales_zeros, (void)x, (void)y, (void)rows, (void)n_out, (void)n_pad, (void)k, (void)group;
    return 2;
}

int q4_linear_bf16(const uint8_t *codes, const uint16_t *scales_zeros, const uint16_t *x, uint16_t *y,
                   int64_t rows, int64_t n_out, int64_t n_pad, int64_t k, int64_t group) {
    (void)codes, (void)scales_zeros, (void)x, (void)y, (void)rows, (void)n_out, (void)n_pad, (void)k, (void)group;
    return 2;
}

#endif
