/* One layer's attention step in one call (included at the end of paged_attention.c, per ISA): the step's new
 * K/V rows stored into a float32 or bf16 pool, then every request attending through the kernel above, the
 * queries and the output in the model's dtype. What a Python layer did in six torch calls around the kernel
 * (two indexed stores, the queries widened, q_starts, the output narrowed): at batch 1 on 2 cores those cost
 * more than the kernel itself.
 *
 *   q        [T, H, D] of q_kind (float32 0, bf16 1), rows q_stride elements apart, each row's heads contiguous
 *   new_k/v  [T, KVH, D] of q_kind, rows k_stride / v_stride elements apart: stored at slots[t] of the pools
 *            (slot * KVH * D elements in), converted as torch's .to(pool dtype) converts
 *   out      [T, H, D] of q_kind, contiguous
 *   q_starts NULL: one query per request (T == B)
 * Returns the kernel's codes, or 1 for a q_kind or pool kind it does not serve (quantized pools keep the
 * Python store). */
#ifndef RADIXRT_ATTEND_LAYER_H
#define RADIXRT_ATTEND_LAYER_H

#define PAR_ELEMENTS (1 << 16) /* query elements from which the conversions split between threads */

/* n elements from src (of src_bf16's kind) to dst (of dst_bf16's), as torch converts them */
static void convert_row(const void *src, int src_bf16, void *dst, int dst_bf16, int64_t n) {
    if (src_bf16 == dst_bf16) {
        memcpy(dst, src, (size_t)n * (src_bf16 ? 2 : 4));
    } else if (dst_bf16) {
        for (int64_t i = 0; i < n; i++) ((uint16_t *)dst)[i] = float_to_bf16(((const float *)src)[i]);
    } else {
        for (int64_t i = 0; i < n; i++) ((float *)dst)[i] = float_at(src, 1, i);
    }
}

int CAT(radixrt_attend_layer, ISA_NAME)(const void *q, int q_kind, int64_t q_stride, const void *new_k, int64_t k_stride,
                                        const void *new_v, int64_t v_stride, const int64_t *slots, int64_t T, void *k_pool,
                                        void *v_pool, int kind, const int64_t *pages, int64_t pages_stride,
                                        const int64_t *kv_lens, const int64_t *q_starts, int B, int H, int KVH, int D,
                                        int page_size, float scale, int64_t window, float softcap, void *out) {
    if ((q_kind != KIND_F32 && q_kind != KIND_BF16) || (kind != KIND_F32 && kind != KIND_BF16)) return 1;
    const int64_t row = (int64_t)KVH * D, width = (int64_t)H * D, pool_bytes = kind == KIND_BF16 ? 2 : 4;
    const int64_t q_bytes = q_kind == KIND_BF16 ? 2 : 4;
    const int par = T * width >= PAR_ELEMENTS; /* a prefill chunk's rows: every thread converts some */
#pragma omp parallel for if (par) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        convert_row((const char *)new_k + t * k_stride * q_bytes, q_kind, (char *)k_pool + slots[t] * row * pool_bytes, kind, row);
        convert_row((const char *)new_v + t * v_stride * q_bytes, q_kind, (char *)v_pool + slots[t] * row * pool_bytes, kind, row);
    }
    const int direct = q_kind == KIND_F32 && q_stride == width; /* the kernel reads q and writes out as they are */
    float *qf = direct ? (float *)q : malloc(sizeof(float) * (size_t)(T * width) * 2);
    int64_t *starts = q_starts ? NULL : malloc(sizeof(int64_t) * (size_t)(B + 1));
    if (!qf || (!q_starts && !starts)) {
        if (!direct) free(qf);
        free(starts);
        return 3;
    }
    float *of = direct ? (float *)out : qf + T * width;
    if (!direct) {
#pragma omp parallel for if (par) schedule(static)
        for (int64_t t = 0; t < T; t++) convert_row((const char *)q + t * q_stride * q_bytes, q_kind, qf + t * width, 0, width);
    }
    if (!q_starts)
        for (int b = 0; b <= B; b++) starts[b] = b;
    const int err = CAT(radixrt_paged_attention, ISA_NAME)(qf, k_pool, v_pool, kind, NULL, NULL, pages, pages_stride, kv_lens,
                                                           q_starts ? q_starts : starts, B, H, KVH, D, page_size, scale,
                                                           window, softcap, of, NULL);
    if (!direct) {
        if (!err) {
#pragma omp parallel for if (par) schedule(static)
            for (int64_t t = 0; t < T; t++) convert_row(of + t * width, 0, (char *)out + t * width * q_bytes, q_kind, width);
        }
        free(qf);
    }
    free(starts);
    return err;
}

#endif
