/* The bfloat16 products' prefetch, in a burst or spread out: SmolLM2-135M's 121 products (269 MB,
 * oneDNN's packed layout) streamed back to back through the one-row VDPBF16PS loop and the AMX
 * tiles. "shipped" is engine_service/model/kernels/packed_gemv.c itself (included below), which
 * spreads its L2 prefetches of the chunk two ahead between the loads (4 lines a pair, 16 a tile;
 * the eighth round); "burst" is the same loops with the seventh round's 64 prefetches at the
 * chunk's start, kept here only as the baseline. The four variants alternate; medians of 15.
 *
 *   gcc -O3 -march=native -fopenmp scripts/bench_prefetch.c -o /tmp/bench_prefetch
 *   OMP_NUM_THREADS=2 /tmp/bench_prefetch [rows, 2-16, default 7]
 *
 * Needs AVX512-BF16 and AMX (Linux 5.16+). The weights are constants: only the reads are timed. */
#include "../engine_service/model/kernels/packed_gemv.c"

#include <stdio.h>
#include <time.h>

#if !defined(PG_AMX)
#error "this harness needs a compiler and CPU with AMX-BF16 (-march=native on one)"
#endif

#define REPS 15
#define MAX_K 1536

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* the seventh round's one-row loop: every line of the chunk two ahead, in one burst */
static void one_row_burst(const uint16_t *block, const uint16_t *x, int64_t chunks, float *out) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t c = 0; c < chunks; c++) {
        const uint16_t *chunk = block + c * CHUNK, *xc = x + c * PG_BLOCK_K;
        prefetch_lines(chunk + 2 * CHUNK, 0, 64);
        for (int p = 0; p < PG_BLOCK_K / 2; p++) {
            const uint16_t *wp = chunk + p * 2 * PG_BLOCK_N;
            uint32_t xp;
            memcpy(&xp, xc + 2 * p, sizeof xp);
            const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xp);
            a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(wp), xv);
            a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(wp + 32), xv);
            a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_loadu_si512(wp + 64), xv);
            a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_loadu_si512(wp + 96), xv);
        }
    }
    _mm512_storeu_ps(out, a0);
    _mm512_storeu_ps(out + 16, a1);
    _mm512_storeu_ps(out + 32, a2);
    _mm512_storeu_ps(out + 48, a3);
}

/* the seventh round's tile loop, likewise */
static void tiles_burst(const uint16_t *block, const uint16_t *x, int64_t ldx, int64_t chunks, float *out) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t c = 0; c < chunks; c++) {
        const uint16_t *chunk = block + c * CHUNK;
        prefetch_lines(chunk + 2 * CHUNK, 0, 64);
        _tile_loadd(4, x + c * PG_BLOCK_K, ldx * 2);
        _tile_loadd(5, chunk, 4 * 64);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, chunk + 32, 4 * 64);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(7, chunk + 64, 4 * 64);
        _tile_dpbf16ps(2, 4, 7);
        _tile_loadd(5, chunk + 96, 4 * 64);
        _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, out, PG_BLOCK_N * 4);
    _tile_stored(1, out + 16, PG_BLOCK_N * 4);
    _tile_stored(2, out + 32, PG_BLOCK_N * 4);
    _tile_stored(3, out + 48, PG_BLOCK_N * 4);
}

static int cmp(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    const int rows = argc > 1 ? atoi(argv[1]) : 7;
    if (rows < 2 || rows > PG_TILE_ROWS || !amx_usable()) {
        fprintf(stderr, "rows must be 2-16, and the CPU must have AMX\n");
        return 2;
    }
    int64_t n[121], k[121];
    int count = 0;
    for (int l = 0; l < 30; l++) { /* qkv, o, gate|up, down */
        n[count] = 960, k[count++] = 576;
        n[count] = 576, k[count++] = 576;
        n[count] = 3072, k[count++] = 576;
        n[count] = 576, k[count++] = 1536;
    }
    n[count] = 49152, k[count++] = 576; /* the LM head */
    uint16_t *w[121];
    for (int i = 0; i < count; i++) {
        const size_t size = (size_t)(n[i] * k[i]);
        w[i] = aligned_alloc(4096, size * 2);
        for (size_t j = 0; j < size; j++) w[i][j] = (uint16_t)(0x3f80 + (j & 7));
    }
    uint16_t *x = aligned_alloc(64, PG_MAX_ROWS * MAX_K * 2);
    for (int i = 0; i < PG_MAX_ROWS * MAX_K; i++) x[i] = 0x3f80;
    const char *names[4] = {"one row, burst", "one row, shipped", "tiles, burst", "tiles, shipped"};
    double ms[4][REPS];
    float sink = 0.f;
    for (int rep = 0; rep < REPS; rep++)
        for (int v = 0; v < 4; v++) {
            const int amx = v >= 2, shipped = v % 2;
            const double started = now();
            for (int i = 0; i < count; i++) {
                const int64_t blocks = n[i] / PG_BLOCK_N, chunks = k[i] / PG_BLOCK_K;
#pragma omp parallel reduction(+ : sink)
                {
                    if (amx) PG_AMX_CONFIGURE(rows);
#pragma omp for schedule(static)
                    for (int64_t b = 0; b < blocks; b++) {
                        float sums[PG_MAX_ROWS * PG_BLOCK_N];
                        const uint16_t *block = w[i] + b * chunks * CHUNK;
                        if (amx && shipped) block_sums_amx(block, x, k[i], rows, chunks, sums);
                        else if (amx) tiles_burst(block, x, k[i], chunks, sums);
                        else if (shipped) block_sums(block, x, chunks, 1, sums);
                        else one_row_burst(block, x, chunks, sums);
                        sink += sums[0] + sums[16] + sums[32] + sums[48]; /* all four accumulators, so none is dropped */
                    }
                    if (amx) _tile_release();
                }
            }
            ms[v][rep] = (now() - started) * 1e3;
        }
    printf("121 products, %d rows through the tiles, ms (median of %d; min)\n", rows, REPS);
    for (int v = 0; v < 4; v++) {
        qsort(ms[v], REPS, sizeof(double), cmp);
        printf("  %-16s %7.2f  %7.2f\n", names[v], ms[v][REPS / 2], ms[v][0]);
    }
    return sink == 12345.f; /* keeps the sums live */
}
