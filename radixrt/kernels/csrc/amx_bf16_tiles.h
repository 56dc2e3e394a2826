/* The held weight dequantized to bf16 a tile at a time, multiplied by AMX-BF16 tiles (included at the end of
 * qgemm.c, in its amx variant): for many rows, where the AMX-INT8 tiles pay a store and a float32 scaling of
 * every group's sums (its scales and mins differ per group), here the scales and mins are folded into the
 * bf16 weights once per call and tile, and every row block's sums accumulate in float32 tiles across all of K.
 * The activations are rounded to bf16, not quantized to int8: the product is x_bf16 W_bf16^T summed in
 * float32, W_bf16 exactly what `radixrt_qdequantize` writes in bf16 (the same v d + m, rounded to nearest
 * even), as F.linear over that weight computes it, up to the order of the sums.
 *
 * Per output tile of 16: its G groups dequantized into B tiles' layout (per group 16 rows of 64 bytes, row i
 * holding k = 2i and 2i + 1 of each output as a pair), then for each block of up to 64 rows (four C tiles)
 * each group's B tile loaded once for the block's A tiles (16 rows x 32 bf16 of x). */
#ifndef RADIXRT_AMX_BF16_TILES_H
#define RADIXRT_AMX_BF16_TILES_H

#define BF16_BLOCKS 4 /* C tiles 0-3: up to 64 rows a pass; A tiles 4 and 6 alternate, B tile 5 */
#define PAIR_ROWS 128 /* from these rows (padded), two output tiles a pass: x read once for both */

static void configure_bf16_tiles(void) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.rows[t] = 16, c.colsb[t] = 64;
    _tile_loadconfig(&c);
}

/* One output tile's weights as bf16 pairs: bt [G][16][16][2] (group, pair row, output, element). */
static void dequantize_tile_bf16(const uint8_t *wt, int bits, int sub, const uint16_t *dt, const uint16_t *mt, int64_t G,
                                 uint32_t *bt) {
    for (int64_t g = 0; g < G; g++) {
        __m512i wv[8];
        unpack_group(wt + g * GROUP_BYTES(bits), bits, wv);
        const GroupScales s = group_scales(dt, mt, sub, offset_min(bits), g);
        for (int j = 0; j < 8; j++) {
            __m512i e[4];
            for (int b = 0; b < 4; b++) e[b] = _mm512_cvtepu16_epi32(to_bf16x16(group_element(wv[j], bits, b, j < 4 ? s.d0 : s.d1, s.m)));
            _mm512_store_si512(bt + (g * 16 + 2 * j) * TILE, _mm512_or_si512(e[0], _mm512_slli_epi32(e[1], 16)));
            _mm512_store_si512(bt + (g * 16 + 2 * j + 1) * TILE, _mm512_or_si512(e[2], _mm512_slli_epi32(e[3], 16)));
        }
    }
}

/* C tile q (float32 [16][16], stored) of rows r0 .. r0 + 15 into out's columns n0 .. n0 + 15, rows past M left out. */
static void tile_rows_out(const float *c, int64_t r0, int64_t M, void *out, int out_kind, int64_t N, int64_t n0) {
    const int rows = M - r0 < TILE ? (int)(M - r0) : TILE;
    __m512 acc[TILE];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_load_ps(c + r * TILE);
    if (rows > 0) store_rows(acc, rows, (char *)out + (r0 * N + n0) * (out_kind == KIND_F32 ? 4 : 2), out_kind, N);
}

/* Row block's C tile `c` from its A rows at xa (row stride K bf16) and the B tiles at bt (immediates: tiles). */
#define BF16_BLOCK(c, a)                                                          \
    do {                                                                          \
        if (blocks > (c)) {                                                       \
            _tile_loadd(a, xa + (m0 + 16 * (c)) * K + g * GROUP, (int)(K * 2));   \
            _tile_dpbf16ps(c, a, 5);                                              \
        }                                                                         \
    } while (0)

static void bf16_rows(const uint32_t *bt, const uint16_t *xa, int64_t K, int64_t m0, int blocks, int64_t M, void *out,
                      int out_kind, int64_t N, int64_t n0) {
    float c[BF16_BLOCKS][TILE * TILE] __attribute__((aligned(64)));
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t g = 0; g < K / GROUP; g++) {
        _tile_loadd(5, bt + g * 16 * TILE, 64);
        BF16_BLOCK(0, 4);
        BF16_BLOCK(1, 6);
        BF16_BLOCK(2, 4);
        BF16_BLOCK(3, 6);
    }
    _tile_stored(0, c[0], 64);
    _tile_stored(1, c[1], 64);
    _tile_stored(2, c[2], 64);
    _tile_stored(3, c[3], 64);
    for (int blk = 0; blk < blocks; blk++) tile_rows_out(c[blk], m0 + 16 * blk, M, out, out_kind, N, n0);
}

/* Two output tiles (bt0, bt1) for rows m0 .. m0 + 31 (two row blocks): C tiles (block, tile) 0 (0, 0), 1 (0, 1),
 * 2 (1, 0), 3 (1, 1); each group's two A tiles and two B tiles loaded once for four products, so that x is read
 * once for 32 outputs, not 16 (for many rows, x streams from L2 for every pass). */
static void bf16_rows2(const uint32_t *bt0, const uint32_t *bt1, const uint16_t *xa, int64_t K, int64_t m0, int64_t M,
                       void *out, int out_kind, int64_t N, int64_t n0) {
    float c[4][TILE * TILE] __attribute__((aligned(64)));
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t g = 0; g < K / GROUP; g++) {
        _tile_loadd(4, xa + m0 * K + g * GROUP, (int)(K * 2));
        _tile_loadd(5, xa + (m0 + 16) * K + g * GROUP, (int)(K * 2));
        _tile_loadd(6, bt0 + g * 16 * TILE, 64);
        _tile_loadd(7, bt1 + g * 16 * TILE, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, c[0], 64);
    _tile_stored(1, c[1], 64);
    _tile_stored(2, c[2], 64);
    _tile_stored(3, c[3], 64);
    for (int q = 0; q < 4; q++) tile_rows_out(c[q], m0 + 16 * (q / 2), M, out, out_kind, N, n0 + TILE * (q % 2));
}

int CAT(radixrt_qgemm_bf16, ISA_NAME)(const void *x, int kind, int64_t M, int64_t K, int64_t N, const uint8_t *w, int bits,
                                      int sub, const uint16_t *d, const uint16_t *mn, void *out, int out_kind, int threads) {
    if (!valid(kind, bits, sub, mn != NULL) || (out_kind != KIND_F32 && out_kind != KIND_BF16)) return 1;
    if (K % GROUP || N % TILE) return 2;
    if (!amx_granted()) return 4;
    const int64_t G = K / GROUP, S = K / sub, tile_bytes = G * GROUP_BYTES(bits);
    const int pairs = (M + TILE - 1) / TILE * TILE >= PAIR_ROWS; /* two output tiles a pass (bf16_rows2) */
    const int64_t pass = pairs ? 2 * TILE : TILE, Mp = (M + pass - 1) / pass * pass; /* rows padded to whole passes */
    uint16_t *xa = aligned_alloc(64, ((size_t)(Mp * K) * 2 + 63) & ~(size_t)63); /* x in bf16, zero rows to Mp */
    if (!xa) return 3;
    memset(xa + M * K, 0, (size_t)((Mp - M) * K) * 2);
    for (int64_t m = 0; m < M; m++) {
        if (kind == KIND_BF16) {
            memcpy(xa + m * K, (const uint16_t *)x + m * K, (size_t)K * 2);
            continue;
        }
        for (int64_t k = 0; k < K; k += TILE)
            _mm256_storeu_si256((__m256i *)(xa + m * K + k), to_bf16x16(_mm512_loadu_ps((const float *)x + m * K + k)));
    }
    int failed = 0;
    const int64_t per = pairs ? 2 : 1, tiles = N / TILE;
#pragma omp parallel num_threads(threads)
    {
        uint32_t *bt = aligned_alloc(64, (size_t)G * 16 * TILE * 4 * 2);
        if (!bt) {
#pragma omp atomic write
            failed = 3;
        }
        configure_bf16_tiles();
#pragma omp for schedule(static)
        for (int64_t p = 0; p < (tiles + per - 1) / per; p++) {
            if (!bt) continue;
            const int64_t t = p * per, n = tiles - t < per ? tiles - t : per; /* n output tiles from tile t */
            for (int64_t i = 0; i < n; i++)
                dequantize_tile_bf16(w + (t + i) * tile_bytes, bits, sub, d + (t + i) * S * TILE,
                                     mn ? mn + (t + i) * G * TILE : NULL, G, bt + i * G * 16 * TILE);
            if (n == 2) {
                for (int64_t m0 = 0; m0 < Mp; m0 += 32)
                    bf16_rows2(bt, bt + G * 16 * TILE, xa, K, m0, M, out, out_kind, N, t * TILE);
                continue;
            }
            for (int64_t m0 = 0; m0 < Mp; m0 += 16 * BF16_BLOCKS) {
                const int blocks = (Mp - m0) / 16 < BF16_BLOCKS ? (int)((Mp - m0) / 16) : BF16_BLOCKS;
                bf16_rows(bt, xa, K, m0, blocks, M, out, out_kind, N, t * TILE);
            }
        }
        _tile_release();
        free(bt);
    }
    free(xa);
    return failed;
}

#endif
