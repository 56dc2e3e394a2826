/* Quantizing new K/V rows into an int4 KV pool in place (radixrt/kernels/kv_quant.py: quantize_int4 is the
 * reference, held bit for bit). In torch the quantization is some fifteen passes over the rows and a
 * scatter; at a decode step each costs its dispatch (~170 us a layer where bf16's write costs 12), at a
 * 2,048-token chunk its memory pass (3.7 ms a layer against 0.18). Here it is one pass.
 *
 *   quantize_int4  x [rows, D] float32 (kind 0) or bf16 (kind 1), row r going to pool row dst[r] (a slot
 *                  times the KV heads plus the head): for each group of 32 elements, peak = the first
 *                  element of largest magnitude, scale = float16(clamp(peak / -8, +-65504)), s = that
 *                  scale read back, q = round-half-even(x * (1 / s)) clamped to [-8, 7] (0 where s is 0),
 *                  stored + 8, two a byte (element 2i in the low nibble). Writes values [.., D / 2] and
 *                  scales [.., D / 32] at row dst[r].
 *
 * Built once per instruction set by radixrt/kernels/native_build.py. Every operation is the IEEE float32
 * one torch does, in its order (-std=c11: no fused multiply-adds). Returns 0, or 1 for an unknown kind,
 * 2 for D not a multiple of 32.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"
#include "half.h"

enum { KIND_F32 = 0, KIND_BF16 = 1 };
#define GROUP 32
#define PAR_MIN_ROWS 64 /* rows from which a call forks */

static void quantize_group(const void *x, int kind, int64_t at, uint8_t *values, uint16_t *scale) {
    float g[GROUP], peak = 0.0f, best = -1.0f;
    for (int e = 0; e < GROUP; e++) {
        g[e] = float_at(x, kind == KIND_BF16, at + e);
        if (fabsf(g[e]) > best) best = fabsf(g[e]), peak = g[e];
    }
    const float fmax = 65504.0f, raw = peak / -8.0f;
    *scale = float_to_half(raw > fmax ? fmax : raw < -fmax ? -fmax : raw);
    const float s = half_to_float(*scale), inv = s != 0.0f ? 1.0f / s : 0.0f;
    for (int e = 0; e < GROUP; e += 2) {
        float lo = nearbyintf(g[e] * inv), hi = nearbyintf(g[e + 1] * inv);
        lo = lo < -8.0f ? -8.0f : lo > 7.0f ? 7.0f : lo;
        hi = hi < -8.0f ? -8.0f : hi > 7.0f ? 7.0f : hi;
        values[e / 2] = (uint8_t)((int)lo + 8) | (uint8_t)(((int)hi + 8) << 4);
    }
}

int CAT(radixrt_quantize_int4, ISA_NAME)(const void *x, int kind, int64_t rows, int D, const int64_t *dst,
                                        uint8_t *values, uint16_t *scales, int threads) {
    if (kind != KIND_F32 && kind != KIND_BF16) return 1;
    if (D % GROUP) return 2;
    const int par = rows >= PAR_MIN_ROWS ? threads : 1;
#pragma omp parallel for num_threads(par) schedule(static) if (par > 1)
    for (int64_t r = 0; r < rows; r++)
        for (int g = 0; g < D / GROUP; g++)
            quantize_group(x, kind, r * D + g * GROUP, values + dst[r] * (D / 2) + g * GROUP / 2,
                           scales + dst[r] * (D / GROUP) + g);
    return 0;
}
