/* Weight dequantization for products of many rows (prefill chunks, big batches): the entry points
 * shared by the C kernels (dequantize.c) and their torch binding (dequantize_op.cpp). */
#ifndef SLUICE_DEQUANTIZE_H
#define SLUICE_DEQUANTIZE_H

#include <stdint.h>

#define DQ_INT4_BLOCK_N 64 /* output rows per block of torch's CPU int4 packed layout */
#define DQ_INT4_MAX_GROUP 256

#ifdef __cplusplus
extern "C" {
#endif

/* int4, torch's CPU packed layout: packed [n/64][k][32] bytes, scales_zeros [k/group][n][2]
 * (scale, zero); out [n][k] = (code - 8) * scale + zero. n a multiple of 64, k of group,
 * group at most DQ_INT4_MAX_GROUP. */
void dequantize_int4_f32(const uint8_t *packed, const float *scales_zeros, int64_t n, int64_t k,
                         int64_t group, float *out);
void dequantize_int4_bf16(const uint8_t *packed, const uint16_t *scales_zeros, int64_t n, int64_t k,
                          int64_t group, uint16_t *out);
/* int8, one scale per output row: out [n][k] = q * scales[n]. */
void dequantize_int8_f32(const int8_t *q, const float *scales, int64_t n, int64_t k, float *out);
void dequantize_int8_bf16(const int8_t *q, const uint16_t *scales, int64_t n, int64_t k, uint16_t *out);

#ifdef __cplusplus
}
#endif

#endif
