/* The bfloat16 one-row products of SmolLM2-135M (121 of them, 269 MB in oneDNN's packed layout)
 * from 4 KiB pages and from 2 MiB huge pages, and each thread's share laid out in one contiguous
 * run instead of one buffer per product ("arena"). The loop is packed_gemv.c's own one-row loop
 * (block_sums_256, the one-row loop without software prefetch, as on AMD), split between two threads as the
 * shipped kernel splits it (omp static over blocks of 64 outputs). The four variants alternate;
 * medians of 25. The weights are random bfloat16 values; every sum is kept live.
 *
 *   gcc -O3 -march=native -fopenmp scripts/bench_pages.c -o /tmp/bench_pages
 *   OMP_NUM_THREADS=2 /tmp/bench_pages
 *
 * Needs AVX512-BF16 and Linux (madvise). docs/performance.md, eleventh round. */
#include "../engine_service/model/kernels/packed_gemv.c"

#include <stdio.h>

#include "bench_harness.h"

#define REPS 25
#define PRODUCTS 121

static uint32_t state = 1;
static uint16_t random_bf16(void) { /* xorshift: values near 1, never constant pages */
    state ^= state << 13, state ^= state >> 17, state ^= state << 5;
    return (uint16_t)(0x3f80 + (state & 0x3f));
}

/* bytes on 4 KiB pages (an ordinary allocation) or in a mapping advised for huge pages */
static uint16_t *allocate(size_t bytes, int huge) {
    return huge ? huge_alloc(bytes) : aligned_alloc(4096, (bytes + 4095) / 4096 * 4096);
}

int main(void) {
    int64_t n[PRODUCTS], k[PRODUCTS];
    int count = 0;
    for (int l = 0; l < 30; l++) { /* qkv, o, gate|up, down */
        n[count] = 960, k[count++] = 576;
        n[count] = 576, k[count++] = 576;
        n[count] = 3072, k[count++] = 576;
        n[count] = 576, k[count++] = 1536;
    }
    n[count] = 49152, k[count++] = 576; /* the LM head */
    /* thread 0 takes blocks [0, half), thread 1 [half, blocks): omp static's split for two */
    int64_t half[PRODUCTS], offset[2][2][PRODUCTS];
    size_t run[2] = {0, 0};
    for (int i = 0; i < count; i++) {
        half[i] = (n[i] / PG_BLOCK_N + 1) / 2;
        offset[0][0][i] = offset[1][0][i] = (int64_t)run[0] / 2;
        offset[0][1][i] = offset[1][1][i] = (int64_t)run[1] / 2;
        run[0] += (size_t)(half[i] * PG_BLOCK_N * k[i] * 2);
        run[1] += (size_t)((n[i] / PG_BLOCK_N - half[i]) * PG_BLOCK_N * k[i] * 2);
    }
    uint16_t *separate[2][PRODUCTS], *arena[2][2];
    for (int huge = 0; huge < 2; huge++) {
        for (int i = 0; i < count; i++) {
            const size_t size = (size_t)(n[i] * k[i]);
            if ((separate[huge][i] = allocate(size * 2, huge)) == NULL) return 1;
            for (size_t j = 0; j < size; j++) separate[huge][i][j] = random_bf16();
        }
        for (int t = 0; t < 2; t++) {
            if ((arena[huge][t] = allocate(run[t], huge)) == NULL) return 1;
            for (size_t j = 0; j < run[t] / 2; j++) arena[huge][t][j] = random_bf16();
        }
    }
    uint16_t *x = aligned_alloc(64, 1536 * 2);
    for (int i = 0; i < 1536; i++) x[i] = 0x3f80;
    const char *names[4] = {"separate, 4 KiB", "separate, 2 MiB", "arena, 4 KiB", "arena, 2 MiB"};
    double ms[4][REPS];
    float sink = 0.f;
    for (int rep = 0; rep < REPS; rep++)
        for (int v = 0; v < 4; v++) {
            const int huge = v & 1, in_arena = v >= 2;
            const double started = now();
            for (int i = 0; i < count; i++) {
                const int64_t blocks = n[i] / PG_BLOCK_N, chunks = k[i] / PG_BLOCK_K;
#pragma omp parallel num_threads(2) reduction(+ : sink)
                {
                    const int t = omp_get_thread_num();
                    const int64_t first = t ? half[i] : 0, last = t ? blocks : half[i];
                    float sums[PG_BLOCK_N];
                    for (int64_t b = first; b < last; b++) {
                        const uint16_t *block = in_arena ? arena[huge][t] + offset[huge][t][i] + (b - first) * chunks * CHUNK
                                                         : separate[huge][i] + b * chunks * CHUNK;
                        block_sums_256(block, x, chunks, sums, NULL);
                        for (int r = 0; r < PG_BLOCK_N; r += 16) sink += sums[r] + sums[r + 1]; /* all four accumulators */
                    }
                }
            }
            ms[v][rep] = (now() - started) * 1e3;
        }
    double bytes = 0;
    for (int i = 0; i < count; i++) bytes += (double)(n[i] * k[i] * 2);
    printf("121 one-row products, two threads, ms (median of %d; min), GB/s at the median\n", REPS);
    for (int v = 0; v < 4; v++) {
        qsort(ms[v], REPS, sizeof(double), cmp_doubles);
        printf("  %-16s %7.2f  %7.2f  %5.1f\n", names[v], ms[v][REPS / 2], ms[v][0], bytes / ms[v][REPS / 2] / 1e6);
    }
    return sink == 12345.f;
}
