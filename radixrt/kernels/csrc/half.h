/* IEEE float16 <-> float32 (and bf16 reads and writes) in plain C, for every variant (F16C is not among the scalar variant's flags):
 * the int4 KV pool's scales (radixrt/kernels/kv_quant.py), read by the attention kernel and written by
 * the quantizer. float_to_half rounds to nearest, ties to even, as torch's .to(torch.float16) does; a
 * value beyond float16's range becomes infinity (the quantizer clamps before it converts). */
#ifndef RADIXRT_HALF_H
#define RADIXRT_HALF_H
#include <stdint.h>
#include <string.h>

static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t bits;
    if (exp == 0) { /* zero or subnormal: man * 2^-24 */
        const float f = (float)man * (1.0f / 16777216.0f);
        return sign ? -f : f;
    }
    bits = sign | (exp == 31 ? 0x7f800000u | (man << 13) : ((exp + 112) << 23) | (man << 13));
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t float_to_half(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    const uint16_t sign = (uint16_t)((bits >> 16) & 0x8000);
    const int32_t exp = (int32_t)((bits >> 23) & 0xff) - 127 + 15;
    uint32_t man = bits & 0x7fffff;
    if (((bits >> 23) & 0xff) == 0xff) return sign | 0x7c00 | (man ? 0x200 : 0); /* inf, NaN */
    if (exp >= 31) return sign | 0x7c00;                                          /* overflow */
    int shift = 13;
    uint32_t h;
    if (exp <= 0) { /* a float16 subnormal, or zero */
        if (exp < -10) return sign;
        man |= 0x800000;
        shift = 14 - exp;
        h = 0;
    } else {
        h = (uint32_t)exp << 10;
    }
    const uint32_t kept = man >> shift, rest = man & ((1u << shift) - 1), half = 1u << (shift - 1);
    h += kept;
    if (rest > half || (rest == half && (h & 1))) h++; /* a carry into the exponent is the right result */
    return sign | (uint16_t)h;
}
/* Element i of a row of float32 (bf16 == 0) or bf16 (bf16 == 1, the top half of a float32) values. */
static inline float float_at(const void *x, int bf16, int64_t i) {
    if (!bf16) return ((const float *)x)[i];
    const uint32_t bits = (uint32_t)((const uint16_t *)x)[i] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* float32 -> bf16, rounded to nearest even as torch's .to(torch.bfloat16) does (NaN -> 0x7fc0, as torch). */
static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if (f != f) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

#endif /* RADIXRT_HALF_H */
