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

#ifdef __cplusplus
}
#endif

#endif
