/* Decode attention on CPU, reading the paged KV pool in place.
 *
 * One query token per request. A task is one request (or, with fewer requests than twice
 * the threads, one request's KV head): the scores of its query heads against every cached
 * token, read from the request's pages in place (a token's K for the task's heads is one
 * contiguous run, so a page is read front to back; no gathered copy), a softmax in float32,
 * then the weighted sum of the V rows. K and V are read once each, widened from the pool's
 * dtype to float32 four rows at a time, so no half-precision arithmetic is needed (the slow
 * path on CPUs without half GEMM units). AVX2 intrinsics where the compiler targets it
 * (-march=native; AVX-512 CPUs have AVX2 too), plain C elsewhere. Tasks are split across the
 * OpenMP threads of the runtime torch itself loaded (same soname: one runtime, one thread count).
 *
 * Layouts (all contiguous, row-major):
 *   q      [B, H, D] float32                  out  [B, H, D] float32
 *   pool   [slots, KVH, D] of `kind`          lse  [B, H] float32, or NULL
 *   pages  [B, pages_stride] int64: request b's i-th page id; slot = page * page_size + offset
 *   kv_lens [B] int64, each >= 1: tokens of request b to attend over, from its first page
 * window > 0: request b reads only its last `window` tokens, max(0, kv_len - window) .. kv_len - 1
 * (a sliding-window layer; the pages before stay in the pool, unread); 0: all of them.
 * softcap > 0: each score s = scale * q . k becomes softcap * tanh(s / softcap) before the
 * softmax (Gemma 2); 0: scores as they are. Neither costs a layer that does not use it anything
 * but one branch per row.
 * The python reference is kernels/decode_attention.py (attend); tests hold this to it.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { KIND_F32 = 0, KIND_BF16 = 1 };

#ifdef __AVX2__
#include <immintrin.h>
#endif

static inline void widen_row(const void *pool, int kind, int64_t offset, int D, float *dst) {
    if (kind == KIND_F32) {
        memcpy(dst, (const float *)pool + offset, (size_t)D * sizeof(float));
        return;
    }
    const uint16_t *src = (const uint16_t *)pool + offset;
    int d = 0;
#ifdef __AVX2__
    for (; d + 8 <= D; d += 8) { /* bf16 is the top half of a float32 */
        __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + d)));
        _mm256_storeu_ps(dst + d, _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
    }
#endif
    for (; d < D; d++) {
        uint32_t bits = (uint32_t)src[d] << 16;
        memcpy(dst + d, &bits, sizeof bits);
    }
}

static inline float dot(const float *a, const float *b, int D) {
    int d = 0;
    float s = 0.0f;
#ifdef __AVX2__
    __m256 acc = _mm256_setzero_ps();
    for (; d + 8 <= D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
    __m128 half = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    half = _mm_add_ps(half, _mm_movehl_ps(half, half));
    s = _mm_cvtss_f32(_mm_add_ss(half, _mm_movehdup_ps(half)));
#endif
    for (; d < D; d++) s += a[d] * b[d];
    return s;
}

/* Four dot products of a against rows[0..3] (D floats each, `stride` apart): four independent
 * FMA chains, so the FMA latency is hidden where one chain would wait on itself. */
static inline void dot4(const float *a, const float *rows, int64_t stride, int D, float *out) {
#ifdef __AVX2__
    if (D % 8 == 0) {
        __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps(), s2 = _mm256_setzero_ps(), s3 = _mm256_setzero_ps();
        for (int d = 0; d < D; d += 8) {
            __m256 x = _mm256_loadu_ps(a + d);
            s0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(rows + d), s0);
            s1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(rows + stride + d), s1);
            s2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(rows + 2 * stride + d), s2);
            s3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(rows + 3 * stride + d), s3);
        }
        /* transpose-add: lane i of the result is the sum of s_i */
        __m256 h01 = _mm256_hadd_ps(s0, s1), h23 = _mm256_hadd_ps(s2, s3);
        __m256 h = _mm256_hadd_ps(h01, h23);
        _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
        return;
    }
#endif
    for (int i = 0; i < 4; i++) out[i] = dot(a, rows + i * stride, D);
}

/* e^x for x <= 0 (a score minus its row's max), Cephes' expf: x = n ln2 + r with |r| <= ln2 / 2,
 * e^r by its degree-7 polynomial (about 1 ulp), 2^n into the exponent bits. Branch-free so the
 * loop over a row vectorizes, where libm's expf is one call per element. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x; /* keeps 2^n a normal float; e^-87 is below every weight that counts */
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

#ifdef __AVX2__
/* exp_nonpositive on eight lanes (the same steps, in AVX2). */
static inline __m256 exp8_nonpositive(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

/* s[t] = exp(s[t] - m) for t < T; returns their sum. */
static inline float exp_shifted(float *s, int64_t T, float m) {
    int64_t t = 0;
    float sum = 0.0f;
#ifdef __AVX2__
    __m256 acc = _mm256_setzero_ps(), mv = _mm256_set1_ps(m);
    for (; t + 8 <= T; t += 8) {
        __m256 e = exp8_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + t), mv));
        _mm256_storeu_ps(s + t, e);
        acc = _mm256_add_ps(acc, e);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    for (int i = 0; i < 8; i++) sum += lanes[i];
#endif
    for (; t < T; t++) {
        s[t] = exp_nonpositive(s[t] - m);
        sum += s[t];
    }
    return sum;
}

/* s[t] = cap * tanh(s[t] / cap) for t < T. tanh(x) = sign(x) (1 - e) / (1 + e) with e = exp(-2|x|),
 * so the branch-free exp above serves (its -87 clamp only reaches |x| > 43, where tanh is 1 in float). */
static inline float tanh_via_exp(float x) {
    float e = exp_nonpositive(-2.0f * fabsf(x)), t = (1.0f - e) / (1.0f + e);
    return x < 0.0f ? -t : t;
}

/* NOTE: noinline: inlined into attend_task it slowed layers without a cap by ~7% (measured). */
__attribute__((noinline)) static void softcap_row(float *s, int64_t T, float cap) {
    const float inv = 1.0f / cap;
    int64_t t = 0;
#ifdef __AVX2__
    const __m256 sign_bit = _mm256_set1_ps(-0.0f), one = _mm256_set1_ps(1.0f);
    const __m256 capv = _mm256_set1_ps(cap), m2inv = _mm256_set1_ps(-2.0f * inv);
    for (; t + 8 <= T; t += 8) {
        __m256 x = _mm256_loadu_ps(s + t);
        __m256 sign = _mm256_and_ps(x, sign_bit);
        __m256 e = exp8_nonpositive(_mm256_mul_ps(_mm256_andnot_ps(sign_bit, x), m2inv));
        __m256 th = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
        _mm256_storeu_ps(s + t, _mm256_mul_ps(_mm256_or_ps(th, sign), capv));
    }
#endif
    for (; t < T; t++) s[t] = cap * tanh_via_exp(s[t] * inv);
}

/* Up to four tokens' rows from t0 on (the task's heads, W values each), widened into rows [4, W];
 * returns how many (fewer than four only at the end). */
static inline int widen_block(const void *pool, int kind, const int64_t *pages, int64_t t0, int64_t T, int KVH,
                              int h0, int D, int W, int page_size, float *rows) {
    int n = T - t0 < 4 ? (int)(T - t0) : 4;
    for (int i = 0; i < n; i++) {
        int64_t t = t0 + i, slot = pages[t / page_size] * page_size + t % page_size;
        widen_row(pool, kind, (slot * KVH + h0) * D, W, rows + i * W);
    }
    return n;
}

/* Request b's query heads of KV heads [h0, h1) over its tokens [t_begin, T): q, out [(h1 - h0) * G, D];
 * lse [(h1 - h0) * G] or NULL. A token's K (or V) for those heads is one contiguous run of
 * W = (h1 - h0) * D values in the pool, so a page is read front to back.
 * Scratch: scores [(h1 - h0) * G, T - t_begin], rows [4, W]. */
static void attend_task(const float *q, const void *k_pool, const void *v_pool, int kind, const int64_t *pages,
                        int64_t t_begin, int64_t T, int KVH, int h0, int h1, int G, int D, int page_size,
                        float scale, float softcap, float *scores, float *rows, float *out, float *lse) {
    const int NH = h1 - h0, W = NH * D;
    const int64_t N = T - t_begin; /* tokens read; score row r, token t sits at scores[r * N + t - t_begin] */
    for (int64_t t0 = t_begin; t0 < T; t0 += 4) { /* K rows four at a time (dot4) */
        int n = widen_block(k_pool, kind, pages, t0, T, KVH, h0, D, W, page_size, rows);
        for (int h = 0; h < NH; h++) {
            for (int j = 0; j < G; j++) {
                const float *qj = q + (h * G + j) * D;
                float dots[4];
                if (n == 4) {
                    dot4(qj, rows + h * D, W, D, dots);
                } else {
                    for (int i = 0; i < n; i++) dots[i] = dot(qj, rows + i * W + h * D, D);
                }
                float *s = scores + (h * G + j) * N + (t0 - t_begin);
                for (int i = 0; i < n; i++) s[i] = dots[i] * scale;
            }
        }
    }
    for (int r = 0; r < NH * G; r++) {
        float *s = scores + r * N, m = -INFINITY;
        if (softcap > 0.0f) softcap_row(s, N, softcap);
        for (int64_t t = 0; t < N; t++) m = s[t] > m ? s[t] : m;
        float sum = exp_shifted(s, N, m), inv = 1.0f / sum;
        for (int64_t t = 0; t < N; t++) s[t] *= inv;
        if (lse) lse[r] = m + logf(sum);
    }
    memset(out, 0, (size_t)NH * G * D * sizeof(float));
    for (int64_t t0 = t_begin; t0 < T; t0 += 4) { /* V rows four at a time, while the output rows stay in L1 */
        int n = widen_block(v_pool, kind, pages, t0, T, KVH, h0, D, W, page_size, rows);
        for (int h = 0; h < NH; h++) {
            for (int j = 0; j < G; j++) {
                const float *w = scores + (h * G + j) * N + (t0 - t_begin);
                float *o = out + (h * G + j) * D;
                for (int i = 0; i < n; i++) {
                    const float *v = rows + i * W + h * D;
                    float wi = w[i];
#pragma omp simd
                    for (int d = 0; d < D; d++) o[d] += wi * v[d];
                }
            }
        }
    }
}

int radixrt_decode_attention(const float *q, const void *k_pool, const void *v_pool, int kind,
                             const int64_t *pages, int64_t pages_stride, const int64_t *kv_lens,
                             int B, int H, int KVH, int D, int page_size, float scale, int64_t window,
                             float softcap, float *out, float *lse) {
    if (kind != KIND_F32 && kind != KIND_BF16) return 1;
    if (H % KVH) return 2;
    if (window < 0 || softcap < 0.0f) return 4;
    int64_t max_len = 0; /* the most tokens one request reads: its scores' scratch */
    for (int b = 0; b < B; b++) {
        int64_t n = window > 0 && kv_lens[b] > window ? window : kv_lens[b];
        max_len = n > max_len ? n : max_len;
    }
    const int G = H / KVH;
    /* A task is one request's KV heads, split when there are too few requests to keep every thread busy. */
    const int splits = B >= 2 * omp_get_max_threads() ? 1 : KVH;
    const int per_task = KVH / splits;
    int failed = 0;
#pragma omp parallel
    {
        float *scratch = malloc(sizeof(float) * (size_t)(per_task * G * max_len + 4 * per_task * D));
        if (!scratch) {
#pragma omp atomic write
            failed = 3;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < (int64_t)B * splits; task++) {
            if (!scratch) continue;
            int b = (int)(task / splits), h0 = (int)(task % splits) * per_task;
            int64_t head0 = (int64_t)b * H + (int64_t)h0 * G, T = kv_lens[b];
            int64_t t_begin = window > 0 && T > window ? T - window : 0;
            attend_task(q + head0 * D, k_pool, v_pool, kind, pages + b * pages_stride, t_begin, T, KVH, h0,
                        h0 + per_task, G, D, page_size, scale, softcap, scratch, scratch + per_task * G * max_len,
                        out + head0 * D, lse ? lse + head0 : NULL);
        }
        free(scratch);
    }
    return failed;
}
