/* Many-row attention tasks as tile products, through the brgemm micro-kernel torch exports from oneDNN
 * (at::native::cpublas::brgemm, pack, brgemm_release). On a CPU with AMX the products run on its
 * tiles, B packed to VNNI pairs first (`tile_vnni`, torch's could_pack); elsewhere torch computes them
 * with its bf16 GEMM over unpacked B, which is what the tests run on hosts without AMX.
 *
 * Only paged_attention.c's BRGEMM variant includes this; radixrt/kernels/native_attention.py hands
 * it the three functions from libtorch_cpu (radixrt_set_brgemm) before any call. A task of P query
 * positions of one request over NH KV heads, G rows each, goes here when a KV head has M = P * G
 * >= TILE_MIN_ROWS rows; for each KV head:
 *   1. its M query rows to bf16 (as a bf16 model's attention rounds them), row p * G + g;
 *   2. per block of TBB tokens: K gathered from its pages and transposed, kt [D][TBB] (16 tokens x
 *      16 pairs transposed in registers, then split into the even and odd rows), and
 *      S[:, block] = Q [M, D] x kt;
 *   3. each score row scaled and softmaxed over the tokens its position reads (softmax_row: the
 *      vector path's), 0 outside them;
 *   4. per block: its weights to bf16, V gathered [TBB][D], O [M, D] += W[:, block] x V.
 * A block past the last real token repeats it (finite values, weight 0), as the vector path's do.
 */
#ifndef RADIXRT_BRGEMM_TILES_H
#define RADIXRT_BRGEMM_TILES_H
#include <stdbool.h>

#define TBB 64           /* tokens per block of the tile products (a multiple of TB) */
#define TILE_MIN_ROWS 8  /* query rows per KV head from which a task goes through the tiles */
#define SCALAR_BF16 15   /* c10::ScalarType::BFloat16 */

typedef void (*brgemm_fn)(int64_t M, int64_t N, int64_t K, int64_t ld_a, int64_t ld_b, int64_t ld_c, bool add_C,
                          const uint16_t *A, const uint16_t *B, float *C, bool is_vnni);
typedef void (*pack_fn)(int64_t K, int64_t N, int64_t ld_in, int64_t ld_out, int8_t dt_in, int8_t dt_out,
                        const void *in, void *out);
typedef void (*release_fn)(bool is_vnni);

static brgemm_fn tile_gemm;
static pack_fn tile_pack;
static release_fn tile_release;
static bool tile_vnni;

/* The brgemm functions (libtorch_cpu's, looked up by the loader) and whether B is packed to VNNI. */
void radixrt_set_brgemm(void *gemm, void *pack, void *release, int vnni) {
    tile_gemm = (brgemm_fn)gemm;
    tile_pack = (pack_fn)pack;
    tile_release = (release_fn)release;
    tile_vnni = vnni != 0;
}

/* offs[i] = where token b0 + i of the task's range (from t0, N of them) starts in the pool, KV head h,
 * for i < TBB; tokens past the last repeat it. */
static inline void tile_block_rows(const Pool *pool, int64_t t0, int64_t N, int64_t b0, int h, int64_t *offs) {
    for (int j = 0; j < TBB; j += TB) {
        const int64_t left = N - b0 - j;
        if (left <= 0) {
            for (int i = 0; i < TB; i++) offs[j + i] = offs[j - 1];
            continue;
        }
        block_offsets(pool->pages, pool->page_size, t0 + b0 + j, left < TB ? (int)left : TB, pool->KVH, pool->D, offs + j);
        for (int i = 0; i < TB; i++) offs[j + i] += (int64_t)h * pool->D;
    }
}

/* kt[d * TBB + i] = K row i's element d (bf16, the TBB rows at offs): the block transposed. */
static inline void tile_k_transposed(const uint16_t *k_pool, const int64_t *offs, int D, uint16_t *kt) {
    for (int i0 = 0; i0 < TBB; i0 += 16)
        for (int c = 0; c < D / 2; c += 16) { /* 16 tokens x 16 pairs of elements */
            __m512i r[16];
            for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512((const void *)(k_pool + offs[i0 + i] + 2 * c));
            v_transpose16(r); /* r[j]: pair c + j of the 16 tokens */
            for (int j = 0; j < 16; j++) {
                const int64_t even = (int64_t)2 * (c + j) * TBB + i0;
                _mm256_storeu_si256((__m256i *)(kt + even), _mm512_cvtepi32_epi16(r[j]));
                _mm256_storeu_si256((__m256i *)(kt + even + TBB), _mm512_cvtepi32_epi16(_mm512_srli_epi32(r[j], 16)));
            }
        }
}

/* C [M, N] (+)= A [M, K] x B [K, N] (B row-major, ld_b = N). For the tiles B is packed to VNNI pairs
 * first, at most TILE_N columns at a time: oneDNN's packing makes blocks of 16-64 columns only (a
 * head_dim of 128 as one block aborts in torch with "could not create a BRGeMM ukernel packing B
 * object"), so C's columns are filled TILE_N at a time. */
#define TILE_N 64
static inline void tile_product(int64_t M, int64_t N, int64_t K, const uint16_t *A, int64_t ld_a, uint16_t *B,
                                uint16_t *packed, float *C, int64_t ld_c, bool add) {
    if (!tile_vnni) {
        tile_gemm(M, N, K, ld_a, N, ld_c, add, A, B, C, false);
        return;
    }
    for (int64_t n0 = 0; n0 < N; n0 += TILE_N) {
        const int64_t n = N - n0 < TILE_N ? N - n0 : TILE_N;
        tile_pack(K, n, N, n, SCALAR_BF16, SCALAR_BF16, B + n0, packed);
        tile_gemm(M, n, K, ld_a, n, ld_c, add, A, packed, C + n0, true);
    }
}

/* One task (see attend_task for its arguments) over a bf16 pool. Returns 0, or 3 out of memory. */
static int attend_task_tiles(const Pool *pool, const float *q, int64_t q_stride, int P, const int64_t *lo,
                             const int64_t *hi, int64_t t0, int64_t N, int h0, int NH, int G, float *out, float *lse,
                             int64_t lse_stride) {
    const int D = pool->D, M = P * G;
    const int64_t Np = (N + TBB - 1) / TBB * TBB;
    const size_t floats = (size_t)M * (size_t)(Np + D), halves = (size_t)M * (D + TBB) + (size_t)2 * TBB * D;
    float *s = malloc(sizeof(float) * floats + sizeof(uint16_t) * halves);
    if (!s) return 3;
    float *o = s + (size_t)M * Np;
    uint16_t *q16 = (uint16_t *)(o + (size_t)M * D), *w16 = q16 + (size_t)M * D, *blk = w16 + (size_t)M * TBB;
    uint16_t *packed = blk + (size_t)TBB * D;
    const uint16_t *k_pool = pool->k_pool, *v_pool = pool->v_pool;
    int64_t offs[TBB];
    const vf scale = v_set1(pool->scale);
    for (int h = 0; h < NH; h++) {
        for (int r = 0; r < M; r++) /* 1 */
            for (int d = 0; d < D; d += 32)
                _mm512_storeu_si512((void *)(q16 + (int64_t)r * D + d),
                                    (__m512i)vbf_from_f32(q + (r / G) * q_stride + ((int64_t)h * G + r % G) * D + d));
        for (int64_t b0 = 0; b0 < N; b0 += TBB) { /* 2 */
            tile_block_rows(pool, t0, N, b0, h0 + h, offs);
            tile_k_transposed(k_pool, offs, D, blk);
            tile_product(M, TBB, D, q16, D, blk, packed, s + b0, Np, false);
        }
        for (int r = 0; r < M; r++) { /* 3 */
            float *row = s + (int64_t)r * Np;
            for (int64_t t = 0; t < Np; t += VL) v_store(row + t, v_mul(v_load(row + t), scale));
            const int p = r / G;
            const float l = softmax_row(row, lo[p] - t0, hi[p] - t0, Np, pool->softcap);
            if (lse) lse[p * lse_stride + h * G + r % G] = l;
        }
        for (int64_t b0 = 0; b0 < N; b0 += TBB) { /* 4 */
            tile_block_rows(pool, t0, N, b0, h0 + h, offs);
            for (int i = 0; i < TBB; i++) memcpy(blk + (int64_t)i * D, v_pool + offs[i], sizeof(uint16_t) * (size_t)D);
            for (int r = 0; r < M; r++)
                for (int j = 0; j < TBB; j += 32)
                    _mm512_storeu_si512((void *)(w16 + (int64_t)r * TBB + j), (__m512i)vbf_from_f32(s + (int64_t)r * Np + b0 + j));
            tile_product(M, D, TBB, w16, TBB, blk, packed, o, D, b0 > 0);
        }
        for (int r = 0; r < M; r++)
            memcpy(out + (r / G) * q_stride + ((int64_t)h * G + r % G) * D, o + (int64_t)r * D, sizeof(float) * (size_t)D);
    }
    free(s);
    return 0;
}
#endif /* RADIXRT_BRGEMM_TILES_H */
