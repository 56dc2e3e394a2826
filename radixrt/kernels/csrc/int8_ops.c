/* The two passes around a w8a8 int8 GEMM on CPU: per-token quantization of the activations
 * before it, and the rescaling of its int32 sums after it (radixrt/kernels/int8_ops.py).
 *
 * Built once per instruction set by radixrt/kernels/native_build.py; entry points carry the ISA's name.
 * Plain loops the compiler vectorizes with the ISA's -m flags: every operation is an IEEE float32
 * operation in the order the torch reference (radixrt/models/int8_linear.py) does it, so the
 * results equal torch's bit for bit:
 *
 *   quantize_tokens  per row t of x [T, K] (float32, kind 0, or bf16, kind 1; rows `stride`
 *                    elements apart): amax = max |x|, s = amax / 127 (1 for a zero row),
 *                    q = round-half-even(x / s) clamped to [-127, 127]. Writes q [T, K] int8 and
 *                    s [T] float32.
 *   rescale          y[t, n] = ((float)acc[t, n] * sx[t]) * sw[n] (+ bias[n], float32 or bf16 as
 *                    kind says) rounded to the output kind (bf16: to nearest, ties to even).
 *
 * NOTE: -std=c11 keeps GCC from contracting the products into fused multiply-adds, which would
 * round once where torch rounds twice. Each takes `threads` and forks over rows only when a call
 * is large enough (PAR_MIN_WORK elements). Return 0, or 1 for an unknown kind.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

enum { KIND_F32 = 0, KIND_BF16 = 1 };
#define PAR_MIN_WORK (1 << 16)
#define QMAX 127.0f

#define ENTRY(name) CAT(radixrt_##name, ISA_NAME)

static inline float bf16_to_f32(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* to nearest, ties to even; NaN -> 0x7fc0 (as torch) */
    uint32_t u;
    memcpy(&u, &f, 4);
    if (f != f) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* ---- what the quantization needs beyond simd.h: a lane maximum, and lanes stored as int8 ----- */
#if defined(RADIXRT_AVX512_FAMILY)
static inline float v_hmax(vf x) { return _mm512_reduce_max_ps(x); }
/* round half to even (the default MXCSR mode, as nearbyintf), clamp to +-127, store VL int8 */
static inline void v_store_int8(int8_t *q, vf x) {
    __m512i i = _mm512_cvtps_epi32(x);
    i = _mm512_min_epi32(_mm512_max_epi32(i, _mm512_set1_epi32(-127)), _mm512_set1_epi32(127));
    _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(i));
}
#elif defined(RADIXRT_ISA_AVX2)
static inline float v_hmax(vf x) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}
static inline void v_store_int8(int8_t *q, vf x) {
    __m256i i = _mm256_cvtps_epi32(x);
    i = _mm256_min_epi32(_mm256_max_epi32(i, _mm256_set1_epi32(-127)), _mm256_set1_epi32(127));
    __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
    _mm_storel_epi64((__m128i *)q, _mm_packs_epi16(w, w));
}
#else
static inline float v_hmax(vf x) { return x; }
static inline void v_store_int8(int8_t *q, vf x) { *q = (int8_t)fminf(fmaxf(nearbyintf(x), -QMAX), QMAX); }
#endif

static inline vf load_lanes(const void *x, int kind, int64_t k) {
    return kind == KIND_F32 ? v_load((const float *)x + k) : v_load_bf16((const uint16_t *)x + k);
}

static inline float load_one(const void *x, int kind, int64_t k) {
    return kind == KIND_F32 ? ((const float *)x)[k] : bf16_to_f32(((const uint16_t *)x)[k]);
}

/* One row: amax, s = amax / 127 (1 for a zero row), q = x / s rounded half to even, clamped. */
static void quantize_row(const void *x, int kind, int64_t K, int8_t *q, float *scale) {
    int64_t k = 0;
    vf vmax = v_zero();
    for (; k + VL <= K; k += VL) vmax = v_max(vmax, v_abs(load_lanes(x, kind, k)));
    float amax = v_hmax(vmax);
    for (; k < K; k++) amax = fmaxf(amax, fabsf(load_one(x, kind, k)));
    float s = amax > 0.0f ? amax / QMAX : 1.0f;
    vf vs = v_set1(s);
    for (k = 0; k + VL <= K; k += VL) v_store_int8(q + k, v_div(load_lanes(x, kind, k), vs));
    for (; k < K; k++) q[k] = (int8_t)fminf(fmaxf(nearbyintf(load_one(x, kind, k) / s), -QMAX), QMAX);
    *scale = s;
}

int ENTRY(quantize_tokens)(const void *x, int64_t T, int64_t K, int64_t stride, int kind, int8_t *q,
                           float *scales, int threads) {
    if (kind != KIND_F32 && kind != KIND_BF16) return 1;
    int64_t elem = kind == KIND_F32 ? 4 : 2;
    int par = T > 1 && T * K >= PAR_MIN_WORK ? threads : 1;
#pragma omp parallel for num_threads(par) schedule(static) if (par > 1)
    for (int64_t t = 0; t < T; t++) quantize_row((const char *)x + t * stride * elem, kind, K, q + t * K, scales + t);
    return 0;
}

int ENTRY(rescale)(const int32_t *acc, int64_t T, int64_t N, const float *sx, const float *sw, const void *bias,
                   int bias_kind, void *out, int out_kind, int threads) {
    if ((out_kind != KIND_F32 && out_kind != KIND_BF16) || (bias && bias_kind != KIND_F32 && bias_kind != KIND_BF16))
        return 1;
    int par = T > 1 && T * N >= PAR_MIN_WORK ? threads : 1;
#pragma omp parallel for num_threads(par) schedule(static) if (par > 1)
    for (int64_t t = 0; t < T; t++) {
        float row[N]; /* NOTE: on the stack; N is a layer's output width */
        const int32_t *a = acc + t * N;
        float s = sx[t];
        for (int64_t n = 0; n < N; n++) row[n] = ((float)a[n] * s) * sw[n];
        if (bias && bias_kind == KIND_F32)
            for (int64_t n = 0; n < N; n++) row[n] += ((const float *)bias)[n];
        else if (bias)
            for (int64_t n = 0; n < N; n++) row[n] += bf16_to_f32(((const uint16_t *)bias)[n]);
        if (out_kind == KIND_F32) {
            memcpy((float *)out + t * N, row, (size_t)N * sizeof(float));
        } else {
            uint16_t *o = (uint16_t *)out + t * N;
            for (int64_t n = 0; n < N; n++) o[n] = f32_to_bf16(row[n]);
        }
    }
    return 0;
}
