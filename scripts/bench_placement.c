/* Where a VM's two vCPUs sit, and what that does to the read bandwidth: each sample times a cache
 * line passed back and forth between two threads (tens of ns within one L3 / CCD, 100+ across
 * two) and then a two-thread read of a 512 MB buffer, so the two can be set side by side.
 *
 *   gcc -O3 -march=native -fopenmp scripts/bench_placement.c -o /tmp/bench_placement
 *   /tmp/bench_placement [samples, default 150]
 *
 * Prints each sample as "latency ns/GB/s", then the mean bandwidth of the samples whose latency
 * says "one CCD" (under 80 ns) and of the others (docs/performance.md, tenth round). Needs AVX-512. */
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>

#include "bench_harness.h"

int main(int argc, char **argv) {
    const int samples = argc > 1 ? atoi(argv[1]) : 150;
    const size_t n = (512u << 20) / 4;
    float *buf = aligned_alloc(64, n * 4);
    for (size_t i = 0; i < n; i++) buf[i] = (float)i;
    double near_sum = 0, far_sum = 0;
    int near = 0, far = 0;
    float sink = 0;
    for (int s = 0; s < samples; s++) {
        const double latency = ping_pong(20000);
        const double started = now();
        float total = 0;
#pragma omp parallel for reduction(+ : total) num_threads(2)
        for (size_t i = 0; i < n; i += 64) {
            const __m512 a = _mm512_add_ps(_mm512_add_ps(_mm512_load_ps(buf + i), _mm512_load_ps(buf + i + 16)),
                                           _mm512_add_ps(_mm512_load_ps(buf + i + 32), _mm512_load_ps(buf + i + 48)));
            total += _mm512_reduce_add_ps(a);
        }
        const double gb_s = n * 4 / (now() - started) / 1e9;
        sink += total;
        printf("%.0f/%.1f ", latency, gb_s);
        if (latency < 80) near_sum += gb_s, near++;
        else far_sum += gb_s, far++;
        const struct timespec pause = {0, 50000000};
        nanosleep(&pause, NULL);
    }
    printf("\none CCD (latency < 80 ns): %d samples, %.1f GB/s; two: %d samples, %.1f GB/s\n", near,
           near ? near_sum / near : 0.0, far, far ? far_sum / far : 0.0);
    return sink == 1.0f;
}
