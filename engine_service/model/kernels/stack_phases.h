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
_Static_assert(PHASE_END + 1 <= 8, "a thread's stamps fill one row of 8");
/* a row of 8 a thread, on a line of its own: the two threads' stamps share no line */
static uint64_t phase_at[2][8] __attribute__((aligned(64)));
static double phase_ticks[2][8] __attribute__((aligned(64)));
static long phase_layers[2][8] __attribute__((aligned(64)));

/* thread t reaches the start of phase k (PHASE_END: the end of the layer, which adds it up) */
static inline void stack_phase(int t, int k) {
    if (t > 1) return;
    phase_at[t][k] = __rdtsc();
    if (k != PHASE_END) return;
    for (int p = 0; p < PHASE_END; p++) phase_ticks[t][p] += (double)(phase_at[t][p + 1] - phase_at[t][p]);
    phase_layers[t][0]++;
}

__attribute__((destructor)) static void stack_phases_print(void) {
    if (phase_layers[0][0] == 0) return;
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    const uint64_t t0 = __rdtsc();
    double ns;
    do {
        clock_gettime(CLOCK_MONOTONIC, &b);
        ns = (double)(b.tv_sec - a.tv_sec) * 1e9 + (double)(b.tv_nsec - a.tv_nsec);
    } while (ns < 1e8);
    const double ticks_per_us = (double)(__rdtsc() - t0) / ns * 1e3;
    fprintf(stderr, "decode_stack's phases, us a layer (%ld layers), thread 0 / thread 1:\n", phase_layers[0][0]);
    for (int p = 0; p < PHASE_END; p++)
        fprintf(stderr, "  %-42s %8.2f %8.2f\n", phase_names[p],
                phase_ticks[0][p] / (double)phase_layers[0][0] / ticks_per_us,
                phase_layers[1][0] ? phase_ticks[1][p] / (double)phase_layers[1][0] / ticks_per_us : 0.0);
}

#endif
