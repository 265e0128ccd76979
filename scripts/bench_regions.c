/* SmolLM2-135M's 121 bfloat16 one-row products (269 MB in oneDNN's packed layout) each in its own
 * OpenMP parallel region, as packed_gemm_bf16 runs them, against all of them in one parallel
 * region whose threads meet at one barrier a product (an orphaned omp for): what forking and
 * joining the team for every product costs. The same loop either way (block_sums_256, the one-row
 * loop without software prefetch, as on AMD); random weights on 2 MiB pages; the two alternate, medians of 30.
 *
 *   gcc -O3 -march=native -fopenmp -fno-math-errno scripts/bench_regions.c -o /tmp/bench_regions
 *   OMP_NUM_THREADS=2 /tmp/bench_regions
 *
 * Needs AVX512-BF16 and Linux (madvise). docs/performance.md, twelfth round. */
#include "../engine_service/model/kernels/packed_gemv.c"
#include <stdio.h>

#include "bench_harness.h"

#define P 121

int main(void) {
    int64_t n[P], k[P]; uint16_t *w[P]; int c = 0;
    for (int l = 0; l < 30; l++) { n[c] = 960, k[c++] = 576; n[c] = 576, k[c++] = 576; n[c] = 3072, k[c++] = 576; n[c] = 576, k[c++] = 1536; }
    n[c] = 49152, k[c++] = 576;
    for (int i = 0; i < P; i++) { w[i] = huge_alloc((size_t)n[i] * k[i] * 2); if (w[i] == NULL) return 1; for (int64_t j = 0; j < n[i] * k[i]; j++) w[i][j] = 0x3c00 + (j & 0x7f); }
    uint16_t *x = malloc(2 * 1536), *y = malloc(2 * 49152); for (int i = 0; i < 1536; i++) x[i] = 0x3c00;
    double sink = 0, ta[30], tb[30];
    for (int r = -2; r < 30; r++) {
        double t0 = now();
        for (int i = 0; i < P; i++) { packed_gemm_bf16(w[i], x, NULL, y, 1, n[i], k[i], n[i], k[i]); sink += y[0]; }
        double t1 = now();
        #pragma omp parallel
        {
            for (int i = 0; i < P; i++) {
                const int64_t blocks = n[i] / PG_BLOCK_N, chunks = k[i] / PG_BLOCK_K;
                #pragma omp for schedule(static)
                for (int64_t b = 0; b < blocks; b++) {
                    float sums[PG_BLOCK_N];
                    block_sums_256(w[i] + b * chunks * CHUNK, x, chunks, sums, NULL);
                    for (int j = 0; j < PG_BLOCK_N; j++) y[b * PG_BLOCK_N + j] = f32_to_bf16(sums[j]);
                }
                #pragma omp master
                sink += y[0];
            }
        }
        double t2 = now();
        if (r >= 0) ta[r] = t1 - t0, tb[r] = t2 - t1;
    }
    const double ma = median(ta, 30), mb = median(tb, 30);
    printf("own regions %.3f ms, one region %.3f ms: %.3fx (sink %g)\n", ma * 1e3, mb * 1e3, ma / mb, sink);
}
