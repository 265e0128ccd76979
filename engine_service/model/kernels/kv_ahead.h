/* The next layer's K/V lines a thread will attend over, fetched into L2 a few lines at a time from
 * inside the products that come before that attention: decode_stack.c lists them, and the one-row
 * product loops without software prefetches drain the list (packed_gemv.c: per 4 KB chunk of
 * bfloat16 weights; q4_gemv.c: per group of 32 inputs of int4 codes).
 *
 * Why: inside a decode step every layer's weights stream through the caches between one attention
 * and the next, so attention found its K/V in memory and waited on it line by line: at context 300
 * each thread spent 19-21 µs a layer in its partitions, against ~9 µs with the K/V in L3 (the C
 * harness on one CCD, alternating with a build whose layers share one cache). While a product streams, the core's line fetches are
 * already in flight back to back, and a few more a chunk ride along; attention then reads its
 * lines from L2 or L3. Measured on an AMD Zen 4 VM (docs/performance.md, "the next layer's K/V
 * during the products"): the int4 native step 1.08x faster; the bfloat16 one ~1.01x while the
 * VM's two vCPUs sat on two CCDs, and ~0.5% slower on one CCD, where the two cores share one link
 * to memory and every byte of the step is already the bottleneck. A burst of the same prefetches
 * right before attention, or 16 or 32 lines a chunk during the qkv product alone, had lost
 * (eleventh and thirteenth rounds, stop 49): spread over the o, gate/up, down and next qkv
 * products the extra lines are a few percent of what the core fetches. */
#ifndef SLUICE_KV_AHEAD_H
#define SLUICE_KV_AHEAD_H

#include <immintrin.h>
#include <stdint.h>

/* runs of contiguous lines a list holds: two a block of 16 tokens (K and V), 4096 tokens a thread */
#define KV_AHEAD_RUNS 512

/* one thread's list; a whole number of cache lines, so that two threads' lists share none */
typedef struct KvAhead {
    _Alignas(64) int count, cur, line, per_call;
    const char *run[KV_AHEAD_RUNS];
    int32_t lines[KV_AHEAD_RUNS];
} KvAhead;

static inline void kv_ahead_reset(KvAhead *a, int per_call) { a->count = a->cur = a->line = 0, a->per_call = per_call; }

/* bytes from p onwards, whole lines; a full list drops the rest (attention fetches it as before) */
static inline void kv_ahead_add(KvAhead *a, const void *p, int64_t bytes) {
    if (a->count >= KV_AHEAD_RUNS || bytes <= 0) return;
    const uintptr_t lo = (uintptr_t)p & ~(uintptr_t)63, hi = ((uintptr_t)p + (uintptr_t)bytes + 63) & ~(uintptr_t)63;
    a->run[a->count] = (const char *)lo, a->lines[a->count] = (int32_t)((hi - lo) / 64), a->count++;
}

/* the next per_call lines into L2 (_MM_HINT_T0, into L1, read 0.987 in the one two-CCD run it had) */
static inline __attribute__((always_inline)) void kv_ahead_step(KvAhead *a) {
    if (a == 0) return;
    for (int i = 0; i < a->per_call && a->cur < a->count; i++) {
        _mm_prefetch(a->run[a->cur] + 64 * a->line, _MM_HINT_T2);
        if (++a->line == a->lines[a->cur]) a->line = 0, a->cur++;
    }
}

#endif
