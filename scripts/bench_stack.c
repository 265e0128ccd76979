/* SmolLM2-135M's bfloat16 decode step through decode_stack (one row, its output projection
 * included) against what its weights alone cost: the same 121 products called back to back, and
 * two-thread reads of the same bytes (one parallel region per buffer as the products have; all of
 * them in one region, with no barrier between or one after each; as many bytes in one buffer, each
 * thread its half, the pattern of torch's sum for the anchor's bound, which the last column divides).
 * Random weights on 2 MiB pages, a bfloat16 KV cache whose blocks lie scattered, the context
 * growing from the first argument. The variants alternate within each step; medians.
 *
 *   gcc -O3 -march=native -fopenmp -fno-math-errno scripts/bench_stack.c \
 *       engine_service/model/kernels/{decode_stack,packed_gemv,paged_decode_attention,q4_gemv}.c \
 *       -lm -o /tmp/bench_stack
 *   OMP_NUM_THREADS=2 /tmp/bench_stack [context] [rounds] [rows]
 *
 * rows (1 to PG_MAX_ROWS, default 1): the step's rows are one sequence's draft chunk, at positions context ...
 * context + rows - 1, as a speculative step verifies k = rows - 1 drafts (the products' and reads'
 * columns are unchanged; docs/performance.md, "stop 56"; the -DSTACK_AB build below takes it too).
 *
 * Needs AVX512-BF16 and Linux (madvise). docs/performance.md, twelfth round.
 *
 * Built with -DSLUICE_STACK_PHASES as well, it prints at exit each phase of decode_stack's layers
 * (attention, each product with its barrier and copies, the work between them), microseconds a
 * layer for each thread (kernels/stack_phases.h; docs/performance.md, "stop 54").
 *
 * Built with -DSTACK_AB (scripts/bench_stack_ab.sh REV does it), it times this tree's decode_stack
 * against another commit's (linked beside it as `before_decode_stack`), the two alternating step by
 * step, each pair tagged with where the two threads sat (a cache line passed between them: under
 * 80 ns one CCD, else two; "near" and "far" cores on a CPU other than AMD's), and prints the median paired ratio per placement and whether the two
 * gave the same logits bit for bit (docs/performance.md, fourteenth round). */
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../engine_service/model/kernels/decode_stack.h"
#include "../engine_service/model/kernels/packed_gemv.h"
#include "../engine_service/model/kernels/team_barrier.h"
#include "bench_harness.h"

#define LAYERS 30
#define HIDDEN 576
#define HEADS 9
#define KV_HEADS 3
#define HEAD_DIM 64
#define INTER 1536
#define VOCAB 49152
#define BLOCK 16
#define BLOCKS 256 /* per layer's cache: 4096 tokens */
#define POSITIONS 4096

static uint32_t state = 1;
static uint16_t random_bf16(void) { /* small values, so sums stay finite through 30 layers */
    state ^= state << 13, state ^= state >> 17, state ^= state << 5;
    return (uint16_t)(0x3c00 + (state & 0x7f)) | (uint16_t)((state >> 8 & 1) << 15);
}

static void *huge(size_t bytes) {
    void *p = huge_alloc(bytes);
    if (p == NULL) abort();
    return p;
}

static StackWeight weight(int64_t n, int64_t k) {
    const int64_t n_pad = (n + PG_BLOCK_N - 1) / PG_BLOCK_N * PG_BLOCK_N;
    uint16_t *w = huge(sizeof(uint16_t) * (size_t)(n_pad * k));
    for (int64_t i = 0; i < n_pad * k; i++) w[i] = random_bf16();
    return (StackWeight){w, NULL, n, n_pad, k, k};
}

static void *huge(size_t bytes);
static uint16_t *bf16_values_in(uint16_t *p, int64_t n, uint16_t value) {
    for (int64_t i = 0; i < n; i++) p[i] = value ? value : random_bf16();
    return p;
}

static uint16_t *bf16_values(int64_t n, uint16_t value) {
    uint16_t *p = malloc(sizeof(uint16_t) * (size_t)n);
    for (int64_t i = 0; i < n; i++) p[i] = value ? value : random_bf16();
    return p;
}

static const StackWeight *all[4 * LAYERS + 1];
static double sink;

/* the step's 121 products alone, as the stack calls them (bfloat16 in and out) */
static void products(uint16_t *x, uint16_t *y) {
    for (int i = 0; i < 4 * LAYERS + 1; i++) {
        const StackWeight *w = all[i];
        packed_gemm_bf16(w->data, x, NULL, y, 1, w->n_out, w->k, w->n_pad, w->extra);
        sink += y[0];
    }
}

/* the lines [lo, hi) from base summed into acc as float32, 256-bit loads, eight sums. Why this loop:
 * it is the one-row kernel's (block_sums_256), and on two CCDs it read 2% under to 5% over torch's
 * sum, the anchor's bound, where a 512-bit loop into one sum read 8-12% under it
 * (scripts/bench_read_loops.c; docs/performance.md, "the last block in halves"). */
static inline __m256 sum_lines(const char *base, int64_t lo, int64_t hi, __m256 acc) {
    __m256 a[8];
    for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
    int64_t j = lo;
    for (; j + 4 <= hi; j += 4)
        for (int i = 0; i < 8; i++) a[i] = _mm256_add_ps(a[i], _mm256_load_ps((const float *)(base + 64 * j) + 8 * i));
    for (; j < hi; j++) a[0] = _mm256_add_ps(a[0], _mm256_load_ps((const float *)(base + 64 * j)));
    for (int i = 0; i < 8; i++) acc = _mm256_add_ps(acc, a[i]);
    return acc;
}

static double first_lane(__m256 v) {
    float f[8];
    _mm256_storeu_ps(f, v);
    return f[0];
}

/* a two-thread sum over the same weights, a parallel region a buffer: what the products read */
static void read_all(void) {
    double total = 0;
    for (int i = 0; i < 4 * LAYERS + 1; i++) {
        const StackWeight *w = all[i];
        const int64_t lines = w->n_pad * w->k * 2 / 64;
#pragma omp parallel for schedule(static) reduction(+ : total)
        for (int64_t t = 0; t < 2; t++)
            total += first_lane(sum_lines(w->data, t * lines / 2, (t + 1) * lines / 2, _mm256_setzero_ps()));
    }
    sink += total;
}

/* the same reads in one parallel region: each thread its half of every buffer, and where `meet`,
 * the team meeting after each buffer, as a step's products meet (team_barrier.h) */
static TeamBarrier read_barrier;
static void read_one_region(int meet) {
    double total = 0;
#pragma omp parallel reduction(+ : total)
    {
        const int t = omp_get_thread_num(), n = omp_get_num_threads();
        __m256 a = _mm256_setzero_ps();
        for (int i = 0; i < 4 * LAYERS + 1; i++) {
            const StackWeight *w = all[i];
            const int64_t lines = w->n_pad * w->k * 2 / 64;
            a = sum_lines(w->data, t * lines / n, (t + 1) * lines / n, a);
            if (meet) team_barrier(&read_barrier);
        }
        total += first_lane(a);
    }
    sink += total;
}

/* as many bytes in one buffer, each thread its contiguous half: the pattern of torch's sum for the
 * anchor's bound (engine_service/bench/anchor.py, read_bandwidth_gb_s) */
static char *one_buffer;
static int64_t one_buffer_lines;
static void read_one_buffer(void) {
    double total = 0;
#pragma omp parallel reduction(+ : total)
    {
        const int t = omp_get_thread_num(), n = omp_get_num_threads();
        const int64_t lo = t * one_buffer_lines / n, hi = (t + 1) * one_buffer_lines / n;
        total += first_lane(sum_lines(one_buffer, lo, hi, _mm256_setzero_ps()));
    }
    sink += total;
}

#ifdef STACK_AB
int before_decode_stack(const DecodeStack *s, const int64_t *ids, const int64_t *positions, const float *cos_table,
                        const float *sin_table, int64_t num_positions, const int64_t *slots,
                        const int64_t *block_tables, int64_t table_width, const int64_t *context_lens, int64_t rows,
                        void *out, float *logits, int64_t *argmax);

static int paired_ab(const DecodeStack *stack, int64_t context, int pairs, const float *cos_t, const float *sin_t,
                     const int64_t *table, const int64_t *tables, int rows) {
    double *latency = malloc(sizeof(double) * pairs), *t[2] = {malloc(sizeof(double) * pairs), malloc(sizeof(double) * pairs)};
    float *logits[2] = {malloc(sizeof(float) * VOCAB * rows), malloc(sizeof(float) * VOCAB * rows)};
    int same = 1;
    for (int n = -4; n < pairs; n++) {
        int64_t pos[PG_MAX_ROWS], id[PG_MAX_ROWS], slot[PG_MAX_ROWS], len[PG_MAX_ROWS]; /* a draft chunk of `rows` rows (one: a decode) */
        for (int r = 0; r < rows; r++) {
            pos[r] = context + (n < 0 ? 0 : n) % 200 + r, id[r] = (pos[r] * 31) % VOCAB;
            slot[r] = table[pos[r] / BLOCK] * BLOCK + pos[r] % BLOCK, len[r] = pos[r] + 1;
        }
        const double lat = ping_pong(3000);
        for (int j = 0; j < 2; j++) {
            const int after = (n + j + 8) % 2; /* in turn first */
            const double t0 = now();
            if ((after ? decode_stack : before_decode_stack)(stack, id, pos, cos_t, sin_t, POSITIONS, slot, tables,
                                                              BLOCKS, len, rows, NULL, logits[after], NULL))
                abort();
            if (n >= 0) t[after][n] = now() - t0;
        }
        same &= memcmp(logits[0], logits[1], sizeof(float) * VOCAB * rows) == 0;
        if (n >= 0) latency[n] = lat;
    }
    printf("context %lld-%lld, %d row%s, %d pairs of steps, the two alternating\n", (long long)context,
           (long long)(context + (pairs < 200 ? pairs : 200) - 1), rows, rows > 1 ? "s (a draft chunk)" : "", pairs);
    /* CCDs are AMD's; elsewhere (an Intel VM's mesh: ~100 ns between any two cores) the tag only
     * says which side of 80 ns a pair's round trip fell */
    __builtin_cpu_init();
    const int amd = __builtin_cpu_is("amd");
    for (int far = 0; far < 2; far++) {
        double *ratio = malloc(sizeof(double) * pairs), *a = malloc(sizeof(double) * pairs), *b = malloc(sizeof(double) * pairs);
        int c = 0;
        for (int n = 0; n < pairs; n++)
            if ((latency[n] >= 80) == far) ratio[c] = t[0][n] / t[1][n], a[c] = t[0][n], b[c] = t[1][n], c++;
        if (c)
            printf("%-9s %4d pairs: before %.3f ms, after %.3f ms, the median paired ratio (before / after) %.4f\n",
                   amd ? (far ? "two CCDs" : "one CCD") : far ? "far cores" : "near cores", c, 1e3 * median(a, c),
                   1e3 * median(b, c), median(ratio, c));
        free(ratio), free(a), free(b);
    }
    printf("the same logits bit for bit: %s\n", same ? "yes" : "no");
    return 0;
}
#endif

int main(int argc, char **argv) {
    const int64_t context = argc > 1 ? atoll(argv[1]) : 300;
    const int rounds = argc > 2 ? atoi(argv[2]) : 15;
    const int rows = argc > 3 ? atoi(argv[3]) : 1;
    /* the paired A/B's positions reach context + 199 + rows - 1 (paired_ab), the table's end POSITIONS */
    if (rows < 1 || rows > PG_MAX_ROWS || context < 1 || context + 200 + PG_MAX_ROWS > POSITIONS || rounds < 1) {
        fprintf(stderr, "context 1 to %d, rounds 1 or more, rows 1 to %d\n", POSITIONS - 200 - PG_MAX_ROWS, PG_MAX_ROWS);
        return 2;
    }
    const int steps = 16; /* a round's steps; the context grows by one each */
    static StackLayer layers[LAYERS];
    int count = 0;
    for (int l = 0; l < LAYERS; l++) {
        StackLayer *s = &layers[l];
        s->input_norm = bf16_values(HIDDEN, 0x3f80);
        s->post_norm = bf16_values(HIDDEN, 0x3f80);
        s->qkv = weight(HEADS * HEAD_DIM + 2 * KV_HEADS * HEAD_DIM, HIDDEN);
        s->o = weight(HIDDEN, HEADS * HEAD_DIM);
        s->gate_up = weight(2 * INTER, HIDDEN);
        s->down = weight(HIDDEN, INTER);
        all[count++] = &s->qkv, all[count++] = &s->o, all[count++] = &s->gate_up, all[count++] = &s->down;
        /* on 2 MiB pages, as the engine's cache lies (kv_cache.py) */
        const int64_t cache_n = (int64_t)BLOCKS * BLOCK * KV_HEADS * HEAD_DIM;
        s->k_cache = bf16_values_in(huge(sizeof(uint16_t) * (size_t)cache_n), cache_n, 0);
        s->v_cache = bf16_values_in(huge(sizeof(uint16_t) * (size_t)cache_n), cache_n, 0);
    }
    DecodeStack stack = {LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, BLOCK, VOCAB, 1e-5f, 0.125f,
                         STACK_BF16, 1, bf16_values((int64_t)VOCAB * HIDDEN, 0), bf16_values(HIDDEN, 0x3f80),
                         layers, weight(VOCAB, HIDDEN)};
    all[count++] = &stack.head;
    float *cos_t = malloc(sizeof(float) * POSITIONS * HEAD_DIM), *sin_t = malloc(sizeof(float) * POSITIONS * HEAD_DIM);
    for (int64_t i = 0; i < POSITIONS * HEAD_DIM; i++) cos_t[i] = 0.6f, sin_t[i] = 0.8f;
    int64_t table[BLOCKS]; /* scattered, as a pool that has served other requests hands them out */
    for (int64_t i = 0; i < BLOCKS; i++) table[i] = (i * 97 + 13) % BLOCKS;
    float *logits = malloc(sizeof(float) * VOCAB * rows);
    int64_t *tables = malloc(sizeof(int64_t) * BLOCKS * rows); /* every row the sequence's table */
    for (int j = 0; j < rows; j++) memcpy(tables + j * BLOCKS, table, sizeof table);
    uint16_t *x = bf16_values(INTER, 0), *y = malloc(sizeof(uint16_t) * VOCAB);

    const double weight_bytes = ({
        double b = 0;
        for (int i = 0; i < count; i++) b += (double)all[i]->n_pad * all[i]->k * 2;
        b;
    });
#ifdef STACK_AB
    return paired_ab(&stack, context, rounds * steps, cos_t, sin_t, table, tables, rows);
#endif
    one_buffer_lines = (int64_t)(weight_bytes / 64);
    one_buffer = huge((size_t)one_buffer_lines * 64);
    memset(one_buffer, 0, (size_t)one_buffer_lines * 64);
    /* the step, the products, and the three reads, in turn within each step */
    enum { STEP, PRODUCTS, READ, ONE_REGION, MET, ONE_BUFFER, KINDS };
    double *t[KINDS];
    for (int k = 0; k < KINDS; k++) t[k] = malloc(sizeof(double) * rounds);
    for (int r = -2; r < rounds; r++) {
        double sum[KINDS] = {0};
        for (int s = 0; s < steps; s++) {
            int64_t pos[PG_MAX_ROWS], id[PG_MAX_ROWS], slot[PG_MAX_ROWS], len[PG_MAX_ROWS];
            for (int j = 0; j < rows; j++) {
                pos[j] = context + s + j, id[j] = (pos[j] * 31) % VOCAB;
                slot[j] = table[pos[j] / BLOCK] * BLOCK + pos[j] % BLOCK, len[j] = pos[j] + 1;
            }
            double t0 = now();
            if (decode_stack(&stack, id, pos, cos_t, sin_t, POSITIONS, slot, tables, BLOCKS, len, rows, NULL, logits,
                             NULL))
                abort();
            double t1 = now();
            products(x, y);
            double t2 = now();
            read_all();
            double t3 = now();
            read_one_region(0);
            double t4 = now();
            read_one_region(1);
            double t5 = now();
            read_one_buffer();
            double t6 = now();
            sum[STEP] += t1 - t0, sum[PRODUCTS] += t2 - t1, sum[READ] += t3 - t2, sum[ONE_REGION] += t4 - t3;
            sum[MET] += t5 - t4, sum[ONE_BUFFER] += t6 - t5;
            sink += logits[0];
        }
        for (int k = 0; r >= 0 && k < KINDS; k++) t[k][r] = sum[k] / steps;
    }
    static const char *names[KINDS] = {"decode_stack (with head)", "the 121 products alone", "a read a buffer",
                                       "the read in one region", "  and a barrier a buffer", "one buffer, halves"};
    const double bound = median(t[ONE_BUFFER], rounds) * 1e3;
    printf("context %lld, %d row%s, %.1f MB of weights, medians of %d rounds of %d steps\n", (long long)context, rows,
           rows > 1 ? "s (a draft chunk)" : "", weight_bytes / 1e6, rounds, steps);
    printf("%-28s%10s%12s%18s\n", "", "ms", "GB/s", "of one buffer's");
    for (int k = 0; k < KINDS; k++) {
        const double ms = median(t[k], rounds) * 1e3;
        printf("%-28s%10.3f%12.1f%18.3f\n", names[k], ms, weight_bytes / ms / 1e6, bound / ms);
    }
    fprintf(stderr, "(sink %g)\n", sink);
    return 0;
}
