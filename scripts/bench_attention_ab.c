/* The paged decode attention kernel of this tree against another commit's, alone, in one process:
 * REV's paged_decode_attention.c is built with its symbols prefixed `before_` and linked beside
 * this tree's (scripts/bench_attention_ab.sh does it). Each pass runs a step's 30 layers of
 * attention (SmolLM2-135M's shape: 9 query heads, 3 kv heads of 64, a bfloat16 cache in 16-token
 * blocks that lie scattered, q a bfloat16 model's: every value a bfloat16, or a float32 one with
 * BENCH_Q_F32=1) through the entry point, after 64 MB written to flush the caches as a
 * step's weights flush them; the two builds alternate, and it prints the median of the rounds'
 * paired ratios (before / after) and whether the two gave the same output bit for bit.
 *
 *   scripts/bench_attention_ab.sh REV [batch] [context] [rounds]
 *
 * docs/performance.md, "attention's K/V three blocks ahead". */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../engine_service/model/kernels/paged_decode_attention.h"
#include "bench_harness.h"

int before_paged_decode_attention_bf16(const float *q, const uint16_t *k_cache, const uint16_t *v_cache,
                                       const int64_t *block_tables, int64_t table_width, const int64_t *context_lens,
                                       float *out, int64_t batch, int64_t heads, int64_t kv_heads, int64_t head_dim,
                                       int64_t block_size, float scale);

#define LAYERS 30
#define HEADS 9
#define KV_HEADS 3
#define HEAD_DIM 64
#define BLOCK 16
#define FLUSH_BYTES (64 << 20)

int main(int argc, char **argv) {
    const int64_t batch = argc > 1 ? atoll(argv[1]) : 1, context = argc > 2 ? atoll(argv[2]) : 300;
    const int rounds = argc > 3 ? atoi(argv[3]) : 24;
    if (batch < 1 || context < 1 || rounds < 1) {
        fprintf(stderr, "usage: bench_attention_ab [batch >= 1] [context >= 1] [rounds >= 1]\n");
        return 2;
    }
    /* room for each row's context plus the 6 more tokens some rows get */
    const int64_t width = (context + 6 + BLOCK - 1) / BLOCK, blocks = batch * width;
    const int64_t cache_n = blocks * BLOCK * KV_HEADS * HEAD_DIM;
    uint16_t *k[LAYERS], *v[LAYERS];
    for (int l = 0; l < LAYERS; l++) {
        k[l] = huge_alloc(sizeof(uint16_t) * (size_t)cache_n), v[l] = huge_alloc(sizeof(uint16_t) * (size_t)cache_n);
        if (k[l] == NULL || v[l] == NULL) abort();
        for (int64_t i = 0; i < cache_n; i++) k[l][i] = (uint16_t)(0x3c00 + i * 7 % 64), v[l][i] = (uint16_t)(0x3c00 + i * 13 % 64);
    }
    int64_t *table = malloc(sizeof(int64_t) * (size_t)blocks), *lens = malloc(sizeof(int64_t) * (size_t)batch);
    for (int64_t i = 0; i < blocks; i++) table[i] = (i * 97 + 13) % blocks; /* scattered: 97 is prime */
    for (int64_t b = 0; b < batch; b++) lens[b] = context + b % 7;
    const int64_t q_n = batch * HEADS * HEAD_DIM;
    float *q = malloc(sizeof(float) * (size_t)q_n), *out[2] = {malloc(sizeof(float) * (size_t)q_n), malloc(sizeof(float) * (size_t)q_n)};
    /* q as a bfloat16 model's step hands it over: every value a bfloat16 (BENCH_Q_F32=1: not) */
    const char *q_f32 = getenv("BENCH_Q_F32");
    for (int64_t i = 0; i < q_n; i++) {
        q[i] = 0.01f * (float)(i % 17);
        uint32_t bits;
        memcpy(&bits, q + i, sizeof bits);
        if (q_f32 == NULL || strcmp(q_f32, "1") != 0) bits &= 0xFFFF0000u;
        memcpy(q + i, &bits, sizeof bits);
    }
    char *flush = huge_alloc(FLUSH_BYTES);
    double *ratio = malloc(sizeof(double) * (size_t)rounds);
    int same = 1;
    for (int r = -2; r < rounds; r++) {
        double t[2];
        for (int j = 0; j < 2; j++) {
            const int after = (r + j + 2) % 2; /* in turn first */
            memset(flush, r + j, FLUSH_BYTES);
            const double t0 = now();
            for (int l = 0; l < LAYERS; l++)
                if ((after ? paged_decode_attention_bf16 : before_paged_decode_attention_bf16)(
                        q, k[l], v[l], table, width, lens, out[after], batch, HEADS, KV_HEADS, HEAD_DIM, BLOCK, 0.125f))
                    abort();
            t[after] = now() - t0;
        }
        same &= memcmp(out[0], out[1], sizeof(float) * (size_t)q_n) == 0;
        if (r >= 0) ratio[r] = t[0] / t[1];
    }
    printf("batch %lld, context %lld, %d rounds of %d layers: the median paired ratio (before / after) %.4f\n",
           (long long)batch, (long long)context, rounds, LAYERS, median(ratio, rounds));
    printf("the same output bit for bit: %s\n", same ? "yes" : "no");
    return 0;
}
