/* A few activation rows times a bfloat16 weight that oneDNN packed at load (packed_gemv.c). */
#ifndef SLUICE_PACKED_GEMV_H
#define SLUICE_PACKED_GEMV_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* oneDNN's "AB16b64a2b" weight layout: blocks of PG_BLOCK_N output rows by PG_BLOCK_K inputs */
#define PG_BLOCK_N 64
#define PG_BLOCK_K 32
/* the most rows one call takes: a batch's decode step (AMX passes of up to PG_TILE_ROWS rows a
 * block, or VDPBF16PS on groups of rows) */
#define PG_MAX_ROWS 64
/* an AMX tile's rows */
#define PG_TILE_ROWS 16

/* 1 when this build can run the kernel (the CPU has AVX512-BF16), else 0 */
int packed_gemv_bf16_supported(void);

/* 1 when an n_out x k_in weight padded to n_pad x k_pad is the layout's: whole blocks, less than one
 * block of padding each way */
int packed_gemv_sizes_ok(int64_t n_out, int64_t k_in, int64_t n_pad, int64_t k_pad);

/* y[n] = bf16(sum_k x[k] * w[n][k] + bias[n]) for n < n_out; w in the layout above, padded to
 * n_pad x k_pad with zeros; bias may be NULL. Returns 0, 1 when a work buffer could not be
 * allocated (only when k_in is not whole chunks), 2 when unsupported or the sizes are not the
 * layout's (packed_gemv_sizes_ok). */
int packed_gemv_bf16(const uint16_t *w, const uint16_t *x, const uint16_t *bias, uint16_t *y, int64_t n_out,
                     int64_t k_in, int64_t n_pad, int64_t k_pad);

/* whether one-row products prefetch their weights (several rows always do): 1 on, 0 off, -1 the
 * CPU's default (off on AMD, on elsewhere); returns the setting now in force. For benches: set it
 * before a product runs, not while one does. */
int packed_gemv_set_prefetch(int mode);

/* 1 when a one-row product would run its loop without software prefetches (the one that drains
 * PgTeam.ahead), else 0 */
int packed_gemv_one_row_streams(void);

/* the most rows packed_gemm_bf16 takes: PG_MAX_ROWS through AMX tiles where the CPU has them and
 * Linux grants them, else PG_TILE_ROWS by VDPBF16PS on groups of rows where the CPU has
 * AVX512-BF16, 0 without */
int packed_gemm_bf16_max_rows(void);

/* the most rows a product reads each weight once for, in one pass of its blocks at about one row's
 * cost: PG_TILE_ROWS through AMX tiles, PG_ROW_GROUP by VDPBF16PS on a group of rows, 0 without
 * AVX512-BF16 (a fact of the CPU and the build: the speculative back-off's "auto" reads it) */
int packed_gemm_bf16_pass_rows(void);

/* packed_gemm_bf16_flags' flags: several rows take VDPBF16PS on groups of rows even where the CPU
 * has AMX tiles, each row's sums the one-row kernel's bit for bit (the tiles round apart from it) */
#define PG_NO_TILES 1

/* packed_gemm_bf16 for any number of rows (1 or more), in passes of up to PG_MAX_ROWS: each row's
 * output is the same whatever the rows beside it and their count, and with PG_NO_TILES the same as
 * a one-row product's bit for bit. What a deterministic engine runs for every product of a
 * bfloat16 model, a prefill chunk's included. Returns as packed_gemm_bf16. */
int packed_gemm_bf16_flags(const uint16_t *w, const uint16_t *x, const uint16_t *bias, uint16_t *y, int64_t rows,
                           int64_t n_out, int64_t k_in, int64_t n_pad, int64_t k_pad, int flags);

/* packed_gemv_bf16 for `rows` rows (1 to packed_gemm_bf16_max_rows()): x[rows][k_in] and
 * y[rows][n_out], each row's output independent of the others. Returns as packed_gemv_bf16, and 2
 * for a row count out of range. */
int packed_gemm_bf16(const uint16_t *w, const uint16_t *x, const uint16_t *bias, uint16_t *y, int64_t rows,
                     int64_t n_out, int64_t k_in, int64_t n_pad, int64_t k_pad);

/* What a team of two shares to split a product's blocks as they stream (packed_gemv.c,
 * blocks_from_both_ends): `state` and `halves_in` zero before the team's first product (`halves`
 * is written before it is read); and where the team meets at the end of each product
 * (team_barrier.h; NULL: `omp barrier`). */
struct TeamBarrier;
struct KvAhead;
typedef struct {
    uint64_t state;
    struct TeamBarrier *barrier;
    /* the last block a product's claims leave, claimed in halves: the halves' sums, and the
     * product's tag beside the count of halves in, on a line of its own */
    uint64_t halves_in __attribute__((aligned(64)));
    float halves[2][PG_MAX_ROWS * PG_BLOCK_N];
    /* one list a thread (kv_ahead.h) that the one-row loop without prefetches drains a few lines a
     * chunk, or NULL */
    struct KvAhead *ahead;
    /* 1: several rows take VDPBF16PS on groups of rows even where the CPU has AMX tiles, so that
     * each row's sums are the one-row kernel's bit for bit (a deterministic engine's steps) */
    int no_tiles;
} PgTeam;

/* packed_gemm_bf16 without a parallel region of its own, for a caller already inside one: the
 * calling team shares the blocks out and meets at a barrier at the end, so every thread of the
 * team must call it with the same arguments: the same `team` (shared, its counts zeroed before the
 * first product) and a `tag` that differs from the one of the team's product before (a count of
 * the products from 1). bias as packed_gemv_bf16's (NULL: none); x is whole chunks wide (k_pad, its padding zeros), its rows ldx
 * elements apart; rows and sizes as packed_gemm_bf16 takes them, unchecked (the caller checks them
 * first). The same outputs bit for bit as packed_gemm_bf16. Why: a decode step's products forked
 * and joined the thread team once each, and that cost ~2-4% of a bfloat16 step
 * (docs/performance.md, twelfth round). `next` (its sizes next_n_pad x next_k_pad), or NULL: the
 * weights of the product the team computes after this one; in a team of two, a thread that waits at
 * this product's barrier fetches the start of its own run of them meanwhile. */
void packed_gemm_bf16_team(const uint16_t *w, const uint16_t *x, int64_t ldx, const uint16_t *bias, uint16_t *y,
                           int64_t rows, int64_t n_out, int64_t n_pad, int64_t k_pad, PgTeam *team, uint32_t tag,
                           const uint16_t *next, int64_t next_n_pad, int64_t next_k_pad);

#ifdef __cplusplus
}
#endif

#endif
