/* The bfloat16 products' prefetch, in a burst or spread out: SmolLM2-135M's 121 products (269 MB,
 * oneDNN's packed layout as kernels/packed_gemv.c reads it) streamed back to back through the
 * one-row VDPBF16PS loop and the AMX tiles, with every line of the chunk two ahead prefetched into
 * L2 either as 64 prefetches at the chunk's start (the seventh round) or a few between the loads
 * (the eighth: 4 lines a pair, 16 a tile). The four variants alternate; medians of 15.
 *
 *   gcc -O3 -march=native -fopenmp scripts/bench_prefetch.c -o /tmp/bench_prefetch
 *   OMP_NUM_THREADS=2 /tmp/bench_prefetch [rows, 2-16, default 7]
 *
 * Needs AVX512-BF16 and AMX (Linux 5.16+). The weights are constants: only the reads are timed. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define BN 64
#define BK 32
#define CHUNK (BN * BK)
#define REPS 15

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void configure(int rows) {
    struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 4; t++) c.rows[t] = (uint8_t)rows, c.colsb[t] = 64;
    c.rows[4] = (uint8_t)rows, c.colsb[4] = 64;
    for (int t = 5; t < 8; t++) c.rows[t] = 16, c.colsb[t] = 64;
    _tile_loadconfig(&c);
}

static inline void lines(const uint16_t *chunk, int first, int count) {
    for (int l = first; l < first + count; l++) _mm_prefetch((const char *)chunk + 64 * l, _MM_HINT_T2);
}

static void one_row(const uint16_t *block, const uint16_t *x, int64_t chunks, float *out, int spread) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t c = 0; c < chunks; c++) {
        const uint16_t *chunk = block + c * CHUNK, *xc = x + c * BK;
        if (!spread) lines(chunk + 2 * CHUNK, 0, 64);
        for (int p = 0; p < BK / 2; p++) {
            if (spread) lines(chunk + 2 * CHUNK, 4 * p, 4);
            const uint16_t *wp = chunk + p * 2 * BN;
            uint32_t xp;
            memcpy(&xp, xc + 2 * p, sizeof xp);
            const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xp);
            a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(wp), xv);
            a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(wp + 32), xv);
            a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_loadu_si512(wp + 64), xv);
            a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_loadu_si512(wp + 96), xv);
        }
    }
    _mm512_storeu_ps(out, a0), _mm512_storeu_ps(out + 16, a1);
    _mm512_storeu_ps(out + 32, a2), _mm512_storeu_ps(out + 48, a3);
}

static void tiles(const uint16_t *block, const uint16_t *x, int64_t chunks, float *out, int spread) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t c = 0; c < chunks; c++) {
        const uint16_t *chunk = block + c * CHUNK, *ahead = chunk + 2 * CHUNK;
        if (!spread) lines(ahead, 0, 64);
        _tile_loadd(4, x + c * BK, 64);
        if (spread) lines(ahead, 0, 16);
        _tile_loadd(5, chunk, 256);
        _tile_dpbf16ps(0, 4, 5);
        if (spread) lines(ahead, 16, 16);
        _tile_loadd(6, chunk + 32, 256);
        _tile_dpbf16ps(1, 4, 6);
        if (spread) lines(ahead, 32, 16);
        _tile_loadd(7, chunk + 64, 256);
        _tile_dpbf16ps(2, 4, 7);
        if (spread) lines(ahead, 48, 16);
        _tile_loadd(5, chunk + 96, 256);
        _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, out, 256);
    _tile_stored(1, out + 16, 256);
    _tile_stored(2, out + 32, 256);
    _tile_stored(3, out + 48, 256);
}

static int cmp(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    const int rows = argc > 1 ? atoi(argv[1]) : 7;
    if (rows < 2 || rows > 16 || syscall(SYS_arch_prctl, 0x1023, 18) != 0) {
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
    uint16_t *x = aligned_alloc(64, 16 * 2048 * 2);
    for (int i = 0; i < 16 * 2048; i++) x[i] = 0x3f80;
    const char *names[4] = {"one row, burst", "one row, spread", "tiles, burst", "tiles, spread"};
    double ms[4][REPS];
    float sink = 0.f;
    for (int rep = 0; rep < REPS; rep++)
        for (int v = 0; v < 4; v++) {
            const int amx = v >= 2, spread = v % 2;
            const double started = now();
            for (int i = 0; i < count; i++) {
                const int64_t blocks = n[i] / BN, chunks = k[i] / BK;
#pragma omp parallel reduction(+ : sink)
                {
                    if (amx) configure(rows);
#pragma omp for schedule(static)
                    for (int64_t b = 0; b < blocks; b++) {
                        float sums[16 * BN];
                        if (amx) tiles(w[i] + b * chunks * CHUNK, x, chunks, sums, spread);
                        else one_row(w[i] + b * chunks * CHUNK, x, chunks, sums, spread);
                        sink += sums[0];
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
