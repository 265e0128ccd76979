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
 * Numerics: each activation row is quantized to int8 per 32 inputs (scale max|x| / 127). Per row
 * and group: sum_k w x = scale * sum_k code * x + (zero - 8 * scale) * sum_k x, where the first
 * sum is the integer dot product times the activation scale, the second the exact float sum of x.
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
                    const float scale = bf16_to_f32(gsz[r]), zero = bf16_to_f32(gsz[Q4_BLOCK_N + r]);   \
                    for (int64_t c = g * group; c < (g + 1) * group; c++) {                             \
                        const int64_t s = c / Q4_STEP_K, j = c % Q4_STEP_K;                             \
                        const uint8_t byte = blk[s * 64 + r * 4 + (j & 3)];                             \
                        const float code = (float)(j < 4 ? byte & 15 : byte >> 4);                      \
                        dst[c] = STORE((code - 8.0f) * scale + zero);                                   \
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

/* One activation row, quantized: int8 codes, a scale per 32 inputs, the float sum per group. */
typedef struct {
    int8_t *q;
    float *scale;
    float *sum;
} QRow;

static void quantize_row(const float *x, int64_t k, int64_t group, QRow out) {
    for (int64_t b = 0; b < k / Q4_XBLOCK; b++) {
        const float *xb = x + b * Q4_XBLOCK;
        float amax = 0.0f;
        for (int i = 0; i < Q4_XBLOCK; i++) amax = fmaxf(amax, fabsf(xb[i]));
        const float scale = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        out.scale[b] = scale;
        for (int i = 0; i < Q4_XBLOCK; i++) out.q[b * Q4_XBLOCK + i] = (int8_t)nearbyintf(xb[i] * inv);
    }
    for (int64_t g = 0; g < k / group; g++) {
        float s = 0.0f;
        for (int64_t i = 0; i < group; i++) s += x[g * group + i];
        out.sum[g] = s;
    }
}

static inline __m512 load_bf16x16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* the sums of up to TASK_BLOCKS blocks (nb) for one quantized row, into out[nb * 16]: the
 * arithmetic of task_sums below for one row, kept as its own loop because task_sums instantiated
 * for one row ran slower, one stream's case (5-8% in one run, 1-6% in another, the two alternating
 * in one C harness; hoisting the row sums out of task_sums' block loop did not close it). Inlined into
 * a call with nb = TASK_BLOCKS, a constant, so the loops over blocks unroll and the accumulators
 * live in registers (with nb only known at run time they lived on the stack, and every VPDPBUSD
 * waited on a store and a reload: 1.3x slower in cache) */
static inline __attribute__((always_inline)) void task_sums_row(const uint8_t *codes, const uint16_t *sz, int64_t b0, int nb, int64_t k, int64_t group,
                      QRow x, float *out) {
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
                    _mm_prefetch((const char *)(blk[i] + off + 1024), _MM_HINT_T0);
                    const __m512i w = _mm512_loadu_si512(blk[i] + off);
                    isum[i] = _mm512_dpbusd_epi32(isum[i], _mm512_and_si512(w, low), xa);
                    isum[i] = _mm512_dpbusd_epi32(isum[i], _mm512_and_si512(_mm512_srli_epi16(w, 4), low), xh);
                }
            }
            const __m512 xs = _mm512_set1_ps(x.scale[xb]);
            for (int i = 0; i < nb; i++) gacc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[i]), xs, gacc[i]);
        }
        const __m512 xsum = _mm512_set1_ps(x.sum[g]), eight = _mm512_set1_ps(8.0f);
        for (int i = 0; i < nb; i++) {
            const uint16_t *gsz = sz + ((b0 + i) * groups + g) * 2 * Q4_BLOCK_N;
            const __m512 scale = load_bf16x16(gsz), zero = load_bf16x16(gsz + Q4_BLOCK_N);
            acc[i] = _mm512_fmadd_ps(scale, gacc[i], acc[i]);
            acc[i] = _mm512_fmadd_ps(_mm512_fnmadd_ps(eight, scale, zero), xsum, acc[i]);
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
        const __m512 eight = _mm512_set1_ps(8.0f);
        for (int i = 0; i < nb; i++) {
            const uint16_t *gsz = sz + ((b0 + i) * groups + g) * 2 * Q4_BLOCK_N;
            const __m512 scale = load_bf16x16(gsz), zero = load_bf16x16(gsz + Q4_BLOCK_N);
            const __m512 zterm = _mm512_fnmadd_ps(eight, scale, zero);
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

/* task_sums with nb and nrows as constants in each call (see above) */
static void task_rows(const uint8_t *codes, const uint16_t *sz, int64_t b0, int nb, int64_t k, int64_t group,
                      const QRow *x, int nrows, float *out) {
    if (nb == TASK_BLOCKS) {
        if (nrows == 4) task_sums(codes, sz, b0, TASK_BLOCKS, k, group, x, 4, out);
        else if (nrows == 3) task_sums(codes, sz, b0, TASK_BLOCKS, k, group, x, 3, out);
        else if (nrows == 2) task_sums(codes, sz, b0, TASK_BLOCKS, k, group, x, 2, out);
        else task_sums_row(codes, sz, b0, TASK_BLOCKS, k, group, x[0], out);
    } else if (nrows == 1) {
        task_sums_row(codes, sz, b0, nb, k, group, x[0], out);
    } else {
        task_sums(codes, sz, b0, nb, k, group, x, nrows, out);
    }
}

/* x rows as float32 (bf16 input widened), quantized; then the tasks */
static int run(const uint8_t *codes, const uint16_t *sz, const float *xf, int64_t rows, int64_t n_out, int64_t n_pad,
               int64_t k, int64_t group, float *yf, uint16_t *yb) {
    const int64_t xblocks = k / Q4_XBLOCK, groups = k / group;
    int8_t *q = (int8_t *)malloc((size_t)(rows * k));
    float *scales = (float *)malloc(sizeof(float) * (size_t)(rows * (xblocks + groups)));
    if (q == NULL || scales == NULL) {
        free(q), free(scales);
        return 1;
    }
    for (int64_t m = 0; m < rows; m++) {
        QRow r = {q + m * k, scales + m * (xblocks + groups), scales + m * (xblocks + groups) + xblocks};
        quantize_row(xf + m * k, k, group, r);
    }
    const int64_t blocks = n_pad / Q4_BLOCK_N, tasks = (blocks + TASK_BLOCKS - 1) / TASK_BLOCKS;
    _Pragma("omp parallel for schedule(static)")
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t b0 = t * TASK_BLOCKS;
        const int nb = (int)(blocks - b0 < TASK_BLOCKS ? blocks - b0 : TASK_BLOCKS);
        float sums[TASK_ROWS * TASK_BLOCKS * Q4_BLOCK_N];
        for (int64_t m0 = 0; m0 < rows; m0 += TASK_ROWS) {
            const int nrows = (int)(rows - m0 < TASK_ROWS ? rows - m0 : TASK_ROWS);
            QRow r[TASK_ROWS];
            for (int j = 0; j < nrows; j++) {
                float *rs = scales + (m0 + j) * (xblocks + groups);
                r[j] = (QRow){q + (m0 + j) * k, rs, rs + xblocks};
            }
            task_rows(codes, sz, b0, nb, k, group, r, nrows, sums);
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
    free(q), free(scales);
    return 0;
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
