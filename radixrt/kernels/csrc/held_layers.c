/* A step's decoder layers of a model whose linear layers are held quantized, run in one call: per layer the
 * nine kernels the Python layers call one by one (add + RMS norm, the q/k/v product, rope, the attention's
 * store and read, the o product, add + RMS norm, the gate/up product, act * up, the down product), each
 * through the function pointer Python hands over (fused_layers.c, qgemm.c, paged_attention.c's
 * attend_layer.h: the variants the process chose). At batch 1 the Python around those calls cost as much as
 * the calls' own work on a 2-core host (radixrt/models/held_steps.py says where it serves).
 *
 * Every buffer is contiguous, in the activations' dtype (`kind`); x enters as the embedding and leaves as the
 * last layer's output, residual enters zeroed (so the first layer's add is exact) and leaves as the stream
 * before it: the hidden state is their sum, as LlamaForCausalLM.forward returns. Returns 0, or
 * stage * 1000 + the kernel's code with *layer_at the layer that failed. No OpenMP here: the kernels have
 * their own. */
#include <stdint.h>

typedef int (*norm_fn)(const void *, int64_t, int64_t, int64_t, int64_t, void *, void *, const void *, int, int64_t,
                       float, int, int);
typedef int (*gemm_fn)(const void *, int, int64_t, int64_t, int64_t, const void *, int, int, const void *, const void *,
                       void *, int, int);
typedef int (*rope_fn)(const void *, int64_t, void *, int, const void *, int64_t, void *, int, int, int64_t, int, int,
                       const void *, const void *, int, int64_t, const int64_t *, int);
typedef int (*attend_fn)(const void *, int, int64_t, const void *, int64_t, const void *, int64_t, const int64_t *,
                         int64_t, void *, void *, int, const int64_t *, int64_t, const int64_t *, const int64_t *, int,
                         int, int, int, int, float, int64_t, float, void *);
typedef int (*act_fn)(const void *, int64_t, void *, int, int64_t, int64_t, int, int);

#define MAX_ROUTES 4

/* One held linear layer: x [T, K] -> [T, N] through `fn` (qgemm.c's entry), or from route_rows[i] rows on
 * through route_fns[i] (another entry: the AMX-INT8 or AMX-BF16 tiles), as quant_linear.QuantLinear routes. */
typedef struct {
    gemm_fn fn;
    const void *packed, *scales, *mins;
    int32_t bits, sub;
    int64_t N, K;
    int64_t route_rows[MAX_ROUTES];
    gemm_fn route_fns[MAX_ROUTES];
    int32_t routes;
} Linear;

typedef struct {
    Linear qkv, o, gate_up, down;
    const void *norm_in, *norm_post; /* [hidden] in kind */
    void *k_pool, *v_pool;
    float scale, softcap;
    int64_t window;
} Layer;

typedef struct {
    norm_fn norm;
    rope_fn rope;
    act_fn act;
    attend_fn attend;
    int32_t kind, pool_kind, act_code, threads;
    int64_t T, hidden, heads, kv_heads, head_dim, inter;
    float eps;
    int32_t table_kind, rotary_dim;
    const void *cos, *sin;
    int64_t table_rows;
    const int64_t *positions; /* [T] rope table rows */
    const int64_t *slots, *pages, *kv_lens, *q_starts; /* the step's attention (q_starts NULL: decodes) */
    int64_t pages_stride;
    int32_t B, page_size;
    void *x, *residual, *qkv, *q, *k, *attn, *o, *gate_up, *act_out;
} Step;

static int gemm(const Step *s, const Linear *l, const void *x, void *out) {
    gemm_fn fn = l->fn;
    for (int i = 0; i < l->routes; i++)
        if (s->T >= l->route_rows[i]) fn = l->route_fns[i];
    return fn(x, s->kind, s->T, l->K, l->N, l->packed, l->bits, l->sub, l->scales, l->mins, out, s->kind, s->threads);
}

static int run_layer(const Step *s, const Layer *L) {
    const int64_t T = s->T, H = s->heads, KVH = s->kv_heads, D = s->head_dim, es = s->kind ? 2 : 4;
    const int64_t nqkv = (H + 2 * KVH) * D;
    const char *k_in = (const char *)s->qkv + H * D * es, *v_in = (const char *)s->qkv + (H + KVH) * D * es;
    int err;
    if ((err = s->norm(s->x, T, 1, s->hidden, 0, s->residual, s->x, L->norm_in, s->kind, s->hidden, s->eps, 0, s->threads)))
        return 1000 + err;
    if ((err = gemm(s, &L->qkv, s->x, s->qkv))) return 2000 + err;
    if ((err = s->rope(s->qkv, nqkv, s->q, (int)H, k_in, nqkv, s->k, (int)KVH, s->kind, T, (int)D, s->rotary_dim, s->cos,
                       s->sin, s->table_kind, s->table_rows, s->positions, s->threads)))
        return 3000 + err;
    if ((err = s->attend(s->q, s->kind, H * D, s->k, KVH * D, v_in, nqkv, s->slots, T, L->k_pool, L->v_pool, s->pool_kind,
                         s->pages, s->pages_stride, s->kv_lens, s->q_starts, s->B, (int)H, (int)KVH, (int)D, s->page_size,
                         L->scale, L->window, L->softcap, s->attn)))
        return 4000 + err;
    if ((err = gemm(s, &L->o, s->attn, s->o))) return 5000 + err;
    if ((err = s->norm(s->o, T, 1, s->hidden, 0, s->residual, s->o, L->norm_post, s->kind, s->hidden, s->eps, 0, s->threads)))
        return 6000 + err;
    if ((err = gemm(s, &L->gate_up, s->o, s->gate_up))) return 7000 + err;
    if ((err = s->act(s->gate_up, 2 * s->inter, s->act_out, s->kind, T, s->inter, s->act_code, s->threads))) return 8000 + err;
    if ((err = gemm(s, &L->down, s->act_out, s->x))) return 9000 + err;
    return 0;
}

int radixrt_held_layers(const Step *s, const Layer *layers, int n, int *layer_at) {
    for (int i = 0; i < n; i++) {
        const int err = run_layer(s, layers + i);
        if (err) {
            *layer_at = i;
            return err;
        }
    }
    return 0;
}
