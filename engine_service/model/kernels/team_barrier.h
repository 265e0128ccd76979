/* A barrier for the thread team of a parallel region that meets many times: a decode step in one
 * region meets ~150-180 times a step (decode_stack.c, layers_in_one_region).
 *
 * Why not `omp barrier`: libgomp's last thread to arrive makes a futex wake system call at every
 * barrier, whether or not anyone sleeps (~0.3-0.5 us on a 2-vCPU VM against ~0.05-0.2 us for
 * this one). And under OMP_WAIT_POLICY=PASSIVE, which a served engine sets
 * (engine_service/service/main.py) so that idle OpenMP threads leave the CPUs to the gateway and
 * Redis, every thread that arrives first sleeps in the kernel until the futex wakes it: ~20 us a
 * barrier, which made a bfloat16 step 1.1-1.4 times as long (docs/performance.md, "Issue 25: the
 * step's own barrier"). Here each thread stores how many barriers it has passed on a cache line of
 * its own and spins, with PAUSE, until every other thread's count has reached its own. A wait that
 * outlasts TEAM_BARRIER_SPINS (a peer the OS has preempted, on a machine with more runnable threads
 * than cores) sleeps on a futex on the peer's count, and the peer wakes it when it arrives: a
 * woken thread gets its CPU back at once, where spinning or yielding would have handed the time
 * to whatever else runs there. The wait between decode steps, outside the region, stays the
 * runtime's (passive in a served engine).
 *
 * Every thread of the team must pass the same barriers on the same TeamBarrier, zeroed before the
 * team's first; the counts carry on from one region to the next only for a team of the same
 * threads. A team larger than TEAM_BARRIER_MAX, or a NULL barrier, meets at `omp barrier`. */
#ifndef SLUICE_TEAM_BARRIER_H
#define SLUICE_TEAM_BARRIER_H

#include <omp.h>
#include <sched.h>
#include <stdint.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#define TEAM_BARRIER_MAX 64
#ifndef TEAM_BARRIER_SPINS
#define TEAM_BARRIER_SPINS 1024 /* PAUSEs (~25 ns each on Zen 4) before a waiting thread sleeps */
#endif

typedef struct {
    uint32_t passed __attribute__((aligned(64))); /* barriers this thread has arrived at; only it writes */
    uint32_t sleepers; /* threads asleep (or about to be) until `passed` changes */
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

/* until *word != seen (or a spurious return: the caller looks again) */
static inline void team_barrier_sleep(uint32_t *word, uint32_t seen) {
#if defined(__linux__)
    syscall(SYS_futex, word, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
#else
    (void)word, (void)seen;
    sched_yield();
#endif
}

static inline void team_barrier_wake(uint32_t *word) {
#if defined(__linux__)
    syscall(SYS_futex, word, FUTEX_WAKE_PRIVATE, TEAM_BARRIER_MAX, NULL, NULL, 0);
#else
    (void)word;
#endif
}

static inline void team_barrier_fetching(TeamBarrier *b, const char *fetch, const char *fetch_end);
static inline void team_barrier(TeamBarrier *b) { team_barrier_fetching(b, NULL, NULL); }
/* team_barrier; a thread that waits fetches the lines [fetch, fetch_end) into L2 meanwhile, a few
 * lines a turn, and stops fetching when the others arrive */
static inline void team_barrier_fetching(TeamBarrier *b, const char *fetch, const char *fetch_end) {
    const int n = omp_get_num_threads();
    if (n == 1) return;
    if (b == NULL || n > TEAM_BARRIER_MAX) {
        _Pragma("omp barrier")
        return;
    }
    const int me = omp_get_thread_num();
    TeamArrival *own = &b->arrival[me];
    const uint32_t mine = own->passed + 1;
    /* seq_cst, here and for `sleepers` below: either this thread sees a sleeper and wakes it, or the
     * sleeper sees `mine` before it sleeps (the futex looks again too). The release orders what this
     * thread wrote before the barrier before whoever reads `mine`. */
    __atomic_store_n(&own->passed, mine, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&own->sleepers, __ATOMIC_SEQ_CST) != 0) team_barrier_wake(&own->passed);
    for (int i = 0; i < n; i++) {
        if (i == me) continue;
        TeamArrival *other = &b->arrival[i];
        /* signed difference: the counts may wrap */
        for (uint32_t spins = 0;; spins++) {
            const uint32_t seen = __atomic_load_n(&other->passed, __ATOMIC_ACQUIRE);
            if ((int32_t)(seen - mine) >= 0) break;
#if defined(__x86_64__) || defined(__i386__)
            if (fetch < fetch_end) { /* into L2 (Zen 4: T1), four lines a look at the others' counts */
                for (int line = 0; line < 4; line++) _mm_prefetch(fetch + 64 * line, _MM_HINT_T1);
                fetch += 256;
                continue;
            }
#endif
            if (spins < TEAM_BARRIER_SPINS) {
                team_barrier_pause();
                continue;
            }
            __atomic_fetch_add(&other->sleepers, 1, __ATOMIC_SEQ_CST);
            if ((int32_t)(__atomic_load_n(&other->passed, __ATOMIC_SEQ_CST) - mine) < 0)
                team_barrier_sleep(&other->passed, seen);
            __atomic_fetch_sub(&other->sleepers, 1, __ATOMIC_SEQ_CST);
        }
    }
}

#endif
