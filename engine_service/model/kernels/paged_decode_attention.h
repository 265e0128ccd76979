/* The decode attention kernel's entry points and limits, shared by the C kernel
 * (paged_decode_attention.c) and its torch binding (paged_decode_attention_op.cpp). The Python side
 * mirrors the limits in engine_service.model.native.PagedDecodeAttention.supports. */
#ifndef SLUICE_PAGED_DECODE_ATTENTION_H
#define SLUICE_PAGED_DECODE_ATTENTION_H

#include <stdint.h>

#define PDA_MAX_HEADS 128    /* query heads */
#define PDA_MAX_HEAD_DIM 256

#ifdef __cplusplus
extern "C" {
#endif

/* 0: done; 1: out of memory; 2: a shape outside the limits above. */
int paged_decode_attention_f32(const float *q, const float *k_cache, const float *v_cache,
                               const int64_t *block_tables, int64_t table_width,
                               const int64_t *context_lens, float *out, int64_t batch, int64_t heads,
                               int64_t kv_heads, int64_t head_dim, int64_t block_size, float scale);
int paged_decode_attention_bf16(const float *q, const uint16_t *k_cache, const uint16_t *v_cache,
                                const int64_t *block_tables, int64_t table_width,
                                const int64_t *context_lens, float *out, int64_t batch,
                                int64_t heads, int64_t kv_heads, int64_t head_dim,
                                int64_t block_size, float scale);
int paged_decode_attention_f16(const float *q, const uint16_t *k_cache, const uint16_t *v_cache,
                               const int64_t *block_tables, int64_t table_width,
                               const int64_t *context_lens, float *out, int64_t batch,
                               int64_t heads, int64_t kv_heads, int64_t head_dim,
                               int64_t block_size, float scale);

/* paged_decode_attention_bf16 without the AMX scores of a draft chunk's rows (pda_plan_chunks): every
 * row's scores by VDPBF16PS as a lone row's, so that a row's output is the same bit for bit whatever
 * rows of its own sequence run beside it (a deterministic engine's attention) */
int paged_decode_attention_bf16_exact(const float *q, const uint16_t *k_cache, const uint16_t *v_cache,
                                      const int64_t *block_tables, int64_t table_width,
                                      const int64_t *context_lens, float *out, int64_t batch,
                                      int64_t heads, int64_t kv_heads, int64_t head_dim,
                                      int64_t block_size, float scale);

/* Whether a row that follows a row of its own sequence (a draft chunk's rows) prefetches its K/V:
 * 0, the default, it does not (the row before has just read those lines); 1, every row does. The
 * outputs are the same either way. Returns the setting now in force. */
int paged_decode_attention_set_follower_fetch(int on);

/* Whether a bfloat16 step's draft chunks take their scores from AMX tiles, all of a chunk's rows at
 * once (paged_decode_attention.c, "Draft chunks"): 1, the default, where the CPU has AMX; 0, each
 * row's own VDPBF16PS scores. Returns the setting now in force. */
int paged_decode_attention_set_chunk_scores(int on);
/* how many times a thread has computed draft chunks' scores through AMX (0 on a CPU without it) */
int64_t paged_decode_attention_chunk_passes(void);

/* A step's attention laid out once (its partitions and work buffers), for calls from inside a
 * parallel region: the context lengths must stay as planned. threads: the most threads a team
 * calling it will have (the scores scratch has a row for each). Returns 0, 1 (out of memory: nothing to free) or 2 (a shape outside the
 * limits). */
struct TeamBarrier;
typedef struct {
    int64_t tasks, total_len;
    int64_t *first_task, *task_seq;
    float *partials, *scores;
    /* where the team meets after the partitions (team_barrier.h); pda_plan leaves it NULL: `omp barrier` */
    struct TeamBarrier *barrier;
    /* 0 (pda_plan's): each task to whichever thread is free; 1: each thread its own run of tasks
     * (pda_thread_tasks), so that it can fetch their K/V ahead (kv_ahead.h). The results are the
     * same bit for bit: a task's sums do not depend on the thread that computes it. */
    int static_tasks;
    /* draft chunks whose scores AMX tiles compute before the partitions (pda_plan_chunks): each row's
     * chunk (-1: none), each chunk's first row and row count, and the scores, [row][head][score_stride]
     * floats, scaled; num_chunks 0: none */
    int64_t num_chunks, score_stride, *row_chunk, *chunk_first, *chunk_rows;
    float *chunk_scores;
} PdaPlan;
int pda_plan(PdaPlan *plan, const int64_t *context_lens, int64_t batch, int64_t heads, int64_t kv_heads,
             int64_t head_dim, int threads);
void pda_plan_free(PdaPlan *plan);
/* For a bfloat16 cache: find the plan's draft chunks (pda_plan_chunks in paged_decode_attention.c)
 * and room for their scores. 0, or 1 (out of memory: the plan stays valid, without chunks). */
int pda_plan_chunks(PdaPlan *plan, const int64_t *block_tables, int64_t table_width, const int64_t *context_lens,
                    int64_t batch, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size);
/* 1 when a team shares the plan's tasks out, 0 when its context is short enough for one thread */
int pda_plan_shared(const PdaPlan *plan);
/* task `task`'s sequence and its tokens [start, end) */
void pda_task_span(const PdaPlan *plan, const int64_t *context_lens, int64_t task, int64_t *seq, int64_t *start,
                   int64_t *end);
/* the tasks [lo, hi) that thread `thread` of a team of `threads` takes when static_tasks is set */
void pda_thread_tasks(const PdaPlan *plan, int thread, int threads, int64_t *lo, int64_t *hi);
/* a thread's share [lo, hi) of `total` items, contiguous, in thread order: the tasks above, the
 * (sequence, head)s it combines with own_out 2, a draft chunk's tokens, a step's rows */
void pda_share(int64_t total, int thread, int threads, int64_t *lo, int64_t *hi);

/* The kernels' work for a team already running: every thread of the team calls it, and the results
 * are the entry points' above, bit for bit. own_out 0: the same arguments in every thread, and the
 * call ends in a barrier. own_out 1: each thread passes an out of its own and gets all of it (every
 * thread combines every head, a few hundred values a sequence); the call ends after the combine,
 * without the barrier a shared out needs (the partitions' barrier stays), so the caller must not
 * reuse the plan before every thread has combined (decode_stack.c: a product's barrier comes first).
 * own_out 2: the same out in every thread, each combining its share of the (sequence, head)s
 * (pda_share), without a barrier: the caller meets before reading the rest. */
void paged_decode_attention_f32_team(const PdaPlan *plan, const float *q, const float *k_cache,
                                     const float *v_cache, const int64_t *block_tables, int64_t table_width,
                                     const int64_t *context_lens, float *out, int64_t batch, int64_t heads,
                                     int64_t kv_heads, int64_t head_dim, int64_t block_size, float scale,
                                     int own_out);
void paged_decode_attention_bf16_team(const PdaPlan *plan, const float *q, const uint16_t *k_cache,
                                      const uint16_t *v_cache, const int64_t *block_tables, int64_t table_width,
                                      const int64_t *context_lens, float *out, int64_t batch, int64_t heads,
                                      int64_t kv_heads, int64_t head_dim, int64_t block_size, float scale,
                                      int own_out);
void paged_decode_attention_f16_team(const PdaPlan *plan, const float *q, const uint16_t *k_cache,
                                     const uint16_t *v_cache, const int64_t *block_tables, int64_t table_width,
                                     const int64_t *context_lens, float *out, int64_t batch, int64_t heads,
                                     int64_t kv_heads, int64_t head_dim, int64_t block_size, float scale,
                                     int own_out);

#ifdef __cplusplus
}
#endif

#endif
