/* A Llama-family decoder's decode step in one call (decode_stack.c): every layer, for rows that are
 * each one token of a decode, with int4 weights and float32 activations, or bfloat16 weights in
 * oneDNN's packed layout and bfloat16 activations. */
#ifndef SLUICE_DECODE_STACK_H
#define SLUICE_DECODE_STACK_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define STACK_INT4 0 /* q4_gemv.h's layout; float32 activations; up to Q4_MAX_ROWS rows */
#define STACK_BF16 1 /* packed_gemv.h's layout (oneDNN's, read in place); bfloat16 activations; up to packed_gemm_bf16_max_rows() rows */
/* the output projection's layout (DecodeStack.head_kind) */
#define STACK_HEAD_LAYERS 0 /* the layers' kind */
#define STACK_HEAD_Q8 1     /* q8_gemv.h's int8 blocks (a GGUF file's Q8_0 or Q6_K head); int4 stacks only */
/* the KV cache's dtype (kv_cache_dtype), whatever the activations' */
#define STACK_CACHE_F32 0
#define STACK_CACHE_BF16 1
#define STACK_CACHE_F16 2

/* One projection: n_out outputs, k inputs. int4: data = codes, scales_zeros (float16 pairs), n_pad
 * rows, extra = the group size. bfloat16: data = the packed weight, scales_zeros NULL, n_pad x extra
 * (k padded). A STACK_HEAD_Q8 head: data = q8_gemv.h's codes, scales_zeros = its float32 scales,
 * n_pad rows, extra = the group size (16 or 32). */
typedef struct {
    const void *data;
    const void *scales_zeros;
    int64_t n_out, n_pad, k, extra;
} StackWeight;

typedef struct {
    const void *input_norm, *post_norm; /* [hidden], the activations' dtype */
    StackWeight qkv;                    /* q, k, v stacked on the output axis */
    StackWeight o;
    StackWeight gate_up;                /* gate, up stacked on the output axis */
    StackWeight down;
    void *k_cache, *v_cache; /* [num_blocks, block_size, kv_heads, head_dim], of cache_type */
    /* what a family adds to Llama's attention, each NULL where it has none: the q/k/v projection's
     * bias [q + 2 kv] and the output projection's [hidden] (Qwen2, Llama's attention_bias), in the
     * activations' dtype; an RMSNorm over each head of q and of k ([head_dim], Qwen3), after the
     * projection and before the rotary */
    const void *qkv_bias, *o_bias;
    const void *q_norm, *k_norm;
} StackLayer;

typedef struct {
    int64_t num_layers, hidden, heads, kv_heads, head_dim, intermediate, block_size, vocab;
    float eps, scale;
    int kind;       /* STACK_INT4 or STACK_BF16 */
    int cache_type; /* STACK_CACHE_F32, STACK_CACHE_BF16 or STACK_CACHE_F16: what the caches hold */
    const void *embed;      /* [vocab, hidden], the activations' dtype */
    const void *final_norm; /* [hidden] */
    const StackLayer *layers;
    StackWeight head; /* the output projection, [vocab, hidden]; data NULL: none (no logits) */
    /* 1: a deterministic engine's stack: any number of rows up to STACK_DETERMINISTIC_MAX_ROWS (a
     * prefill chunk's, each row attending as a decode of its own length), and every row computed
     * as one row alone computes it bit for bit: no AMX tiles in the products (PG_NO_TILES), no AMX
     * scores for a chunk's rows in the attention */
    int deterministic;
    int head_kind; /* STACK_HEAD_LAYERS or STACK_HEAD_Q8 */
} DecodeStack;

/* the most rows one call of a deterministic stack takes (the caller splits a bigger step: a row's
 * output does not depend on the rows beside it) */
#define STACK_DETERMINISTIC_MAX_ROWS 1024

/* out[rows, hidden] (the activations' dtype) = the final norm of the stack's output for tokens
 * ids[rows] at positions[rows], each row a decode: its K/V written at slots[r], then attending to
 * context_lens[r] tokens through block_tables[r] (table_width columns). cos/sin: the rotary tables,
 * float32 [num_positions, head_dim]. With logits (and the stack's head), logits[rows, head.n_out]
 * = that output times the head, float32 (with bfloat16 activations, each rounded to bfloat16 first,
 * as the head's own product rounds it); out may then be NULL. With logits and argmax, argmax[rows] =
 * each row's stack_argmax of its logits. Returns 0; 1 when scratch memory
 * could not be had; 2 when a size or an id is out of range, logits are asked of a stack without a
 * head (or an argmax without logits), or the CPU cannot run the products; 3 when the attention
 * kernel refused its shape. */
int decode_stack(const DecodeStack *stack, const int64_t *ids, const int64_t *positions, const float *cos_table,
                 const float *sin_table, int64_t num_positions, const int64_t *slots, const int64_t *block_tables,
                 int64_t table_width, const int64_t *context_lens, int64_t rows, void *out, float *logits,
                 int64_t *argmax);

/* `steps` greedy decode steps in one call, each row's input after the first step being its argmax
 * of the step before: step j runs decode_stack on positions[j * rows ...], slots[j * rows ...] and
 * context_lens[j * rows ...] ([steps][rows] each) with the block tables given, and writes its
 * argmax to tokens[j * rows ...]; logits[rows, head.n_out] is the scratch for each step's logits
 * (the last step's are left there). The same steps as `steps` calls of decode_stack bit for bit.
 * Returns decode_stack's codes (2 also for steps < 1 or a stack without a head); a step that
 * fails ends the call, the steps before it written. */
int decode_stack_steps(const DecodeStack *stack, const int64_t *ids, const int64_t *positions, const float *cos_table,
                       const float *sin_table, int64_t num_positions, const int64_t *slots, const int64_t *block_tables,
                       int64_t table_width, const int64_t *context_lens, int64_t rows, int64_t steps, float *logits,
                       int64_t *tokens);

/* Whether a stack (int4 or bfloat16) runs its layers in one parallel region (1, the default) or
 * forks and joins the thread team for each product and each attention (0); the two give the same
 * numbers bit for bit. For tests and benches: set it between steps. Returns the setting now in
 * force. */
int decode_stack_set_one_region(int on);

/* Whether the one-region step's team meets at its own barrier (1, the default; team_barrier.h) or
 * at libgomp's `omp barrier` (0); the same numbers bit for bit. For benches: set it between steps.
 * Returns the setting now in force. */
int decode_stack_set_own_barrier(int on);

/* How many lines of the next layer's K/V each thread of a one-row, one-region step fetches into L2
 * per 4 KB chunk of bfloat16 weights, or per group of int4 codes, of the products before that
 * attention (kv_ahead.h; 8, the default; 0 off). Where it is on, the context is long enough to share
 * out and the products run their loop without prefetches (packed_gemv_one_row_streams,
 * q4_gemv_one_row_streams: AMD's default), attention's tasks are each thread's own run
 * (PdaPlan.static_tasks); the numbers are the same bit for bit either way. For benches: set it between steps (a negative count leaves it). Returns
 * the setting now in force. */
int decode_stack_set_kv_ahead(int lines);
/* how many of those lists the steps have made so far (thread 0's, one a layer after the first) */
int64_t decode_stack_kv_ahead_lists(void);

/* From how many bytes a step's scratch stays with the calling thread between calls (default 32 MB,
 * glibc's largest mmap threshold; a negative count leaves it), and whether a kept buffer is filled
 * with 0xff bytes before each use (1 on, 0 off, -1 leaves it). For tests: set it between steps.
 * Returns the byte count now in force. */
int64_t decode_stack_set_keep_scratch(int64_t min_bytes, int poison);

/* The index of v's largest value, the first of equal ones, as torch's argmax picks it: a NaN counts
 * as the largest (the first NaN), and all -inf gives 0; -1 for n <= 0. */
int64_t stack_argmax(const float *v, int64_t n);

/* dst[i] = src[i] as IEEE half, rounded to nearest even (torch's float -> float16): how the step
 * writes a float16 KV cache. */
void stack_f32_to_f16(const float *src, uint16_t *dst, int64_t n);

/* The step's barrier (team_barrier.h) put to the test: `rounds` times, each thread of a team of
 * `threads` stores the round in a slot of its own, meets the others, and counts the slots that do
 * not hold the round; then meets them again before the next round's stores. Returns the count, 0
 * when every thread waited for every other; -1 for a team size outside 1..64 or rounds < 1. */
int64_t stack_team_barrier_check(int threads, int64_t rounds);

#ifdef __cplusplus
}
#endif

#endif
