/* Whether a one-row product's loop issues software prefetches for its weights, by default: not on
 * AMD, yes elsewhere. On an AMD EPYC (Zen 4) VM the hardware prefetcher streams one row's weights
 * on its own and the prefetches only cost: SmolLM2's 121 one-row products ran 13-15% faster
 * without them in bfloat16 (packed_gemv.c, tenth round) and 1.10-1.21x faster in int4 (q4_gemv.c,
 * fourteenth round), each variant alternating with the other in one process
 * (docs/performance.md). The Intel VM of the earlier rounds measured no loss from them at one row,
 * so Intel keeps them. Each kernel keeps its own override for its bench (packed_gemv_set_prefetch,
 * q4_gemv_set_prefetch); this is the rule both follow when none is set. */
#ifndef SLUICE_ONE_ROW_PREFETCH_H
#define SLUICE_ONE_ROW_PREFETCH_H

static inline int one_row_prefetch_default(void) {
    __builtin_cpu_init();
    return !__builtin_cpu_is("amd");
}

/* A kernel's own setting: `static int stream_prefetch(void)`, the setting in force (the CPU's
 * default until SETTER sets one; decided at the first product), and `int SETTER(int mode)`: 1 on,
 * 0 off, -1 the CPU's default, returning the setting now in force. */
#define ONE_ROW_PREFETCH_SETTING(SETTER)                                    \
    static int prefetch_mode = -1;                                          \
    static int stream_prefetch(void) {                                      \
        if (prefetch_mode < 0) prefetch_mode = one_row_prefetch_default();  \
        return prefetch_mode;                                               \
    }                                                                       \
    int SETTER(int mode) {                                                  \
        prefetch_mode = mode < 0 ? -1 : mode != 0;                          \
        return stream_prefetch();                                           \
    }

#endif
