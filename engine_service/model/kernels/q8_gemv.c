/* int8 block-quantized products for decode (GGUF's Q8_0 and Q6_K weights served as they are):
 * the codes are read in place, a byte a weight, and multiplied in integers, as q4_gemv.c multiplies
 * its int4 codes (read that file first: this one is its 8-bit counterpart and follows it closely).
 *
 * A 64-byte load holds 16 rows x 4 inputs, each code stored as c + 128 (unsigned: VPDPBUSD's first
 * operand), so one VPDPBUSD per load and activation row, with that row's four int8 activations
 * broadcast as the signed operand, sums 64 multiply-adds into the block's 16 int32 lanes.
 *
 * Numerics: each activation row is quantized to int8 per 32 inputs (scale s_x = max|x| / 127,
 * round to nearest even: q4_gemv.c's quantize_row). Per row and weight group of g inputs (16 or 32,
 * inside one activation block): y += (s_w * s_x) * (isum - 128 * xqsum), where isum = sum (c + 128)
 * * xq is VPDPBUSD's exact int32 sum and xqsum the exact integer sum of the group's quantized
 * activations, so the offset is removed in integers and the float work starts from sum c * xq,
 * exactly. The error against the float product of the weights is that of the activation rounding,
 * at most sum_k |w_k| * s_x / 2 per output (tests/unit/test_q8_blocks.py holds it to that bound).
 * Every float operation on a row's sums takes only that row's values, in the same order whatever
 * the rows beside it, so a row's output is the same bit for bit alone or in any batch.
 *
 * A task is up to four blocks of 16 rows (four independent accumulator chains hide VPDPBUSD's
 * latency), the activation rows up to four at a time: a block's codes are read from memory once and
 * from cache for the other passes. Tasks run on torch's OpenMP pool (native.py links libgomp). */
#include "q8_gemv.h"

#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "one_row_prefetch.h"
#include "team_barrier.h"

#define NOCONTRACT __attribute__((optimize("fp-contract=off")))
#define TASK_BLOCKS 4
#define TASK_ROWS 4

int q8_layout_ok(int64_t n_out, int64_t n_pad, int64_t k, int64_t group) {
    return n_out > 0 && n_pad % Q8_BLOCK_N == 0 && n_pad >= n_out && n_pad - n_out < Q8_BLOCK_N && k > 0 &&
           k % Q8_XBLOCK == 0 && (group == 16 || group == 32);
}

static inline int sizes_ok(int64_t rows, int64_t n_out, int64_t n_pad, int64_t k, int64_t group) {
    return rows > 0 && rows <= Q8_MAX_ROWS && q8_layout_ok(n_out, n_pad, k, group);
}

/* dequantization: portable C (the dense path runs it for prefill chunks), reading the codes in
 * their order (a 64-byte step: four inputs of each of the block's 16 rows), so that the loops over
 * a step's bytes vectorise (reading each row's codes 64 bytes apart took 1.8x (float32) and 2.5x
 * (bfloat16) as long on 49152x576, one thread) */
#define DEFINE_DEQ(NAME, OUT_T, STORE)                                                                     \
    NOCONTRACT void NAME(const uint8_t *codes, const float *scales, int64_t n_pad, int64_t k, int64_t group, \
                         OUT_T *out) {                                                                     \
        const int64_t blocks = n_pad / Q8_BLOCK_N, groups = k / group, steps = k / Q8_STEP_K;              \
        _Pragma("omp parallel for schedule(static)")                                                       \
        for (int64_t b = 0; b < blocks; b++) {                                                             \
            OUT_T *dst = out + b * Q8_BLOCK_N * k;                                                         \
            for (int64_t t = 0; t < steps; t++) {                                                          \
                const uint8_t *src = codes + (b * steps + t) * 64;                                         \
                const float *sc = scales + (b * groups + t * Q8_STEP_K / group) * Q8_BLOCK_N;              \
                for (int r = 0; r < Q8_BLOCK_N; r++)                                                       \
                    for (int j = 0; j < Q8_STEP_K; j++)                                                    \
                        dst[r * k + t * Q8_STEP_K + j] = STORE((float)((int)src[4 * r + j] - 128) * sc[r]); \
            }                                                                                              \
        }                                                                                                  \
    }

#define AS_IS(x) (x)
DEFINE_DEQ(dequantize_q8_f32, float, AS_IS)
DEFINE_DEQ(dequantize_q8_bf16, uint16_t, f32_to_bf16)

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)

#include <immintrin.h>

int q8_gemv_supported(void) { return 1; }

ONE_ROW_PREFETCH_SETTING(q8_gemv_set_prefetch)

/* One activation row, quantized: int8 codes, a scale per 32 inputs, and per weight group 128 times
 * the integer sum of its codes (the offset of the unsigned weight codes, subtracted in integers). */
typedef struct {
    int8_t *q;
    float *scale;
    int32_t *offset;
} QRow;

/* q4_gemv.c's quantize_row, the same codes and scales bit for bit (the lead will share one copy):
 * max|x| per 32 inputs, scale amax / 127, codes x * (127 / amax) rounded to nearest even by
 * VCVTPS2DQ. Instead of q4's float group sums it keeps the integer sums of the codes, per weight
 * group, taken back from the stored bytes so that they are the codes the products read. */
static void quantize_row(const float *x, int64_t k, int64_t group, QRow out) {
    const __m512 sign = _mm512_set1_ps(-0.0f);
    for (int64_t b = 0; b < k / Q8_XBLOCK; b++) {
        const __m512 x0 = _mm512_loadu_ps(x + b * Q8_XBLOCK), x1 = _mm512_loadu_ps(x + b * Q8_XBLOCK + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, x0), _mm512_andnot_ps(sign, x1)));
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        out.scale[b] = amax / 127.0f;
        const __m512 vinv = _mm512_set1_ps(inv);
        const __m128i q0 = _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(x0, vinv)));
        const __m128i q1 = _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(x1, vinv)));
        _mm_storeu_si128((__m128i *)(out.q + b * Q8_XBLOCK), q0);
        _mm_storeu_si128((__m128i *)(out.q + b * Q8_XBLOCK + 16), q1);
        const int32_t s0 = _mm512_reduce_add_epi32(_mm512_cvtepi8_epi32(q0));
        const int32_t s1 = _mm512_reduce_add_epi32(_mm512_cvtepi8_epi32(q1));
        if (group == 32) {
            out.offset[b] = 128 * (s0 + s1);
        } else {
            out.offset[2 * b] = 128 * s0;
            out.offset[2 * b + 1] = 128 * s1;
        }
    }
}

/* the sums of up to TASK_BLOCKS blocks (nb) for up to TASK_ROWS quantized rows (nrows), row r's
 * into out[r * TASK_BLOCKS * 16 ...], weight groups of G inputs. Inlined into calls where G, nb and
 * nrows are constants (task_rows), so the loops unroll and the accumulators live in registers. Each
 * row's float operations are the same, in the same order, for every nrows: the one-row call and a
 * row of a four-row pass give the same bits. */
static inline __attribute__((always_inline)) void task_sums(const uint8_t *codes, const float *scales, int64_t b0,
                                                            int nb, int64_t k, const int G, const QRow *x,
                                                            const int nrows, const int stream, float *out) {
    const int64_t steps = k / Q8_STEP_K, groups = k / G;
    const uint8_t *blk[TASK_BLOCKS];
    __m512 acc[TASK_ROWS][TASK_BLOCKS];
    for (int i = 0; i < nb; i++) blk[i] = codes + (b0 + i) * steps * 64;
    for (int r = 0; r < nrows; r++)
        for (int i = 0; i < nb; i++) acc[r][i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512i isum[TASK_ROWS][TASK_BLOCKS];
        for (int r = 0; r < nrows; r++)
            for (int i = 0; i < nb; i++) isum[r][i] = _mm512_setzero_si512();
        for (int t = 0; t < G / Q8_STEP_K; t++) {
            __m512i xa[TASK_ROWS];
            for (int r = 0; r < nrows; r++) {
                int32_t four;
                memcpy(&four, x[r].q + g * G + t * Q8_STEP_K, 4);
                xa[r] = _mm512_set1_epi32(four);
            }
            const int64_t off = (g * (G / Q8_STEP_K) + t) * 64;
            for (int i = 0; i < nb; i++) {
                if (stream) _mm_prefetch((const char *)(blk[i] + off + 1024), _MM_HINT_T0);
                const __m512i w = _mm512_loadu_si512(blk[i] + off);
                for (int r = 0; r < nrows; r++) isum[r][i] = _mm512_dpbusd_epi32(isum[r][i], w, xa[r]);
            }
        }
        const int64_t xb = g * G / Q8_XBLOCK;
        for (int i = 0; i < nb; i++) {
            const __m512 sw = _mm512_loadu_ps(scales + ((b0 + i) * groups + g) * Q8_BLOCK_N);
            for (int r = 0; r < nrows; r++) {
                const __m512 ws = _mm512_mul_ps(sw, _mm512_set1_ps(x[r].scale[xb]));
                const __m512i exact = _mm512_sub_epi32(isum[r][i], _mm512_set1_epi32(x[r].offset[g]));
                acc[r][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), ws, acc[r][i]);
            }
        }
    }
    for (int r = 0; r < nrows; r++)
        for (int i = 0; i < nb; i++) _mm512_storeu_ps(out + (r * TASK_BLOCKS + i) * Q8_BLOCK_N, acc[r][i]);
}

/* task_sums with G, nb (where a whole task) and nrows as constants in each call */
#define TASK_ROWS_FOR(G)                                                                                        \
    static void task_rows_g##G(const uint8_t *codes, const float *scales, int64_t b0, int nb, int64_t k,        \
                               const QRow *x, int nrows, int stream, float *out) {                              \
        if (nb == TASK_BLOCKS) {                                                                                \
            if (nrows == 4) task_sums(codes, scales, b0, TASK_BLOCKS, k, G, x, 4, 1, out);                      \
            else if (nrows == 3) task_sums(codes, scales, b0, TASK_BLOCKS, k, G, x, 3, 1, out);                 \
            else if (nrows == 2) task_sums(codes, scales, b0, TASK_BLOCKS, k, G, x, 2, 1, out);                 \
            else if (stream) task_sums(codes, scales, b0, TASK_BLOCKS, k, G, x, 1, 1, out);                     \
            else task_sums(codes, scales, b0, TASK_BLOCKS, k, G, x, 1, 0, out);                                 \
        } else {                                                                                                \
            task_sums(codes, scales, b0, nb, k, G, x, nrows, 1, out);                                           \
        }                                                                                                       \
    }
TASK_ROWS_FOR(16)
TASK_ROWS_FOR(32)

/* rows of x, each quantized into q (rows x k), xs (rows x k/32: the activation scales) and offs
 * (rows x k/group: the groups' offsets) */
static void quantize_rows(const float *x, int64_t rows, int64_t k, int64_t group, int8_t *q, float *xs,
                          int32_t *offs) {
    const int64_t xblocks = k / Q8_XBLOCK, groups = k / group;
    for (int64_t m = 0; m < rows; m++)
        quantize_row(x + m * k, k, group, (QRow){q + m * k, xs + m * xblocks, offs + m * groups});
}

/* The tasks of a product of quantized rows, shared out over the calling team (an orphaned omp for,
 * without its barrier: the caller's region ends in one, or the caller meets at team_barrier):
 * inside a parallel region each thread takes its tasks, outside one the caller takes them all.
 * Outputs to yf (float32) or yb (bfloat16 bits). */
static void team_tasks(const uint8_t *codes, const float *scales, const int8_t *q, const float *xs,
                       const int32_t *offs, int64_t rows, int64_t n_out, int64_t n_pad, int64_t k, int64_t group,
                       int stream, float *yf, uint16_t *yb) {
    const int64_t xblocks = k / Q8_XBLOCK, groups = k / group;
    const int64_t blocks = n_pad / Q8_BLOCK_N, tasks = (blocks + TASK_BLOCKS - 1) / TASK_BLOCKS;
    _Pragma("omp for schedule(static) nowait")
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t b0 = t * TASK_BLOCKS;
        const int nb = (int)(blocks - b0 < TASK_BLOCKS ? blocks - b0 : TASK_BLOCKS);
        float sums[TASK_ROWS * TASK_BLOCKS * Q8_BLOCK_N];
        for (int64_t m0 = 0; m0 < rows; m0 += TASK_ROWS) {
            const int nrows = (int)(rows - m0 < TASK_ROWS ? rows - m0 : TASK_ROWS);
            QRow r[TASK_ROWS];
            for (int j = 0; j < nrows; j++)
                r[j] = (QRow){(int8_t *)q + (m0 + j) * k, (float *)xs + (m0 + j) * xblocks,
                              (int32_t *)offs + (m0 + j) * groups};
            if (group == 16) task_rows_g16(codes, scales, b0, nb, k, r, nrows, stream, sums);
            else task_rows_g32(codes, scales, b0, nb, k, r, nrows, stream, sums);
            const int64_t first = b0 * Q8_BLOCK_N;
            const int64_t count = n_out - first < nb * Q8_BLOCK_N ? n_out - first : nb * Q8_BLOCK_N;
            for (int j = 0; j < nrows; j++) {
                const int64_t m = m0 + j;
                const float *rsum = sums + j * TASK_BLOCKS * Q8_BLOCK_N;
                for (int64_t c = 0; c < count; c++) {
                    if (yf != NULL) yf[m * n_out + first + c] = rsum[c];
                    else yb[m * n_out + first + c] = f32_to_bf16(rsum[c]);
                }
            }
        }
    }
}

/* x rows as float32 (bf16 input widened), quantized; then the tasks, outputs to yf (float32) or
 * yb (bfloat16 bits) */
static int run(const uint8_t *codes, const float *scales, const float *xf, int64_t rows, int64_t n_out,
               int64_t n_pad, int64_t k, int64_t group, float *yf, uint16_t *yb) {
    int8_t *q = (int8_t *)malloc((size_t)(rows * k));
    float *xs = (float *)malloc(sizeof(float) * (size_t)(rows * (k / Q8_XBLOCK)));
    int32_t *offs = (int32_t *)malloc(sizeof(int32_t) * (size_t)(rows * (k / group)));
    if (q == NULL || xs == NULL || offs == NULL) {
        free(q), free(xs), free(offs);
        return 1;
    }
    quantize_rows(xf, rows, k, group, q, xs, offs);
    const int stream = stream_prefetch();
    _Pragma("omp parallel")
    team_tasks(codes, scales, q, xs, offs, rows, n_out, n_pad, k, group, stream, yf, yb);
    free(q), free(xs), free(offs);
    return 0;
}

int64_t q8_team_scratch_bytes(int64_t rows, int64_t k, int64_t group) {
    return (int64_t)sizeof(float) * rows * (k / Q8_XBLOCK) + (int64_t)sizeof(int32_t) * rows * (k / group) + rows * k;
}

void q8_linear_f32_team(const uint8_t *codes, const float *scales, const float *x, float *y, int64_t rows,
                        int64_t n_out, int64_t n_pad, int64_t k, int64_t group, void *scratch,
                        TeamBarrier *barrier) {
    float *xs = (float *)scratch;
    int32_t *offs = (int32_t *)(xs + rows * (k / Q8_XBLOCK));
    int8_t *q = (int8_t *)(offs + rows * (k / group));
    quantize_rows(x, rows, k, group, q, xs, offs);
    team_tasks(codes, scales, q, xs, offs, rows, n_out, n_pad, k, group, stream_prefetch(), y, NULL);
    team_barrier(barrier);
}

int q8_linear_f32(const uint8_t *codes, const float *scales, const float *x, float *y, int64_t rows, int64_t n_out,
                  int64_t n_pad, int64_t k, int64_t group) {
    if (!sizes_ok(rows, n_out, n_pad, k, group)) return 2;
    return run(codes, scales, x, rows, n_out, n_pad, k, group, y, NULL);
}

int q8_linear_bf16(const uint8_t *codes, const float *scales, const uint16_t *x, uint16_t *y, int64_t rows,
                   int64_t n_out, int64_t n_pad, int64_t k, int64_t group) {
    if (!sizes_ok(rows, n_out, n_pad, k, group)) return 2;
    float *xf = (float *)malloc(sizeof(float) * (size_t)(rows * k));
    if (xf == NULL) return 1;
    for (int64_t i = 0; i < rows * k; i++) xf[i] = bf16_to_f32(x[i]);
    const int rc = run(codes, scales, xf, rows, n_out, n_pad, k, group, NULL, y);
    free(xf);
    return rc;
}

#else

int q8_gemv_supported(void) { return 0; }

int q8_gemv_set_prefetch(int mode) {
    (void)mode;
    return 0;
}

int64_t q8_team_scratch_bytes(int64_t rows, int64_t k, int64_t group) {
    (void)rows, (void)k, (void)group;
    return 0;
}

void q8_linear_f32_team(const uint8_t *codes, const float *scales, const float *x, float *y, int64_t rows,
                        int64_t n_out, int64_t n_pad, int64_t k, int64_t group, void *scratch,
                        TeamBarrier *barrier) {
    (void)codes, (void)scales, (void)x, (void)y, (void)rows, (void)n_out, (void)n_pad, (void)k, (void)group,
        (void)scratch, (void)barrier;
}

int q8_linear_f32(const uint8_t *codes, const float *scales, const float *x, float *y, int64_t rows, int64_t n_out,
                  int64_t n_pad, int64_t k, int64_t group) {
    (void)codes, (void)scales, (void)x, (void)y, (void)rows, (void)n_out, (void)n_pad, (void)k, (void)group;
    return 2;
}

int q8_linear_bf16(const uint8_t *codes, const float *scales, const uint16_t *x, uint16_t *y, int64_t rows,
                   int64_t n_out, int64_t n_pad, int64_t k, int64_t group) {
    (void)codes, (void)scales, (void)x, (void)y, (void)rows, (void)n_out, (void)n_pad, (void)k, (void)group;
    return 2;
}

#endif
