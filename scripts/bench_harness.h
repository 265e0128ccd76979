/* What the C benches under scripts/ share: a monotonic clock, medians, memory on 2 MiB pages (an
 * anonymous mapping advised for huge pages, as the engine's weights lie), and where two threads
 * sit. Linux only; built with -fopenmp. */
#ifndef SLUICE_BENCH_HARNESS_H
#define SLUICE_BENCH_HARNESS_H

#include <omp.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>

#define HUGE_PAGE (2u << 20)

static inline double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static inline int cmp_doubles(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* sorts v */
static inline double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_doubles);
    return v[n / 2];
}

/* bytes on huge pages, 2 MiB aligned; NULL when the mapping fails */
static inline void *huge_alloc(size_t bytes) {
    const size_t size = (bytes + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE;
    char *p = mmap(NULL, size + HUGE_PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return NULL;
    char *aligned = (char *)(((uintptr_t)p + HUGE_PAGE - 1) & ~(uintptr_t)(HUGE_PAGE - 1));
    madvise(aligned, size, MADV_HUGEPAGE);
    return aligned;
}

/* One way's latency in ns of a cache line handed from one of two threads to the other and back
 * `iters` times: tens of ns while a VM's two vCPUs share an L3 (one CCD), 100+ across two. Where
 * the threads sit decides what the machine reads (scripts/bench_placement.c, docs/performance.md,
 * tenth round). Needs -fopenmp. */
static _Alignas(64) atomic_int ping_pong_flag;

static inline double ping_pong(int iters) {
    atomic_store(&ping_pong_flag, 0);
    double started = 0, done = 0;
#pragma omp parallel num_threads(2)
    {
        const int me = omp_get_thread_num();
#pragma omp barrier
        if (me == 0) started = now();
        for (int i = 0; i < iters; i++) {
            const int wait = 2 * i + me;
            while (atomic_load_explicit(&ping_pong_flag, memory_order_acquire) != wait) {
            }
            atomic_store_explicit(&ping_pong_flag, wait + 1, memory_order_release);
        }
#pragma omp barrier
        if (me == 0) done = now();
    }
    return (done - started) / iters / 2 * 1e9;
}

#endif
