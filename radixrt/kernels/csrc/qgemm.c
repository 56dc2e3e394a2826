/* y = x W^T with W held quantized in groups of 32 along K (llama.cpp's Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q6_K and
 * Q8_0, repacked at load by radixrt/kernels/quant_weights.py): the activations quantized to int8 per row and
 * group, each group's products summed as integers, then scaled (llama.cpp's way on CPUs). For output n, row m:
 *     y[m, n] = sum_g sx[m, g] (sum_s d[n, s] sum_{k in s} qx[m, k] w[n, k] + mn[n, g] sum_{k in g} qx[m, k])
 * where x[m, k] ~ sx[m, g] qx[m, k] (qx int8, sx = the group's largest |x| / 127), s runs over the group's
 * scale blocks (the group itself, or its two halves of 16 where `sub` is 16), and W's element is d w + mn:
 *   bits 4: w in 0..15, a float16 scale d and min mn per 32, or without mins (Q4_0) mn = -8 d
 *   bits 5: w in 0..31, likewise, or without mins (Q5_0) mn = -16 d
 *   bits 8: w in -127..127, a float16 scale d per 32 or (sub 16: Q6_K) per 16, no min
 *
 * W's layout (independent of the ISA; quant_weights.py packs it): outputs in tiles of 16; per tile, per group,
 * GROUP_BYTES(bits) bytes:
 *   4-bit: [4][16][4]: lane n's dword j holds k = 8j + b in byte b's low nibble, 8j + 4 + b in its high
 *   5-bit: those 256 bytes, then [16][4]: bit j of lane n's byte b is the fifth bit of k = 4j + b
 *   8-bit: [8][16][4]: lane n's dword j holds k = 4j + b in byte b (int8)
 *   d: float16 [K / sub][16], mn: float16 [K / 32][16]
 * so a group unpacks to eight vectors of 16 lanes x 4 bytes (k = 4j + b in vector j, whatever the bits), and
 * 16 outputs' dot products over 4 elements of K are one VNNI instruction (vpdpbusd: u8 x s8, four a lane):
 * 4- and 5-bit weights are the unsigned operand as stored; 8-bit ones take the activations' signs
 * (|qx| x sign(w, qx)). AVX2 does the same with vpmaddubsw + vpmaddwd (16-bit pair sums: 31 x 127 x 2 and
 * 127 x 127 x 2 fit); the scalar variant in plain C.
 *
 * The amx variant (HAVE_AMX_INT8) multiplies 16 activation rows at a time by AMX-INT8 tiles instead: per group,
 * A = 16 rows x 32 int8 activations, B = the group's eight vectors above as 8 rows of 64 bytes (the tile
 * layout the weights already have), one tdpbsud (tdpbssd for int8 weights) into a 16 x 16 int32 tile, which is
 * stored and scaled in float32 as the VNNI sums are (two tiles of K = 16 where scales are per 16). 4- and 5-bit
 * weights are unpacked to bytes once per call and tile, for every row block.
 *
 * x [M, K] float32 (kind 0) or bf16 (kind 1), rows contiguous; out [M, N] in float32 or bf16 (out_kind, rounded to
 * nearest even). Threads split the output tiles. Returns 0, or 1 for an unknown kind, bits or sub, 2 for K not a
 * multiple of 32 or N of 16, 3 out of memory, 4 where Linux does not grant this process the AMX tile state.
 */
#define _GNU_SOURCE /* syscall() */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"
#include "half.h"
#ifdef HAVE_AMX_INT8
#include <sys/syscall.h>
#include <unistd.h>
#endif

enum { KIND_F32 = 0, KIND_BF16 = 1 };
#define GROUP 32
#define TILE 16 /* outputs per tile */
#define MR 8    /* activation rows per pass over a tile's weights */
#define GROUP_BYTES(bits) (GROUP * TILE * (bits) / 8)

static int valid(int kind, int bits, int sub, int has_min) {
    if (kind != KIND_F32 && kind != KIND_BF16) return 0;
    if (bits == 8) return (sub == 32 || sub == 16) && !has_min;
    /* 4 and 5 bits: with mins, or without (a min of -8 or -16 scales) */
    return (bits == 4 || bits == 5) && sub == 32;
}

/* The min of a 4- or 5-bit weight held without mins, per unit of its scale: -8, -16 (0 for 8 bits). */
static inline float offset_min(int bits) { return bits == 8 ? 0.0f : -(float)(1 << (bits - 1)); }

static void store_row(void *out, int kind, int64_t at, const float *v, int n) {
    if (kind == KIND_F32) {
        memcpy((float *)out + at, v, sizeof(float) * (size_t)n);
    } else {
        for (int i = 0; i < n; i++) ((uint16_t *)out)[at + i] = float_to_bf16(v[i]);
    }
}

/* One activation row quantized: qx [K] int8, and per group sx (float32) and sx times the sum of its qx (ms:
 * what a group's min is multiplied by). */
static void quantize_row(const void *x, int kind, int64_t K, int8_t *qx, float *sx, float *ms) {
    for (int64_t g = 0; g < K / GROUP; g++) {
        float v[GROUP], amax = 0.0f;
        for (int e = 0; e < GROUP; e++) {
            v[e] = float_at(x, kind == KIND_BF16, g * GROUP + e);
            amax = fabsf(v[e]) > amax ? fabsf(v[e]) : amax;
        }
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        int32_t s = 0;
        for (int e = 0; e < GROUP; e++) {
            const int q = (int)nearbyintf(v[e] * inv);
            qx[g * GROUP + e] = (int8_t)q;
            s += q;
        }
        sx[g] = amax / 127.0f, ms[g] = sx[g] * (float)s;
    }
}

/* The stored value of lane n's element k = 4j + b of one group (w: the group's bytes). */
static inline int group_value(const uint8_t *w, int bits, int n, int j, int b) {
    if (bits == 8) return (int8_t)w[64 * j + 4 * n + b];
    const uint8_t byte = w[64 * (j / 2) + 4 * n + b];
    const int low = j % 2 ? byte >> 4 : byte & 15;
    return bits == 5 ? low | (((w[256 + 4 * n + b] >> j) & 1) << 4) : low;
}

#ifndef HAVE_VNNI
/* The integer dot products of one group for 16 outputs and `rows` activation rows (qx[r] their group's 32
 * values), each half of 16 elements apart: lo[r][n] over k < 16, hi[r][n] over k >= 16. The weights are
 * unpacked once for every row. */
static inline void group_dots(const uint8_t *w, int bits, const int8_t *const *qx, int rows, int32_t lo[][TILE],
                              int32_t hi[][TILE]) {
#if defined(RADIXRT_ISA_AVX2) || defined(RADIXRT_AVX512_FAMILY) /* AVX-512 without VNNI: the AVX2 code */
    const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(15), bit = _mm256_set1_epi8(1);
    for (int h = 0; h < 2; h++) { /* outputs 8h .. 8h + 7: the second half of each 64-byte row */
        __m256i wv[8];
        for (int j = 0; j < 8; j++) {
            if (bits == 8) {
                wv[j] = _mm256_loadu_si256((const __m256i *)(w + 64 * j + 32 * h));
                continue;
            }
            const __m256i packed = _mm256_loadu_si256((const __m256i *)(w + 64 * (j / 2) + 32 * h));
            wv[j] = _mm256_and_si256(j % 2 ? _mm256_srli_epi32(packed, 4) : packed, low);
            if (bits == 5) {
                const __m256i plane = _mm256_loadu_si256((const __m256i *)(w + 256 + 32 * h));
                const __m256i fifth = _mm256_and_si256(_mm256_srl_epi16(plane, _mm_cvtsi32_si128(j)), bit);
                wv[j] = _mm256_or_si256(wv[j], _mm256_slli_epi16(fifth, 4));
            }
        }
        for (int r = 0; r < rows; r++) {
            __m256i acc[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
            for (int j = 0; j < 8; j++) {
                int32_t a;
                memcpy(&a, qx[r] + 4 * j, 4);
                const __m256i xa = _mm256_set1_epi32(a);
                const __m256i pairs = bits != 8 ? _mm256_maddubs_epi16(wv[j], xa)
                                                : _mm256_maddubs_epi16(_mm256_abs_epi8(xa), _mm256_sign_epi8(wv[j], xa));
                acc[j / 4] = _mm256_add_epi32(acc[j / 4], _mm256_madd_epi16(pairs, ones));
            }
            _mm256_storeu_si256((__m256i *)(lo[r] + 8 * h), acc[0]);
            _mm256_storeu_si256((__m256i *)(hi[r] + 8 * h), acc[1]);
        }
    }
#else
    for (int r = 0; r < rows; r++)
        for (int n = 0; n < TILE; n++) {
            int32_t s[2] = {0, 0};
            for (int j = 0; j < 8; j++)
                for (int b = 0; b < 4; b++) s[j / 4] += group_value(w, bits, n, j, b) * qx[r][4 * j + b];
            lo[r][n] = s[0], hi[r][n] = s[1];
        }
#endif
}

/* One tile's 16 outputs for `rows` activation rows (qx, sx, ms from the block's first row), scales and mins
 * converted once a tile into dt ([K / sub][16]) and mt ([K / 32][16]). */
static void block_plain(const uint8_t *wt, int bits, int sub, const float *dt, const float *mt, const int8_t *qx,
                        const float *sx, const float *ms, int64_t K, int rows, float acc[][TILE]) {
    const int64_t G = K / GROUP;
    for (int r = 0; r < rows; r++) memset(acc[r], 0, sizeof acc[r]);
    for (int64_t g = 0; g < G; g++) {
        const int8_t *rows_qx[MR];
        int32_t lo[MR][TILE], hi[MR][TILE];
        for (int r = 0; r < rows; r++) rows_qx[r] = qx + r * K + g * GROUP;
        group_dots(wt + g * GROUP_BYTES(bits), bits, rows_qx, rows, lo, hi);
        const float *d0 = dt + (sub == 16 ? 2 * g : g) * TILE, *d1 = sub == 16 ? d0 + TILE : d0, *mg = mt + g * TILE;
        for (int r = 0; r < rows; r++) {
            const float s = sx[r * G + g], m = ms[r * G + g];
            for (int n = 0; n < TILE; n++) acc[r][n] += ((float)lo[r][n] * d0[n] + (float)hi[r][n] * d1[n]) * s + mg[n] * m;
        }
    }
}
#endif

#ifdef RADIXRT_AVX512_FAMILY
/* A group's weights as eight vectors of 16 lanes x 4 bytes (k = 4j + b in vector j): unsigned for 4 and 5
 * bits, int8 for 8. */
static inline void unpack_group(const uint8_t *w, int bits, __m512i wv[8]) {
    if (bits == 8) {
        for (int j = 0; j < 8; j++) wv[j] = _mm512_loadu_si512((const void *)(w + 64 * j));
        return;
    }
    const __m512i low = _mm512_set1_epi8(15);
    for (int j = 0; j < 4; j++) {
        const __m512i packed = _mm512_loadu_si512((const void *)(w + 64 * j));
        wv[2 * j] = _mm512_and_si512(packed, low);
        wv[2 * j + 1] = _mm512_and_si512(_mm512_srli_epi32(packed, 4), low);
    }
    if (bits == 5) {
        const __m512i plane = _mm512_loadu_si512((const void *)(w + 256)), sixteen = _mm512_set1_epi8(16);
        for (int j = 0; j < 8; j++)
            wv[j] = _mm512_mask_add_epi8(wv[j], _mm512_test_epi8_mask(plane, _mm512_set1_epi8((char)(1 << j))), wv[j], sixteen);
    }
}

static inline __m512 load_half16(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }

/* Group g's scales of a tile's 16 outputs (d0; d1 its second half's where scales are per 16) and mins (per
 * 32: the held ones, or min_per_scale scales), read from the tile's float16 dt [K / sub][16], mt [K / 32][16]. */
typedef struct {
    __m512 d0, d1, m;
} GroupScales;

static inline GroupScales group_scales(const uint16_t *dt, const uint16_t *mt, int sub, float min_per_scale, int64_t g) {
    GroupScales s;
    s.d0 = load_half16(dt + (sub == 16 ? 2 * g : g) * TILE);
    s.d1 = sub == 16 ? load_half16(dt + (2 * g + 1) * TILE) : s.d0;
    s.m = mt ? load_half16(mt + g * TILE) : _mm512_mul_ps(s.d0, _mm512_set1_ps(min_per_scale));
    return s;
}

/* Byte b of each lane of an unpacked group's vector (element k = 4j + b of the 16 outputs), dequantized: v d + m. */
static inline __m512 group_element(__m512i wj, int bits, int b, __m512 d, __m512 m) {
    const __m128i up = _mm_cvtsi32_si128(24 - 8 * b), down = _mm_cvtsi32_si128(bits == 8 ? 24 : 8 * b);
    const __m512i v = bits == 8 ? _mm512_sra_epi32(_mm512_sll_epi32(wj, up), down)
                                : _mm512_and_si512(_mm512_srl_epi32(wj, down), _mm512_set1_epi32(255));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), d, m);
}

static inline __m256i to_bf16x16(__m512 f) { /* rounded to nearest even */
#ifdef HAVE_DOT_BF16
    return (__m256i)_mm512_cvtneps_pbh(f);
#else
    const __m512i u = _mm512_castps_si512(f);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16));
#endif
}

/* A tile's 16 outputs of `rows` rows (acc[r]) into out (row stride N), float32 or bf16. */
static inline void store_rows(const __m512 *acc, int rows, void *out, int out_kind, int64_t N) {
    for (int r = 0; r < rows; r++) {
        if (out_kind == KIND_F32)
            _mm512_storeu_ps((float *)out + r * N, acc[r]);
        else
            _mm256_storeu_si256((__m256i *)((uint16_t *)out + r * N), to_bf16x16(acc[r]));
    }
}
#endif

#ifdef HAVE_VNNI

/* One tile's 16 outputs for `rows` activation rows (qx, sx, ms from the block's first row), the accumulators
 * in registers across the groups: each group's weights unpacked once, its integer sums scaled in place by the
 * tile's float16 scales and mins (dt: [K / sub][16], mt: [K / 32][16] or NULL), converted as they are read. */
static void block_vnni(const uint8_t *wt, int bits, int sub, const uint16_t *dt, const uint16_t *mt, const int8_t *qx,
                       const float *sx, const float *ms, int64_t K, int rows, void *out, int out_kind, int64_t N) {
    const int64_t G = K / GROUP;
    __m512 acc[MR];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m512i wv[8];
        unpack_group(wt + g * GROUP_BYTES(bits), bits, wv);
        const GroupScales gs = group_scales(dt, mt, sub, offset_min(bits), g);
        const __m512 d0 = gs.d0, d1 = gs.d1, mg = gs.m;
        for (int r = 0; r < rows; r++) {
            const int8_t *x = qx + r * K + g * GROUP;
            __m512i dot[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
            for (int j = 0; j < 8; j++) {
                int32_t a;
                memcpy(&a, x + 4 * j, 4);
                const __m512i xa = _mm512_set1_epi32(a);
                dot[j / 4] = bits != 8 ? _mm512_dpbusd_epi32(dot[j / 4], wv[j], xa)
                                       : _mm512_dpbusd_epi32(dot[j / 4], _mm512_abs_epi8(xa),
                                                             _mm512_mask_sub_epi8(wv[j], _mm512_movepi8_mask(xa), _mm512_setzero_si512(), wv[j]));
            }
            const __m512 s = _mm512_set1_ps(sx[r * G + g]);
            __m512 a = _mm512_fmadd_ps(mg, _mm512_set1_ps(ms[r * G + g]), acc[r]);
            a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[1]), _mm512_mul_ps(d1, s), a);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[0]), _mm512_mul_ps(d0, s), a);
        }
    }
    store_rows(acc, rows, out, out_kind, N);
}
#endif

#ifdef HAVE_AMX_INT8
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tile_config;

/* Whether Linux grants this process the AMX tile data state (asked once: arch_prctl ARCH_REQ_XCOMP_PERM,
 * XFEATURE_XTILEDATA). */
static int amx_granted(void) {
    static int state; /* 0 not asked, 1 granted, -1 refused */
    if (!state) state = syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 1 : -1;
    return state == 1;
}

/* Tiles 0, 3: C (16 x 16 int32); 1, 4: A (16 rows x the scale block's bytes); 2, 5: B (block / 4 rows of 64
 * bytes). One scale block of 32 uses tiles 0-2; two of 16 use all six. */
static void configure_tiles(int sub) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 6; t++) {
        c.rows[t] = t % 3 == 2 ? (uint8_t)(sub / 4) : 16;
        c.colsb[t] = t % 3 == 1 ? (uint16_t)sub : 64;
    }
    _tile_loadconfig(&c);
}

/* A 16 x 16 int32 tile of one group's sums (c0; c1 the second half's where scales are per 16) scaled into
 * the rows' accumulators. */
static inline void scale_sums(__m512 acc[TILE], const int32_t *c0, const int32_t *c1, int sub, float min_per_scale, const uint16_t *dt,
                              const uint16_t *mt, const float *sx, const float *ms, int64_t G, int64_t g) {
    const GroupScales gs = group_scales(dt, mt, sub, min_per_scale, g);
    const __m512 d0 = gs.d0, d1 = gs.d1, mg = gs.m;
    for (int r = 0; r < TILE; r++) {
        const __m512 s = _mm512_set1_ps(sx[r * G + g]);
        __m512 v = mt || min_per_scale != 0.0f ? _mm512_fmadd_ps(mg, _mm512_set1_ps(ms[r * G + g]), acc[r]) : acc[r];
        if (sub == 16) v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c1 + r * TILE)), _mm512_mul_ps(d1, s), v);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c0 + r * TILE)), _mm512_mul_ps(d0, s), v);
    }
}

/* Group g's product into C tile c from A tile a and B tile b (immediates: tile numbers). */
#define TILE_PRODUCT(c, a, b, g)                                           \
    do {                                                                   \
        _tile_zero(c);                                                     \
        _tile_loadd(a, qx + (g) * GROUP, (int)K);                          \
        _tile_loadd(b, B + (g) * 512, 64);                                 \
        if (bits == 8) _tile_dpbssd(c, a, b); else _tile_dpbsud(c, a, b); \
    } while (0)

/* One tile's 16 outputs for 16 activation rows (qx, sx, ms from the block's first row; rows past M are zeros),
 * B the tile's groups as tile rows (bytes [G][8][64]). Scales per 32: groups alternate between tiles 0-2 and
 * 3-5, so that one group's product runs while the last one's sums are scaled. Per 16: one group at a time,
 * its halves in tiles 0-2 and 3-5. */
static void block_amx(const uint8_t *B, int bits, int sub, const uint16_t *dt, const uint16_t *mt, const int8_t *qx,
                      const float *sx, const float *ms, int64_t K, int rows, void *out, int out_kind, int64_t N) {
    const int64_t G = K / GROUP;
    int32_t c[2][TILE * TILE] __attribute__((aligned(64)));
    __m512 acc[TILE];
    for (int r = 0; r < TILE; r++) acc[r] = _mm512_setzero_ps();
    if (sub == 16) {
        for (int64_t g = 0; g < G; g++) {
            _tile_zero(0);
            _tile_zero(3);
            _tile_loadd(1, qx + g * GROUP, (int)K);
            _tile_loadd(4, qx + g * GROUP + 16, (int)K);
            _tile_loadd(2, B + g * 512, 64);
            _tile_loadd(5, B + g * 512 + 256, 64);
            _tile_dpbssd(0, 1, 2); /* per 16 only with int8 weights */
            _tile_dpbssd(3, 4, 5);
            _tile_stored(0, c[0], 64);
            _tile_stored(3, c[1], 64);
            scale_sums(acc, c[0], c[1], sub, 0.0f, dt, mt, sx, ms, G, g);
        }
    } else {
        TILE_PRODUCT(0, 1, 2, 0);
        for (int64_t g = 0; g < G; g += 2) {
            if (g + 1 < G) TILE_PRODUCT(3, 4, 5, g + 1);
            _tile_stored(0, c[0], 64);
            if (g + 2 < G) TILE_PRODUCT(0, 1, 2, g + 2);
            scale_sums(acc, c[0], NULL, sub, offset_min(bits), dt, mt, sx, ms, G, g);
            if (g + 1 < G) {
                _tile_stored(3, c[1], 64);
                scale_sums(acc, c[1], NULL, sub, offset_min(bits), dt, mt, sx, ms, G, g + 1);
            }
        }
    }
    store_rows(acc, rows, out, out_kind, N);
}
#endif

int CAT(radixrt_qgemm, ISA_NAME)(const void *x, int kind, int64_t M, int64_t K, int64_t N, const uint8_t *w, int bits,
                                 int sub, const uint16_t *d, const uint16_t *mn, void *out, int out_kind, int threads) {
    if (!valid(kind, bits, sub, mn != NULL) || (out_kind != KIND_F32 && out_kind != KIND_BF16)) return 1;
    if (K % GROUP || N % TILE) return 2;
    const int64_t G = K / GROUP, S = K / sub, tile_bytes = G * GROUP_BYTES(bits);
#ifdef HAVE_AMX_INT8
    if (!amx_granted()) return 4;
    const int64_t Mp = (M + TILE - 1) / TILE * TILE; /* rows padded to whole tiles, the padding zeros */
#else
    const int64_t Mp = M;
#endif
    const size_t qbytes = ((size_t)(Mp * K) + 63) & ~(size_t)63; /* the scales after it, 64-byte aligned */
    int8_t *qx = aligned_alloc(64, qbytes + (((size_t)(Mp * G) * 2 * sizeof(float) + 63) & ~(size_t)63));
    if (!qx) return 3;
    float *sx = (float *)((char *)qx + qbytes);
    float *ms = sx + Mp * G;
    memset(qx + M * K, 0, (size_t)((Mp - M) * K));
    memset(sx + M * G, 0, sizeof(float) * (size_t)((Mp - M) * G));
    memset(ms + M * G, 0, sizeof(float) * (size_t)((Mp - M) * G));
    const int par = M * N * K >= (1 << 18) ? threads : 1;
    int failed = 0;
#pragma omp parallel num_threads(par) if (par > 1)
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) quantize_row((const char *)x + m * K * (kind == KIND_F32 ? 4 : 2), kind, K, qx + m * K, sx + m * G, ms + m * G);
#if defined(HAVE_AMX_INT8)
        uint8_t *unpacked = bits == 8 ? NULL : aligned_alloc(64, (size_t)(G * 512)); /* a tile's groups as bytes */
        configure_tiles(sub);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < N / TILE; t++) {
            const uint8_t *B = w + t * tile_bytes;
            if (bits != 8) {
                if (!unpacked) continue;
                for (int64_t g = 0; g < G; g++) {
                    __m512i wv[8];
                    unpack_group(B + g * GROUP_BYTES(bits), bits, wv);
                    for (int j = 0; j < 8; j++) _mm512_store_si512((void *)(unpacked + g * 512 + 64 * j), wv[j]);
                }
                B = unpacked;
            }
            for (int64_t m0 = 0; m0 < M; m0 += TILE)
                block_amx(B, bits, sub, d + t * S * TILE, mn ? mn + t * G * TILE : NULL, qx + m0 * K, sx + m0 * G, ms + m0 * G, K,
                          M - m0 < TILE ? (int)(M - m0) : TILE, (char *)out + (m0 * N + t * TILE) * (out_kind == KIND_F32 ? 4 : 2),
                          out_kind, N);
        }
        _tile_release();
        if (bits != 8 && !unpacked) {
#pragma omp atomic write
            failed = 3;
        }
        free(unpacked);
#elif defined(HAVE_VNNI)
#pragma omp for schedule(static)
        for (int64_t t = 0; t < N / TILE; t++)
            for (int64_t m0 = 0; m0 < M; m0 += MR)
                block_vnni(w + t * tile_bytes, bits, sub, d + t * S * TILE, mn ? mn + t * G * TILE : NULL, qx + m0 * K, sx + m0 * G,
                           ms + m0 * G, K, M - m0 < MR ? (int)(M - m0) : MR,
                           (char *)out + (m0 * N + t * TILE) * (out_kind == KIND_F32 ? 4 : 2), out_kind, N);
#else
        float *dt = malloc(sizeof(float) * (size_t)((S + G) * TILE)), *mt = dt + S * TILE; /* a tile's scales and mins */
#pragma omp for schedule(static)
        for (int64_t t = 0; t < N / TILE; t++) {
            if (!dt) continue;
            for (int64_t i = 0; i < S * TILE; i++) dt[i] = half_to_float(d[t * S * TILE + i]);
            for (int64_t i = 0; i < G * TILE; i++) mt[i] = mn ? half_to_float(mn[t * G * TILE + i]) : offset_min(bits) * dt[i];
            for (int64_t m0 = 0; m0 < M; m0 += MR) {
                const int rows = M - m0 < MR ? (int)(M - m0) : MR;
                float acc[MR][TILE];
                block_plain(w + t * tile_bytes, bits, sub, dt, mt, qx + m0 * K, sx + m0 * G, ms + m0 * G, K, rows, acc);
                for (int r = 0; r < rows; r++) store_row(out, out_kind, (m0 + r) * N + t * TILE, acc[r], TILE);
            }
        }
        if (!dt) {
#pragma omp atomic write
            failed = 3;
        }
        free(dt);
#endif
    }
    free(qx);
    return failed;
}

/* W^T as float32 (kind 0) or bf16 (kind 1, rounded to nearest even), out [K, N]: what the weight holds, for a
 * product through the model dtype's GEMM where many rows make that faster than the integer tiles. Transposed,
 * so that a tile's 16 outputs of one element of K are 16 consecutive values: one vector each. */
int CAT(radixrt_qdequantize, ISA_NAME)(const uint8_t *w, int bits, int sub, const uint16_t *d, const uint16_t *mn, int64_t K,
                                       int64_t N, void *out, int kind, int threads) {
    if (!valid(kind, bits, sub, mn != NULL)) return 1;
    if (K % GROUP || N % TILE) return 2;
    const int64_t G = K / GROUP, S = K / sub, tile_bytes = G * GROUP_BYTES(bits);
#pragma omp parallel for num_threads(threads) schedule(static) /* by rows of out: each thread writes whole rows */
    for (int64_t g = 0; g < G; g++)
        for (int64_t t = 0; t < N / TILE; t++) {
            const uint8_t *wg = w + t * tile_bytes + g * GROUP_BYTES(bits);
#ifdef RADIXRT_AVX512_FAMILY
            __m512i wv[8];
            unpack_group(wg, bits, wv);
            const GroupScales gs = group_scales(d + t * S * TILE, mn ? mn + t * G * TILE : NULL, sub, offset_min(bits), g);
            const __m512 d0 = gs.d0, d1 = gs.d1, m = gs.m;
            for (int j = 0; j < 8; j++)
                for (int b = 0; b < 4; b++) { /* byte b of each lane: element k = 4j + b of the 16 outputs */
                    const __m512 f = group_element(wv[j], bits, b, j < 4 ? d0 : d1, m);
                    const int64_t at = (g * GROUP + 4 * j + b) * N + t * TILE;
                    if (kind == KIND_F32)
                        _mm512_storeu_ps((float *)out + at, f);
                    else
                        _mm256_storeu_si256((__m256i *)((uint16_t *)out + at), to_bf16x16(f));
                }
#else
            const uint16_t *dg = d + (t * S + (sub == 16 ? 2 * g : g)) * TILE, *mg = mn ? mn + (t * G + g) * TILE : NULL;
            for (int j = 0; j < 8; j++)
                for (int b = 0; b < 4; b++) {
                    float row[TILE];
                    for (int n = 0; n < TILE; n++)
                        row[n] = (float)group_value(wg, bits, n, j, b) * half_to_float(dg[(sub == 16 && j >= 4 ? TILE : 0) + n]) +
                                 (mg ? half_to_float(mg[n]) : offset_min(bits) * half_to_float(dg[n]));
                    store_row(out, kind, (g * GROUP + 4 * j + b) * N + t * TILE, row, TILE);
                }
#endif
        }
    return 0;
}

#ifdef HAVE_AMX_INT8
#include "amx_bf16_tiles.h"
#endif
