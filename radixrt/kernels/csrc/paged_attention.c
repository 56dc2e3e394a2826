/* Paged attention on CPU (decode, prefill chunks over a cached prefix, a cascade's shared prefix),
 * reading the KV pool in place, one source for every ISA.
 *
 * Built once per instruction set by radixrt/kernels/native_build.py (-DRADIXRT_ISA_AVX512, _AVX2 or
 * _SCALAR, with explicit -m flags, never -march=native), which picks the variant at run time;
 * the entry point carries the ISA's name (radixrt_paged_attention_avx512). Only the small
 * vector layer below differs between variants; the kernel is written once over it.
 *
 * Request b's queries are its last n_b tokens (decode: n_b = 1), each reading causally up to
 * itself; a KV head's G query rows of one position (the GQA group, or a cascade's many requests
 * over one shared prefix, presented as one request) are read together. A task is a chunk of
 * up to PC positions of one request, for all its KV heads or, when that leaves threads idle or
 * the rows are wide, for one. It reads its tokens in blocks of TB, from the pages in place, the
 * next block prefetched (pages are scattered: the hardware prefetcher loses the stream at
 * every page boundary; measured 2.3x at batch 64 x 600 tokens):
 *   1. scores: for a tile of up to GT query rows and four tokens at a time, the dot products
 *      accumulate in registers (K widened from bf16 in the register, no scratch copy) and are
 *      reduced four at once;
 *   2. softmax per query row in float32 (branch-free vector exp), over the tokens it reads;
 *   3. output: for a tile of GT query rows and DT vectors of head_dim, the weighted V rows
 *      accumulate in registers across the block's TB tokens, so the output rows are loaded
 *      and stored once per block, not once per token.
 * A task with many query rows per KV head (a prefill chunk, a cascade's shared prefix) goes by GEMM
 * tiles instead (see qk_gemm_tile). Over a bf16 pool on a CPU with the bf16 dot product, those
 * tiles take the pool's K and V as they are, two elements per lane and instruction: the queries
 * and the softmax weights rounded to bf16, as a bf16 model's attention rounds them (measured on
 * an AVX-512 EPYC: prefill chunks 1.4-1.6x faster than widening K and V to float32). There every task
 * takes them, decodes too: 16 tokens' K rows transposed by pairs in registers (v_transpose16), so a row's
 * 16 scores come out of one instruction per pair of head_dim with no horizontal sum, and a decode's few
 * rows take the transposed K straight from the registers (qk_dot_few_tile); measured on an AVX-512 EPYC,
 * decodes 0.71-1.06x the time of the widening 4-token tiles over ten shapes (group 8: 0.71x).
 * The BRGEMM variant (AVX512BF16's code otherwise) sends a bf16 pool's tasks of many rows per KV head to
 * tile products instead (brgemm_tiles.h: oneDNN's micro-kernel, on AMX tiles where the CPU has them).
 * Which variant serves a kind of call is measured at start (radixrt/kernels/kernel_choice.py).
 * K and V are each read from memory once per task; a block's rows stay in L1 between tiles.
 * The last block is padded with its last real token (read, never weighted: its weights are 0).
 *
 * Layouts (all contiguous, row-major):
 *   q      [T, H, D] float32 query rows       out  [T, H, D] float32
 *   pool   [slots, KVH, D] of `kind`          lse  [T, H] float32, or NULL
 *          (int4: [slots, KVH, D / 2] bytes, two values each, and scales [slots, KVH, D / 32] float16;
 *          int8: [slots, KVH, D] and scales [slots, KVH] float32. A task dequantizes each block's rows once
 *          per KV head, into float32 scratch in L1; with VNNI an int4 pool's scores are integer dot
 *          products over the nibbles instead, the queries quantized to int8: quant_rows.h)
 *   pages  [B, pages_stride] int64: request b's i-th page id; slot = page * page_size + offset
 *   kv_lens [B] int64: tokens of request b, its new ones included
 *   q_starts [B + 1] int64: request b's queries are rows q_starts[b] .. q_starts[b + 1] - 1
 * window > 0: a query at position p reads only p - window + 1 .. p (a sliding-window layer; the
 * pages before stay in the pool, unread); 0: all of 0 .. p.
 * softcap > 0: each score s = scale * q . k becomes softcap * tanh(s / softcap) before the
 * softmax (Gemma 2); 0: scores as they are.
 * Returns 0, or: 1 unknown kind, 2 H not a multiple of KVH, 3 out of memory, 4 bad window or
 * softcap, 5 D not a multiple of this variant's vector lanes, 6 a request with no queries or
 * more queries than tokens, 7 (the BRGEMM variant) its brgemm functions not set, 8 a quantized pool whose head_dim
 * is above 256 (int4: or not a multiple of 32), or without its scales.
 * The python reference is radixrt/kernels/decode_attention.py (attend); tests hold every variant to
 * naive attention.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { KIND_F32 = 0, KIND_BF16 = 1, KIND_INT4 = 2, KIND_INT8 = 3 };
#define QUANTIZED(kind) ((kind) >= KIND_INT4) /* rows dequantized in the kernel, with their scales (quant_rows.h) */
#define INT4_GROUP 32 /* elements of a token's head per float16 scale (radixrt/settings/kv.py) */

#include "simd.h"

#if VL == 16
#define GT 4 /* query rows per register tile: 4 x 4 score accumulators, or 4 x DT output ones */
#elif VL == 8
#define GT 2 /* 16 registers: 2 x 4 score accumulators, or 2 x DT output ones, plus the operands */
#else
#define GT 4
#endif

/* ---- the kernel, written once over the vector layer -------------------------------------- */
#define TB 16 /* tokens per block: their rows stay in L1 while every tile of the task reads them */
#define DT 4  /* head_dim vectors per output tile */

ALWAYS_INLINE vf load_kind(const void *pool, int64_t offset, const int kind) {
    return kind == KIND_BF16 ? v_load_bf16((const uint16_t *)pool + offset) : v_load((const float *)pool + offset);
}

/* offs[i] = where token t0 + i's row (KV head 0) starts in the pool, for i < TB; tokens past the
 * last real one (n) repeat it, so a block is always TB rows of real, finite values. */
static inline void block_offsets(const int64_t *pages, int page_size, int64_t t0, int n, int KVH, int D, int64_t *offs) {
    const int64_t row = (int64_t)KVH * D;
    int64_t page = t0 / page_size, in_page = t0 % page_size; /* one division per block, not per token */
    int64_t at = (pages[page] * page_size + in_page) * row;
    for (int i = 0; i < TB; i++) {
        offs[i] = at;
        if (i + 1 >= n) continue; /* past the last real token: repeat it */
        if (++in_page == page_size) {
            in_page = 0;
            at = pages[++page] * page_size * row;
        } else {
            at += row;
        }
    }
}

/* Asks for a block's rows of KV heads [h0, h0 + NH) ahead of use (the pages are scattered, so the
 * hardware prefetcher loses the stream at every page boundary), into L2 (prefetcht1), not L1: a
 * block's worth of L1 requests at once stalls the loads of the block being read. Measured on an
 * AVX-512 EPYC, decodes at batch 64 over 530 tokens from DRAM: 1.5-2.2x faster than prefetcht0
 * over four shapes and both vector widths, prefill chunks 1.0-1.1x. */
static inline void prefetch_block(const void *pool, int halves, const int64_t *offs, int h0, int NH, int D) {
    const char *p = (const char *)pool; /* halves: half-bytes per element (int4: 1) */
    const int64_t bytes = (int64_t)NH * D * halves / 2;
    for (int i = 0; i < TB; i++) {
        const char *row = p + (offs[i] + (int64_t)h0 * D) * halves / 2;
        for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(row + b, 0, 2);
    }
}

/* s[r * stride + i] = scale * q_r . k_i for gn query rows (q, D apart) and the four K rows at offs. */
ALWAYS_INLINE void qk_tile(const float *q, const void *k_pool, const int kind, const int64_t *offs, int D, const int gn,
                           float scale, float *s, int64_t stride) {
    vf acc[GT][4];
    for (int r = 0; r < gn; r++)
        for (int i = 0; i < 4; i++) acc[r][i] = v_zero();
    for (int d = 0; d < D; d += VL) {
        vf k0 = load_kind(k_pool, offs[0] + d, kind), k1 = load_kind(k_pool, offs[1] + d, kind);
        vf k2 = load_kind(k_pool, offs[2] + d, kind), k3 = load_kind(k_pool, offs[3] + d, kind);
        for (int r = 0; r < gn; r++) {
            vf x = v_load(q + r * D + d);
            acc[r][0] = v_fma(x, k0, acc[r][0]);
            acc[r][1] = v_fma(x, k1, acc[r][1]);
            acc[r][2] = v_fma(x, k2, acc[r][2]);
            acc[r][3] = v_fma(x, k3, acc[r][3]);
        }
    }
    for (int r = 0; r < gn; r++) {
        float dots[4];
        v_hsum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3], dots);
        for (int i = 0; i < 4; i++) s[r * stride + i] = dots[i] * scale;
    }
}

/* o_r[d0 .. d0 + dn * VL) += sum over the block's TB tokens of w[r * stride + i] * v_i, for gn rows. */
ALWAYS_INLINE void pv_tile(const float *w, int64_t stride, const void *v_pool, const int kind, const int64_t *offs, int d0,
                           float *o, int D, const int gn, const int dn) {
    vf acc[GT][DT];
    for (int r = 0; r < gn; r++)
        for (int j = 0; j < dn; j++) acc[r][j] = v_load(o + r * D + d0 + j * VL);
    for (int i = 0; i < TB; i++) {
        vf v[DT];
        for (int j = 0; j < dn; j++) v[j] = load_kind(v_pool, offs[i] + d0 + j * VL, kind);
        for (int r = 0; r < gn; r++) {
            vf wr = v_set1(w[r * stride + i]);
            for (int j = 0; j < dn; j++) acc[r][j] = v_fma(wr, v[j], acc[r][j]);
        }
    }
    for (int r = 0; r < gn; r++)
        for (int j = 0; j < dn; j++) v_store(o + r * D + d0 + j * VL, acc[r][j]);
}

/* The tiles above for a runtime row count (and vector count), each case compiled with its constants. */
ALWAYS_INLINE void qk_rows(const float *q, const void *k_pool, const int kind, const int64_t *offs, int D, int gn,
                           float scale, float *s, int64_t stride) {
    switch (gn) {
#if GT >= 4
    case 4: qk_tile(q, k_pool, kind, offs, D, 4, scale, s, stride); break;
    case 3: qk_tile(q, k_pool, kind, offs, D, 3, scale, s, stride); break;
#endif
    case 2: qk_tile(q, k_pool, kind, offs, D, 2, scale, s, stride); break;
    default: qk_tile(q, k_pool, kind, offs, D, 1, scale, s, stride); break;
    }
}

/* A PV tile function for gn rows over the widest of 4, 2 or 1 vectors of head_dim left (dn): its
 * arguments, then gn and that count. */
#define PV_CASES(TILE, gn, ...)                                                                               \
    if (dn >= 4) TILE(__VA_ARGS__, gn, 4);                                                                     \
    else if (dn >= 2) TILE(__VA_ARGS__, gn, 2);                                                                \
    else TILE(__VA_ARGS__, gn, 1);

/* Returns how many vectors of head_dim it covered from d0 (4, 2 or 1). */
ALWAYS_INLINE int pv_rows(const float *w, int64_t stride, const void *v_pool, const int kind, const int64_t *offs, int d0,
                          float *o, int D, int gn) {
    const int dn = (D - d0) / VL;
    switch (gn) {
#if GT >= 4
    case 4: PV_CASES(pv_tile, 4, w, stride, v_pool, kind, offs, d0, o, D) break;
    case 3: PV_CASES(pv_tile, 3, w, stride, v_pool, kind, offs, d0, o, D) break;
#endif
    case 2: PV_CASES(pv_tile, 2, w, stride, v_pool, kind, offs, d0, o, D) break;
    default: PV_CASES(pv_tile, 1, w, stride, v_pool, kind, offs, d0, o, D) break;
    }
    return dn >= 4 ? 4 : dn >= 2 ? 2 : 1;
}

/* ---- many query rows over one block: scores as a small GEMM -------------------------------------
 * Where a task has many query rows per KV head (a prefill chunk's positions times the GQA group,
 * or a cascade's members), each block's K is widened and transposed once, kt [D][TB], and a tile
 * of RT query rows computes all TB scores with one broadcast per row and element: no horizontal
 * sums, the K rows read once per block instead of once per row tile. The block's V is widened
 * once likewise, vb [TB][D], for the output tiles. */
#define NV (TB / VL) /* vectors per row of TB scores */
#if VL == 16
#define RT 12 /* rows per score tile: RT x NV accumulators, NV K vectors, one broadcast */
#elif VL == 8
#define RT 6
#else
#define RT 4
#endif
#define GEMM_MIN_ROWS 8 /* query rows per KV head from which a task goes through the GEMM tiles */

#define MAX_GEMM_D 256 /* head_dim up to which the GEMM tiles serve (their block buffers are on the stack) */

#include "quant_rows.h"

/* kt[d * TB + i] = K row i's element d (the rows at offs), in float32: the block transposed. */
static inline void widen_transposed(const void *k_pool, const int kind, const int64_t *offs, int D, float *kt,
                                    const void *scales) {
    if (QUANTIZED(kind)) { /* the block's rows dequantized into L1, then transposed */
        float rows[TB * MAX_GEMM_D];
        for (int i = 0; i < TB; i++) quant_row(kind, k_pool, scales, offs[i], D, rows + i * D);
#if defined(RADIXRT_AVX512_FAMILY) && TB == 16
        for (int d = 0; d < D; d += 16) {
            __m512i r[16];
            for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512((const void *)(rows + i * D + d));
            v_transpose16(r);
            for (int j = 0; j < 16; j++) _mm512_storeu_si512((void *)(kt + (d + j) * TB), r[j]);
        }
#else
        for (int i = 0; i < TB; i++)
            for (int d = 0; d < D; d++) kt[d * TB + i] = rows[i * D + d];
#endif
        return;
    }
#if defined(RADIXRT_AVX512_FAMILY) && TB == 16
    for (int d = 0; d < D; d += 16) { /* 16 tokens x 16 elements at a time, transposed in registers */
        __m512i r[16];
        for (int i = 0; i < 16; i++) r[i] = _mm512_castps_si512(load_kind(k_pool, offs[i] + d, kind));
        v_transpose16(r);
        for (int j = 0; j < 16; j++) _mm512_storeu_si512((void *)(kt + (d + j) * TB), r[j]);
    }
#else
    for (int i = 0; i < TB; i++)
        for (int d = 0; d < D; d += VL) {
            float lanes[VL];
            v_store(lanes, load_kind(k_pool, offs[i] + d, kind));
            for (int l = 0; l < VL; l++) kt[(d + l) * TB + i] = lanes[l];
        }
#endif
}

/* vb[i * D + d] = V row i's element d (the rows at offs), in float32. */
static inline void widen_rows(const void *v_pool, const int kind, const int64_t *offs, int D, float *vb,
                              const void *scales) {
    if (QUANTIZED(kind)) {
        for (int i = 0; i < TB; i++) quant_row(kind, v_pool, scales, offs[i], D, vb + i * D);
        return;
    }
    for (int i = 0; i < TB; i++)
        for (int d = 0; d < D; d += VL) v_store(vb + i * D + d, load_kind(v_pool, offs[i] + d, kind));
}

/* s_r[0 .. TB) = scale * q_r . k_i for rn rows: q rows at qp[r], score rows at sp[r]. */
ALWAYS_INLINE void qk_gemm_tile(const float *const *qp, const float *kt, int D, const int rn, float scale, float *const *sp) {
    vf acc[RT][NV];
    for (int r = 0; r < rn; r++)
        for (int j = 0; j < NV; j++) acc[r][j] = v_zero();
    for (int d = 0; d < D; d++) {
        vf k[NV];
        for (int j = 0; j < NV; j++) k[j] = v_load(kt + d * TB + j * VL);
        for (int r = 0; r < rn; r++) {
            const vf x = v_set1(qp[r][d]);
            for (int j = 0; j < NV; j++) acc[r][j] = v_fma(x, k[j], acc[r][j]);
        }
    }
    const vf sc = v_set1(scale);
    for (int r = 0; r < rn; r++)
        for (int j = 0; j < NV; j++) v_store(sp[r] + j * VL, v_mul(acc[r][j], sc));
}

/* qk_gemm_tile over n rows, in tiles of RT, then of 4, 2 and 1 (each compiled with its constant). */
static void qk_gemm_rows(const float *const *qp, const float *kt, int D, int n, float scale, float *const *sp) {
    int r = 0;
    for (; r + RT <= n; r += RT) qk_gemm_tile(qp + r, kt, D, RT, scale, sp + r);
#if RT > 4
    for (; r + 4 <= n; r += 4) qk_gemm_tile(qp + r, kt, D, 4, scale, sp + r);
#endif
    for (; r + 2 <= n; r += 2) qk_gemm_tile(qp + r, kt, D, 2, scale, sp + r);
    for (; r < n; r++) qk_gemm_tile(qp + r, kt, D, 1, scale, sp + r);
}

#ifdef HAVE_DOT_BF16
/* kp[j * TB + i] = K row i's elements 2j and 2j + 1 (the rows at offs, bf16), one 32-bit pair: the
 * block transposed by pairs, as the bf16 dot product takes it. */
static inline void pair_transposed(const uint16_t *k_pool, const int64_t *offs, int D, uint32_t *kp) {
    for (int c = 0; c < D / 2; c += 16) { /* 16 tokens x 16 pairs at a time, transposed in registers */
        __m512i r[16];
        for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512((const void *)(k_pool + offs[i] + 2 * c));
        v_transpose16(r);
        for (int j = 0; j < 16; j++) _mm512_storeu_si512((void *)(kp + (c + j) * TB), r[j]);
    }
}

/* qk_gemm_tile by the bf16 dot product: query rows in bf16 (q16 rows at qp[r]), a pair of head_dim
 * elements per instruction and lane, the TB scores of a row in one vector (TB == VL). */
ALWAYS_INLINE void qk_dot_tile(const uint16_t *const *qp, const uint32_t *kp, int D, const int rn, float scale,
                               float *const *sp) {
    vf acc[RT];
    for (int r = 0; r < rn; r++) acc[r] = v_zero();
    for (int j = 0; j < D / 2; j++) {
        const vbf k = (vbf)_mm512_loadu_si512((const void *)(kp + j * TB));
        for (int r = 0; r < rn; r++) {
            uint32_t pair;
            memcpy(&pair, qp[r] + 2 * j, sizeof pair);
            acc[r] = v_dot_bf16(acc[r], (vbf)_mm512_set1_epi32((int)pair), k);
        }
    }
    const vf sc = v_set1(scale);
    for (int r = 0; r < rn; r++) v_store(sp[r], v_mul(acc[r], sc));
}

/* vp[j * D + d] = V rows 2j and 2j + 1's element d (the rows at offs, bf16), one 32-bit pair: the
 * block's tokens paired, as the bf16 dot product takes them. */
static inline void pair_rows(const uint16_t *v_pool, const int64_t *offs, int D, uint32_t *vp) {
    for (int j = 0; j < TB / 2; j++)
        for (int d = 0; d < D; d += VL) {
            const __m512i a = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(v_pool + offs[2 * j] + d)));
            const __m512i b = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(v_pool + offs[2 * j + 1] + d)));
            _mm512_storeu_si512((void *)(vp + j * D + d), _mm512_or_si512(a, _mm512_slli_epi32(b, 16)));
        }
}

/* pv_tile by the bf16 dot product over paired V (vp): the weights rounded to bf16, as a bf16 model's
 * attention rounds them before its product with V; two tokens per instruction and lane. */
ALWAYS_INLINE void pv_dot_tile(const float *w, int64_t stride, const uint32_t *vp, int d0, float *o, int D, const int gn,
                               const int dn) {
    uint32_t wp[GT][TB / 2];
    for (int r = 0; r < gn; r++) _mm256_storeu_si256((__m256i *)wp[r], (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(w + r * stride)));
    vf acc[GT][DT];
    for (int r = 0; r < gn; r++)
        for (int j = 0; j < dn; j++) acc[r][j] = v_load(o + r * D + d0 + j * VL);
    for (int i = 0; i < TB / 2; i++) {
        vbf v[DT];
        for (int j = 0; j < dn; j++) v[j] = (vbf)_mm512_loadu_si512((const void *)(vp + i * D + d0 + j * VL));
        for (int r = 0; r < gn; r++) {
            const vbf wr = (vbf)_mm512_set1_epi32((int)wp[r][i]);
            for (int j = 0; j < dn; j++) acc[r][j] = v_dot_bf16(acc[r][j], wr, v[j]);
        }
    }
    for (int r = 0; r < gn; r++)
        for (int j = 0; j < dn; j++) v_store(o + r * D + d0 + j * VL, acc[r][j]);
}

/* pv_rows over paired V; returns how many vectors of head_dim it covered from d0. */
static int pv_dot_rows(const float *w, int64_t stride, const uint32_t *vp, int d0, float *o, int D, int gn) {
    const int dn = (D - d0) / VL;
    switch (gn) {
    case 4: PV_CASES(pv_dot_tile, 4, w, stride, vp, d0, o, D) break;
    case 3: PV_CASES(pv_dot_tile, 3, w, stride, vp, d0, o, D) break;
    case 2: PV_CASES(pv_dot_tile, 2, w, stride, vp, d0, o, D) break;
    default: PV_CASES(pv_dot_tile, 1, w, stride, vp, d0, o, D) break;
    }
    return dn >= 4 ? 4 : dn >= 2 ? 2 : 1;
}

/* qk_dot_tile for rn <= FEW_ROWS rows straight from the pool: each 16 pairs of head_dim of the block's
 * K transposed in registers and taken at once by every row, with no pass through a scratch copy (a decode's
 * few rows would read that copy back once per tile of rows). */
#define FEW_ROWS 4
ALWAYS_INLINE void qk_dot_few_tile(const uint16_t *k_pool, const int64_t *offs, const uint16_t *const *qp, int D,
                                   const int rn, float scale, float *const *sp) {
    vf acc[FEW_ROWS];
    for (int r = 0; r < rn; r++) acc[r] = v_zero();
    for (int c = 0; c < D / 2; c += 16) {
        __m512i k[16];
        for (int i = 0; i < 16; i++) k[i] = _mm512_loadu_si512((const void *)(k_pool + offs[i] + 2 * c));
        v_transpose16(k); /* k[j]: pair c + j of the 16 tokens */
        for (int j = 0; j < 16; j++)
            for (int r = 0; r < rn; r++) {
                uint32_t pair;
                memcpy(&pair, qp[r] + 2 * (c + j), sizeof pair);
                acc[r] = v_dot_bf16(acc[r], (vbf)_mm512_set1_epi32((int)pair), (vbf)k[j]);
            }
    }
    const vf sc = v_set1(scale);
    for (int r = 0; r < rn; r++) v_store(sp[r], v_mul(acc[r], sc));
}

static void qk_dot_few(const uint16_t *k_pool, const int64_t *offs, const uint16_t *const *qp, int D, int n, float scale,
                       float *const *sp) {
    switch (n) {
    case 4: qk_dot_few_tile(k_pool, offs, qp, D, 4, scale, sp); break;
    case 3: qk_dot_few_tile(k_pool, offs, qp, D, 3, scale, sp); break;
    case 2: qk_dot_few_tile(k_pool, offs, qp, D, 2, scale, sp); break;
    default: qk_dot_few_tile(k_pool, offs, qp, D, 1, scale, sp); break;
    }
}

static void qk_dot_rows(const uint16_t *const *qp, const uint32_t *kp, int D, int n, float scale, float *const *sp) {
    int r = 0;
    for (; r + RT <= n; r += RT) qk_dot_tile(qp + r, kp, D, RT, scale, sp + r);
    for (; r + 4 <= n; r += 4) qk_dot_tile(qp + r, kp, D, 4, scale, sp + r);
    for (; r + 2 <= n; r += 2) qk_dot_tile(qp + r, kp, D, 2, scale, sp + r);
    for (; r < n; r++) qk_dot_tile(qp + r, kp, D, 1, scale, sp + r);
}
#endif

/* Row s[0 .. Np) -> the softmax of s[lo .. hi) in place (after the soft cap, if any), 0 elsewhere;
 * returns its log-sum-exp. Np is a multiple of the vector lanes; outside [lo, hi) the row is
 * scratch, so the vector loops run over all of it and it is overwritten before it counts. */
static float softmax_row(float *s, int64_t lo, int64_t hi, int64_t Np, float softcap) {
    if (softcap > 0.0f) { /* cap * tanh(x / cap); tanh(x) = sign(x) (1 - e) / (1 + e), e = exp(-2|x|) */
        const vf one = v_set1(1.0f), cap = v_set1(softcap), k = v_set1(-2.0f / softcap);
        for (int64_t t = 0; t < Np; t += VL) {
            vf x = v_load(s + t), e = v_exp_nonpositive(v_mul(v_abs(x), k));
            v_store(s + t, v_mul(v_copysign(v_div(v_sub(one, e), v_add(one, e)), x), cap));
        }
    }
    for (int64_t t = 0; t < lo; t++) s[t] = -INFINITY; /* e^(-inf - m) clamps to e^-87: ~1e-38 of the sum */
    for (int64_t t = hi; t < Np; t++) s[t] = -INFINITY;
    vf mv = v_set1(-INFINITY);
    for (int64_t t = 0; t < Np; t += VL) mv = v_max(mv, v_load(s + t));
    float lanes[VL], m = -INFINITY;
    v_store(lanes, mv);
    for (int i = 0; i < VL; i++) m = lanes[i] > m ? lanes[i] : m;
    vf acc = v_zero();
    mv = v_set1(m);
    for (int64_t t = 0; t < Np; t += VL) {
        vf e = v_exp_nonpositive(v_sub(v_load(s + t), mv));
        v_store(s + t, e);
        acc = v_add(acc, e);
    }
    float sum = 0.0f;
    v_store(lanes, acc);
    for (int i = 0; i < VL; i++) sum += lanes[i];
    const vf inv = v_set1(1.0f / sum);
    for (int64_t t = 0; t < Np; t += VL) v_store(s + t, v_mul(v_load(s + t), inv));
    memset(s, 0, sizeof(float) * (size_t)lo); /* outside the row's range the weights are exactly 0 */
    memset(s + hi, 0, sizeof(float) * (size_t)(Np - hi));
    return m + logf(sum);
}

/* A block's rows of one KV head (at `head` elements into each token's row): offs[i] = where row i starts
 * in the pool; returns the pool, or for a quantized one `scratch`, which then holds the rows dequantized, D apart. */
static inline const void *head_block(const int kind, const void *pool, const void *scales, const int64_t *base,
                                     int64_t head, int D, int64_t *offs, float *scratch) {
    for (int i = 0; i < TB; i++) offs[i] = base[i] + head;
    if (!QUANTIZED(kind)) return pool;
    for (int i = 0; i < TB; i++) quant_row(kind, pool, scales, offs[i], D, scratch + i * D);
    return scratch;
}

/* One task: query positions [p0, p1) of a request (P = p1 - p0 of them, its queries' rows in q and
 * out `q_stride` floats apart), the G rows of each of KV heads [h0, h0 + NH). Position p reads
 * tokens [lo[p - p0], hi[p - p0]) of the request, all within [t0, t0 + N). q, out point at
 * position p0's row of KV head h0; lse likewise (`lse_stride` floats between positions) or NULL.
 * Scratch: scores [P * NH * G, Np], Np >= N a multiple of TB; score row ((p - p0) * NH + h) * G + g,
 * column t - t0. */
typedef struct {
    const void *k_pool, *v_pool;
    const void *k_scales, *v_scales; /* int4: a float16 scale per INT4_GROUP elements; int8: a float32 per row; else NULL */
    const int64_t *pages;
    int KVH, D, page_size;
    float scale, softcap;
} Pool;

ALWAYS_INLINE void attend_task(const int kind, const Pool *pool, const float *q, int64_t q_stride, int P,
                               const int64_t *lo, const int64_t *hi, int64_t t0, int64_t N, int h0, int NH, int G,
                               float *scores, int64_t Np, uint16_t *q16, float *out, float *lse, int64_t lse_stride) {
    const int D = pool->D, KVH = pool->KVH;
    const int halves = kind == KIND_INT4 ? 1 : kind == KIND_INT8 ? 2 : kind == KIND_BF16 ? 4 : 8; /* half-bytes per element */
    /* many query rows per KV head: scores in GEMM tiles. Where the bf16 dot product serves (q16), every
     * task goes by them, decodes too: a block's K transposed by pairs in registers, 16 scores of a row per
     * instruction with no horizontal sums, two elements per lane (the widening path's 4-token tiles end
     * in a horizontal sum per row and 4 tokens, which costs more than the transpose at any row count). */
    const int gemm = (P * G >= GEMM_MIN_ROWS || q16 != NULL) && D <= MAX_GEMM_D;
    if (!gemm) q16 = NULL;
#ifdef HAVE_VNNI
    if (q16 && kind == KIND_INT4) /* the task's query rows quantized for the integer tiles, in score-row order */
        for (int p = 0; p < P; p++)
            for (int r = 0; r < NH * G; r++)
                quantize_query(q + p * q_stride + (int64_t)r * D, D, (uint8_t *)(q16 + ((int64_t)p * NH * G + r) * D));
#endif
#ifdef HAVE_DOT_BF16
    if (q16 && kind == KIND_BF16) /* the task's query rows in bf16, in score-row order */
        for (int p = 0; p < P; p++)
            for (int r = 0; r < NH * G; r++)
                for (int d = 0; d < D; d += 32)
                    _mm512_storeu_si512((void *)(q16 + ((int64_t)p * NH * G + r) * D + d),
                                        (__m512i)vbf_from_f32(q + p * q_stride + (int64_t)r * D + d));
#endif
    int64_t base[TB], ahead[TB], offs[TB]; /* rows of the block being read, and of the one to read next */
    /* gemm: the block's K transposed (in float32, or by pairs for the dot product), and its V, in float32 */
    float kt[MAX_GEMM_D * TB] __attribute__((aligned(64))), vb[TB * MAX_GEMM_D] __attribute__((aligned(64)));
    int64_t rows_of_vb[TB];
    for (int i = 0; i < TB; i++) rows_of_vb[i] = (int64_t)i * D;
    const float *qp[gemm ? P * G : 1];
    const uint16_t *qp16[gemm ? P * G : 1];
    float *sp[gemm ? P * G : 1];
#define BLOCK_AT(b0, dst) block_offsets(pool->pages, pool->page_size, t0 + (b0), N - (b0) < TB ? (int)(N - (b0)) : TB, KVH, D, dst)
    BLOCK_AT(0, ahead);
    for (int64_t b0 = 0; b0 < N; b0 += TB) { /* 1. scores, a block of tokens at a time */
        memcpy(base, ahead, sizeof base);
        if (b0 + TB < N) { /* the next block's K rows; after the last, the first block's V rows (step 3) */
            BLOCK_AT(b0 + TB, ahead);
            prefetch_block(pool->k_pool, halves, ahead, h0, NH, D);
        } else {
            BLOCK_AT(0, ahead);
            prefetch_block(pool->v_pool, halves, ahead, h0, NH, D);
        }
        if (gemm) {
            for (int h = 0; h < NH; h++) {
                for (int i = 0; i < TB; i++) offs[i] = base[i] + (int64_t)(h0 + h) * D;
                int n = 0; /* the rows that read any of this block */
                for (int p = 0; p < P; p++) {
                    if (lo[p] - t0 >= b0 + TB || hi[p] - t0 <= b0) continue;
                    for (int g = 0; g < G; g++) {
                        const int64_t row = ((int64_t)p * NH + h) * G + g;
                        qp[n] = q + p * q_stride + ((int64_t)h * G + g) * D;
                        qp16[n] = q16 ? q16 + row * D : NULL;
                        sp[n++] = scores + row * Np + b0;
                    }
                }
#ifdef HAVE_VNNI
                if (q16 && kind == KIND_INT4) {
                    int4_block(pool->k_pool, pool->k_scales, offs, D, (__m512i *)kt, vb);
                    qk_int4_rows((const uint8_t *const *)qp16, (const __m512i *)kt, vb, D, n, pool->scale, sp);
                    continue;
                }
#endif
#ifdef HAVE_DOT_BF16
                if (q16 && n <= FEW_ROWS) {
                    qk_dot_few(pool->k_pool, offs, qp16, D, n, pool->scale, sp);
                    continue;
                }
                if (q16) {
                    pair_transposed(pool->k_pool, offs, D, (uint32_t *)kt);
                    qk_dot_rows(qp16, (const uint32_t *)kt, D, n, pool->scale, sp);
                    continue;
                }
#endif
                widen_transposed(pool->k_pool, kind, offs, D, kt, pool->k_scales);
                qk_gemm_rows(qp, kt, D, n, pool->scale, sp);
            }
            continue;
        }
        for (int h = 0; h < NH; h++) {
            const void *k_rows = head_block(kind, pool->k_pool, pool->k_scales, base, (int64_t)(h0 + h) * D, D, offs, kt);
            const int64_t *rows = QUANTIZED(kind) ? rows_of_vb : offs; /* where k_rows holds the block's rows */
            for (int p = 0; p < P; p++) {
                const int64_t from = lo[p] - t0 > b0 ? (lo[p] - t0 - b0) & ~(int64_t)3 : 0; /* first group of 4 it reads */
                const int64_t to = hi[p] - t0 - b0 < TB ? hi[p] - t0 - b0 : TB;
                for (int g0 = 0; g0 < G; g0 += GT) {
                    const int gn = G - g0 < GT ? G - g0 : GT;
                    const int64_t row = ((int64_t)p * NH + h) * G + g0;
                    const float *qr = q + p * q_stride + ((int64_t)h * G + g0) * D;
                    for (int64_t i = from; i < to; i += 4)
                        qk_rows(qr, k_rows, QUANTIZED(kind) ? KIND_F32 : kind, rows + i, D, gn, pool->scale,
                                scores + row * Np + b0 + i, Np);
                }
            }
        }
    }
    for (int p = 0; p < P; p++) /* 2. softmax */
        for (int r = 0; r < NH * G; r++) {
            float l = softmax_row(scores + ((int64_t)p * NH * G + r) * Np, lo[p] - t0, hi[p] - t0, Np, pool->softcap);
            if (lse) lse[p * lse_stride + r] = l;
        }
    for (int p = 0; p < P; p++) memset(out + p * q_stride, 0, (size_t)NH * G * D * sizeof(float));
    for (int64_t b0 = 0; b0 < N; b0 += TB) { /* 3. the weighted V rows */
        memcpy(base, ahead, sizeof base);
        if (b0 + TB < N) {
            BLOCK_AT(b0 + TB, ahead);
            prefetch_block(pool->v_pool, halves, ahead, h0, NH, D);
        }
        if (gemm) { /* the block's V widened once per KV head, for every row tile */
            for (int h = 0; h < NH; h++) {
                for (int i = 0; i < TB; i++) offs[i] = base[i] + (int64_t)(h0 + h) * D;
#ifdef HAVE_DOT_BF16
                if (q16 && kind == KIND_BF16) pair_rows(pool->v_pool, offs, D, (uint32_t *)vb);
                else
#endif
                    widen_rows(pool->v_pool, kind, offs, D, vb, pool->v_scales);
                for (int p = 0; p < P; p++) {
                    if (lo[p] - t0 >= b0 + TB || hi[p] - t0 <= b0) continue;
                    for (int g0 = 0; g0 < G; g0 += GT) {
                        const int gn = G - g0 < GT ? G - g0 : GT;
                        const int64_t row = ((int64_t)p * NH + h) * G + g0;
                        float *o = out + p * q_stride + ((int64_t)h * G + g0) * D;
                        for (int d0 = 0; d0 < D;) {
#ifdef HAVE_DOT_BF16
                            if (q16 && kind == KIND_BF16) {
                                d0 += VL * pv_dot_rows(scores + row * Np + b0, Np, (const uint32_t *)vb, d0, o, D, gn);
                                continue;
                            }
#endif
                            d0 += VL * pv_rows(scores + row * Np + b0, Np, vb, KIND_F32, rows_of_vb, d0, o, D, gn);
                        }
                    }
                }
            }
            continue;
        }
        for (int h = 0; h < NH; h++) {
            const void *v_rows = head_block(kind, pool->v_pool, pool->v_scales, base, (int64_t)(h0 + h) * D, D, offs, vb);
            const int64_t *rows = QUANTIZED(kind) ? rows_of_vb : offs;
            for (int p = 0; p < P; p++) {
                if (lo[p] - t0 >= b0 + TB || hi[p] - t0 <= b0) continue; /* the block is outside what it reads */
                for (int g0 = 0; g0 < G; g0 += GT) {
                    const int gn = G - g0 < GT ? G - g0 : GT;
                    const int64_t row = ((int64_t)p * NH + h) * G + g0;
                    float *o = out + p * q_stride + ((int64_t)h * G + g0) * D;
                    for (int d0 = 0; d0 < D;)
                        d0 += VL * pv_rows(scores + row * Np + b0, Np, v_rows, QUANTIZED(kind) ? KIND_F32 : kind, rows,
                                           d0, o, D, gn);
                }
            }
        }
    }
#undef BLOCK_AT
}

static void attend_task_f32(const Pool *pool, const float *q, int64_t q_stride, int P, const int64_t *lo, const int64_t *hi,
                            int64_t t0, int64_t N, int h0, int NH, int G, float *scores, int64_t Np, uint16_t *q16,
                            float *out, float *lse, int64_t lse_stride) {
    attend_task(KIND_F32, pool, q, q_stride, P, lo, hi, t0, N, h0, NH, G, scores, Np, q16, out, lse, lse_stride);
}

static void attend_task_bf16(const Pool *pool, const float *q, int64_t q_stride, int P, const int64_t *lo, const int64_t *hi,
                             int64_t t0, int64_t N, int h0, int NH, int G, float *scores, int64_t Np, uint16_t *q16,
                             float *out, float *lse, int64_t lse_stride) {
    attend_task(KIND_BF16, pool, q, q_stride, P, lo, hi, t0, N, h0, NH, G, scores, Np, q16, out, lse, lse_stride);
}

#ifdef HAVE_BRGEMM
#include "brgemm_tiles.h"
#endif

static void attend_task_int4(const Pool *pool, const float *q, int64_t q_stride, int P, const int64_t *lo, const int64_t *hi,
                             int64_t t0, int64_t N, int h0, int NH, int G, float *scores, int64_t Np, uint16_t *q16,
                             float *out, float *lse, int64_t lse_stride) {
    attend_task(KIND_INT4, pool, q, q_stride, P, lo, hi, t0, N, h0, NH, G, scores, Np, q16, out, lse, lse_stride);
}

static void attend_task_int8(const Pool *pool, const float *q, int64_t q_stride, int P, const int64_t *lo, const int64_t *hi,
                             int64_t t0, int64_t N, int h0, int NH, int G, float *scores, int64_t Np, uint16_t *q16,
                             float *out, float *lse, int64_t lse_stride) {
    attend_task(KIND_INT8, pool, q, q_stride, P, lo, hi, t0, N, h0, NH, G, scores, Np, NULL, out, lse, lse_stride);
}

#define PC 16 /* query positions per task: a request's K/V is read once per chunk of this many */
#define SPLIT_MIN_TOKENS 128 /* a decode's tokens per part, at least, where its tokens are split between threads */

/* `parts` partial attentions of the same rows over disjoint token ranges (outs [parts][rows][D], each
 * normalized over its range, and their log-sum-exps [parts][rows]) -> the attention over all of them. */
static void merge_parts(const float *outs, const float *lses, int parts, int64_t rows, int D, float *out, float *lse) {
    for (int64_t r = 0; r < rows; r++) {
        float m = -INFINITY, w[parts], sum = 0.0f;
        for (int p = 0; p < parts; p++) m = lses[p * rows + r] > m ? lses[p * rows + r] : m;
        for (int p = 0; p < parts; p++) sum += w[p] = expf(lses[p * rows + r] - m);
        for (int d = 0; d < D; d++) {
            float v = 0.0f;
            for (int p = 0; p < parts; p++) v += w[p] * outs[(p * rows + r) * D + d];
            out[r * D + d] = v / sum;
        }
        if (lse) lse[r] = m + logf(sum);
    }
}

/* The token range [lo, hi) of each query position of request b: its n queries are the last n of its
 * kv_len tokens, each reading up to itself, the last `window` tokens of that when window > 0. */
static inline void position_range(int64_t kv_len, int64_t n, int64_t i, int64_t window, int64_t *lo, int64_t *hi) {
    *hi = kv_len - n + i + 1;
    *lo = window > 0 && *hi > window ? *hi - window : 0;
}

int CAT(radixrt_paged_attention, ISA_NAME)(const float *q, const void *k_pool, const void *v_pool, int kind,
                                           const void *k_scales, const void *v_scales, const int64_t *pages, int64_t pages_stride, const int64_t *kv_lens,
                                           const int64_t *q_starts, int B, int H, int KVH, int D, int page_size,
                                           float scale, int64_t window, float softcap, float *out, float *lse) {
    if (kind < KIND_F32 || kind > KIND_INT8) return 1;
    if (QUANTIZED(kind) && ((kind == KIND_INT4 && D % INT4_GROUP) || D > MAX_GEMM_D || !k_scales || !v_scales)) return 8;
    if (H % KVH) return 2;
    if (window < 0 || softcap < 0.0f) return 4;
    if (D % VL) return 5;
    const int G = H / KVH;
#ifdef HAVE_BRGEMM
    if (!tile_gemm) return 7;
    const int tiles = kind == KIND_BF16 && D % 32 == 0; /* a bf16 pool's many-row tasks go through the tiles */
#endif
    /* Tasks: (request, chunk of PC query positions), then split by KV head unless there are enough of
     * them to keep every thread busy and a token's rows of all KV heads (one contiguous run) are
     * small: a block of wide rows would crowd L1 (measured: 8 KV heads of 128 bf16 read 1.2x faster split). */
    int64_t chunks = 0, widest = 0; /* widest: the most tokens one chunk reads (its scores' scratch) */
    for (int b = 0; b < B; b++) {
        const int64_t n = q_starts[b + 1] - q_starts[b];
        if (n < 1 || n > kv_lens[b]) return 6;
        for (int64_t c = 0; c < n; c += PC) {
            int64_t lo0, hi0, lo1, hi1;
            position_range(kv_lens[b], n, c, window, &lo0, &hi0);
            position_range(kv_lens[b], n, (c + PC < n ? c + PC : n) - 1, window, &lo1, &hi1);
            widest = hi1 - lo0 > widest ? hi1 - lo0 : widest;
            chunks++;
        }
    }
    int64_t *chunk_req = malloc(sizeof(int64_t) * 2 * (size_t)(chunks ? chunks : 1));
    if (!chunk_req) return 3;
    int64_t *chunk_pos = chunk_req + chunks, at = 0;
    for (int b = 0; b < B; b++)
        for (int64_t c = 0; c < q_starts[b + 1] - q_starts[b]; c += PC) chunk_req[at] = b, chunk_pos[at++] = c;
    const int64_t row_bytes = (int64_t)KVH * D * (kind == KIND_INT4 ? 1 : kind == KIND_INT8 ? 2 : kind == KIND_BF16 ? 4 : 8) / 2;
    const int splits = chunks >= 2 * omp_get_max_threads() && row_bytes <= 512 ? 1 : KVH;
    const int per_task = KVH / splits;
    const int64_t Np = (widest + TB - 1) / TB * TB;
    const Pool pool = {k_pool, v_pool, k_scales, v_scales, NULL, KVH, D, page_size, scale, softcap};
    void (*task_fn)(const Pool *, const float *, int64_t, int, const int64_t *, const int64_t *, int64_t, int64_t, int,
                    int, int, float *, int64_t, uint16_t *, float *, float *, int64_t) =
        kind == KIND_INT8 ? attend_task_int8 : kind == KIND_INT4 ? attend_task_int4 : kind == KIND_BF16 ? attend_task_bf16 : attend_task_f32;
#ifdef HAVE_DOT_BF16
    /* The bf16 dot product computes the scores of a bf16 pool's GEMM-tiled tasks (many rows per KV head), the
     * int8 one an int4 pool's (quant_rows.h); both take the query rows converted into the scratch's second part. */
    const int dot = (kind == KIND_BF16 && D % 32 == 0) || kind == KIND_INT4;
#else
    const int dot = 0;
#endif
    const size_t rows = (size_t)PC * per_task * G;
    /* Decodes too few to give every thread as many tasks (one request of three KV heads on two threads) split
     * each task's tokens into `parts` ranges of SPLIT_MIN_TOKENS or more, each attended alone into its own out
     * and lse, then merged by their log-sum-exps. */
    int64_t shortest = INT64_MAX;
    for (int b = 0; b < B; b++) shortest = q_starts[b + 1] - q_starts[b] > 1 ? 0 : kv_lens[b] < shortest ? kv_lens[b] : shortest;
    if (window > 0 && window < shortest) shortest = window;
    const int64_t tasks = chunks * splits, threads = omp_get_max_threads();
    int64_t parts = 1, common = tasks, t = threads; /* the fewest parts that give every thread as many */
    while (t) {
        const int64_t r = common % t;
        common = t, t = r;
    }
    if (tasks < 2 * threads && tasks % threads) parts = threads / common;
    if (parts > shortest / SPLIT_MIN_TOKENS) parts = shortest / SPLIT_MIN_TOKENS > 1 ? shortest / SPLIT_MIN_TOKENS : 1;
    const int64_t part_rows = (int64_t)per_task * G; /* a part's out rows (D floats each) and lse */
    float *part_out = parts > 1 ? malloc(sizeof(float) * (size_t)(tasks * parts * part_rows * (D + 1))) : NULL;
    if (parts > 1 && !part_out) {
        free(chunk_req);
        return 3;
    }
    float *part_lse = part_out ? part_out + tasks * parts * part_rows * D : NULL;
    int failed = 0;
#pragma omp parallel
    {
        int tiled = 0; /* whether this thread ran tile products (and holds their hardware state) */
        float *scratch = malloc(sizeof(float) * rows * (size_t)Np + (dot ? sizeof(uint16_t) * rows * (size_t)D : 0));
        if (!scratch) {
#pragma omp atomic write
            failed = 3;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t job = 0; job < tasks * parts; job++) {
            if (!scratch) continue;
            const int64_t task = job / parts, part = job % parts;
            const int64_t b = chunk_req[task / splits], c = chunk_pos[task / splits];
            const int h0 = (int)(task % splits) * per_task;
            const int64_t n = q_starts[b + 1] - q_starts[b], P = n - c < PC ? n - c : PC;
            int64_t lo[PC], hi[PC];
            for (int64_t i = 0; i < P; i++) position_range(kv_lens[b], n, c + i, window, lo + i, hi + i);
            Pool mine = pool;
            mine.pages = pages + b * pages_stride;
            const int64_t row = (q_starts[b] + c) * H + (int64_t)h0 * G; /* position c's first row of KV head h0 */
            float *o = out + row * D, *l = lse ? lse + row : NULL;
            if (parts > 1) { /* a decode (P = 1): this part's share of its tokens */
                const int64_t from = lo[0], len = hi[0] - lo[0];
                lo[0] = from + len * part / parts, hi[0] = from + len * (part + 1) / parts;
                o = part_out + job * part_rows * D, l = part_lse + job * part_rows;
            }
            const int64_t N = hi[P - 1] - lo[0]; /* its scores' rows are this long, padded: not the widest task's */
#ifdef HAVE_BRGEMM
            if (tiles && P * G >= TILE_MIN_ROWS) {
                const int err = attend_task_tiles(&mine, q + row * D, (int64_t)H * D, (int)P, lo, hi, lo[0], N, h0, per_task, G,
                                                  o, l, H);
                tiled = 1;
                if (err) {
#pragma omp atomic write
                    failed = err;
                }
                continue;
            }
#endif
            task_fn(&mine, q + row * D, (int64_t)H * D, (int)P, lo, hi, lo[0], N, h0, per_task, G, scratch,
                    (N + TB - 1) / TB * TB, dot ? (uint16_t *)(scratch + rows * (size_t)Np) : NULL, o, l, H);
        }
        free(scratch);
#ifdef HAVE_BRGEMM
        if (tiled) tile_release(tile_vnni);
#else
        (void)tiled;
#endif
        if (parts > 1) {
#pragma omp for schedule(static)
            for (int64_t task = 0; task < tasks; task++) {
                const int64_t row = q_starts[chunk_req[task / splits]] * H + (int64_t)(task % splits) * per_task * G;
                merge_parts(part_out + task * parts * part_rows * D, part_lse + task * parts * part_rows, (int)parts,
                            part_rows, D, out + row * D, lse ? lse + row : NULL);
            }
        }
    }
    free(part_out);
    free(chunk_req);
    return failed;
}

#include "attend_layer.h"
