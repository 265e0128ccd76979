/* SmolLM2-135M's 121 int4 products (one row, as one stream's decode step calls them: q4_linear_f32,
 * two threads) with the one-row loop's software prefetch on and off, alternating in one process:
 * the medians and the median of the paired ratios. Random codes on 2 MiB pages (84 MB, so they
 * stream from memory); the two settings' outputs are compared bit for bit.
 *
 *   gcc -O3 -march=native -fopenmp -fno-math-errno scripts/bench_q4.c \
 *       engine_service/model/kernels/q4_gemv.c -lm -o /tmp/bench_q4
 *   OMP_NUM_THREADS=2 /tmp/bench_q4 [rounds]
 *
 * Needs AVX512-VNNI and Linux (madvise). docs/performance.md, fourteenth round. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../engine_service/model/kernels/q4_gemv.h"
#include "bench_harness.h"

#define GROUP 32

typedef struct {
    uint8_t *codes;
    uint16_t *scales_zeros;
    int64_t n, k;
} Q4Weight;

static uint32_t state = 1;
static uint32_t random_u32(void) {
    state ^= state << 13, state ^= state >> 17, state ^= state << 5;
    return state;
}

static Q4Weight weight(int64_t n, int64_t k) {
    const int64_t sz = n / Q4_BLOCK_N * (k / GROUP) * 2 * Q4_BLOCK_N;
    Q4Weight w = {huge_alloc((size_t)(n * k / 2)), huge_alloc(sizeof(uint16_t) * (size_t)sz), n, k};
    if (w.codes == NULL || w.scales_zeros == NULL) abort();
    for (int64_t i = 0; i < n * k / 2; i++) w.codes[i] = (uint8_t)random_u32();
    for (int64_t i = 0; i < sz; i++) w.scales_zeros[i] = (uint16_t)(0x3c00 + (random_u32() & 0x7f));
    return w;
}

int main(int argc, char **argv) {
    const int rounds = argc > 1 ? atoi(argv[1]) : 30;
    if (!q4_gemv_supported() || rounds < 1) return 1;
    static Q4Weight ws[121];
    int count = 0;
    for (int l = 0; l < 30; l++) {
        ws[count++] = weight(960, 576), ws[count++] = weight(576, 576);
        ws[count++] = weight(3072, 576), ws[count++] = weight(576, 1536);
    }
    ws[count++] = weight(49152, 576);
    double bytes = 0;
    for (int i = 0; i < count; i++) bytes += ws[i].n * ws[i].k / 2 + ws[i].n / Q4_BLOCK_N * (ws[i].k / GROUP) * 64;
    float *x = malloc(sizeof(float) * 1536), *y[2] = {malloc(sizeof(float) * 49152), malloc(sizeof(float) * 49152)};
    for (int i = 0; i < 1536; i++) x[i] = (float)((int)(random_u32() % 2001) - 1000) / 997.0f;
    double *t[2] = {malloc(sizeof(double) * rounds), malloc(sizeof(double) * rounds)}, *ratio = malloc(sizeof(double) * rounds);
    int same = 1;
    for (int r = -2; r < rounds; r++) {
        for (int j = 0; j < 2; j++) {
            const int on = (r + j) % 2 == 0; /* in turn first */
            q4_gemv_set_prefetch(on);
            const double t0 = now();
            for (int i = 0; i < count; i++)
                if (q4_linear_f32(ws[i].codes, ws[i].scales_zeros, x, y[on], 1, ws[i].n, ws[i].n, ws[i].k, GROUP)) abort();
            if (r >= 0) t[on][r] = now() - t0;
        }
        same &= memcmp(y[0], y[1], sizeof(float) * 49152) == 0;
        if (r >= 0) ratio[r] = t[1][r] / t[0][r];
    }
    const int native = q4_gemv_set_prefetch(-1);
    const double off = median(t[0], rounds), on = median(t[1], rounds);
    printf("121 int4 products, one row, %.1f MB, medians of %d (the CPU's default: prefetch %s)\n", bytes / 1e6,
           rounds, native ? "on" : "off");
    printf("prefetch on   %.3f ms  %.1f GB/s\n", 1e3 * on, bytes / on / 1e9);
    printf("prefetch off  %.3f ms  %.1f GB/s\n", 1e3 * off, bytes / off / 1e9);
    printf("on / off, the median of the paired ratios: %.3f; outputs the same bit for bit: %s\n", median(ratio, rounds),
           same ? "yes" : "NO");
    return same ? 0 : 1;
}
