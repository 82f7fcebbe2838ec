/* A bfloat16 Llama decoder's layers for a pure-decode step, in one call: the same kernels the
 * runner's Python layer loop (worker_svc/decoder_loop.py) calls, with the same arguments in the
 * same order, so the result is that loop's bits. What goes is the loop's per-layer Python
 * (module calls, views, torch allocations, ctypes calls: ~140 us a layer at batch 64), during
 * which the second OpenMP thread can only wait.
 *
 * Per layer l, with x the residual stream [T, hidden] (updated in place):
 *   h = rms_norm(x) (layer 0), else x += delta; h = rms_norm(x)      input norm
 *   qkv = h @ Wqkv^T (+ b)                                             one AMX GEMM
 *   q = rotary(qkv[:, :Nq]), k = rotary(qkv[:, Nq:Nq+Nk]), v = qkv[:, Nq+Nk:]
 *   cache slots <- k, v; o = paged decode attention of q
 *   x += o @ Wo^T (+ b); h = rms_norm(x)                               post-attention norm
 *   delta = (silu(h @ Wg^T) * (h @ Wu^T)) @ Wd^T (+ b)                 the gated MLP
 * and after the last layer x += delta; out = rms_norm(x) with the final norm's weight.
 *
 * Each layer's pointers, DECODE_LAYER_PTRS int64 values at layers[l * DECODE_LAYER_PTRS]:
 * input norm weight, post norm weight, packed qkv, qkv bias (0: none), packed o, o bias,
 * packed gate/up pairs, packed down, down bias, key cache, value cache; eps[2 l] and eps[2 l + 1]
 * the two norms' epsilons. scratch holds decode_stack_scratch_elems() bfloat16 values.
 * Returns 0; -2 when the attention has no bfloat16 body here (checked in layer 0, before x
 * changes: the caller can run its own loop instead); -1 when a kernel refused or ran out of
 * memory part way (x is then undefined).
 */
#include <stdint.h>

#define DECODE_LAYER_PTRS 11

int decode_stack_layer_ptrs(void) { return DECODE_LAYER_PTRS; }

static int64_t padded(int64_t elems) { return (elems + 31) / 32 * 32; } /* 64-byte multiples */

/* h, qkv, q, k, o, attn_out, act, delta */
int64_t decode_stack_scratch_elems(int64_t tokens, int64_t hidden, int64_t heads,
                                   int64_t kv_heads, int64_t head_dim, int64_t intermediate) {
    const int64_t qkv = (heads + 2 * kv_heads) * head_dim;
    return padded(tokens * hidden) * 3 + padded(tokens * qkv) + padded(tokens * heads * head_dim) * 2 +
           padded(tokens * kv_heads * head_dim) + padded(tokens * intermediate);
}

#if defined(__x86_64__) && defined(__AVX512F__) && defined(__GNUC__) && __GNUC__ >= 11

int amx_gemm_bf16(const uint16_t *x, int64_t M, int64_t K, int64_t lda, const uint16_t *packed,
                  int64_t N, const uint16_t *bias, uint16_t *y, int64_t ldy, int64_t num_threads);
int amx_gemm_bf16_silu_mul(const uint16_t *x, int64_t M, int64_t K, int64_t lda,
                           const uint16_t *packed, int64_t N, uint16_t *y, int64_t ldy,
                           int64_t num_threads);
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
int write_kv(const void *k, const void *v, void *k_cache, void *v_cache, const int64_t *slots,
             int64_t tokens, int64_t kv_heads, int64_t head_dim, int64_t elem_size,
             int64_t k_head_stride, int64_t k_token_stride, int64_t v_head_stride,
             int64_t v_token_stride);
int paged_decode_bf16_io(const float *q, const void *k_cache, const void *v_cache,
                         const int64_t *block_table, int64_t block_table_stride,
                         const int64_t *seq_lens, float *out, int64_t rows, int64_t heads,
                         int64_t kv_heads, int64_t head_dim, int64_t block_size, float scale,
                         int64_t max_seq_len);

#define PTR(l, i) ((const uint16_t *)(intptr_t)layers[(l) * DECODE_LAYER_PTRS + (i)])

int decode_stack_bf16(const int64_t *layers, const float *eps, int64_t num_layers, uint16_t *x,
                      int64_t tokens, int64_t hidden, int64_t heads, int64_t kv_heads,
                      int64_t head_dim, int64_t intermediate, const uint16_t *cos,
                      const uint16_t *sin, int64_t cs_tok, const int64_t *slots,
                      const int64_t *block_table, int64_t block_table_stride,
                      const int64_t *seq_lens, int64_t max_seq_len, int64_t block_size,
                      float scale, const uint16_t *final_norm, float final_eps, uint16_t *out,
                      uint16_t *scratch, int64_t num_threads) {
    const int64_t T = tokens, nq = heads * head_dim, nk = kv_heads * head_dim;
    const int64_t nqkv = nq + 2 * nk;
    uint16_t *h = scratch, *qkv = h + padded(T * hidden), *q = qkv + padded(T * nqkv);
    uint16_t *k = q + padded(T * nq), *o = k + padded(T * nk), *attn = o + padded(T * nq);
    uint16_t *act = attn + padded(T * hidden), *delta = act + padded(T * intermediate);
    for (int64_t l = 0; l < num_layers; l++) {
        int rc = l == 0 ? rms_norm_bf16(x, T, hidden, hidden, PTR(l, 0), eps[2 * l], h, hidden,
                                        num_threads)
                        : add_rms_norm_bf16(x, delta, T, hidden, hidden, hidden, PTR(l, 0),
                                            eps[2 * l], h, hidden, num_threads);
        rc |= amx_gemm_bf16(h, T, hidden, hidden, PTR(l, 2), nqkv, PTR(l, 3), qkv, nqkv,
                            num_threads);
        rc |= rotary_bf16(qkv, q, T, heads, head_dim, nqkv, head_dim, nq, head_dim, cos, sin,
                          cs_tok, num_threads);
        rc |= rotary_bf16(qkv + nq, k, T, kv_heads, head_dim, nqkv, head_dim, nk, head_dim, cos,
                          sin, cs_tok, num_threads);
        if (rc) return -1;
        void *k_cache = (void *)PTR(l, 9), *v_cache = (void *)PTR(l, 10);
        write_kv(k, qkv + nq + nk, k_cache, v_cache, slots, T, kv_heads, head_dim, 2, head_dim,
                 nk, head_dim, nqkv);
        rc = paged_decode_bf16_io((const float *)q, k_cache, v_cache, block_table,
                                  block_table_stride, seq_lens, (float *)o, T, heads, kv_heads,
                                  head_dim, block_size, scale, max_seq_len);
        if (rc) return rc == -2 && l == 0 ? -2 : -1;
        rc = amx_gemm_bf16(o, T, nq, nq, PTR(l, 4), hidden, PTR(l, 5), attn, hidden, num_threads);
        rc |= add_rms_norm_bf16(x, attn, T, hidden, hidden, hidden, PTR(l, 1), eps[2 * l + 1], h,
                                hidden, num_threads);
        rc |= amx_gemm_bf16_silu_mul(h, T, hidden, hidden, PTR(l, 6), intermediate, act,
                                     intermediate, num_threads);
        rc |= amx_gemm_bf16(act, T, intermediate, intermediate, PTR(l, 7), hidden, PTR(l, 8),
                            delta, hidden, num_threads);
        if (rc) return -1;
    }
    return add_rms_norm_bf16(x, delta, T, hidden, hidden, hidden, final_norm, final_eps, out,
                             hidden, num_threads)
               ? -1
               : 0;
}

int decode_stack_available(void) { return 1; }
#else
int decode_stack_available(void) { return 0; }
#endif
