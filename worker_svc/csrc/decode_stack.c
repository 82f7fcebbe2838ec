/* A Llama decoder's layers for a pure-decode step, in one call: the same kernels the runner's
 * Python layer loop (worker_svc/decoder_loop.py) calls, with the same arguments in the same
 * order, so the result is that loop's bits. What goes is the loop's per-layer Python (module
 * calls, views, torch allocations, ctypes calls), during which the second OpenMP thread can
 * only wait.
 *
 * Per layer, with x the residual stream [T, hidden] (updated in place):
 *   h = rms_norm(x) (layer 0), else x += delta; h = rms_norm(x)       input norm
 *   q, k, v = h @ Wq^T, h @ Wk^T, h @ Wv^T (+ b)   bfloat16: one AMX GEMM over the joint weight
 *   q, k = rotary(q), rotary(k); cache slots <- k, v; o = paged decode attention of q
 *   x += o @ Wo^T (+ b); h = rms_norm(x)                                post-attention norm
 *   delta = (silu(h @ Wg^T) * (h @ Wu^T)) @ Wd^T (+ b)   bfloat16: gate, up and product fused
 * and after the last layer x += delta; out = rms_norm(x) with the final norm's weight.
 *
 * Each layer's pointers: STACK_PTRS int64 values at layers[l * STACK_PTRS], in the order of the
 * enum below (0 for a missing bias; bfloat16 keeps the joint q/k/v weight in P_Q and the gate/up
 * pairs in P_GATE; a float32 layer's weight is int8 where its *_SCALE, the per-column scales of
 * --quantization int8, is set, float32 where it is 0); eps[2 l], eps[2 l + 1] the two norms'
 * epsilons; scratch holds decode_stack_scratch_bytes() bytes. Returns 0; -2 when the attention
 * has no body for these inputs here (found in layer 0, before x changes: the caller can run its
 * own loop instead); -1 when a kernel refused or ran out of memory part way (x is then
 * undefined).
 */
#include <stddef.h>
#include <stdint.h>

enum {
    P_INPUT_NORM, P_POST_NORM, P_Q, P_Q_BIAS, P_K, P_K_BIAS, P_V, P_V_BIAS, P_O, P_O_BIAS,
    P_GATE, P_GATE_BIAS, P_UP, P_UP_BIAS, P_DOWN, P_DOWN_BIAS, P_K_CACHE, P_V_CACHE,
    P_Q_SCALE, P_K_SCALE, P_V_SCALE, P_O_SCALE, P_GATE_SCALE, P_UP_SCALE, P_DOWN_SCALE, STACK_PTRS
};

int decode_stack_layer_ptrs(void) { return STACK_PTRS; }

/* a buffer of n elements, in 64-byte multiples */
static int64_t span(int64_t n, int64_t elem) { return (n * elem + 63) / 64 * 64; }

/* The scratch buffers: h, q/k/v as the projections give them (bfloat16: one joint q/k/v
 * output in q_raw), the rotated q and k, o, the attention output, gate, up, delta. */
typedef struct {
    char *h, *q_raw, *k_raw, *v, *q, *k, *o, *attn, *gate, *up, *delta;
} Buffers;

/* Lays the buffers out from `base` (NULL: only sizes them); returns the bytes they take. */
static int64_t carve(char *base, int64_t T, int64_t hidden, int64_t nq, int64_t nk,
                     int64_t intermediate, int64_t elem, Buffers *b) {
    const int64_t sizes[] = {T * hidden, T * (nq + 2 * nk), T * nk, T * nk, T * nq, T * nk,
                             T * nq, T * hidden, T * intermediate, T * intermediate, T * hidden};
    char **slots[] = {&b->h, &b->q_raw, &b->k_raw, &b->v, &b->q, &b->k,
                      &b->o, &b->attn, &b->gate, &b->up, &b->delta};
    int64_t at = 0;
    for (int i = 0; i < (int)(sizeof(sizes) / sizeof(sizes[0])); i++) {
        *slots[i] = base ? base + at : NULL;
        at += span(sizes[i], elem);
    }
    return at;
}

int64_t decode_stack_scratch_bytes(int64_t elem, int64_t tokens, int64_t hidden, int64_t heads,
                                   int64_t kv_heads, int64_t head_dim, int64_t intermediate) {
    Buffers b;
    return carve(NULL, tokens, hidden, heads * head_dim, kv_heads * head_dim, intermediate, elem,
                 &b);
}

#if defined(__x86_64__) && (defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__)))

int rms_norm_f32(const float *x, int64_t rows, int64_t dim, int64_t x_stride,
                 const float *weight, float eps, float *out, int64_t out_stride,
                 int64_t num_threads);
int add_rms_norm_f32(float *x, const float *delta, int64_t rows, int64_t dim, int64_t x_stride,
                     int64_t delta_stride, const float *weight, float eps, float *out,
                     int64_t out_stride, int64_t num_threads);
int rotary_f32(const float *x, float *out, int64_t tokens, int64_t heads, int64_t head_dim,
               int64_t x_tok, int64_t x_head, int64_t out_tok, int64_t out_head,
               const float *cos, const float *sin, int64_t cs_tok, int64_t num_threads);
int silu_mul_f32(const float *gate, const float *up, float *out, int64_t n, int64_t num_threads);
int rms_norm_bf16(const uint16_t *x, int64_t rows, int64_t dim, int64_t x_stride,
                  const uint16_t *weight, float eps, uint16_t *out, int64_t out_stride,
                  int64_t num_threads);
int add_rms_norm_bf16(uint16_t *x, const uint16_t *delta, int64_t rows, int64_t dim,
                      int64_t x_stride, int64_t delta_stride, const uint16_t *weight, float eps,
                      uint16_t *out, int64_t out_stride, int64_t num_threads);
int rotary_bf16(const uint16_t *x, uint16_t *out, int64_t tokens, int64_t heads,
                int64_t head_dim, int64_t x_tok, int64_t x_head, int64_t out_tok,
                int64_t out_head, const uint16_t *cos, const uint16_t *sin, int64_t cs_tok,
                int64_t num_threads);
int packed_sgemm(const float *x, int64_t M, int64_t K, int64_t lda, const float *packed,
                 int64_t N, const float *bias, float *y, int64_t ldy, int64_t num_threads);
int packed_i8gemm(const float *x, int64_t M, int64_t K, int64_t lda, const int8_t *packed,
                  int64_t N, const float *scale, const float *bias, float *y, int64_t ldy,
                  int64_t num_threads);
int amx_gemm_bf16(const uint16_t *x, int64_t M, int64_t K, int64_t lda, const uint16_t *packed,
                  int64_t N, const uint16_t *bias, uint16_t *y, int64_t ldy, int64_t num_threads);
int amx_gemm_bf16_silu_mul(const uint16_t *x, int64_t M, int64_t K, int64_t lda,
                           const uint16_t *packed, int64_t N, uint16_t *y, int64_t ldy,
                           int64_t num_threads);
int write_kv(const void *k, const void *v, void *k_cache, void *v_cache, const int64_t *slots,
             int64_t tokens, int64_t kv_heads, int64_t head_dim, int64_t elem_size,
             int64_t k_head_stride, int64_t k_token_stride, int64_t v_head_stride,
             int64_t v_token_stride);
int paged_decode_f32(const float *q, const void *k_cache, const void *v_cache,
                     const int64_t *block_table, int64_t block_table_stride,
                     const int64_t *seq_lens, float *out, int64_t rows, int64_t heads,
                     int64_t kv_heads, int64_t head_dim, int64_t block_size, float scale,
                     int64_t max_seq_len);
int paged_decode_bf16_io(const float *q, const void *k_cache, const void *v_cache,
                         const int64_t *block_table, int64_t block_table_stride,
                         const int64_t *seq_lens, float *out, int64_t rows, int64_t heads,
                         int64_t kv_heads, int64_t head_dim, int64_t block_size, float scale,
                         int64_t max_seq_len);

#define PTR(i) ((const void *)(intptr_t)layer[(i)])

/* The step's shapes and the attention's inputs, the same for every layer. */
typedef struct {
    int64_t T, hidden, heads, kv_heads, head_dim, intermediate, threads;
    const void *cos, *sin;
    int64_t cs_tok;
    const int64_t *slots, *block_table, *seq_lens;
    int64_t block_table_stride, max_seq_len, block_size;
    float scale;
} Step;

/* y [M, N] = x [M, K] @ the layer's weight `w` (+ its bias): float32, or int8 with scales */
static int linear_f32(const int64_t *layer, int w, const float *x, int64_t M, int64_t K,
                      int64_t N, float *y, int64_t nth) {
    /* P_Q, P_K, ... P_DOWN each followed by its bias; their scales in the same order */
    const int bias = w + 1, scale = P_Q_SCALE + (w - P_Q) / 2;
    return PTR(scale) ? packed_i8gemm(x, M, K, K, PTR(w), N, PTR(scale), PTR(bias), y, N, nth)
                      : packed_sgemm(x, M, K, K, PTR(w), N, PTR(bias), y, N, nth);
}

/* float32: the layer loop's separate packed GEMMs, the product of gate and up in place */
static int layer_f32(const int64_t *layer, const float *eps, int first, float *x, const Step *s,
                     const Buffers *b) {
    const int64_t T = s->T, H = s->hidden, I = s->intermediate, nth = s->threads;
    const int64_t nq = s->heads * s->head_dim, nk = s->kv_heads * s->head_dim;
    float *h = (float *)b->h, *q = (float *)b->q, *k = (float *)b->k, *o = (float *)b->o;
    float *gate = (float *)b->gate, *up = (float *)b->up, *delta = (float *)b->delta;
    int rc = first ? rms_norm_f32(x, T, H, H, PTR(P_INPUT_NORM), eps[0], h, H, nth)
                   : add_rms_norm_f32(x, delta, T, H, H, H, PTR(P_INPUT_NORM), eps[0], h, H, nth);
    rc |= linear_f32(layer, P_Q, h, T, H, nq, (float *)b->q_raw, nth);
    rc |= linear_f32(layer, P_K, h, T, H, nk, (float *)b->k_raw, nth);
    rc |= linear_f32(layer, P_V, h, T, H, nk, (float *)b->v, nth);
    rc |= rotary_f32((const float *)b->q_raw, q, T, s->heads, s->head_dim, nq, s->head_dim, nq,
                     s->head_dim, s->cos, s->sin, s->cs_tok, nth);
    rc |= rotary_f32((const float *)b->k_raw, k, T, s->kv_heads, s->head_dim, nk, s->head_dim,
                     nk, s->head_dim, s->cos, s->sin, s->cs_tok, nth);
    if (rc) return -1;
    void *k_cache = (void *)PTR(P_K_CACHE), *v_cache = (void *)PTR(P_V_CACHE);
    write_kv(k, b->v, k_cache, v_cache, s->slots, T, s->kv_heads, s->head_dim, 4, s->head_dim,
             nk, s->head_dim, nk);
    rc = paged_decode_f32(q, k_cache, v_cache, s->block_table, s->block_table_stride,
                          s->seq_lens, o, T, s->heads, s->kv_heads, s->head_dim, s->block_size,
                          s->scale, s->max_seq_len);
    if (rc) return rc == -2 && first ? -2 : -1;
    rc = linear_f32(layer, P_O, o, T, nq, H, (float *)b->attn, nth);
    rc |= add_rms_norm_f32(x, (const float *)b->attn, T, H, H, H, PTR(P_POST_NORM), eps[1], h, H,
                           nth);
    rc |= linear_f32(layer, P_GATE, h, T, H, I, gate, nth);
    rc |= linear_f32(layer, P_UP, h, T, H, I, up, nth);
    rc |= silu_mul_f32(gate, up, gate, T * I, nth);
    rc |= linear_f32(layer, P_DOWN, gate, T, I, H, delta, nth);
    return rc ? -1 : 0;
}

#if defined(__AVX512F__)
/* bfloat16 on AMX: q/k/v as one GEMM, gate/up and their product as one */
static int layer_bf16(const int64_t *layer, const float *eps, int first, uint16_t *x,
                      const Step *s, const Buffers *b) {
    const int64_t T = s->T, H = s->hidden, I = s->intermediate, nth = s->threads;
    const int64_t nq = s->heads * s->head_dim, nk = s->kv_heads * s->head_dim;
    const int64_t nqkv = nq + 2 * nk;
    uint16_t *h = (uint16_t *)b->h, *qkv = (uint16_t *)b->q_raw, *q = (uint16_t *)b->q;
    uint16_t *k = (uint16_t *)b->k, *o = (uint16_t *)b->o, *attn = (uint16_t *)b->attn;
    uint16_t *act = (uint16_t *)b->gate, *delta = (uint16_t *)b->delta;
    int rc = first ? rms_norm_bf16(x, T, H, H, PTR(P_INPUT_NORM), eps[0], h, H, nth)
                   : add_rms_norm_bf16(x, delta, T, H, H, H, PTR(P_INPUT_NORM), eps[0], h, H, nth);
    rc |= amx_gemm_bf16(h, T, H, H, PTR(P_Q), nqkv, PTR(P_Q_BIAS), qkv, nqkv, nth);
    rc |= rotary_bf16(qkv, q, T, s->heads, s->head_dim, nqkv, s->head_dim, nq, s->head_dim,
                      s->cos, s->sin, s->cs_tok, nth);
    rc |= rotary_bf16(qkv + nq, k, T, s->kv_heads, s->head_dim, nqkv, s->head_dim, nk,
                      s->head_dim, s->cos, s->sin, s->cs_tok, nth);
    if (rc) return -1;
    void *k_cache = (void *)PTR(P_K_CACHE), *v_cache = (void *)PTR(P_V_CACHE);
    write_kv(k, qkv + nq + nk, k_cache, v_cache, s->slots, T, s->kv_heads, s->head_dim, 2,
             s->head_dim, nk, s->head_dim, nqkv);
    rc = paged_decode_bf16_io((const float *)q, k_cache, v_cache, s->block_table,
                              s->block_table_stride, s->seq_lens, (float *)o, T, s->heads,
                              s->kv_heads, s->head_dim, s->block_size, s->scale, s->max_seq_len);
    if (rc) return rc == -2 && first ? -2 : -1;
    rc = amx_gemm_bf16(o, T, nq, nq, PTR(P_O), H, PTR(P_O_BIAS), attn, H, nth);
    rc |= add_rms_norm_bf16(x, attn, T, H, H, H, PTR(P_POST_NORM), eps[1], h, H, nth);
    rc |= amx_gemm_bf16_silu_mul(h, T, H, H, PTR(P_GATE), I, act, I, nth);
    rc |= amx_gemm_bf16(act, T, I, I, PTR(P_DOWN), H, PTR(P_DOWN_BIAS), delta, H, nth);
    return rc ? -1 : 0;
}
#else
static int layer_bf16(const int64_t *layer, const float *eps, int first, uint16_t *x,
                      const Step *s, const Buffers *b) {
    return -1; /* decode_stack_available() does not offer bfloat16 here */
}
#endif

/* bf16: 0 float32, 1 bfloat16 (x, cos, sin, the weights, caches and out of that type) */
int decode_stack(int bf16, const int64_t *layers, const float *eps, int64_t num_layers, void *x,
                 int64_t tokens, int64_t hidden, int64_t heads, int64_t kv_heads,
                 int64_t head_dim, int64_t intermediate, const void *cos, const void *sin,
                 int64_t cs_tok, const int64_t *slots, const int64_t *block_table,
                 int64_t block_table_stride, const int64_t *seq_lens, int64_t max_seq_len,
                 int64_t block_size, float scale, const void *final_norm, float final_eps,
                 void *out, void *scratch, int64_t num_threads) {
    if (num_layers < 1) return -1;
    const Step s = {tokens, hidden, heads, kv_heads, head_dim, intermediate, num_threads,
                    cos, sin, cs_tok, slots, block_table, seq_lens, block_table_stride,
                    max_seq_len, block_size, scale};
    Buffers b;
    carve(scratch, tokens, hidden, heads * head_dim, kv_heads * head_dim, intermediate,
          bf16 ? 2 : 4, &b);
    for (int64_t l = 0; l < num_layers; l++) {
        const int rc = bf16 ? layer_bf16(layers + l * STACK_PTRS, eps + 2 * l, l == 0, x, &s, &b)
                            : layer_f32(layers + l * STACK_PTRS, eps + 2 * l, l == 0, x, &s, &b);
        if (rc) return rc;
    }
    const int64_t H = hidden, T = tokens;
    const int rc =
        bf16 ? add_rms_norm_bf16(x, (const uint16_t *)b.delta, T, H, H, H, final_norm,
                                 final_eps, out, H, num_threads)
             : add_rms_norm_f32(x, (const float *)b.delta, T, H, H, H, final_norm, final_eps,
                                out, H, num_threads);
    return rc ? -1 : 0;
}

/* which dtypes the stack runs here: bit 0 float32, bit 1 bfloat16 (AMX) */
int decode_stack_available(void) {
#if defined(__AVX512F__)
    int amx_gemm_available(void);
    return 1 | (amx_gemm_available() ? 2 : 0);
#else
    return 1;
#endif
}
#else
int decode_stack_available(void) { return 0; }
#endif
