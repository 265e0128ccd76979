/* e^x in plain arithmetic, for loops that must vectorise (a libm call per element does not):
 * Cephes' expf, range reduction by ln 2 and a degree-6 polynomial, within 2 ulp of expf. x is
 * clamped to [-87, 88] (the float range); the softmax (paged_decode_attention.c) only passes
 * x <= 0 (there the libm call per score was a third of the kernel's time at batch 64), SiLU
 * (decode_stack.c) any x, where the clamp leaves x / (1 + e^-x) at its limit. */
#ifndef SLUICE_FAST_EXP_H
#define SLUICE_FAST_EXP_H

#include <stdint.h>
#include <string.h>

static inline float fast_exp(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float k = __builtin_rintf(x * 1.44269504088896341f);
    const float r = x - k * 0.693359375f + k * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const float y = p * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)k + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return y * scale;
}

#endif
