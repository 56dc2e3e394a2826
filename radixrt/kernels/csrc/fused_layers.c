/* A decoder layer's non-GEMM work on CPU, fused: RMSNorm with the residual add, rope, act(gate) * up.
 *
 * Built once per instruction set by radixrt/kernels/native_build.py (-DRADIXRT_ISA_AVX512, _AVX2, ...,
 * explicit -m flags); each entry point carries the ISA's name (radixrt_rms_norm_avx512). The
 * kernels are written once over the shared vector layer (simd.h) and the few operations below
 * it lacks, so the variants compute the same float32 operations in the same order (but exp's
 * multiply-adds, which simd.h's scalar layer rounds twice).
 *
 * Activations are float32 (kind 0) or bfloat16 (kind 1). The math is float32, and a bf16 value
 * is rounded (to nearest, ties to even, as torch does) exactly where the torch reference rounds
 * one (radixrt/kernels/fused_layers.py: rms_norm_ref, add_rms_norm_ref, rope_ref, act_mul_ref). So the
 * results equal the reference's bit for bit (the norm sums its squares in torch's own order:
 * torch_row_sum) except where exp is taken (ours, not Sleef's): the activations may move a bf16
 * result by one ulp, rarely. tests/test_fused_layers.py holds every variant to them.
 * NOTE: products that torch rounds are never contracted into fused multiply-adds: the vector code
 * calls mul and add apart, and -std=c11 makes GCC's default -ffp-contract=off. (exp's polynomial,
 * which matches nothing of torch's bit for bit, uses explicit v_fma.)
 *
 *   rms_norm  out = norm(x) * w, or with a residual: residual += x, then out = norm(residual) * w
 *             (vLLM's fused_add_rms_norm). norm(s) = s / sqrt(mean(s^2) + eps) in float32; Llama
 *             rounds that to the activations' dtype and then scales (two roundings), Gemma scales
 *             by (1 + w) in float32 and rounds once.
 *   rope      neox-style (rotate_half) rotation of the first rotary_dim features of every q and k
 *             head by the cos/sin table rows of each token (float32, or bf16 where model.to()
 *             rounded the tables), cos and sin first rounded to the activations' dtype (as
 *             transformers applies them); the other features copied.
 *   act_mul   out = act(gate) * up from gate_up = [gate | up] per token, act SiLU or tanh-GELU
 *             (the activation's result rounded before the product, as two torch ops round).
 *
 * Every entry point takes `threads` (the caller's torch thread count) and uses them over tokens
 * only when the call is large enough to pay for the fork (PAR_MIN_WORK). The OpenMP runtime is
 * torch's own: the dynamic linker gives our libgomp.so.1 dependency the copy torch loaded.
 * Return 0, or: 1 unknown kind or activation, 2 bad rope shape, 3 a table row out of range,
 * 4 a norm's rows longer than MAX_NORM_HIDDEN.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

enum { KIND_F32 = 0, KIND_BF16 = 1 };
enum { ACT_SILU = 0, ACT_GELU_TANH = 1 };
/* A call runs on `threads` threads when its elements times its kernel's cost reach PAR_MIN_WORK,
 * the cost being about how many plain elementwise torch ops one element's work equals: so an act
 * call splits from 16k elements, a norm or rope from 32k, torch's own grain for one op (measured
 * on 2 cores: act at 24k elements 21 -> 13 us, norm at 37k 23 -> 16 us; below, the fork costs more). */
#define PAR_MIN_WORK (1 << 16)
enum { COST_NORM = 2, COST_ROPE = 2, COST_ACT = 4 };
#define MAX_NORM_HIDDEN (1 << 16) /* a norm's row of squares lives on the stack (256 KB at most) */

/* ---- beyond simd.h's vector layer: what these kernels need besides, one section per ISA ----- */
#if defined(RADIXRT_AVX512_FAMILY)
/* a < b ? a : b: b when either is NaN, so a NaN passed as b survives (as v_max) */
static inline vf v_min(vf a, vf b) { return _mm512_min_ps(a, b); }
/* The nearest bf16 (ties to even) as a float32; NaN becomes the quiet NaN 0x7fc0 (as torch's). */
static inline vf v_round_bf16(vf x) {
    __m512i u = _mm512_castps_si512(x);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_and_si512(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))),
                                 _mm512_set1_epi32((int)0xffff0000u));
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc00000));
    return _mm512_castsi512_ps(r);
}
static inline void v_store_bf16(uint16_t *p, vf x) { /* x's top halves: x must be v_round_bf16's */
    __m512i hi = _mm512_srli_epi32(_mm512_castps_si512(x), 16);
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(hi));
}
#elif defined(RADIXRT_ISA_AVX2)
static inline vf v_min(vf a, vf b) { return _mm256_min_ps(a, b); }
static inline vf v_round_bf16(vf x) {
    __m256i u = _mm256_castps_si256(x);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_and_si256(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))),
                                 _mm256_set1_epi32((int)0xffff0000u));
    vf nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    return _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)), nan);
}
static inline void v_store_bf16(uint16_t *p, vf x) {
    __m256i hi = _mm256_srli_epi32(_mm256_castps_si256(x), 16);
    __m256i packed = _mm256_packus_epi32(hi, hi);      /* per 128-bit lane: h0..h3 h0..h3 | h4..h7 h4..h7 */
    packed = _mm256_permute4x64_epi64(packed, 0x08); /* h0..h3 h4..h7 in the low 128 bits */
    _mm_storeu_si128((__m128i *)p, _mm256_castsi256_si128(packed));
}
#else
static inline vf v_min(vf a, vf b) { return a < b ? a : b; }
static inline vf v_round_bf16(vf x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    u = x != x ? 0x7fc00000u : (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    memcpy(&x, &u, sizeof x);
    return x;
}
static inline void v_store_bf16(uint16_t *p, vf x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    *p = (uint16_t)(u >> 16);
}
#endif

/* 8-lane float32 vectors, whatever the variant: the lanes of torch's sum kernel (torch_row_sum) */
#if defined(RADIXRT_AVX512_FAMILY) || defined(RADIXRT_ISA_AVX2)
typedef __m256 v8;
static inline v8 v8_zero(void) { return _mm256_setzero_ps(); }
static inline v8 v8_load(const float *p) { return _mm256_loadu_ps(p); }
static inline v8 v8_add(v8 a, v8 b) { return _mm256_add_ps(a, b); }
static inline void v8_store(float *p, v8 x) { _mm256_storeu_ps(p, x); }
#else
typedef struct { float v[8]; } v8;
static inline v8 v8_zero(void) { return (v8){{0}}; }
static inline v8 v8_load(const float *p) {
    v8 x;
    memcpy(x.v, p, sizeof x.v);
    return x;
}
static inline v8 v8_add(v8 a, v8 b) {
    for (int l = 0; l < 8; l++) a.v[l] += b.v[l];
    return a;
}
static inline void v8_store(float *p, v8 x) { memcpy(p, x.v, sizeof x.v); }
#endif

#define ENTRY(name) CAT(name, ISA_NAME)

/* ---- activations in either dtype, n <= VL elements at element i ---------------------------
 * A row's last partial vector goes through a zero-padded buffer; its padding lanes are computed
 * (on zeros: no NaN, no trap) and never stored. `kind` and, in a row's main loop, n == VL are
 * constants where these inline, so the main loop has no tail logic and no calls. */
ALWAYS_INLINE vf load_n(const void *p, int kind, int64_t i, int n) {
    if (kind == KIND_BF16) {
        const uint16_t *q = (const uint16_t *)p + i;
        if (n == VL) return v_load_bf16(q);
        uint16_t buf[VL] = {0};
        memcpy(buf, q, (size_t)n * sizeof *buf);
        return v_load_bf16(buf);
    }
    const float *q = (const float *)p + i;
    if (n == VL) return v_load(q);
    float buf[VL] = {0};
    memcpy(buf, q, (size_t)n * sizeof *buf);
    return v_load(buf);
}

/* x rounded to the dtype (the identity for float32) */
ALWAYS_INLINE vf round_to(vf x, int kind) { return kind == KIND_BF16 ? v_round_bf16(x) : x; }

/* Stores x rounded to the dtype. */
ALWAYS_INLINE void store_n(void *p, int kind, int64_t i, int n, vf x) {
    if (kind == KIND_BF16) {
        uint16_t *q = (uint16_t *)p + i;
        x = v_round_bf16(x);
        if (n == VL) return v_store_bf16(q, x);
        uint16_t buf[VL];
        v_store_bf16(buf, x);
        memcpy(q, buf, (size_t)n * sizeof *buf);
        return;
    }
    float *q = (float *)p + i;
    if (n == VL) return v_store(q, x);
    float buf[VL];
    v_store(buf, x);
    memcpy(q, buf, (size_t)n * sizeof *buf);
}

/* Runs STEP(i, m) over a row of len elements: whole vectors (m == VL), then the partial one. */
#define FOR_VECTORS(len, STEP)                                                                                          \
    do {                                                                                                               \
        int64_t i_ = 0;                                                                                                \
        for (; i_ + VL <= (len); i_ += VL) STEP(i_, VL);                                                               \
        if (i_ < (len)) STEP(i_, (int)((len) - i_));                                                                   \
    } while (0)

static inline size_t elem_size(int kind) { return kind == KIND_BF16 ? 2 : 4; }

static inline int threads_for(int64_t work, int threads) { return work >= PAR_MIN_WORK && threads > 1 ? threads : 1; }

/* e^x over the whole range (v_exp_nonpositive serves x <= 0 only), by simd.h's v_exp_reduced.
 * Below -86 it returns about e^-86 instead of a smaller number (every caller adds the result to
 * 1); above 88.72 +inf; NaN stays NaN. The scale is applied as (2 p) 2^(n - 1) so that n = 128
 * keeps the exponent field finite and overflows only when e^x does. */
static inline vf v_exp(vf x) {
    vf n, p = v_exp_reduced(v_min(v_set1(89.0f), v_max(v_set1(-86.0f), x)), &n);
    return v_mul(v_add(p, p), v_pow2i(v_sub(n, v_set1(1.0f))));
}

/* x / (1 + e^-x), as torch's silu */
static inline vf v_silu(vf x) { return v_div(x, v_add(v_set1(1.0f), v_exp(v_sub(v_zero(), x)))); }

/* 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), as torch's gelu(approximate="tanh"),
 * tanh |u| = 1 - 2 / (e^2|u| + 1): within about an ulp of 1 (where 1 + tanh is taken), so 1 + tanh
 * agrees with torch's where tanh is near -1 (there both keep only float32's absolute precision) */
static inline vf v_gelu_tanh(vf x) {
    const float beta = 0.7978845608028654f; /* sqrt(2 / pi) */
    vf inner = v_mul(v_set1(beta), v_add(x, v_mul(v_set1(0.044715f), v_mul(v_mul(x, x), x))));
    vf e = v_exp(v_mul(v_set1(2.0f), v_abs(inner)));
    vf tanh = v_copysign(v_sub(v_set1(1.0f), v_div(v_set1(2.0f), v_add(e, v_set1(1.0f)))), inner);
    return v_mul(v_mul(v_set1(0.5f), x), v_add(v_set1(1.0f), tanh));
}

/* ---- RMSNorm -------------------------------------------------------------------------------- */

/* The float32 sum of s[0..n) in torch's order, so that the norm's mean of squares is torch's to
 * the bit: ATen's cascade_sum for a contiguous inner reduction (SumKernel.cpp), which torch runs
 * with its AVX2 kernel, 8 lanes, on AVX2 and AVX-512 CPUs alike (sum registers no AVX-512 one).
 * The row as 8-float vectors V_i in rows of four (V_4r .. V_4r+3), each of the four columns summed
 * with carries every 16 rows (the cascade's levels); the leftover vectors into column 0; the
 * columns added in order; then the leftover floats, then the 8 lanes, onto 0. Rows of fewer than
 * 8 floats take its scalar form (four scalar columns). */
static float torch_row_sum(const float *s, int64_t n) {
    enum { LEVELS = 4, COLS = 4 };
    if (n < 8) {
        float c[COLS] = {0};
        for (int64_t i = 0; i < n / COLS * COLS; i++) c[i % COLS] += s[i];
        for (int64_t i = n / COLS * COLS; i < n; i++) c[0] += s[i];
        return 0.0f + (((c[0] + c[1]) + c[2]) + c[3]);
    }
    const int64_t vecs = n / 8, rows = vecs / COLS;
    int ceil_log2 = 1; /* ATen's CeilLog2: 1 up to 2 */
    while (rows > 2 && ((int64_t)1 << ceil_log2) < rows) ceil_log2++;
    const int power = ceil_log2 / LEVELS > 4 ? ceil_log2 / LEVELS : 4;
    const int64_t step = (int64_t)1 << power, mask = step - 1;
    v8 acc[LEVELS][COLS];
    for (int j = 0; j < LEVELS; j++)
        for (int k = 0; k < COLS; k++) acc[j][k] = v8_zero();
    int64_t i = 0;
    while (i + step <= rows) {
        for (int64_t r = 0; r < step; r++, i++)
            for (int k = 0; k < COLS; k++) acc[0][k] = v8_add(acc[0][k], v8_load(s + (i * COLS + k) * 8));
        for (int j = 1; j < LEVELS; j++) {
            for (int k = 0; k < COLS; k++) acc[j][k] = v8_add(acc[j][k], acc[j - 1][k]), acc[j - 1][k] = v8_zero();
            if (i & (mask << (j * power))) break;
        }
    }
    for (; i < rows; i++)
        for (int k = 0; k < COLS; k++) acc[0][k] = v8_add(acc[0][k], v8_load(s + (i * COLS + k) * 8));
    for (int j = 1; j < LEVELS; j++)
        for (int k = 0; k < COLS; k++) acc[0][k] = v8_add(acc[0][k], acc[j][k]);
    v8 col = acc[0][0];
    for (int64_t v = rows * COLS; v < vecs; v++) col = v8_add(col, v8_load(s + v * 8));
    for (int k = 1; k < COLS; k++) col = v8_add(col, acc[0][k]);
    float total = 0.0f, lanes[8];
    for (int64_t k = vecs * 8; k < n; k++) total += s[k];
    v8_store(lanes, col);
    for (int l = 0; l < 8; l++) total += lanes[l];
    return total;
}

/* One row of n features. With res: res = round(res + x) first, and the row normalized is res.
 * squares: scratch for n floats. */
ALWAYS_INLINE void norm_row(const void *x, void *res, void *out, const void *w, int kind, int64_t n, float eps,
                            int gemma, float *squares) {
    const void *src = res ? res : x;
#define SUM_SQUARES(i, m)                                                                                              \
    do {                                                                                                               \
        vf s = load_n(x, kind, i, m);                                                                                  \
        if (res) {                                                                                                     \
            s = round_to(v_add(load_n(res, kind, i, m), s), kind);                                                     \
            store_n(res, kind, i, m, s);                                                                               \
        }                                                                                                              \
        store_n(squares, KIND_F32, i, m, v_mul(s, s)); /* rounded to float32, as torch's pow(2) */                     \
    } while (0)
    FOR_VECTORS(n, SUM_SQUARES);
    /* torch: rsqrt(sum / n + eps) as 1 / sqrt(), in float32 */
    const vf inv = v_set1(1.0f / sqrtf(torch_row_sum(squares, n) / (float)n + eps));
#define SCALE(i, m)                                                                                                    \
    do {                                                                                                               \
        vf y = v_mul(load_n(src, kind, i, m), inv), wv = load_n(w, kind, i, m);                                        \
        y = gemma ? v_mul(y, v_add(v_set1(1.0f), wv)) : v_mul(round_to(y, kind), wv);                                 \
        store_n(out, kind, i, m, y);                                                                                   \
    } while (0)
    FOR_VECTORS(n, SCALE);
}

static void norm_rows(const char *x, int64_t inner, int64_t so, int64_t si, char *res, char *out, const void *w,
                      int kind, int64_t rows, int64_t n, float eps, int gemma, int threads) {
    const size_t es = elem_size(kind);
    const int nt = threads_for(rows * n * COST_NORM, threads);
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        float squares[n]; /* per thread: a row's squares (n <= MAX_NORM_HIDDEN) */
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            const char *xr = x + ((r / inner) * so + (r % inner) * si) * es;
            char *rr = res ? res + r * n * es : NULL;
            if (kind == KIND_BF16)
                norm_row(xr, rr, out + r * n * es, w, KIND_BF16, n, eps, gemma, squares);
            else
                norm_row(xr, rr, out + r * n * es, w, KIND_F32, n, eps, gemma, squares);
        }
    }
}

/* x: rows = outer * inner rows of `hidden` features, row (o, i) at element o * x_outer + i * x_inner
 * (a [T, heads, head_dim] view of a fused q/k/v, or a plain [T, hidden]); residual (or NULL) and
 * out: [rows, hidden] contiguous; w: [hidden] in the activations' dtype. out may be x itself. */
int ENTRY(radixrt_rms_norm)(const void *x, int64_t outer, int64_t inner, int64_t x_outer, int64_t x_inner,
                            void *residual, void *out, const void *w, int kind, int64_t hidden, float eps, int gemma,
                            int threads) {
    if (kind != KIND_F32 && kind != KIND_BF16) return 1;
    if (hidden > MAX_NORM_HIDDEN) return 4;
    norm_rows(x, inner, x_outer, x_inner, residual, out, w, kind, outer * inner, hidden, eps, gemma, threads);
    return 0;
}

/* ---- rope ----------------------------------------------------------------------------------- */

/* One head: out[i] = x[i] c[i] - x[i + h] s[i], out[i + h] = x[i + h] c[i + h] + x[i] s[i + h]
 * for i < h = rot / 2, each product and the sum rounded to the dtype; features rot.. copied. */
ALWAYS_INLINE void rope_head(const void *x, void *out, const void *c, const void *s, int kind, int tkind, int d,
                            int rot) {
    const int h = rot / 2;
#define ROTATE(i, m)                                                                                                   \
    do {                                                                                                               \
        vf x1 = load_n(x, kind, i, m), x2 = load_n(x, kind, i + h, m);                                                 \
        vf c1 = round_to(load_n(c, tkind, i, m), kind), c2 = round_to(load_n(c, tkind, i + h, m), kind);               \
        vf s1 = round_to(load_n(s, tkind, i, m), kind), s2 = round_to(load_n(s, tkind, i + h, m), kind);               \
        store_n(out, kind, i, m, v_sub(round_to(v_mul(x1, c1), kind), round_to(v_mul(x2, s1), kind)));                 \
        store_n(out, kind, i + h, m, v_add(round_to(v_mul(x2, c2), kind), round_to(v_mul(x1, s2), kind)));             \
    } while (0)
    FOR_VECTORS(h, ROTATE);
    if (rot < d) memcpy((char *)out + rot * elem_size(kind), (const char *)x + rot * elem_size(kind), (d - rot) * elem_size(kind));
}

ALWAYS_INLINE void rope_token(const char *x, int64_t stride, char *out, int heads, const void *c, const void *s,
                              int kind, int tkind, int d, int rot, int64_t t) {
    const size_t es = elem_size(kind);
    for (int hd = 0; hd < heads; hd++)
        rope_head(x + (t * stride + (int64_t)hd * d) * es, out + (t * heads + hd) * (int64_t)d * es, c, s, kind, tkind,
                  d, rot);
}

/* q: token t's head h at element t * q_stride + h * head_dim (its features contiguous), likewise k;
 * q_out [tokens, q_heads, head_dim] and k_out [tokens, k_heads, head_dim] contiguous (they may not
 * overlap q or k); cos, sin: [table_rows, rotary_dim] of table_kind; rows: [tokens] int64, token t's row. */
int ENTRY(radixrt_rope)(const void *q, int64_t q_stride, void *q_out, int q_heads, const void *k, int64_t k_stride,
                        void *k_out, int k_heads, int kind, int64_t tokens, int head_dim, int rotary_dim,
                        const void *cos, const void *sin, int table_kind, int64_t table_rows, const int64_t *rows,
                        int threads) {
    if (kind != KIND_F32 && kind != KIND_BF16) return 1;
    if (table_kind != KIND_F32 && table_kind != KIND_BF16) return 1;
    if (rotary_dim <= 0 || rotary_dim % 2 || rotary_dim > head_dim) return 2;
    for (int64_t t = 0; t < tokens; t++)
        if (rows[t] < 0 || rows[t] >= table_rows) return 3;
    const int nt = threads_for(tokens * (q_heads + k_heads) * (int64_t)head_dim * COST_ROPE, threads);
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int64_t t = 0; t < tokens; t++) {
        const size_t row = rows[t] * rotary_dim * elem_size(table_kind);
        const char *c = (const char *)cos + row, *s = (const char *)sin + row;
        if (kind == KIND_BF16) {
            rope_token(q, q_stride, q_out, q_heads, c, s, KIND_BF16, table_kind, head_dim, rotary_dim, t);
            rope_token(k, k_stride, k_out, k_heads, c, s, KIND_BF16, table_kind, head_dim, rotary_dim, t);
        } else {
            rope_token(q, q_stride, q_out, q_heads, c, s, KIND_F32, table_kind, head_dim, rotary_dim, t);
            rope_token(k, k_stride, k_out, k_heads, c, s, KIND_F32, table_kind, head_dim, rotary_dim, t);
        }
    }
    return 0;
}

/* ---- act(gate) * up ------------------------------------------------------------------------- */

ALWAYS_INLINE void act_mul_row(const void *g, const void *u, void *out, int kind, int64_t n, int act) {
#define ACT_MUL(i, m)                                                                                                  \
    do {                                                                                                               \
        vf x = load_n(g, kind, i, m);                                                                                  \
        vf a = act == ACT_SILU ? v_silu(x) : v_gelu_tanh(x);                                                           \
        store_n(out, kind, i, m, v_mul(round_to(a, kind), load_n(u, kind, i, m)));                                     \
    } while (0)
    FOR_VECTORS(n, ACT_MUL);
}

/* gate_up: token t's gate at element t * stride, its up right after (inter features each);
 * out: [tokens, inter] contiguous. */
int ENTRY(radixrt_act_mul)(const void *gate_up, int64_t stride, void *out, int kind, int64_t tokens, int64_t inter,
                           int act, int threads) {
    if ((kind != KIND_F32 && kind != KIND_BF16) || (act != ACT_SILU && act != ACT_GELU_TANH)) return 1;
    const size_t es = elem_size(kind);
    const int nt = threads_for(tokens * inter * COST_ACT, threads);
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int64_t t = 0; t < tokens; t++) {
        const char *g = (const char *)gate_up + t * stride * es;
        char *o = (char *)out + t * inter * es;
        if (kind == KIND_BF16)
            act == ACT_SILU ? act_mul_row(g, g + inter * es, o, KIND_BF16, inter, ACT_SILU)
                            : act_mul_row(g, g + inter * es, o, KIND_BF16, inter, ACT_GELU_TANH);
        else
            act == ACT_SILU ? act_mul_row(g, g + inter * es, o, KIND_F32, inter, ACT_SILU)
                            : act_mul_row(g, g + inter * es, o, KIND_F32, inter, ACT_GELU_TANH);
    }
    return 0;
}
