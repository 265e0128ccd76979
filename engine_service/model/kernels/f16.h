/* IEEE half (float16) <-> float32 for the C kernels: the attention's portable loops widen with
 * f16_to_f32 (its AVX-512 paths with vcvtph2ps), the native decode step writes a float16 KV
 * cache with f32_to_f16 (decode_stack.c). A half travels as its bits in a uint16_t. */
#ifndef SLUICE_F16_H
#define SLUICE_F16_H

#include <stdint.h>
#include <string.h>

static inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu, bits;
    if (exp == 0x1fu) {
        bits = sign | 0x7f800000u | (man << 13); /* inf, NaN (payload kept) */
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (man << 13); /* rebias: 127 - 15 */
    } else if (man == 0) {
        bits = sign; /* +-0 */
    } else { /* subnormal: man * 2^-24, normalised */
        uint32_t e = 0;
        while (!(man & 0x400u)) {
            man <<= 1;
            e++;
        }
        bits = sign | ((113u - e) << 23) | ((man & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* float32 -> IEEE half, rounding to nearest even as torch's conversion does: past the largest
 * half (65504) to infinity, below the smallest normal to a subnormal or zero; a NaN stays a NaN. */
static inline uint16_t f32_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    const uint32_t ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* 65520 and up round to infinity */
    if (ax >= 0x38800000u) {                                   /* a normal half: rebias, round at bit 13 */
        uint32_t r = ax - 0x38000000u;
        r += 0xfffu + ((r >> 13) & 1u);
        return (uint16_t)(sign | (r >> 13));
    }
    /* below 2^-14: (mantissa with its hidden bit) * 2^(e - 150) in units of 2^-24 */
    const uint32_t e = ax >> 23, mant = (ax & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - e; /* >= 14 */
    if (e == 0 || shift > 24u) return sign; /* under half the smallest subnormal (a tie goes to 0, even) */
    uint32_t n = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (n & 1u))) n++;
    return (uint16_t)(sign | n);
}

#endif
