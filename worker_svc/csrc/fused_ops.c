/* float32 elementwise steps of a decoder layer in one pass each (the CPU forward's RMSNorm and
 * SiLU-gated MLP product). Each replaces a chain of torch ops: RMSNorm is six (to, pow, mean,
 * add, rsqrt, mul, mul), each reading and writing the whole activation, and at prefill sizes
 * (2048 x 576 floats, larger than L2) each of those passes goes to memory.
 *
 * rms_norm_f32: out[r] = weight * (x[r] * 1 / sqrt(mean(x[r]^2) + eps)), HF's Llama order.
 * silu_mul_f32: out = gate / (1 + e^-gate) * up, elementwise; out may alias gate.
 * The _bf16 versions take and give bfloat16 and round where torch's bfloat16 ops round: the
 * norm is computed in float32 and rounded before and after the weight multiply, the SiLU is
 * rounded before the product.
 * All return -1 where built without AVX-512 (the caller keeps torch's ops).
 */
#include <math.h>
#include <stdint.h>

#define PARALLEL_MIN_FLOATS 65536 /* below this, waking the second thread costs more */

#if defined(__AVX512F__)
#include <immintrin.h>

#include "simd_math.h"

int rms_norm_f32(const float *x, int64_t rows, int64_t dim, int64_t x_stride, const float *weight,
                 float eps, float *out, int64_t out_stride, int64_t num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (rows * dim >= PARALLEL_MIN_FLOATS && num_threads > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        float *o = out + r * out_stride;
        __m512 acc = _mm512_setzero_ps();
        int64_t d = 0;
        for (; d + 16 <= dim; d += 16) {
            const __m512 v = _mm512_loadu_ps(xr + d);
            acc = _mm512_fmadd_ps(v, v, acc);
        }
        const __mmask16 tail = (__mmask16)((1u << (dim - d)) - 1);
        if (tail) {
            const __m512 v = _mm512_maskz_loadu_ps(tail, xr + d);
            acc = _mm512_fmadd_ps(v, v, acc);
        }
        const float inv = 1.0f / sqrtf(_mm512_reduce_add_ps(acc) / (float)dim + eps);
        const __m512 scale = _mm512_set1_ps(inv);
        for (d = 0; d + 16 <= dim; d += 16) {
            const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(xr + d), scale);
            _mm512_storeu_ps(o + d, _mm512_mul_ps(_mm512_loadu_ps(weight + d), v));
        }
        if (tail) {
            const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, xr + d), scale);
            _mm512_mask_storeu_ps(o + d, tail, _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, weight + d), v));
        }
    }
    return 0;
}

static inline __m512 silu16(__m512 g) {
    const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));
    return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}

static inline __m512 silu_mul16(__m512 g, __m512 u) { return _mm512_mul_ps(silu16(g), u); }

int rms_norm_bf16(const uint16_t *x, int64_t rows, int64_t dim, int64_t x_stride,
                  const uint16_t *weight, float eps, uint16_t *out, int64_t out_stride,
                  int64_t num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (rows * dim >= PARALLEL_MIN_FLOATS && num_threads > 1)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * x_stride;
        uint16_t *o = out + r * out_stride;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t d = 0; d < dim; d += 16) {
            const __mmask16 m = dim - d >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (dim - d)) - 1);
            const __m512 v = maskz_load_bf16x16(m, xr + d);
            acc = _mm512_fmadd_ps(v, v, acc);
        }
        const __m512 scale =
            _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(acc) / (float)dim + eps));
        for (int64_t d = 0; d < dim; d += 16) {
            const __mmask16 m = dim - d >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (dim - d)) - 1);
            const __m512 h = through_bf16(_mm512_mul_ps(maskz_load_bf16x16(m, xr + d), scale));
            const __m512 y = _mm512_mul_ps(maskz_load_bf16x16(m, weight + d), h);
            _mm256_mask_storeu_epi16(o + d, m, round_to_bf16x16(y));
        }
    }
    return 0;
}

int silu_mul_bf16(const uint16_t *gate, const uint16_t *up, uint16_t *out, int64_t n,
                  int64_t num_threads) {
    const int64_t chunks = (n + 15) / 16;
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (n >= PARALLEL_MIN_FLOATS && num_threads > 1)
    for (int64_t i = 0; i < chunks; i++) {
        const int64_t left = n - 16 * i;
        const __mmask16 m = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
        const __m512 s = through_bf16(silu16(maskz_load_bf16x16(m, gate + 16 * i)));
        const __m512 y = _mm512_mul_ps(s, maskz_load_bf16x16(m, up + 16 * i));
        _mm256_mask_storeu_epi16(out + 16 * i, m, round_to_bf16x16(y));
    }
    return 0;
}

int silu_mul_f32(const float *gate, const float *up, float *out, int64_t n, int64_t num_threads) {
    const int64_t vectors = n / 16;
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (n >= PARALLEL_MIN_FLOATS && num_threads > 1)
    for (int64_t i = 0; i < vectors; i++)
        _mm512_storeu_ps(out + 16 * i,
                         silu_mul16(_mm512_loadu_ps(gate + 16 * i), _mm512_loadu_ps(up + 16 * i)));
    const __mmask16 tail = (__mmask16)((1u << (n - 16 * vectors)) - 1);
    if (tail)
        _mm512_mask_storeu_ps(out + 16 * vectors, tail,
                              silu_mul16(_mm512_maskz_loadu_ps(tail, gate + 16 * vectors),
                                         _mm512_maskz_loadu_ps(tail, up + 16 * vectors)));
    return 0;
}
#else
int rms_norm_f32(const float *x, int64_t rows, int64_t dim, int64_t x_stride, const float *weight,
                 float eps, float *out, int64_t out_stride, int64_t num_threads) {
    (void)x, (void)rows, (void)dim, (void)x_stride, (void)weight, (void)eps, (void)out;
    (void)out_stride, (void)num_threads;
    return -1;
}

int silu_mul_f32(const float *gate, const float *up, float *out, int64_t n, int64_t num_threads) {
    (void)gate, (void)up, (void)out, (void)n, (void)num_threads;
    return -1;
}

int rms_norm_bf16(const uint16_t *x, int64_t rows, int64_t dim, int64_t x_stride,
                  const uint16_t *weight, float eps, uint16_t *out, int64_t out_stride,
                  int64_t num_threads) {
    (void)x, (void)rows, (void)dim, (void)x_stride, (void)weight, (void)eps, (void)out;
    (void)out_stride, (void)num_threads;
    return -1;
}

int silu_mul_bf16(const uint16_t *gate, const uint16_t *up, uint16_t *out, int64_t n,
                  int64_t num_threads) {
    (void)gate, (void)up, (void)out, (void)n, (void)num_threads;
    return -1;
}
#endif
