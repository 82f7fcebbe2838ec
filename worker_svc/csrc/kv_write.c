/* The KV write: each step's new K and V rows copied into their slots of the block-structured
 * cache (float32 or bfloat16), for the paged attention kernels (paged_attention.c,
 * paged_prefill.c) to read. */
#include <stdint.h>
#include <string.h>

/* Write the step's new K and V into their cache slots. Source element (head h, token t, d) of k
 * sits at k + (h * k_head_stride + t * k_token_stride + d) elements (any layout with d
 * contiguous: the model's [1, kv_heads, T, head_dim] views are often transposed ones); slot s
 * lives at row s of the cache viewed as [num_blocks * block_size, kv_heads, head_dim].
 * elem_size: 4 (float32) or 2 (bfloat16). */
int write_kv(const void *k, const void *v, void *k_cache, void *v_cache, const int64_t *slots,
             int64_t tokens, int64_t kv_heads, int64_t head_dim, int64_t elem_size,
             int64_t k_head_stride, int64_t k_token_stride, int64_t v_head_stride,
             int64_t v_token_stride) {
    const int64_t row = head_dim * elem_size;
#pragma omp parallel for schedule(static) if (tokens * kv_heads > 256)
    for (int64_t t = 0; t < tokens; t++) {
        for (int64_t h = 0; h < kv_heads; h++) {
            const int64_t dst = (slots[t] * kv_heads + h) * row;
            memcpy((char *)k_cache + dst,
                   (const char *)k + (h * k_head_stride + t * k_token_stride) * elem_size, row);
            memcpy((char *)v_cache + dst,
                   (const char *)v + (h * v_head_stride + t * v_token_stride) * elem_size, row);
        }
    }
    return 0;
}
