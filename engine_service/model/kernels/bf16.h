/* bfloat16 <-> float32 as torch converts them, for the C kernels (paged_decode_attention.c,
 * dequantize.c). bfloat16 travels as its bits in a uint16_t. */
#ifndef SLUICE_BF16_H
#define SLUICE_BF16_H

#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* round to nearest even, as torch's float -> bfloat16 conversion; NaN becomes torch's 0x7fc0 */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

#endif
