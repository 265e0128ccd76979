/* What the C benches under scripts/ share: a monotonic clock, medians, and memory on 2 MiB pages
 * (an anonymous mapping advised for huge pages, as the engine's weights lie). Linux only. */
#ifndef SLUICE_BENCH_HARNESS_H
#define SLUICE_BENCH_HARNESS_H

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

#endif
