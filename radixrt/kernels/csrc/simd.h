/* The vector layer the CPU kernels of this folder are written over: one section per ISA,
 * selected by the -DRADIXRT_ISA_<NAME> that radixrt/kernels/native_build.py compiles each variant with
 * (AVX512BF16 and AVX512: 16 float32 lanes, the first with a bf16 dot product; BRGEMM: AVX512BF16's
 * layer, its many-row tasks through brgemm_tiles.h; AVX2: 8;
 * SCALAR: 1, plain C for any target). A kernel uses only
 * these names (vf, VL, v_*; v_int4_group dequantizes 32 int4 values, v_load_i8 widens VL int8 ones;
 * HAVE_VNNI: the int8 dot products of AVX512-VNNI), so its source is the same for every variant; ISA_NAME suffixes its
 * entry points (CAT(radixrt_name, ISA_NAME) -> radixrt_name_avx512).
 */
#ifndef RADIXRT_SIMD_H
#define RADIXRT_SIMD_H
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(RADIXRT_ISA_AVX512BF16) /* AVX-512 with its bf16 dot product (v_dot_bf16) */
#define RADIXRT_AVX512_FAMILY
#define ISA_NAME avx512bf16
#define HAVE_DOT_BF16 1
#define HAVE_VNNI 1
#elif defined(RADIXRT_ISA_BRGEMM) /* AVX512BF16, and many-row tasks by oneDNN's brgemm (AMX tiles where present) */
#define RADIXRT_AVX512_FAMILY
#define ISA_NAME brgemm
#define HAVE_DOT_BF16 1
#define HAVE_VNNI 1
#define HAVE_BRGEMM 1
#elif defined(RADIXRT_ISA_AMX) /* AVX512BF16, and AMX-INT8 tiles: built for qgemm.c only (native_build.AMX) */
#define RADIXRT_AVX512_FAMILY
#define ISA_NAME amx
#define HAVE_DOT_BF16 1
#define HAVE_VNNI 1
#define HAVE_AMX_INT8 1
#elif defined(RADIXRT_ISA_AVX512)
#define RADIXRT_AVX512_FAMILY
#define ISA_NAME avx512
#endif

#if defined(RADIXRT_AVX512_FAMILY) || defined(RADIXRT_ISA_AVX2)
#include <immintrin.h>
#endif

#if defined(RADIXRT_AVX512_FAMILY)
#define VL 16 /* float32 lanes */
typedef __m512 vf;
static inline vf v_zero(void) { return _mm512_setzero_ps(); }
static inline vf v_set1(float x) { return _mm512_set1_ps(x); }
static inline vf v_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void v_store(float *p, vf x) { _mm512_storeu_ps(p, x); }
static inline vf v_load_bf16(const uint16_t *p) { /* bf16 is the top half of a float32 */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline vf v_load_i8(const int8_t *p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p))); }
static inline vf v_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf v_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf v_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf v_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf v_div(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline vf v_max(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf v_floor(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
static inline vf v_pow2i(vf n) { /* 2^n for integral n in the normal range */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
static inline vf v_abs(vf x) { return _mm512_andnot_ps(_mm512_set1_ps(-0.0f), x); }
static inline vf v_copysign(vf mag, vf sign) {
    return _mm512_or_ps(mag, _mm512_and_ps(sign, _mm512_set1_ps(-0.0f)));
}
static inline __m256 halves_added(vf x) { return _mm256_add_ps(_mm512_castps512_ps256(x), _mm512_extractf32x8_ps(x, 1)); }
/* dst[0 .. 32) = (q - 8) * scale for the 32 4-bit values of 16 bytes (element 2i in byte i's low nibble) */
static inline void v_int4_group(const uint8_t *bytes, float scale, float *dst) {
    const __m128i b = _mm_loadu_si128((const __m128i *)bytes), m = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(b, m), hi = _mm_and_si128(_mm_srli_epi16(b, 4), m);
    const vf s = v_set1(scale), off = v_set1(-8.0f * scale);
    _mm512_storeu_ps(dst, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi))), s, off));
    _mm512_storeu_ps(dst + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi8(lo, hi))), s, off));
}
/* r[i] lane j <- r[j] lane i: a 16 x 16 block of 32-bit elements transposed in registers (4 rounds of
 * 16 shuffles: pairs, quads, 128-bit lanes, halves), for K blocks read with their tokens across lanes. */
static inline void v_transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int h = 0; h < 16; h += 8)
        for (int i = 0; i < 4; i++) {
            t[h + i] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0x88);
            t[h + i + 4] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0xdd);
        }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    }
}
#ifdef HAVE_DOT_BF16
typedef __m512bh vbf; /* 32 bf16 */
static inline vbf vbf_load(const uint16_t *p) { return (vbf)_mm512_loadu_si512((const void *)p); }
/* 32 float32 -> 32 bf16, rounded to nearest even (exact for a value that is a bf16) */
static inline vbf vbf_from_f32(const float *x) { return _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + 16), _mm512_loadu_ps(x)); }
/* acc lane i += a[2i] b[2i] + a[2i + 1] b[2i + 1] */
static inline vf v_dot_bf16(vf acc, vbf a, vbf b) { return _mm512_dpbf16_ps(acc, a, b); }
#endif
#elif defined(RADIXRT_ISA_AVX2)
#define ISA_NAME avx2
#define VL 8
typedef __m256 vf;
static inline vf v_zero(void) { return _mm256_setzero_ps(); }
static inline vf v_set1(float x) { return _mm256_set1_ps(x); }
static inline vf v_load(const float *p) { return _mm256_loadu_ps(p); }
static inline void v_store(float *p, vf x) { _mm256_storeu_ps(p, x); }
static inline vf v_load_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline vf v_load_i8(const int8_t *p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p))); }
static inline vf v_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf v_add(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf v_sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf v_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf v_div(vf a, vf b) { return _mm256_div_ps(a, b); }
static inline vf v_max(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline vf v_floor(vf x) { return _mm256_floor_ps(x); }
static inline vf v_pow2i(vf n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
static inline vf v_abs(vf x) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x); }
static inline vf v_copysign(vf mag, vf sign) {
    return _mm256_or_ps(mag, _mm256_and_ps(sign, _mm256_set1_ps(-0.0f)));
}
static inline __m256 halves_added(vf x) { return x; }
static inline void v_int4_group(const uint8_t *bytes, float scale, float *dst) {
    const __m128i b = _mm_loadu_si128((const __m128i *)bytes), m = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(b, m), hi = _mm_and_si128(_mm_srli_epi16(b, 4), m);
    const __m128i e[2] = {_mm_unpacklo_epi8(lo, hi), _mm_unpackhi_epi8(lo, hi)}; /* elements 0-15, 16-31 */
    const vf s = v_set1(scale), off = v_set1(-8.0f * scale);
    for (int h = 0; h < 2; h++) {
        _mm256_storeu_ps(dst + 16 * h, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(e[h])), s, off));
        _mm256_storeu_ps(dst + 16 * h + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(e[h], 8))), s, off));
    }
}
#else
#define ISA_NAME scalar
#define VL 1
typedef float vf;
static inline vf v_zero(void) { return 0.0f; }
static inline vf v_set1(float x) { return x; }
static inline vf v_load(const float *p) { return *p; }
static inline void v_store(float *p, vf x) { *p = x; }
static inline vf v_load_bf16(const uint16_t *p) {
    uint32_t bits = (uint32_t)*p << 16;
    float x;
    memcpy(&x, &bits, sizeof x);
    return x;
}
static inline vf v_load_i8(const int8_t *p) { return (float)*p; }
static inline vf v_fma(vf a, vf b, vf c) { return a * b + c; }
static inline vf v_add(vf a, vf b) { return a + b; }
static inline vf v_sub(vf a, vf b) { return a - b; }
static inline vf v_mul(vf a, vf b) { return a * b; }
static inline vf v_div(vf a, vf b) { return a / b; }
static inline vf v_max(vf a, vf b) { return a > b ? a : b; }
static inline vf v_floor(vf x) { return floorf(x); }
static inline vf v_pow2i(vf n) {
    int32_t bits = ((int32_t)n + 127) << 23;
    float x;
    memcpy(&x, &bits, sizeof x);
    return x;
}
static inline vf v_abs(vf x) { return fabsf(x); }
static inline vf v_copysign(vf mag, vf sign) { return copysignf(mag, sign); }
static inline void v_int4_group(const uint8_t *bytes, float scale, float *dst) {
    for (int j = 0; j < 16; j++) {
        dst[2 * j] = (float)((int)(bytes[j] & 15) - 8) * scale;
        dst[2 * j + 1] = (float)((int)(bytes[j] >> 4) - 8) * scale;
    }
}
#endif

/* Four horizontal sums at once: out[i] = the sum of x_i's lanes. */
static inline void v_hsum4(vf a, vf b, vf c, vf d, float *out) {
#if VL > 1
    __m256 h01 = _mm256_hadd_ps(halves_added(a), halves_added(b)), h23 = _mm256_hadd_ps(halves_added(c), halves_added(d));
    __m256 h = _mm256_hadd_ps(h01, h23); /* lane i (and i + 4) holds part of x_i's sum */
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
#else
    out[0] = a, out[1] = b, out[2] = c, out[3] = d;
#endif
}

#define CAT_(a, b) a##_##b
#define CAT(a, b) CAT_(a, b)
#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* Cephes' expf, about 1 ulp: x = n ln2 + r with |r| <= ln2 / 2 and e^r by its degree-7 polynomial;
 * returns e^r and sets *n, so e^x = e^r 2^n. x must be clamped to where the caller's scaling holds. */
static inline vf v_exp_reduced(vf x, vf *n) {
    *n = v_floor(v_fma(x, v_set1(1.44269504088896341f), v_set1(0.5f)));
    vf r = v_fma(*n, v_set1(-0.693359375f), x);
    r = v_fma(*n, v_set1(2.12194440e-4f), r);
    vf p = v_set1(1.9875691500e-4f);
    p = v_fma(p, r, v_set1(1.3981999507e-3f));
    p = v_fma(p, r, v_set1(8.3334519073e-3f));
    p = v_fma(p, r, v_set1(4.1665795894e-2f));
    p = v_fma(p, r, v_set1(1.6666665459e-1f));
    p = v_fma(p, r, v_set1(5.0000001201e-1f));
    return v_fma(v_mul(p, r), r, v_add(r, v_set1(1.0f)));
}

/* e^x for x <= 0 (a score minus its row's max). The -87 clamp keeps 2^n a normal float; e^-87 is
 * below every weight that counts. */
static inline vf v_exp_nonpositive(vf x) {
    vf n, p = v_exp_reduced(v_max(x, v_set1(-87.0f)), &n);
    return v_mul(p, v_pow2i(n));
}

#endif /* RADIXRT_SIMD_H */
