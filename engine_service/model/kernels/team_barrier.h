/* A barrier for the thread team of a parallel region that meets many times: a decode step in one
 * region meets ~180 times a step (decode_stack.c, layers_in_one_region).
 *
 * Why not `omp barrier`: libgomp's last thread to arrive makes a futex wake system call at every
 * barrier, whether or not anyone sleeps (~0.3-0.5 us on a 2-vCPU VM against ~0.05-0.2 us for
 * this one). And under OMP_WAIT_POLICY=PASSIVE, which a served engine sets
 * (engine_service/service/main.py) so that idle OpenMP threads leave the CPUs to the gateway and
 * Redis, every thread that arrives first sleeps in the kernel until the futex wakes it: ~20 us a
 * barrier, which made a bfloat16 step 1.1-1.4 times as long (docs/performance.md, "Issue 25: the
 * step's own barrier"). Here each thread stores how many barriers it has passed on a cache line of
 * its own and spins, with PAUSE, until every other thread's count has reached its own. A peer that
 * the OS has preempted is waited for with sched_yield after a few thousand spins, so that the CPU
 * goes to whatever else is runnable there; the wait between decode steps, outside the region,
 * stays the runtime's (passive in a served engine).
 *
 * Every thread of the team must pass the same barriers on the same TeamBarrier, zeroed before the
 * team's first; the counts carry on from one region to the next only for a team of the same
 * threads. A team larger than TEAM_BARRIER_MAX, or a NULL barrier, meets at `omp barrier`. */
#ifndef SLUICE_TEAM_BARRIER_H
#define SLUICE_TEAM_BARRIER_H

#include <omp.h>
#include <sched.h>
#include <stdint.h>

#define TEAM_BARRIER_MAX 64
#define TEAM_BARRIER_SPINS 4096 /* PAUSEs before a waiting thread starts yielding its CPU */

typedef struct {
    uint32_t passed __attribute__((aligned(64))); /* barriers this thread has arrived at; only it writes */
} TeamArrival;

/* tagged, so that headers can point to one without including this file */
typedef struct TeamBarrier {
    TeamArrival arrival[TEAM_BARRIER_MAX];
} TeamBarrier;

static inline void team_barrier_pause(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static inline void team_barrier(TeamBarrier *b) {
    const int n = omp_get_num_threads();
    if (n == 1) return;
    if (b == NULL || n > TEAM_BARRIER_MAX) {
        _Pragma("omp barrier")
        return;
    }
    const int me = omp_get_thread_num();
    const uint32_t mine = b->arrival[me].passed + 1;
    /* release: what this thread wrote before the barrier is seen by whoever reads `mine` */
    __atomic_store_n(&b->arrival[me].passed, mine, __ATOMIC_RELEASE);
    for (int i = 0; i < n; i++) {
        if (i == me) continue;
        /* signed difference: the counts may wrap */
        for (uint32_t spins = 0; (int32_t)(__atomic_load_n(&b->arrival[i].passed, __ATOMIC_ACQUIRE) - mine) < 0;) {
            if (spins < TEAM_BARRIER_SPINS) {
                spins++;
                team_barrier_pause();
            } else {
                sched_yield();
            }
        }
    }
}

#endif
