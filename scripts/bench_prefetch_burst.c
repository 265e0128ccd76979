/* Whether software prefetches issued ahead of time land: one thread reads a 320 KB region (about a
 * thread's run of the output projection) right after the caches were flushed by a 64 MB read-modify-
 * write, with each way of fetching it first, then a 12 us wait (about one layer's attention), then
 * the timed read. Each way alternates with a read of the same cold region and no fetch, the region
 * moving through a 64 MB buffer; it prints the mean time of each and their ratio.
 *
 *   gcc -O2 -march=native scripts/bench_prefetch_burst.c -o /tmp/bench_prefetch_burst
 *   /tmp/bench_prefetch_burst
 *
 * The ways: a read of the region itself (it is then warm: what a fetch could reach at best);
 * every line prefetched into L2 in one burst (PREFETCHT1, T0 and T2); every line prefetched with
 * a few PAUSEs after each, or in groups of 16 lines with ~30 ns between groups; and only the first
 * 1, 2, 4 or 8 lines of each 4 KB page (to start the hardware prefetcher on every page).
 * docs/performance.md, "stop 54". Needs AVX2 and Linux (madvise, bench_harness.h). */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_harness.h"

#define REGION (320 << 10)
#define BUFFER ((size_t)64 << 20)
#define FLUSH ((size_t)64 << 20)
#define ROUNDS 200

static double sink;

static void spin_us(double us) {
    const double t0 = now();
    while ((now() - t0) * 1e6 < us) _mm_pause();
}

static double read_region(const char *p) {
    __m256 a = _mm256_setzero_ps();
    const double t0 = now();
    for (int i = 0; i < REGION; i += 64) a = _mm256_add_ps(a, _mm256_load_ps((const float *)(p + i)));
    const double t = now() - t0;
    float f[8];
    _mm256_storeu_ps(f, a);
    sink += f[0];
    return t;
}

enum { WARM, BURST_T1, BURST_T0, BURST_T2, PAUSED, GROUPS, PAGE_1, PAGE_2, PAGE_4, PAGE_8, WAYS };
static const char *names[WAYS] = {"a read of the region (warm)", "burst, PREFETCHT1", "burst, PREFETCHT0",
                                  "burst, PREFETCHT2", "each line, 8 PAUSEs after", "16 lines, ~30 ns after",
                                  "1 line a page", "2 lines a page", "4 lines a page", "8 lines a page"};

static void fetch(const char *p, int way) {
    switch (way) {
    case WARM: read_region(p); break;
    case BURST_T1: for (int i = 0; i < REGION; i += 64) _mm_prefetch(p + i, _MM_HINT_T1); break;
    case BURST_T0: for (int i = 0; i < REGION; i += 64) _mm_prefetch(p + i, _MM_HINT_T0); break;
    case BURST_T2: for (int i = 0; i < REGION; i += 64) _mm_prefetch(p + i, _MM_HINT_T2); break;
    case PAUSED:
        for (int i = 0; i < REGION; i += 64) {
            _mm_prefetch(p + i, _MM_HINT_T1);
            for (int k = 0; k < 8; k++) _mm_pause();
        }
        break;
    case GROUPS:
        for (int i = 0; i < REGION; i += 64) {
            _mm_prefetch(p + i, _MM_HINT_T1);
            if ((i & 1023) == 0) spin_us(0.03);
        }
        break;
    default: {
        const int lines = way == PAGE_1 ? 1 : way == PAGE_2 ? 2 : way == PAGE_4 ? 4 : 8;
        for (int page = 0; page < REGION; page += 4096)
            for (int l = 0; l < lines; l++) _mm_prefetch(p + page + 64 * l, _MM_HINT_T1);
    }
    }
}

int main(void) {
    char *buf = huge_alloc(BUFFER), *flush = huge_alloc(FLUSH);
    if (buf == NULL || flush == NULL) return 1;
    memset(buf, 1, BUFFER);
    memset(flush, 0, FLUSH);
    printf("%-30s%12s%12s%8s\n", "fetched 12 us before the read", "cold, us", "fetched, us", "ratio");
    for (int way = 0; way < WAYS; way++) {
        double t[2] = {0, 0};
        for (int r = 0; r < ROUNDS; r++) {
            const char *p = buf + (size_t)(r % 100) * 2 * REGION % (BUFFER - REGION);
            for (int fetched = 0; fetched < 2; fetched++) {
                /* a read-modify-write of every line: memset's non-temporal stores would leave the caches be */
                for (size_t i = 0; i < FLUSH; i += 64) flush[i] += (char)r;
                if (fetched) fetch(p, way);
                spin_us(12);
                t[fetched] += read_region(p);
            }
        }
        printf("%-30s%12.2f%12.2f%8.2f\n", names[way], t[0] / ROUNDS * 1e6, t[1] / ROUNDS * 1e6, t[0] / t[1]);
    }
    fprintf(stderr, "(sink %g)\n", sink);
    return 0;
}
