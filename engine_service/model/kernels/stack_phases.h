/* A bench build's clock on each phase of decode_stack's layers (layers_in_one_region), per thread
 * of a team of two: built only with -DSLUICE_STACK_PHASES (scripts/bench_stack.c's header), never
 * into the engine's library. At the process's exit it prints each phase's mean microseconds a
 * layer for each thread, from the time-stamp counter, whose rate it measures against
 * CLOCK_MONOTONIC. Why: a step's own split (what its attention, each product with its barrier and
 * copies, and the work between them take) is what tells where a step loses against a plain read of
 * its weights (docs/performance.md, "stop 54"). */
#ifndef SLUICE_STACK_PHASES_H
#define SLUICE_STACK_PHASES_H

#include <stdint.h>
#include <stdio.h>
#include <time.h>
#include <x86intrin.h>

enum { PHASE_ATTENTION, PHASE_O, PHASE_NORM, PHASE_GATE_UP, PHASE_SILU, PHASE_DOWN, PHASE_QKV, PHASE_END };
static const char *const phase_names[PHASE_END] = {
    "attention (partitions, barrier, combine)", "o (its barrier and copies in)", "residual and norm",
    "gate/up", "SiLU", "down", "residual, norm, qkv, rotary"};
/* each thread's stamps and sums, on lines of their own: the two threads' writes share no line */
static struct __attribute__((aligned(64))) {
    uint64_t at[PHASE_END + 1];
    double ticks[PHASE_END];
    long layers;
} phases[2];

/* thread t reaches the start of phase k (PHASE_END: the end of the layer, which adds it up) */
static inline void stack_phase(int t, int k) {
    if (t > 1) return;
    phases[t].at[k] = __rdtsc();
    if (k != PHASE_END) return;
    for (int p = 0; p < PHASE_END; p++) phases[t].ticks[p] += (double)(phases[t].at[p + 1] - phases[t].at[p]);
    phases[t].layers++;
}

__attribute__((destructor)) static void stack_phases_print(void) {
    if (phases[0].layers == 0) return;
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    const uint64_t t0 = __rdtsc();
    double ns;
    do {
        clock_gettime(CLOCK_MONOTONIC, &b);
        ns = (double)(b.tv_sec - a.tv_sec) * 1e9 + (double)(b.tv_nsec - a.tv_nsec);
    } while (ns < 1e8);
    const double ticks_per_us = (double)(__rdtsc() - t0) / ns * 1e3;
    fprintf(stderr, "decode_stack's phases, us a layer (%ld layers), thread 0 / thread 1:\n", phases[0].layers);
    for (int p = 0; p < PHASE_END; p++)
        fprintf(stderr, "  %-42s %8.2f %8.2f\n", phase_names[p], phases[0].ticks[p] / (double)phases[0].layers / ticks_per_us,
                phases[1].layers ? phases[1].ticks[p] / (double)phases[1].layers / ticks_per_us : 0.0);
}

#endif
