/* Products of activation rows with int4 group-quantized weights in a layout of our own, read in
 * place with AVX512-VNNI integer dot products, or AMX tiles for 12 rows and more where the CPU has
 * them (q4_gemv.c); and the same weights dequantized into a dense matrix for products of very many
 * rows. */
#ifndef SLUICE_Q4_GEMV_H
#define SLUICE_Q4_GEMV_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define Q4_BLOCK_N 16  /* output rows per block: one 512-bit register of int32 sums */
#define Q4_STEP_K 8    /* inputs per 64-byte load (16 rows x 8 nibbles) */
#define Q4_XBLOCK 32   /* inputs per activation scale */
#define Q4_MAX_ROWS 4096

/* The layout, for n rows padded to n_pad (a multiple of Q4_BLOCK_N) and k inputs (a multiple of
 * Q4_XBLOCK and of group):
 *   codes [n_pad/16][k/8][64] bytes: byte 4r + j of step s of block b holds code (row 16b + r,
 *     input 8s + j) in its low nibble and (row 16b + r, input 8s + 4 + j) in its high nibble,
 *     j = 0..3, so that each 32-bit lane is one row's four consecutive inputs (VPDPBUSD's operand);
 *   scales_zeros [n_pad/16][k/group][2][16] float16: scale, then min, of the block's 16 rows.
 * The weight is w = code * scale + min: GGUF's Q4_1 block (Q4_0's is min = -8 scale), read without
 * a rounding; quantization.py's own int4 stores its groups' (scale, lo) the same way. */

/* 1 when this build can run q4_linear (AVX512-VNNI and AVX512BW), else 0 */
int q4_gemv_supported(void);

/* whether one-row products prefetch their codes (several rows always do): 1 on, 0 off, -1 the
 * CPU's default (one_row_prefetch.h: off on AMD, on elsewhere); returns the setting now in force.
 * For benches: set it before a product runs, not while one does. */
int q4_gemv_set_prefetch(int mode);

/* 1 when products of AMX_MIN_ROWS rows or more take AMX tile passes: built with AMX-INT8, and
 * Linux granted this process the tile state; else 0 */
int q4_amx_usable(void);

/* y[m][n] = sum_k x[m][k] * w[n][k] for m < rows, n < n_out; x and y float32 (q4_linear_f32) or
 * bfloat16 bits (q4_linear_bf16). Each row of x is quantized to int8 per 32 inputs (scale
 * max|x| / 127, round to nearest even) and multiplied in integers, group by group; the min terms
 * take the sums of the rounded inputs (the product is of the weights and the rounded x). Returns 0, 1 when scratch memory could not be had, 2 when the
 * sizes are not the layout's or the CPU cannot run it. */
int q4_linear_f32(const uint8_t *codes, const uint16_t *scales_zeros, const float *x, float *y, int64_t rows,
                  int64_t n_out, int64_t n_pad, int64_t k, int64_t group);
int q4_linear_bf16(const uint8_t *codes, const uint16_t *scales_zeros, const uint16_t *x, uint16_t *y,
                   int64_t rows, int64_t n_out, int64_t n_pad, int64_t k, int64_t group);

/* q4_linear_f32 for a caller already inside a parallel region (decode_stack.c's int4 step): every
 * thread of the team must call it with the same arguments but its own `scratch` (at least
 * q4_team_scratch_bytes(rows, k, group) bytes, float-aligned), into which it quantizes the rows;
 * the tasks are shared out (an orphaned omp for) and y, shared, is complete for every thread when
 * it returns (a barrier: `barrier`, team_barrier.h, or `omp barrier` where it is NULL). The sizes
 * are not checked: the caller checked them once. The same outputs bit for bit as q4_linear_f32. */
struct TeamBarrier;
struct KvAhead;
int64_t q4_team_scratch_bytes(int64_t rows, int64_t k, int64_t group);
void q4_linear_f32_team(const uint8_t *codes, const uint16_t *scales_zeros, const float *x, float *y, int64_t rows,
                        int64_t n_out, int64_t n_pad, int64_t k, int64_t group, void *scratch,
                        struct TeamBarrier *barrier, struct KvAhead *ahead);

/* 1 when a one-row product runs its loop without software prefetches (the one that drains a
 * q4_linear_f32_team's `ahead`: one list a thread, kv_ahead.h, or NULL), else 0 */
int q4_gemv_one_row_streams(void);

/* out [n_pad][k] = code * scale + min in float32 without fused multiply-adds, one rounding
 * to the output type (the torch reference: quantization.dequantize_q4) */
void dequantize_q4_f32(const uint8_t *codes, const uint16_t *scales_zeros, int64_t n_pad, int64_t k, int64_t group,
                       float *out);
void dequantize_q4_bf16(const uint8_t *codes, const uint16_t *scales_zeros, int64_t n_pad, int64_t k,
                        int64_t group, uint16_t *out);

#ifdef __cplusplus
}
#endif

#endif
