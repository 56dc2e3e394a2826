/* The quantized pools' rows for paged_attention.c: int4 (two values a byte, a float16 scale per INT4_GROUP
 * elements of a token's head) and int8 (a float32 scale per token and KV head), as radixrt/kernels/kv_quant.py
 * stores them.
 *
 * quant_row dequantizes a row into float32 (every variant: the block's rows go to L1 scratch once per KV
 * head, and the float tiles read them there). Where the CPU has VNNI (the AVX512BF16 and BRGEMM variants),
 * an int4 pool's scores skip that: the queries are quantized to int8 per group of 32 (a float32 scale each,
 * as llama.cpp's q8_0 activations) and each group's dot products are integer ones over the nibbles as they
 * are stored, u8 x s8 four at a time (vpdpbusd):
 *     q . k = sum_g s_g sq_g (sum_{d in g} n_d qi_d - 8 sum_{d in g} qi_d),   k_d = s_g (n_d - 8), q_d ~ sq_g qi_d
 * the second sum fixed per query row and group. A block's K is transposed in registers 16 tokens at a time,
 * its nibbles split into even and odd elements, once per KV head for every query row that reads it.
 * Included by paged_attention.c after its TB, RT and kinds.
 */
#ifndef RADIXRT_QUANT_ROWS_H
#define RADIXRT_QUANT_ROWS_H

#include "half.h"

/* dst[0 .. D) = the quantized row at element offset `at` (of a [slots, KVH, D] pool), dequantized: int4's
 * groups times their float16 scales (as kv_quant.dequantize_int4), int8's values times the row's scale. */
static inline void quant_row(const int kind, const void *pool, const void *scales, int64_t at, int D, float *dst) {
    if (kind == KIND_INT8) {
        const int8_t *x = (const int8_t *)pool + at;
        const vf s = v_set1(((const float *)scales)[at / D]);
        for (int d = 0; d < D; d += VL) v_store(dst + d, v_mul(v_load_i8(x + d), s));
        return;
    }
    const uint8_t *bytes = (const uint8_t *)pool + at / 2;
    const uint16_t *sc = (const uint16_t *)scales + at / INT4_GROUP;
    for (int g = 0; g < D / INT4_GROUP; g++) v_int4_group(bytes + g * INT4_GROUP / 2, half_to_float(sc[g]), dst + g * INT4_GROUP);
}

#ifdef HAVE_VNNI
#define QUERY_INT8_BYTES(D) (2 * (D)) /* a quantized query row's bytes (a bf16 row's: the same scratch serves) */

/* One query row quantized for int4 keys, into dst (QUERY_INT8_BYTES(D)): D int8 values, each 8 elements as
 * the 4 even ones then the 4 odd ones (the order the nibbles split into), then per group its float32 scale
 * (the group's largest |q| / 127) and -8 times the sum of its int8 values (int32). */
static void quantize_query(const float *q, int D, uint8_t *dst) {
    int8_t *qi = (int8_t *)dst;
    float *sq = (float *)(dst + D);
    int32_t *offset = (int32_t *)(sq + D / INT4_GROUP);
    for (int g = 0; g < D / INT4_GROUP; g++) {
        const float *x = q + g * INT4_GROUP;
        float amax = 0.0f;
        for (int e = 0; e < INT4_GROUP; e++) amax = fabsf(x[e]) > amax ? fabsf(x[e]) : amax;
        const float s = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        int32_t sum = 0;
        for (int e = 0; e < INT4_GROUP; e++) {
            const int d = g * INT4_GROUP + e, v = (int)lrintf(x[e] * inv); /* |v| <= 127 */
            qi[(d & ~7) | ((d & 1) << 2) | ((d & 7) >> 1)] = (int8_t)v;
            sum += v;
        }
        sq[g] = s, offset[g] = -8 * sum;
    }
}

/* The block's K of one KV head for the integer tiles: kx[2j], kx[2j + 1] = the 16 tokens' even and odd
 * nibbles of elements 8j .. 8j + 7 (a dword per token), and ks[g * TB + i] = token i's scale of group g. */
static inline void int4_block(const uint8_t *k_pool, const uint16_t *k_scales, const int64_t *offs, int D, __m512i *kx,
                              float *ks) {
    const __m512i low = _mm512_set1_epi8(15);
    for (int c = 0; c < D / 8; c += 16) { /* 16 dwords (128 elements) of 16 tokens at a time */
        const __mmask16 m = D / 8 - c >= 16 ? 0xffff : (__mmask16)((1u << (D / 8 - c)) - 1);
        __m512i r[16];
        for (int i = 0; i < 16; i++) r[i] = _mm512_maskz_loadu_epi32(m, k_pool + offs[i] / 2 + 4 * c);
        v_transpose16(r);
        for (int j = 0; j < 16 && c + j < D / 8; j++) {
            kx[2 * (c + j)] = _mm512_and_si512(r[j], low);
            kx[2 * (c + j) + 1] = _mm512_and_si512(_mm512_srli_epi32(r[j], 4), low);
        }
    }
    for (int g = 0; g < D / INT4_GROUP; g++) {
        uint16_t h[16];
        for (int i = 0; i < 16; i++) h[i] = k_scales[offs[i] / INT4_GROUP + g];
        _mm512_storeu_ps(ks + g * TB, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)h)));
    }
}

/* s_r[0 .. TB) = scale * q_r . k_i for rn quantized query rows (at qp[r]) over a block from int4_block. */
ALWAYS_INLINE void qk_int4_tile(const uint8_t *const *qp, const __m512i *kx, const float *ks, int D, const int rn,
                                float scale, float *const *sp) {
    vf acc[RT];
    for (int r = 0; r < rn; r++) acc[r] = v_zero();
    for (int g = 0; g < D / INT4_GROUP; g++) {
        const vf kscale = v_load(ks + g * TB);
        for (int r = 0; r < rn; r++) {
            const float *sq = (const float *)(qp[r] + D);
            __m512i dot = _mm512_set1_epi32(((const int32_t *)(sq + D / INT4_GROUP))[g]);
            for (int j = 4 * g; j < 4 * g + 4; j++) {
                int32_t even, odd;
                memcpy(&even, qp[r] + 8 * j, 4);
                memcpy(&odd, qp[r] + 8 * j + 4, 4);
                dot = _mm512_dpbusd_epi32(dot, kx[2 * j], _mm512_set1_epi32(even));
                dot = _mm512_dpbusd_epi32(dot, kx[2 * j + 1], _mm512_set1_epi32(odd));
            }
            acc[r] = v_fma(_mm512_cvtepi32_ps(dot), v_mul(kscale, v_set1(sq[g])), acc[r]);
        }
    }
    const vf sc = v_set1(scale);
    for (int r = 0; r < rn; r++) v_store(sp[r], v_mul(acc[r], sc));
}

/* qk_int4_tile over n rows, in tiles of RT, then of 4, 2 and 1. */
static void qk_int4_rows(const uint8_t *const *qp, const __m512i *kx, const float *ks, int D, int n, float scale,
                         float *const *sp) {
    int r = 0;
    for (; r + RT <= n; r += RT) qk_int4_tile(qp + r, kx, ks, D, RT, scale, sp + r);
    for (; r + 4 <= n; r += 4) qk_int4_tile(qp + r, kx, ks, D, 4, scale, sp + r);
    for (; r + 2 <= n; r += 2) qk_int4_tile(qp + r, kx, ks, D, 2, scale, sp + r);
    for (; r < n; r++) qk_int4_tile(qp + r, kx, ks, D, 1, scale, sp + r);
}
#endif

#endif /* RADIXRT_QUANT_ROWS_H */
