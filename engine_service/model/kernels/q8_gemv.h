/* Products of activation rows with int8 block-quantized weights (GGUF's Q8_0 and Q6_K, as they
 * are: int8 codes with one float32 scale per group of 16 or 32 inputs) in a layout of our own, read
 * in place with AVX512-VNNI integer dot products (q8_gemv.c); and the same weights dequantized into
 * a dense matrix for products of very many rows. The int8 counterpart of q4_gemv.h. */
#ifndef SLUICE_Q8_GEMV_H
#define SLUICE_Q8_GEMV_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define Q8_BLOCK_N 16  /* output rows per block: one 512-bit register of int32 sums */
#define Q8_STEP_K 4    /* inputs per 64-byte load (16 rows x 4 codes) */
#define Q8_XBLOCK 32   /* inputs per activation scale */
#define Q8_MAX_ROWS 4096

/* The layout, for n rows padded to n_pad (a multiple of Q8_BLOCK_N, zero rows) and k inputs (a
 * multiple of Q8_XBLOCK), group g = 16 or 32 inputs per weight scale:
 *   codes [n_pad/16][k/4][64] bytes: byte 4r + j of step t of block b holds c + 128 for code c
 *     (int8, -128..127) of row 16b + r, input 4t + j, j = 0..3, so that each 32-bit lane is one
 *     row's four consecutive inputs, unsigned (VPDPBUSD's unsigned operand);
 *   scales [n_pad/16][k/g][16] float32: the scale of each of the block's 16 rows for that group.
 * The weight is w = c * scale. Q8_0 is g = 32 (scale d); Q6_K is g = 16 (scale d * sc, exact in
 * float32; code q - 32). */

/* 1 when n_out x k weights in groups of `group` inputs fit the layout below as n_pad rows, else 0 */
int q8_layout_ok(int64_t n_out, int64_t n_pad, int64_t k, int64_t group);

/* 1 when this build can run q8_linear (AVX512-VNNI and AVX512BW), else 0 */
int q8_gemv_supported(void);

/* whether one-row products prefetch their codes (several rows always do): 1 on, 0 off, -1 the
 * CPU's default (one_row_prefetch.h); returns the setting now in force. For benches: set it
 * before a product runs, not while one does. */
int q8_gemv_set_prefetch(int mode);

/* y[m][n] = sum_k x[m][k] * w[n][k] for m < rows, n < n_out; x and y float32 (q8_linear_f32) or
 * bfloat16 bits (q8_linear_bf16). Each row of x is quantized to int8 per 32 inputs (scale
 * max|x| / 127, round to nearest even: q4_gemv.c's quantize_row) and multiplied in integers group
 * by group: y += (s_w * s_x) * (isum - 128 * xqsum), isum the dot product of the unsigned codes
 * with the quantized activations and xqsum the group's sum of those (the offset of 128 removed
 * exactly, in integers). A row's output depends on that row alone, bit for bit. Returns 0, 1 when
 * scratch memory could not be had, 2 when the sizes are not the layout's or the CPU cannot run it. */
int q8_linear_f32(const uint8_t *codes, const float *scales, const float *x, float *y, int64_t rows, int64_t n_out,
                  int64_t n_pad, int64_t k, int64_t group);
int q8_linear_bf16(const uint8_t *codes, const float *scales, const uint16_t *x, uint16_t *y, int64_t rows,
                   int64_t n_out, int64_t n_pad, int64_t k, int64_t group);

/* q8_linear_f32 for a caller already inside a parallel region (decode_stack.c's int4 step, whose
 * output projection is a GGUF file's Q8_0 or Q6_K blocks): every thread of the team must call it
 * with the same arguments but its own `scratch` (at least q8_team_scratch_bytes(rows, k, group)
 * bytes, float-aligned), into which it quantizes the rows; the tasks are shared out (an orphaned omp
 * for) and y, shared, is complete for every thread when it returns (a barrier: `barrier`,
 * team_barrier.h, or `omp barrier` where it is NULL). The sizes are not checked: the caller checked
 * them once. The same outputs bit for bit as q8_linear_f32. */
struct TeamBarrier;
int64_t q8_team_scratch_bytes(int64_t rows, int64_t k, int64_t group);
void q8_linear_f32_team(const uint8_t *codes, const float *scales, const float *x, float *y, int64_t rows,
                        int64_t n_out, int64_t n_pad, int64_t k, int64_t group, void *scratch,
                        struct TeamBarrier *barrier);

/* out [n_pad][k] = (float)c * scale in float32, one rounding to the output type (the torch
 * reference: q8_blocks.dequantize_q8); portable C */
void dequantize_q8_f32(const uint8_t *codes, const float *scales, int64_t n_pad, int64_t k, int64_t group,
                       float *out);
void dequantize_q8_bf16(const uint8_t *codes, const float *scales, int64_t n_pad, int64_t k, int64_t group,
                        uint16_t *out);

#ifdef __cplusplus
}
#endif

#endif
