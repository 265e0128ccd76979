/* A Llama-family decoder's decode step in one call: every layer of an int4-quantized model with
 * float32 activations, for rows that are each one token of a decode (q4_decode.c). */
#ifndef SLUICE_Q4_DECODE_H
#define SLUICE_Q4_DECODE_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* One int4 projection in q4_gemv.h's layout: n_out outputs (n_pad rows), k inputs. */
typedef struct {
    const uint8_t *codes;
    const uint16_t *scales_zeros;
    int64_t n_out, n_pad, k, group;
} Q4Weight;

typedef struct {
    const float *input_norm, *post_norm; /* [hidden] */
    Q4Weight qkv;                        /* q, k, v stacked on the output axis */
    Q4Weight o;
    Q4Weight gate_up;                    /* gate, up stacked on the output axis */
    Q4Weight down;
    void *k_cache, *v_cache; /* [num_blocks, block_size, kv_heads, head_dim], float32 or bfloat16 */
} Q4Layer;

typedef struct {
    int64_t num_layers, hidden, heads, kv_heads, head_dim, intermediate, block_size, vocab;
    float eps, scale;
    int cache_bf16; /* 1: the caches hold bfloat16, else float32 */
    const float *embed;      /* [vocab, hidden] */
    const float *final_norm; /* [hidden] */
    const Q4Layer *layers;
} Q4Stack;

/* out[rows, hidden] = the final norm of the stack's output for tokens ids[rows] at positions[rows],
 * each row a decode: its K/V written at slots[r], then attending to context_lens[r] tokens through
 * block_tables[r] (table_width columns). cos/sin: the rotary tables, [>= max position + 1, head_dim].
 * Returns 0; 1 when scratch memory could not be had; 2 when a size or an id is out of range or the
 * CPU cannot run the int4 kernel; 3 when the attention kernel refused its shape. */
int q4_decode_stack(const Q4Stack *stack, const int64_t *ids, const int64_t *positions, const float *cos_table,
                    const float *sin_table, int64_t num_positions, const int64_t *slots,
                    const int64_t *block_tables, int64_t table_width, const int64_t *context_lens, int64_t rows,
                    float *out);

#ifdef __cplusplus
}
#endif

#endif
