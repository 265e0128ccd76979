/* A few activation rows times a bfloat16 weight in oneDNN's packed layout, for decode steps of one
 * stream (its speculative drafts included) and of small batches.
 *
 * Why: oneDNN's own product for one row (brgemm on AMX tiles of 16 rows) streams the weights at
 * ~18 GB/s on the development VM, where a plain read reaches ~26 GB/s; a decode step of one stream
 * is nothing but those reads (docs/performance.md, "bfloat16 one-row products"). This kernel reads
 * the packed weight where it lies: the engine keeps one copy, oneDNN's, and products of more rows
 * than packed_gemm_bf16_max_rows() still go to oneDNN.
 *
 * The layout (oneDNN's tag AB16b64a2b for a [N, K] weight, checked against the weight at load by
 * engine_service/model/prepacked.py): blocks of 64 output rows, each a run of K/32 chunks of 4 KB;
 * inside a chunk, 16 input pairs, each pair holding the 64 rows' two bfloat16 inputs side by side.
 * So one chunk is read front to back, and each 64-byte load is 16 rows x 2 inputs: exactly the
 * operand of one VDPBF16PS, which multiplies bfloat16 pairs and accumulates in float32.
 *
 * Sums are float32, in input order per output (pairs), then the bias, then one rounding to
 * bfloat16; the blocks a team of two shares out as it goes (halved_blocks) sum each half of the
 * inputs in order and add the two. oneDNN blocks the sum differently, so a few outputs in ten
 * thousand differ from its by one bfloat16 ulp (tests/unit/test_prepacked.py bounds them against a
 * float64 reference).
 *
 * Two to PG_MAX_ROWS rows go through AMX's tile multiply where the CPU has it: the layout's chunk is
 * four B tiles as it lies (16 input pairs x 16 outputs each, rows 256 bytes apart), so a step of
 * several rows reads each weight once, as one row does, and its tile multiplies cost about the
 * same at 2 rows as at 16. A batch of 17 to PG_MAX_ROWS rows takes a block in passes of up to 16
 * (block_sums_amx), the later ones reading it from L2: SmolLM2's 121 products at 32 rows ran 1.25x
 * and at 64 rows 1.08x as fast as oneDNN's (scripts/bench_gemv.py --rows N; docs/performance.md,
 * "a batch through the native step"). One row keeps VDPBF16PS, which streams faster than tile loads. The two
 * multiply the same bfloat16 pairs into float32 sums, but the tile multiply rounds its sums its own
 * way (docs/performance.md, sixth round): a few outputs in ten thousand differ from the one-row
 * kernel's by one ulp. A row's output through the tiles does not depend on the rows beside it.
 * Without AMX, up to PG_TILE_ROWS rows take VDPBF16PS in groups (block_sums_rows), bit for bit the
 * one-row kernel's. */
#include "packed_gemv.h"

#include <immintrin.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "one_row_prefetch.h"
#include "kv_ahead.h"
#include "team_barrier.h"

#define CHUNK (PG_BLOCK_N * PG_BLOCK_K) /* elements of one 64 x 32 chunk */

int packed_gemv_sizes_ok(int64_t n_out, int64_t k_in, int64_t n_pad, int64_t k_pad) {
    return n_out > 0 && k_in > 0 && n_pad % PG_BLOCK_N == 0 && k_pad % PG_BLOCK_K == 0 && n_pad >= n_out &&
           k_pad >= k_in && n_pad - n_out < PG_BLOCK_N && k_pad - k_in < PG_BLOCK_K;
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)

int packed_gemv_bf16_supported(void) { return 1; }

/* Every line of a chunk, into L2, two chunks ahead of its use, a few lines at a time between the
 * current chunk's loads (the one-row kernel: 4 lines a pair; the tiles: 16 lines a tile). Why
 * every line: the hardware prefetcher restarts at each 4 KB page (a chunk), and tile loads do not
 * train it at all (two lines a chunk, as the one-row kernel once asked, left the tiles 1.7x
 * slower). Why into L2: a prefetch into L1 holds one of the core's few fill buffers until its
 * line arrives, which caps the lines in flight (seventh round). Why spread: 64 prefetches in a
 * burst stall on those same buffers and hold the loads behind them; under perf, 38% of the tiles'
 * samples sat on the burst. Spread out, the tiles stream SmolLM2's 121 products faster
 * (scripts/bench_prefetch.c; docs/performance.md, eighth round); the one-row loop ran as fast as
 * it did there, and runs without them on AMD (stream_prefetch below). */
static inline void prefetch_lines(const uint16_t *chunk, int first, int count) {
    for (int line = first; line < first + count; line++) _mm_prefetch((const char *)chunk + 64 * line, _MM_HINT_T2);
}

/* Whether the one-row loop prefetches (groups of rows and the tiles always do): the CPU's default
 * (one_row_prefetch.h: not on AMD, where the bfloat16 one-row products ran 13-15% faster without
 * them, and 3-5% slower without them at seven rows: scripts/bench_gemv.py --prefetch-ab), unless
 * packed_gemv_set_prefetch overrides it. */
ONE_ROW_PREFETCH_SETTING(packed_gemv_set_prefetch)

int packed_gemv_one_row_streams(void) { return !stream_prefetch(); }

/* the 64 sums of one block of rows, into out[64]; `stream`: prefetch the chunks two ahead (one row
 * without prefetches, as on AMD, takes block_sums_256 instead: the same sums). The same
 * sums as group_sums for one row, kept as its own loop because it is one stream's whole step:
 * group_sums(rows = 1) ran ~1% slower through the 121 products, the two alternating in one C
 * harness (docs/performance.md, tenth round). */
static inline __attribute__((always_inline)) void block_sums(const uint16_t *block, const uint16_t *x,
                                                             int64_t chunks, const int stream, float *out) {
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    __m512 acc2 = _mm512_setzero_ps(), acc3 = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; c++) {
        const uint16_t *chunk = block + c * CHUNK;
        const uint16_t *xc = x + c * PG_BLOCK_K;
        for (int pair = 0; pair < PG_BLOCK_K / 2; pair++) {
            if (stream) prefetch_lines(chunk + 2 * CHUNK, 4 * pair, 4);
            const uint16_t *wp = chunk + pair * 2 * PG_BLOCK_N;
            uint32_t xp;
            memcpy(&xp, xc + 2 * pair, sizeof xp);
            const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xp);
            acc0 = _mm512_dpbf16_ps(acc0, (__m512bh)_mm512_loadu_si512(wp), xv);
            acc1 = _mm512_dpbf16_ps(acc1, (__m512bh)_mm512_loadu_si512(wp + 32), xv);
            acc2 = _mm512_dpbf16_ps(acc2, (__m512bh)_mm512_loadu_si512(wp + 64), xv);
            acc3 = _mm512_dpbf16_ps(acc3, (__m512bh)_mm512_loadu_si512(wp + 96), xv);
        }
    }
    _mm512_storeu_ps(out, acc0);
    _mm512_storeu_ps(out + 16, acc1);
    _mm512_storeu_ps(out + 32, acc2);
    _mm512_storeu_ps(out + 48, acc3);
}

/* block_sums without prefetches (the loop AMD runs: stream_prefetch), in 256-bit halves: each
 * 64-byte line as two loads of 8 rows x 2 inputs, eight accumulators of 8 rows. Every lane sums the
 * same pairs in the same order with the same VDPBF16PS rounding, so the sums are block_sums' bit
 * for bit. Why: Zen 4 splits each 512-bit operation in two 256-bit ones, and this loop streamed
 * SmolLM2's 121 one-row products 1.04-1.11x faster than the 512-bit one while the VM's two vCPUs sat
 * on two CCDs and 1.03x on one, the two builds alternating in one process (docs/performance.md,
 * thirteenth round). */
static inline __attribute__((always_inline)) void block_sums_256(const uint16_t *block, const uint16_t *x,
                                                                 int64_t chunks, float *out, KvAhead *ahead) {
    __m256 acc[8];
    for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t c = 0; c < chunks; c++) {
        const uint16_t *chunk = block + c * CHUNK;
        const uint16_t *xc = x + c * PG_BLOCK_K;
        kv_ahead_step(ahead); /* the next attention's K/V, a few lines a chunk (kv_ahead.h) */
        for (int pair = 0; pair < PG_BLOCK_K / 2; pair++) {
            const uint16_t *wp = chunk + pair * 2 * PG_BLOCK_N;
            uint32_t xp;
            memcpy(&xp, xc + 2 * pair, sizeof xp);
            const __m256bh xv = (__m256bh)_mm256_set1_epi32((int)xp);
            for (int j = 0; j < 8; j++)
                acc[j] = _mm256_dpbf16_ps(acc[j], (__m256bh)_mm256_loadu_si256((const __m256i *)(wp + 16 * j)), xv);
        }
    }
    for (int j = 0; j < 8; j++) _mm256_storeu_ps(out + 8 * j, acc[j]);
}

/* Several rows where the CPU has no AMX (AMD Zen 4, Intel Cooper Lake): a group of up to
 * PG_ROW_GROUP rows shares each 64-byte weight load, four accumulators a row (7 x 4 accumulators
 * and 4 weight vectors: the 32 vector registers). Seven, so that a
 * verifying step of six drafts streams the weights in one pass (on Zen 4 it then costs what one row
 * costs; docs/performance.md, ninth round). Groups after the first read the block
 * again, from the caches (a block of 64 outputs is 4 KB an input chunk: 72 KB at K = 576, 192 KB at
 * K = 1536, within L2), so the weights stream from memory once a step however many rows it has.
 * Each row's sums are the one-row kernel's, bit for bit: the same VDPBF16PS on the same pairs in the
 * same order, so a row's output does not depend on the rows beside it nor on their count. */
#define PG_ROW_GROUP 7

static inline __attribute__((always_inline)) void group_sums(const uint16_t *block, const uint16_t *x, int64_t ldx,
                                                             int64_t chunks, const int rows, const int stream,
                                                             float *out) {
    __m512 acc[PG_ROW_GROUP][4];
    for (int m = 0; m < rows; m++)
        for (int j = 0; j < 4; j++) acc[m][j] = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; c++) {
        const uint16_t *chunk = block + c * CHUNK;
        const uint16_t *xc = x + c * PG_BLOCK_K;
        for (int pair = 0; pair < PG_BLOCK_K / 2; pair++) {
            if (stream) prefetch_lines(chunk + 2 * CHUNK, 4 * pair, 4);
            const uint16_t *wp = chunk + pair * 2 * PG_BLOCK_N;
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp), w1 = (__m512bh)_mm512_loadu_si512(wp + 32);
            const __m512bh w2 = (__m512bh)_mm512_loadu_si512(wp + 64), w3 = (__m512bh)_mm512_loadu_si512(wp + 96);
            for (int m = 0; m < rows; m++) {
                uint32_t xp;
                memcpy(&xp, xc + m * ldx + 2 * pair, sizeof xp);
                const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xp);
                acc[m][0] = _mm512_dpbf16_ps(acc[m][0], w0, xv);
                acc[m][1] = _mm512_dpbf16_ps(acc[m][1], w1, xv);
                acc[m][2] = _mm512_dpbf16_ps(acc[m][2], w2, xv);
                acc[m][3] = _mm512_dpbf16_ps(acc[m][3], w3, xv);
            }
        }
    }
    for (int m = 0; m < rows; m++)
        for (int j = 0; j < 4; j++) _mm512_storeu_ps(out + m * PG_BLOCK_N + 16 * j, acc[m][j]);
}

/* the 64 sums of one block for rows (2 to PG_MAX_ROWS) lying ldx elements apart, into out[r * 64 ...],
 * in groups of as even a size as PG_ROW_GROUP allows */
static void block_sums_rows(const uint16_t *block, const uint16_t *x, int64_t ldx, int rows, int64_t chunks,
                            float *out) {
    const int groups = (rows + PG_ROW_GROUP - 1) / PG_ROW_GROUP;
    int done = 0;
    for (int g = 0; g < groups; g++) {
        const int left = groups - g, n = (rows - done + left - 1) / left, stream = g == 0;
        const uint16_t *xg = x + done * ldx;
        float *og = out + done * PG_BLOCK_N;
        switch (n) { /* a constant row count each, so the accumulators stay in registers */
        case 1: group_sums(block, xg, ldx, chunks, 1, stream, og); break;
        case 2: group_sums(block, xg, ldx, chunks, 2, stream, og); break;
        case 3: group_sums(block, xg, ldx, chunks, 3, stream, og); break;
        case 4: group_sums(block, xg, ldx, chunks, 4, stream, og); break;
        case 5: group_sums(block, xg, ldx, chunks, 5, stream, og); break;
        case 6: group_sums(block, xg, ldx, chunks, 6, stream, og); break;
        default: group_sums(block, xg, ldx, chunks, 7, stream, og); break;
        }
        done += n;
    }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define PG_AMX 1
#include "amx.h"

/* The rows one tile pass takes for a product of `rows` rows: all of them up to a tile's 16, else
 * the fewest passes of at most 16, as even as they go (17: two of 9; 40: three of 14; 64: four of
 * 16). */
static inline int amx_group_rows(int rows) {
    const int passes = (rows + PG_TILE_ROWS - 1) / PG_TILE_ROWS;
    return (rows + passes - 1) / passes;
}

/* tiles 0-3: a block's four 16-output sums (group x 16 float32); 4: a pass's rows' 32 inputs of a
 * chunk (64 bytes); 5-7: a chunk's 16 input pairs for 16 outputs */
#define PG_AMX_CONFIGURE(rows) amx_configure(amx_group_rows(rows), PG_BLOCK_K * 2, PG_BLOCK_K / 2)

/* the 64 sums of one block for the configured rows (lying ldx elements apart), into out[r * 64 ...];
 * `stream`: prefetch the chunks two ahead (a pass after a block's first finds them in L2) */
static inline __attribute__((always_inline)) void block_pass_amx(const uint16_t *block, const uint16_t *x,
                                                                 int64_t ldx, int64_t chunks, const int stream,
                                                                 float *out) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t c = 0; c < chunks; c++) {
        const uint16_t *chunk = block + c * CHUNK, *ahead = chunk + 2 * CHUNK;
        _tile_loadd(4, x + c * PG_BLOCK_K, ldx * 2);
        if (stream) prefetch_lines(ahead, 0, 16);
        _tile_loadd(5, chunk, 4 * 64);
        _tile_dpbf16ps(0, 4, 5);
        if (stream) prefetch_lines(ahead, 16, 16);
        _tile_loadd(6, chunk + 32, 4 * 64);
        _tile_dpbf16ps(1, 4, 6);
        if (stream) prefetch_lines(ahead, 32, 16);
        _tile_loadd(7, chunk + 64, 4 * 64);
        _tile_dpbf16ps(2, 4, 7);
        if (stream) prefetch_lines(ahead, 48, 16);
        _tile_loadd(5, chunk + 96, 4 * 64);
        _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, out, PG_BLOCK_N * 4);
    _tile_stored(1, out + 16, PG_BLOCK_N * 4);
    _tile_stored(2, out + 32, PG_BLOCK_N * 4);
    _tile_stored(3, out + 48, PG_BLOCK_N * 4);
}

/* the 64 sums of one block for `rows` rows, in passes of amx_group_rows(rows) (the configured tile
 * rows): the first streams the block from memory, the others read it again from L2 (a block is
 * 4 KB an input chunk: 72 KB at K = 576, 192 KB at K = 1536), so the weights leave memory once a
 * step however many rows it has. The last pass starts at rows - group, redoing a row or two of the
 * pass before where the passes do not divide the rows evenly: a row's sums through the tiles do not
 * depend on the rows beside it, so it writes the same values again. Why passes, not more tiles:
 * four row groups' sums would take 16 tiles, and AMX has 8. */
static void block_sums_amx(const uint16_t *block, const uint16_t *x, int64_t ldx, int rows, int64_t chunks,
                           float *out) {
    const int group = amx_group_rows(rows);
    for (int start = 0;;) {
        block_pass_amx(block, x + start * ldx, ldx, chunks, start == 0, out + start * PG_BLOCK_N);
        if (start + group >= rows) break;
        start = start + 2 * group > rows ? rows - group : start + group;
    }
}
#endif

/* 1 when several rows go through AMX's tiles in this process, 0 when through block_sums_rows */
static int use_tiles(void) {
#if defined(PG_AMX)
    return amx_usable();
#else
    return 0;
#endif
}

/* PG_MAX_ROWS through the tiles; PG_TILE_ROWS through block_sums_rows, the most rows measured
 * against oneDNN on a CPU without AMX (AMD Zen 4: 1.23x as fast at 16 rows, docs/performance.md,
 * ninth round); more go to oneDNN there */
int packed_gemm_bf16_max_rows(void) { return use_tiles() ? PG_MAX_ROWS : PG_TILE_ROWS; }

int packed_gemm_bf16_pass_rows(void) { return use_tiles() ? PG_TILE_ROWS : PG_ROW_GROUP; }

/* the rows x 64 sums of chunks [c0, c1) of block b, into sums[m * 64 ...] */
static inline void part_sums(const uint16_t *w, const uint16_t *xp, int64_t ldx, int64_t rows, int64_t chunks,
                             int tiles, int prefetch, int64_t b, int64_t c0, int64_t c1, KvAhead *ahead,
                             float *sums) {
    const uint16_t *block = w + b * chunks * CHUNK + c0 * CHUNK, *xc = xp + c0 * PG_BLOCK_K;
    const int64_t n = c1 - c0;
#if defined(PG_AMX)
    if (tiles) block_sums_amx(block, xc, ldx, (int)rows, n, sums);
    else
#else
    (void)tiles;
#endif
    if (rows > 1) block_sums_rows(block, xc, ldx, (int)rows, n, sums);
    else if (prefetch) block_sums(block, xc, n, 1, sums);
    else block_sums_256(block, xc, n, sums, ahead);
}

/* block b's sums (rows x 64), stored to y with the bias */
static inline void store_block(const float *sums, const uint16_t *bias, uint16_t *y, int64_t rows, int64_t n_out,
                               int64_t b) {
    const int64_t first = b * PG_BLOCK_N, count = n_out - first < PG_BLOCK_N ? n_out - first : PG_BLOCK_N;
    for (int64_t m = 0; m < rows; m++)
        for (int64_t r = 0; r < count; r++) {
            const float sum = sums[m * PG_BLOCK_N + r];
            y[m * n_out + first + r] = f32_to_bf16(bias != NULL ? sum + bf16_to_f32(bias[first + r]) : sum);
        }
}

/* a team of two's fixed runs of a product of `blocks` blocks: the first `front` (thread 0's) and the
 * last `back` (thread 1's) */
static inline void fixed_runs(int64_t blocks, int64_t *front, int64_t *back) {
    const int64_t shared = blocks >= 3 ? blocks / 4 : 0;
    *front = (blocks - shared) / 2;
    *back = blocks - shared - *front;
}

/* [*lo, *hi): the blocks a product sums in two halves (none where a block is a single chunk): those
 * between a team of two's fixed runs, the ones it shares out as it goes (blocks_from_both_ends).
 * A halved block sums its first half of the inputs in order, its second half in order, then adds
 * the two. Why: the two threads meet somewhere among those blocks, and the one that got there
 * first waited up to a whole block at the barrier (72 KB at K = 576, 192 KB at K = 1536); in
 * halves, the last block left can go half to each. Chosen by the product's shape alone, so a
 * block's sums do not depend on the team's size nor on which thread computes which half. */
static inline void halved_blocks(int64_t blocks, int64_t chunks, int64_t *lo, int64_t *hi) {
    int64_t front, back;
    fixed_runs(blocks, &front, &back);
    *lo = front, *hi = chunks >= 2 ? blocks - back : front;
}

/* block b whole: its rows x 64 sums (in two halves where it is one of halved_blocks), stored to y */
static inline void one_block(const uint16_t *w, const uint16_t *xp, int64_t ldx, const uint16_t *bias, uint16_t *y,
                             int64_t rows, int64_t n_out, int64_t blocks, int64_t chunks, int tiles, int prefetch,
                             int64_t b, KvAhead *ahead) {
    float sums[PG_MAX_ROWS * PG_BLOCK_N];
    int64_t lo, hi;
    halved_blocks(blocks, chunks, &lo, &hi);
    if (b >= lo && b < hi) {
        float second[PG_MAX_ROWS * PG_BLOCK_N];
        const int64_t half = chunks / 2;
        part_sums(w, xp, ldx, rows, chunks, tiles, prefetch, b, 0, half, ahead, sums);
        part_sums(w, xp, ldx, rows, chunks, tiles, prefetch, b, half, chunks, ahead, second);
        for (int64_t i = 0; i < rows * PG_BLOCK_N; i++) sums[i] += second[i];
    } else {
        part_sums(w, xp, ldx, rows, chunks, tiles, prefetch, b, 0, chunks, ahead, sums);
    }
    store_block(sums, bias, y, rows, n_out, b);
}

/* 1 when the calling thread's arrival with its half of a block is the second of the two in the
 * product tagged `tag` (its half sits in team->halves by now), 0 when the first */
static inline int second_half_in(PgTeam *team, uint32_t tag) {
    const uint64_t mine = (uint64_t)tag << 32;
    for (uint64_t old = __atomic_load_n(&team->halves_in, __ATOMIC_ACQUIRE);;) {
        const uint64_t fresh = (old & ~0xffffffffull) == mine ? old + 1 : mine | 1;
        /* release: this thread's half before the count; acquire: the other's, when it came first */
        if (__atomic_compare_exchange_n(&team->halves_in, &old, fresh, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            return fresh == (mine | 2);
    }
}

/* one half (second: 0 the first, 1 the second) of halved block b, claimed on its own: its sums
 * into team->halves[second]; the thread that brings the second of the two in adds them and stores
 * the block */
static inline void one_half(const uint16_t *w, const uint16_t *xp, int64_t ldx, const uint16_t *bias, uint16_t *y,
                            int64_t rows, int64_t n_out, int64_t chunks, int tiles, int prefetch, int64_t b,
                            int second, KvAhead *ahead, PgTeam *team, uint32_t tag) {
    const int64_t half = chunks / 2;
    part_sums(w, xp, ldx, rows, chunks, tiles, prefetch, b, second ? half : 0, second ? chunks : half, ahead,
              team->halves[second]);
    if (!second_half_in(team, tag)) return;
    float sums[PG_MAX_ROWS * PG_BLOCK_N];
    for (int64_t i = 0; i < rows * PG_BLOCK_N; i++) sums[i] = team->halves[0][i] + team->halves[1][i];
    store_block(sums, bias, y, rows, n_out, b);
}

/* The lines of the next product's run a thread fetches as it takes its last claim of a product: 16.
 * Why: the thread that reaches the barrier last waits for nothing, so its barrier fetches nothing,
 * and its next product started cold. With them the step ran 1.0075x as fast on one CCD (the median
 * of ten runs' paired ratios, their range 0.987-1.042) and as fast on two (1.002, 0.998-1.003 in
 * five); 48 lines, 0.994-1.010 (scripts/bench_stack_ab.sh; docs/performance.md, "the last block in
 * halves"). */
#define PG_START_NEXT_LINES 16

/* A team of two shares a product's blocks from both ends: thread 0 takes the first blocks in order,
 * thread 1 the last, each a fixed three eighths or so; the quarter between them goes to whichever
 * thread gets there first, a quarter of what is left a claim, down to one block, and the last block
 * in its two halves (a compare-and-swap on `state`: the product's tag, the next half block from
 * the front, the half block after the last one left from the back; each claim moves a cache line
 * between the threads). Why shrinking claims: with a
 * sixteenth of the product a claim, the head's were 48 blocks (3.5 MB, ~120 us on two CCDs) and
 * the thread that finished first waited up to a whole claim at the barrier; shrinking ones leave it
 * at most one block, and the step ran 1.009-1.015x as fast on two CCDs, as fast on one
 * (scripts/bench_stack_ab.sh; docs/performance.md, "claims that shrink, a waiting thread that
 * fetches"). Each thread's blocks stay one region of memory, and a thread that streams faster takes
 * more. Why: on two CCDs each thread streams its own CCD's share, the two CCDs' rates drift apart
 * by up to ~15% under the VM's neighbours, and with a fixed half each the faster thread waited for
 * the slower at every product's barrier. A bfloat16 step ran ~1% faster this way there (the median
 * of 16 runs' paired ratios 1.008, their range 0.990-1.047), and as fast on one CCD (scripts/bench_stack_ab.sh;
 * docs/performance.md, fourteenth round). Why the last block in halves (halved_blocks): the
 * thread that got there first waited up to that whole block; now up to half of it, and the step
 * ran 1.011x as fast on two CCDs (the median of ten runs' paired ratios, their range 0.999-1.029)
 * and as fast on one (1.002, 0.975-1.019 in thirteen) (scripts/bench_stack_ab.sh;
 * docs/performance.md, "the last block in halves"). The thread that brings the second half in
 * adds the two. Which thread computes a block or a half does not change its sums. `fetch`: the
 * start of the calling thread's run of the next product (next_run_start), or NULL. */
static void blocks_from_both_ends(const uint16_t *w, const uint16_t *xp, int64_t ldx, const uint16_t *bias,
                                  uint16_t *y, int64_t rows, int64_t n_out, int64_t blocks, int64_t chunks, int tiles,
                                  int prefetch, PgTeam *team, uint32_t tag, const char *fetch) {
    const int me = omp_get_thread_num();
    KvAhead *ahead = team->ahead != NULL ? team->ahead + me : NULL;
    int64_t front, back, lo, hi;
    fixed_runs(blocks, &front, &back);
    halved_blocks(blocks, chunks, &lo, &hi);
    /* the state counts halves: the shared blocks are units 2 * front to 2 * (blocks - back) */
    const uint64_t mine = (uint64_t)tag << 32;
    for (uint64_t old = __atomic_load_n(&team->state, __ATOMIC_ACQUIRE); (old & ~0xffffffffull) != mine;) {
        const uint64_t fresh = mine | (uint64_t)(2 * front) << 16 | (uint64_t)(2 * (blocks - back));
        if (__atomic_compare_exchange_n(&team->state, &old, fresh, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) break;
    }
    for (int64_t b = me == 0 ? 0 : blocks - back; b < (me == 0 ? front : blocks); b++)
        one_block(w, xp, ldx, bias, y, rows, n_out, blocks, chunks, tiles, prefetch, b, ahead);
    for (uint64_t old = __atomic_load_n(&team->state, __ATOMIC_ACQUIRE);;) {
        const int64_t next = (int64_t)(old >> 16 & 0xffff), end = (int64_t)(old & 0xffff);
        if (next >= end) break;
        /* whole blocks, a quarter of what is left, down to one; the last one left in halves where
         * it is halved (a claim of one half only ever leaves one half) */
        const int64_t guided = (end - next) / 2 / 4, n = end - next <= 2 && hi > lo ? 1 : 2 * (guided > 1 ? guided : 1);
        const uint64_t claimed = me == 0 ? mine | (uint64_t)(next + n) << 16 | (uint64_t)end
                                         : mine | (uint64_t)next << 16 | (uint64_t)(end - n);
        if (!__atomic_compare_exchange_n(&team->state, &old, claimed, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            continue; /* old now holds the state another claim left */
        const int64_t first = me == 0 ? next : end - n;
        if (fetch != NULL && n >= end - next) /* its last claim */
            for (int line = 0; line < PG_START_NEXT_LINES; line++) _mm_prefetch(fetch + 64 * line, _MM_HINT_T1);
        if (n == 1) {
            one_half(w, xp, ldx, bias, y, rows, n_out, chunks, tiles, prefetch, first / 2, (int)(first % 2), ahead,
                     team, tag);
        } else {
            for (int64_t b = first / 2; b < (first + n) / 2; b++)
                one_block(w, xp, ldx, bias, y, rows, n_out, blocks, chunks, tiles, prefetch, b, ahead);
        }
        old = __atomic_load_n(&team->state, __ATOMIC_ACQUIRE);
    }
}

/* The lines of the next product's run a thread fetches while it waits at a product's barrier, at
 * most: 512 (32 KB). On two CCDs the step ran 1.001-1.020x as fast with them (five runs), about as
 * much with 256 or 1024, 1.003-1.004x with 2048, and 0.92-0.95x with 8192 and more, which fill much
 * of L2 (the K/V fetched ahead for the next attention among what they evict) and queue behind one
 * another while the waiting thread looks for the other's arrival; which costs more was not
 * measured (scripts/bench_stack_ab.sh; docs/performance.md, "claims that shrink, a waiting thread
 * that fetches"). */
#define PG_FETCH_NEXT_LINES 512

/* [*from, *to): the first PG_FETCH_NEXT_LINES lines of the calling thread's fixed run (of a team of
 * two) of the next product's weights w (n_pad x k_pad), for it to fetch while it waits at this
 * product's barrier; empty where w is NULL. Why: on two CCDs, a product's end keeps one thread
 * waiting for the other ~1-7 us at each barrier (a 9-block product splits 5 and 4, and the two
 * stream at different rates), ~0.4 ms a bfloat16 step in all; its memory sits idle meanwhile. */
static void next_run_start(const uint16_t *w, int64_t n_pad, int64_t k_pad, int me, const char **from,
                           const char **to) {
    *from = *to = NULL;
    if (w == NULL) return;
    const int64_t blocks = n_pad / PG_BLOCK_N, block_bytes = k_pad * PG_BLOCK_N * 2;
    int64_t front, back;
    fixed_runs(blocks, &front, &back);
    const int64_t run = (me == 0 ? front : back) * block_bytes;
    *from = (const char *)w + (me == 0 ? 0 : (blocks - back) * block_bytes);
    *to = *from + (PG_FETCH_NEXT_LINES * 64 < run ? PG_FETCH_NEXT_LINES * 64 : run);
}

/* The block loop, shared out over the calling team, its barrier at the end (team->barrier's, or
 * `omp barrier` where that is NULL): inside a parallel region each thread takes its blocks, outside
 * one the caller takes them all. A team of two with `team` shares them from both ends
 * (blocks_from_both_ends; `tag` tells this product's claims from the last one's); other teams take
 * equal runs (an orphaned omp for). x is whole chunks wide (k_pad), rows ldx elements apart. */
static void team_blocks(const uint16_t *w, const uint16_t *xp, int64_t ldx, const uint16_t *bias, uint16_t *y,
                        int64_t rows, int64_t n_out, int64_t n_pad, int64_t k_pad, int tiles, int prefetch,
                        PgTeam *team, uint32_t tag, const uint16_t *next, int64_t next_n_pad, int64_t next_k_pad) {
    const int64_t blocks = n_pad / PG_BLOCK_N, chunks = k_pad / PG_BLOCK_K;
#if defined(PG_AMX)
    if (tiles) PG_AMX_CONFIGURE((int)rows);
#endif
    const int me = omp_get_thread_num(), pair = omp_get_num_threads() == 2 && 2 * blocks <= 0xffff;
    KvAhead *ahead = team->ahead != NULL ? team->ahead + me : NULL;
    const char *fetch = NULL, *fetch_end = NULL; /* a team of two: the thread that waits starts the next product */
    if (pair) next_run_start(next, next_n_pad, next_k_pad, me, &fetch, &fetch_end);
    if (pair) {
        blocks_from_both_ends(w, xp, ldx, bias, y, rows, n_out, blocks, chunks, tiles, prefetch, team, tag, fetch);
    } else {
        _Pragma("omp for schedule(static) nowait")
        for (int64_t b = 0; b < blocks; b++)
            one_block(w, xp, ldx, bias, y, rows, n_out, blocks, chunks, tiles, prefetch, b, ahead);
    }
#if defined(PG_AMX)
    if (tiles) _tile_release(); /* so the kernel need not save this thread's tiles */
#endif
    team_barrier_fetching(team->barrier, fetch, fetch_end);
}

int packed_gemm_bf16(const uint16_t *w, const uint16_t *x, const uint16_t *bias, uint16_t *y, int64_t rows,
                     int64_t n_out, int64_t k_in, int64_t n_pad, int64_t k_pad) {
    if (rows > packed_gemm_bf16_max_rows()) return 2;
    return packed_gemm_bf16_flags(w, x, bias, y, rows, n_out, k_in, n_pad, k_pad, 0);
}

int packed_gemm_bf16_flags(const uint16_t *w, const uint16_t *x, const uint16_t *bias, uint16_t *y, int64_t rows,
                           int64_t n_out, int64_t k_in, int64_t n_pad, int64_t k_pad, int flags) {
    if (rows < 1 || !packed_gemv_sizes_ok(n_out, k_in, n_pad, k_pad)) return 2;
    /* an input that is not whole chunks is padded with zeros (the weight's padding is zeros too) */
    uint16_t *padded = NULL;
    if (k_pad != k_in) {
        padded = (uint16_t *)calloc((size_t)(rows * k_pad), sizeof *padded);
        if (padded == NULL) return 1;
        for (int64_t m = 0; m < rows; m++) memcpy(padded + m * k_pad, x + m * k_in, (size_t)k_in * sizeof *padded);
    }
    const uint16_t *xp = padded != NULL ? padded : x;
    const int64_t ldx = padded != NULL ? k_pad : k_in;
    const int prefetch = stream_prefetch();
    if (rows > PG_MAX_ROWS && ((flags & PG_NO_TILES) || !use_tiles())) {
        /* many rows (a deterministic engine's prefill chunk): one parallel region, each thread whole
         * blocks for every pass of PG_MAX_ROWS rows in turn, so that a block's weights stay in L2
         * across the passes. one_block sums a block as the paired team does (halved_blocks depends
         * on the shape alone), so each row's output is the same as through the passes below. A
         * region a pass, its blocks shared from both ends, ran 2.4x slower than one thread at 512
         * rows on two threads. */
        const int64_t blocks = n_pad / PG_BLOCK_N, chunks = k_pad / PG_BLOCK_K;
        const int64_t passes = (rows + PG_MAX_ROWS - 1) / PG_MAX_ROWS;
        _Pragma("omp parallel for schedule(static)")
        for (int64_t t = 0; t < blocks * passes; t++) {
            const int64_t b = t / passes, r0 = (t % passes) * PG_MAX_ROWS;
            const int64_t n = rows - r0 < PG_MAX_ROWS ? rows - r0 : PG_MAX_ROWS;
            one_block(w, xp + r0 * ldx, ldx, bias, y + r0 * n_out, n, n_out, blocks, chunks, 0, prefetch, b, NULL);
        }
        free(padded);
        return 0;
    }
    PgTeam team; /* the fields a product reads before it writes them (not the 32 KB of halves) */
    team.state = team.halves_in = 0, team.barrier = NULL, team.ahead = NULL, team.no_tiles = 0;
    /* passes of up to PG_MAX_ROWS rows, each a product of its own: a row's sums do not depend on the
     * rows beside it (tiles or groups), so the passes give what one product of them all would */
    uint32_t tag = 0;
    for (int64_t r0 = 0; r0 < rows; r0 += PG_MAX_ROWS) {
        const int64_t n = rows - r0 < PG_MAX_ROWS ? rows - r0 : PG_MAX_ROWS;
        const int tiles = n > 1 && use_tiles() && !(flags & PG_NO_TILES);
        ++tag;
        _Pragma("omp parallel")
        team_blocks(w, xp + r0 * ldx, ldx, bias, y + r0 * n_out, n, n_out, n_pad, k_pad, tiles, prefetch, &team, tag,
                    NULL, 0, 0);
    }
    free(padded);
    return 0;
}

void packed_gemm_bf16_team(const uint16_t *w, const uint16_t *x, int64_t ldx, const uint16_t *bias, uint16_t *y,
                           int64_t rows, int64_t n_out, int64_t n_pad, int64_t k_pad, PgTeam *team, uint32_t tag,
                           const uint16_t *next, int64_t next_n_pad, int64_t next_k_pad) {
    team_blocks(w, x, ldx, bias, y, rows, n_out, n_pad, k_pad, rows > 1 && use_tiles() && !team->no_tiles,
                stream_prefetch(), team, tag,
                next, next_n_pad, next_k_pad);
}

int packed_gemv_bf16(const uint16_t *w, const uint16_t *x, const uint16_t *bias, uint16_t *y, int64_t n_out,
                     int64_t k_in, int64_t n_pad, int64_t k_pad) {
    return packed_gemm_bf16(w, x, bias, y, 1, n_out, k_in, n_pad, k_pad);
}

#else

int packed_gemv_bf16_supported(void) { return 0; }

int packed_gemv_one_row_streams(void) { return 0; }

int packed_gemv_set_prefetch(int mode) {
    (void)mode;
    return 0;
}

int packed_gemm_bf16_max_rows(void) { return 0; }

int packed_gemm_bf16_pass_rows(void) { return 0; }

int packed_gemm_bf16(const uint16_t *w, const uint16_t *x, const uint16_t *bias, uint16_t *y, int64_t rows,
                     int64_t n_out, int64_t k_in, int64_t n_pad, int64_t k_pad) {
    (void)w, (void)x, (void)bias, (void)y, (void)rows, (void)n_out, (void)k_in, (void)n_pad, (void)k_pad;
    return 2;
}

int packed_gemm_bf16_flags(const uint16_t *w, const uint16_t *x, const uint16_t *bias, uint16_t *y, int64_t rows,
                           int64_t n_out, int64_t k_in, int64_t n_pad, int64_t k_pad, int flags) {
    (void)w, (void)x, (void)bias, (void)y, (void)rows, (void)n_out, (void)k_in, (void)n_pad, (void)k_pad, (void)flags;
    return 2;
}

void packed_gemm_bf16_team(const uint16_t *w, const uint16_t *x, int64_t ldx, const uint16_t *bias, uint16_t *y,
                           int64_t rows, int64_t n_out, int64_t n_pad, int64_t k_pad, PgTeam *team, uint32_t tag,
                           const uint16_t *next, int64_t next_n_pad, int64_t next_k_pad) {
    (void)w, (void)x, (void)ldx, (void)bias, (void)y, (void)rows, (void)n_out, (void)n_pad, (void)k_pad, (void)team, (void)tag;
    (void)next, (void)next_n_pad, (void)next_k_pad;
}

int packed_gemv_bf16(const uint16_t *w, const uint16_t *x, const uint16_t *bias, uint16_t *y, int64_t n_out,
                     int64_t k_in, int64_t n_pad, int64_t k_pad) {
    (void)w, (void)x, (void)bias, (void)y, (void)n_out, (void)k_in, (void)n_pad, (void)k_pad;
    return 2;
}

#endif
