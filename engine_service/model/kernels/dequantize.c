/* Dequantize a layer's weights into a dense matrix, for the products of many rows that torch's
 * packed int4/int8 kernels (made for a few rows: their time grows with every row) would run slowly.
 * Memory-bound by design: one pass that reads the integer weights once and writes the dense
 * matrix once, where the same arithmetic in torch operations makes six to eight passes over
 * matrices that leave the cache (engine_service/model/quantization.py has the torch reference).
 *
 * The arithmetic is the reference's, operation for operation, in float32 with contraction into
 * fused multiply-adds turned off: the result is bitwise the reference's (tested), so a machine
 * without a compiler dequantizes to the same weights.
 *
 * int4 layout (torch's _convert_weight_to_int4pack_for_cpu, checked layer by layer at load): the
 * n output rows in blocks of 64, each block stored k-major, 32 bytes per input column; byte j of
 * column c holds row j of the block in its low nibble and row 32 + j in its high nibble. A task is
 * one block: its packed bytes (k * 32, 18 KB for k = 576) stay in L1/L2 while its 64 output rows
 * are written in order. */
#include <stdint.h>

#include "bf16.h"
#include "dequantize.h"

#define NOCONTRACT __attribute__((optimize("fp-contract=off")))

#define HALF (DQ_INT4_BLOCK_N / 2)

#define DEFINE_INT4(NAME, SZ_T, OUT_T, LOAD, STORE)                                                  \
    NOCONTRACT void NAME(const uint8_t *packed, const SZ_T *scales_zeros, int64_t n, int64_t k,     \
                         int64_t group, OUT_T *out) {                                              \
        const int64_t blocks = n / DQ_INT4_BLOCK_N;                                                \
        _Pragma("omp parallel for schedule(static)")                                               \
        for (int64_t b = 0; b < blocks; b++) {                                                     \
            const uint8_t *blk = packed + b * k * HALF;                                            \
            /* the block's bytes turned row-major, a group of columns at a time (in L1) */         \
            uint8_t tile[HALF][DQ_INT4_MAX_GROUP];                                                               \
            for (int64_t g0 = 0; g0 < k; g0 += group) {                                            \
                for (int64_t c = 0; c < group; c++)                                                \
                    for (int64_t j = 0; j < HALF; j++) tile[j][c] = blk[(g0 + c) * HALF + j];      \
                for (int64_t j = 0; j < DQ_INT4_BLOCK_N; j++) {                                    \
                    const int64_t row = b * DQ_INT4_BLOCK_N + j;                                   \
                    const int shift = j < HALF ? 0 : 4;                                            \
                    const uint8_t *src = tile[j % HALF];                                           \
                    const SZ_T *sz = scales_zeros + ((g0 / group) * n + row) * 2;                  \
                    const float scale = LOAD(sz[0]), zero = LOAD(sz[1]);                           \
                    OUT_T *dst = out + row * k + g0;                                               \
                    _Pragma("omp simd")                                                            \
                    for (int64_t c = 0; c < group; c++) {                                          \
                        const float code = (float)((src[c] >> shift) & 15);                        \
                        dst[c] = STORE((code - 8.0f) * scale + zero);                              \
                    }                                                                              \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
    }

#define DEFINE_INT8(NAME, S_T, OUT_T, LOAD, STORE)                                                   \
    NOCONTRACT void NAME(const int8_t *q, const S_T *scales, int64_t n, int64_t k, OUT_T *out) {    \
        _Pragma("omp parallel for schedule(static)")                                               \
        for (int64_t row = 0; row < n; row++) {                                                    \
            const float scale = LOAD(scales[row]);                                                 \
            const int8_t *src = q + row * k;                                                       \
            OUT_T *dst = out + row * k;                                                            \
            _Pragma("omp simd")                                                                    \
            for (int64_t c = 0; c < k; c++) dst[c] = STORE((float)src[c] * scale);                 \
        }                                                                                          \
    }

#define AS_IS(x) (x)
DEFINE_INT4(dequantize_int4_f32, float, float, AS_IS, AS_IS)
DEFINE_INT4(dequantize_int4_bf16, uint16_t, uint16_t, bf16_to_f32, f32_to_bf16)
DEFINE_INT8(dequantize_int8_f32, float, float, AS_IS, AS_IS)
DEFINE_INT8(dequantize_int8_bf16, uint16_t, uint16_t, bf16_to_f32, f32_to_bf16)
