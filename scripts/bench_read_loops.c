/* How fast two threads read one buffer (each its contiguous half, one parallel region), by the
 * loop that reads it: 512-bit loads into one integer sum (the loop bench_stack.c read with until
 * stop 51), 256-bit loads into eight float sums (the loop it reads with now), and the bfloat16
 * one-row kernel's own loop (packed_gemv.c's block_sums_256: VDPBF16PS on 256-bit halves, a block
 * of 48 chunks at a time). The three alternate within each round; each round prints its placement
 * (a cache line passed between the two threads: under 80 ns one CCD, else two) and the median
 * of 5 reads each.
 *
 *   gcc -O3 -march=native -fopenmp scripts/bench_read_loops.c -o /tmp/bench_read_loops
 *   OMP_NUM_THREADS=2 OMP_PROC_BIND=true /tmp/bench_read_loops [MB] [rounds]
 *
 * Needs AVX512-BF16 and Linux (madvise). docs/performance.md, "the last block in halves". */
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_harness.h"

static double sink;
static char *buf;
static int64_t lines;

typedef double (*ReadLoop)(const char *, int64_t, int64_t);

static double one_sum_512(const char *b, int64_t lo, int64_t hi) {
    __m512i a = _mm512_setzero_si512();
    for (int64_t j = lo; j < hi; j++) a = _mm512_add_epi32(a, _mm512_load_si512(b + 64 * j));
    return _mm512_reduce_add_epi32(a);
}

static double eight_sums_256(const char *b, int64_t lo, int64_t hi) {
    __m256 a[8];
    for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
    for (int64_t j = lo; j + 4 <= hi; j += 4)
        for (int i = 0; i < 8; i++) a[i] = _mm256_add_ps(a[i], _mm256_load_ps((const float *)(b + 64 * j) + 8 * i));
    for (int i = 1; i < 8; i++) a[0] = _mm256_add_ps(a[0], a[i]);
    float f[8];
    _mm256_storeu_ps(f, a[0]);
    return f[0];
}

/* the lines as 4 KB chunks of 64 outputs x 32 inputs, blocks of 48 chunks (K = 1536) */
static uint16_t x_in[1536];
static double kernel_loop(const char *b, int64_t lo, int64_t hi) {
    const uint16_t *w = (const uint16_t *)b;
    __m256 total = _mm256_setzero_ps();
    for (int64_t blk = lo / 64; blk + 48 <= hi / 64; blk += 48) {
        __m256 acc[8];
        for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
        for (int64_t c = 0; c < 48; c++) {
            const uint16_t *chunk = w + (blk + c) * 2048, *xc = x_in + c * 32;
            for (int pair = 0; pair < 16; pair++) {
                const uint16_t *wp = chunk + pair * 128;
                uint32_t xp;
                memcpy(&xp, xc + 2 * pair, sizeof xp);
                const __m256bh xv = (__m256bh)_mm256_set1_epi32((int)xp);
                for (int j = 0; j < 8; j++)
                    acc[j] = _mm256_dpbf16_ps(acc[j], (__m256bh)_mm256_loadu_si256((const __m256i *)(wp + 16 * j)), xv);
            }
        }
        for (int j = 0; j < 8; j++) total = _mm256_add_ps(total, acc[j]);
    }
    float f[8];
    _mm256_storeu_ps(f, total);
    return f[0];
}

/* GB/s of one two-thread read of the buffer through `loop` */
static double read_once(ReadLoop loop) {
    const double t0 = now();
    double total = 0;
#pragma omp parallel reduction(+ : total)
    {
        const int t = omp_get_thread_num(), n = omp_get_num_threads();
        total += loop(buf, t * lines / n, (t + 1) * lines / n);
    }
    const double s = now() - t0;
    sink += total;
    return (double)lines * 64 / s / 1e9;
}

int main(int argc, char **argv) {
    const int64_t mb = argc > 1 ? atoll(argv[1]) : 269;
    const int rounds = argc > 2 ? atoi(argv[2]) : 6;
    lines = mb * 1000000 / 64 / 3072 * 3072; /* whole blocks of 48 chunks */
    buf = huge_alloc((size_t)lines * 64);
    memset(buf, 0, (size_t)lines * 64);
    ReadLoop loops[] = {one_sum_512, eight_sums_256, kernel_loop};
    printf("%.0f MB, two threads, each its contiguous half; GB/s, the median of 5 reads\n", lines * 64 / 1e6);
    printf("%-10s%18s%18s%18s\n", "placement", "512-bit, one sum", "256-bit, 8 sums", "kernel's loop");
    for (int r = 0; r < rounds; r++) {
        const double latency = ping_pong(3000);
        double g[3][5];
        for (int i = 0; i < 5; i++)
            for (int k = 0; k < 3; k++) g[k][i] = read_once(loops[k]);
        printf("%-10s%18.1f%18.1f%18.1f\n", latency >= 80 ? "two CCDs" : "one CCD", median(g[0], 5), median(g[1], 5),
               median(g[2], 5));
    }
    fprintf(stderr, "(sink %g)\n", sink);
    return 0;
}
