/* y = x W^T with W held quantized in groups of 32 along K (llama.cpp's Q4_0, Q4_1, Q4_K and Q8_0, repacked
 * at load by radixrt/kernels/quant_weights.py): the activations quantized to int8 per row and group, each
 * group's products summed as integers, then scaled (llama.cpp's way on CPUs). For output n, row m:
 *     y[m, n] = sum_g sx[m, g] (d[n, g] sum_{k in g} qx[m, k] w[n, k] + mn[n, g] sum_{k in g} qx[m, k])
 * where x[m, k] ~ sx[m, g] qx[m, k] (qx int8, sx = the group's largest |x| / 127), and W's element is
 * d w + mn: 4-bit w in 0..15 with a float16 scale d and min mn per group (Q4_0: mn = -8 d), or 8-bit w in
 * -127..127 with a scale d (mn none).
 *
 * W's layout (independent of the ISA; quant_weights.py packs it): outputs in tiles of 16, and for each tile
 *   4-bit: bytes [K / 8][16][4]: lane n's dword j holds k = 8j + b in byte b's low nibble, 8j + 4 + b in its high
 *   8-bit: bytes [K / 4][16][4]: lane n's dword j holds k = 4j + b in byte b (int8)
 *   d, mn: float16 [K / 32][16]
 * so 16 outputs' dot products over 4 elements of K are one VNNI instruction (vpdpbusd: u8 x s8, four a lane):
 * 4-bit weights are the unsigned operand as stored; 8-bit ones take the activations' signs (|qx| x sign(w, qx)).
 * AVX2 does the same with vpmaddubsw + vpmaddwd (16-bit pair sums: 15 x 127 x 2 and 127 x 127 x 2 fit);
 * the scalar variant in plain C.
 *
 * x [M, K] float32 (kind 0) or bf16 (kind 1), rows contiguous; out [M, N] float32. Threads split the output
 * tiles. Returns 0, or 1 for an unknown kind or bits, 2 for K not a multiple of 32 or N of 16, 3 out of memory.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"
#include "half.h"

enum { KIND_F32 = 0, KIND_BF16 = 1 };
#define GROUP 32
#define TILE 16 /* outputs per tile */
#define MR 8    /* activation rows per pass over a tile's weights */

/* One activation row quantized: qx [K] int8, and per group sx (float32) and the sum of its qx (int32). */
static void quantize_row(const void *x, int kind, int64_t K, int8_t *qx, float *sx, int32_t *sum) {
    for (int64_t g = 0; g < K / GROUP; g++) {
        float v[GROUP], amax = 0.0f;
        for (int e = 0; e < GROUP; e++) {
            const int64_t k = g * GROUP + e;
            if (kind == KIND_F32) {
                v[e] = ((const float *)x)[k];
            } else {
                const uint32_t bits = (uint32_t)((const uint16_t *)x)[k] << 16;
                memcpy(&v[e], &bits, sizeof bits);
            }
            amax = fabsf(v[e]) > amax ? fabsf(v[e]) : amax;
        }
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        int32_t s = 0;
        for (int e = 0; e < GROUP; e++) {
            const int q = (int)nearbyintf(v[e] * inv);
            qx[g * GROUP + e] = (int8_t)q;
            s += q;
        }
        sx[g] = amax / 127.0f, sum[g] = s;
    }
}

/* The integer dot products of one group (32 elements of K) for 16 outputs and `rows` activation rows (qx[r]
 * their group's 32 values): dots[r][n]. The weights are unpacked once for every row. */
static inline void group_dots(const uint8_t *w, int bits, const int8_t *const *qx, int rows, int32_t dots[][TILE]) {
#if defined(HAVE_VNNI)
    __m512i acc[MR], wv[8];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_si512();
    if (bits == 4) { /* wv[2j], wv[2j + 1]: elements 8j .. 8j + 3 and 8j + 4 .. 8j + 7 of the 16 outputs */
        const __m512i low = _mm512_set1_epi8(15);
        for (int j = 0; j < 4; j++) {
            const __m512i packed = _mm512_loadu_si512((const void *)(w + 64 * j));
            wv[2 * j] = _mm512_and_si512(packed, low);
            wv[2 * j + 1] = _mm512_and_si512(_mm512_srli_epi32(packed, 4), low);
        }
        for (int r = 0; r < rows; r++)
            for (int j = 0; j < 8; j++) {
                int32_t a;
                memcpy(&a, qx[r] + 4 * j, 4);
                acc[r] = _mm512_dpbusd_epi32(acc[r], wv[j], _mm512_set1_epi32(a));
            }
    } else { /* 8-bit weights take the activations' signs: |qx| (unsigned) x sign(w, qx) */
        for (int j = 0; j < 8; j++) wv[j] = _mm512_loadu_si512((const void *)(w + 64 * j));
        for (int r = 0; r < rows; r++)
            for (int j = 0; j < 8; j++) {
                int32_t a;
                memcpy(&a, qx[r] + 4 * j, 4);
                const __m512i xa = _mm512_set1_epi32(a);
                const __mmask64 negative = _mm512_movepi8_mask(xa);
                acc[r] = _mm512_dpbusd_epi32(acc[r], _mm512_abs_epi8(xa), _mm512_mask_sub_epi8(wv[j], negative, _mm512_setzero_si512(), wv[j]));
            }
    }
    for (int r = 0; r < rows; r++) _mm512_storeu_si512((void *)dots[r], acc[r]);
#elif defined(RADIXRT_ISA_AVX2) || defined(RADIXRT_AVX512_FAMILY) /* AVX-512 without VNNI: the AVX2 code */
    const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(15);
    for (int h = 0; h < 2; h++) { /* outputs 8h .. 8h + 7: the second half of each 64-byte row */
        __m256i wv[8];
        for (int j = 0; j < (bits == 4 ? 4 : 8); j++) {
            const __m256i packed = _mm256_loadu_si256((const __m256i *)(w + 64 * j + 32 * h));
            if (bits == 4) {
                wv[2 * j] = _mm256_and_si256(packed, low);
                wv[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi32(packed, 4), low);
            } else {
                wv[j] = packed;
            }
        }
        for (int r = 0; r < rows; r++) {
            __m256i acc = _mm256_setzero_si256();
            for (int j = 0; j < 8; j++) {
                int32_t a;
                memcpy(&a, qx[r] + 4 * j, 4);
                const __m256i xa = _mm256_set1_epi32(a);
                const __m256i pairs = bits == 4 ? _mm256_maddubs_epi16(wv[j], xa)
                                                : _mm256_maddubs_epi16(_mm256_abs_epi8(xa), _mm256_sign_epi8(wv[j], xa));
                acc = _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, ones));
            }
            _mm256_storeu_si256((__m256i *)(dots[r] + 8 * h), acc);
        }
    }
#else
    for (int r = 0; r < rows; r++)
        for (int n = 0; n < TILE; n++) {
            int32_t s = 0;
            for (int j = 0; j < 8; j++) /* dword j of lane n: 4 elements of K */
                for (int b = 0; b < 4; b++) {
                    const int k = bits == 4 ? 8 * (j / 2) + 4 * (j % 2) + b : 4 * j + b;
                    const uint8_t byte = w[64 * (bits == 4 ? j / 2 : j) + 4 * n + b];
                    const int v = bits == 8 ? (int8_t)byte : j % 2 ? byte >> 4 : byte & 15;
                    s += v * qx[r][k];
                }
            dots[r][n] = s;
        }
#endif
}

#ifdef HAVE_VNNI
/* One tile's 16 outputs for `rows` activation rows (qx, sx, sum from the block's first row), the accumulators
 * in registers across the groups: each group's weights unpacked once, its integer sums scaled in place. */
static void block_vnni(const uint8_t *wt, int bits, const float *dt, const float *mt, const int8_t *qx, const float *sx,
                       const int32_t *sum, int64_t K, int rows, float *out, int64_t N) {
    const int64_t G = K / GROUP;
    const __m512i low = _mm512_set1_epi8(15);
    __m512 acc[MR];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *w = wt + g * GROUP * TILE * bits / 8;
        __m512i wv[8];
        for (int j = 0; j < 8; j++) {
            if (bits == 4) {
                const __m512i packed = _mm512_loadu_si512((const void *)(w + 64 * (j / 2)));
                wv[j] = j % 2 ? _mm512_and_si512(_mm512_srli_epi32(packed, 4), low) : _mm512_and_si512(packed, low);
            } else {
                wv[j] = _mm512_loadu_si512((const void *)(w + 64 * j));
            }
        }
        const __m512 dg = _mm512_loadu_ps(dt + g * TILE), mg = _mm512_loadu_ps(mt + g * TILE);
        for (int r = 0; r < rows; r++) {
            const int8_t *x = qx + r * K + g * GROUP;
            __m512i dot = _mm512_setzero_si512();
            for (int j = 0; j < 8; j++) {
                int32_t a;
                memcpy(&a, x + 4 * j, 4);
                const __m512i xa = _mm512_set1_epi32(a);
                dot = bits == 4 ? _mm512_dpbusd_epi32(dot, wv[j], xa)
                                : _mm512_dpbusd_epi32(dot, _mm512_abs_epi8(xa),
                                                      _mm512_mask_sub_epi8(wv[j], _mm512_movepi8_mask(xa), _mm512_setzero_si512(), wv[j]));
            }
            const float s = sx[r * G + g];
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dg, _mm512_set1_ps(s)),
                                     _mm512_fmadd_ps(mg, _mm512_set1_ps(s * (float)sum[r * G + g]), acc[r]));
        }
    }
    for (int r = 0; r < rows; r++) _mm512_storeu_ps(out + r * N, acc[r]);
}
#endif

int CAT(radixrt_qgemm, ISA_NAME)(const void *x, int kind, int64_t M, int64_t K, int64_t N, const uint8_t *w, int bits,
                                 const uint16_t *d, const uint16_t *mn, float *out, int threads) {
    if ((kind != KIND_F32 && kind != KIND_BF16) || (bits != 4 && bits != 8)) return 1;
    if (K % GROUP || N % TILE) return 2;
    const int64_t G = K / GROUP, tile_bytes = K * TILE * bits / 8;
    const size_t qbytes = ((size_t)(M * K) + 3) & ~(size_t)3; /* the scales after it, 4-byte aligned */
    int8_t *qx = malloc(qbytes + (size_t)(M * G) * (sizeof(float) + sizeof(int32_t)));
    if (!qx) return 3;
    float *sx = (float *)((char *)qx + qbytes);
    int32_t *sum = (int32_t *)(sx + M * G);
    const int par = M * N * K >= (1 << 18) ? threads : 1;
    int failed = 0;
#pragma omp parallel num_threads(par) if (par > 1)
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) quantize_row((const char *)x + m * K * (kind == KIND_F32 ? 4 : 2), kind, K, qx + m * K, sx + m * G, sum + m * G);
        float *dt = malloc(sizeof(float) * 2 * (size_t)(G * TILE)), *mt = dt + G * TILE; /* a tile's scales and mins */
#pragma omp for schedule(static)
        for (int64_t t = 0; t < N / TILE; t++) {
            if (!dt) continue;
            const uint8_t *wt = w + t * tile_bytes;
            for (int64_t i = 0; i < G * TILE; i++) {
                dt[i] = half_to_float(d[t * G * TILE + i]);
                mt[i] = mn ? half_to_float(mn[t * G * TILE + i]) : 0.0f;
            }
            for (int64_t m0 = 0; m0 < M; m0 += MR) {
                const int rows = M - m0 < MR ? (int)(M - m0) : MR;
#ifdef HAVE_VNNI
                block_vnni(wt, bits, dt, mt, qx + m0 * K, sx + m0 * G, sum + m0 * G, K, rows, out + m0 * N + t * TILE, N);
                continue;
#endif
                float acc[MR][TILE] = {{0}};
                for (int64_t g = 0; g < G; g++) {
                    const float *dg = dt + g * TILE, *mg = mt + g * TILE;
                    const int8_t *rows_qx[MR];
                    int32_t dots[MR][TILE];
                    for (int r = 0; r < rows; r++) rows_qx[r] = qx + (m0 + r) * K + g * GROUP;
                    group_dots(wt + g * GROUP * TILE * bits / 8, bits, rows_qx, rows, dots);
                    for (int r = 0; r < rows; r++) {
                        const float s = sx[(m0 + r) * G + g], ms = s * (float)sum[(m0 + r) * G + g];
                        for (int n = 0; n < TILE; n++) acc[r][n] += (float)dots[r][n] * dg[n] * s + mg[n] * ms;
                    }
                }
                for (int r = 0; r < rows; r++) memcpy(out + (m0 + r) * N + t * TILE, acc[r], sizeof acc[r]);
            }
        }
        if (!dt) {
#pragma omp atomic write
            failed = 3;
        }
        free(dt);
    }
    free(qx);
    return failed;
}

/* W as float32 (kind 0) or bf16 (kind 1, rounded to nearest even), out [N, K]: what the weight holds, for a
 * product through the model dtype's GEMM where many rows make that faster than the integer tiles. */
int CAT(radixrt_qdequantize, ISA_NAME)(const uint8_t *w, int bits, const uint16_t *d, const uint16_t *mn, int64_t K,
                                       int64_t N, void *out, int kind, int threads) {
    if ((kind != KIND_F32 && kind != KIND_BF16) || (bits != 4 && bits != 8)) return 1;
    if (K % GROUP || N % TILE) return 2;
    const int64_t G = K / GROUP, tile_bytes = K * TILE * bits / 8;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < N / TILE; t++)
        for (int n = 0; n < TILE; n++) {
            float row[K]; /* NOTE: on the stack; K is a layer's input width */
            for (int64_t g = 0; g < G; g++) {
                const float dg = half_to_float(d[(t * G + g) * TILE + n]), mg = mn ? half_to_float(mn[(t * G + g) * TILE + n]) : 0.0f;
                const uint8_t *wg = w + t * tile_bytes + g * GROUP * TILE * bits / 8;
                for (int j = 0; j < 8; j++) /* 4 elements of K a dword, as group_dots reads them */
                    for (int b = 0; b < 4; b++) {
                        const uint8_t byte = wg[64 * (bits == 4 ? j / 2 : j) + 4 * n + b];
                        const int v = bits == 8 ? (int8_t)byte : j % 2 ? byte >> 4 : byte & 15;
                        row[g * GROUP + 4 * j + b] = (float)v * dg + mg;
                    }
            }
            const int64_t at = (t * TILE + n) * K;
            if (kind == KIND_F32) {
                memcpy((float *)out + at, row, sizeof row);
            } else {
                for (int64_t k = 0; k < K; k++) {
                    uint32_t u;
                    memcpy(&u, &row[k], 4);
                    ((uint16_t *)out)[at + k] = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
                }
            }
        }
    return 0;
}
