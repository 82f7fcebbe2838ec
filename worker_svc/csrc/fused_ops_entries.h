/* The exported entry points of the fused elementwise ops, for float32 and bfloat16, over the
 * static bodies the including file defines for its instruction set (fused_ops.c: AVX-512,
 * fused_ops_avx2.c: AVX2 + FMA): rms_norm, silu_mul, argmax_rows, rotary. */
#ifndef SPLITSERVE_FUSED_OPS_ENTRIES_H
#define SPLITSERVE_FUSED_OPS_ENTRIES_H

#define DEFINE_ENTRIES(SUFFIX, T, IS_BF16)                                                   \
    int rms_norm_##SUFFIX(const T *x, int64_t rows, int64_t dim, int64_t x_stride,           \
                          const T *weight, float eps, T *out, int64_t out_stride,            \
                          int64_t num_threads) {                                             \
        rms_norm(IS_BF16, (T *)x, NULL, rows, dim, x_stride, 0, weight, eps, out, out_stride, \
                 num_threads);                                                               \
        return 0;                                                                            \
    }                                                                                        \
    int add_rms_norm_##SUFFIX(T *x, const T *delta, int64_t rows, int64_t dim,               \
                              int64_t x_stride, int64_t delta_stride, const T *weight,       \
                              float eps, T *out, int64_t out_stride, int64_t num_threads) {  \
        rms_norm(IS_BF16, x, delta, rows, dim, x_stride, delta_stride, weight, eps, out,     \
                 out_stride, num_threads);                                                   \
        return 0;                                                                            \
    }                                                                                        \
    int silu_mul_##SUFFIX(const T *gate, const T *up, T *out, int64_t n, int64_t num_threads) { \
        silu_mul(IS_BF16, gate, up, out, n, num_threads);                                    \
        return 0;                                                                            \
    }                                                                                        \
    int argmax_##SUFFIX(const T *x, int64_t rows, int64_t cols, int64_t stride, int64_t *out,  \
                        int64_t num_threads) {                                                \
        return argmax_rows(IS_BF16, x, rows, cols, stride, out, num_threads);                \
    }                                                                                        \
    int rotary_##SUFFIX(const T *x, T *out, int64_t tokens, int64_t heads, int64_t head_dim, \
                        int64_t x_tok, int64_t x_head, int64_t out_tok, int64_t out_head,    \
                        const T *cos, const T *sin, int64_t cs_tok, int64_t num_threads) {   \
        rotary(IS_BF16, x, out, tokens, heads, head_dim, x_tok, x_head, out_tok, out_head,  \
               cos, sin, cs_tok, num_threads);                                               \
        return 0;                                                                            \
    }

DEFINE_ENTRIES(f32, float, 0)
DEFINE_ENTRIES(bf16, uint16_t, 1)

#endif
