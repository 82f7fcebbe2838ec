/* Elementwise steps of a decoder layer in one pass each (the CPU forward's RMSNorm and
 * SiLU-gated MLP product). Each replaces a chain of torch ops: RMSNorm is six (to, pow, mean,
 * add, rsqrt, mul, mul), each reading and writing the whole activation, and at prefill sizes
 * (2048 x 576 floats, larger than L2) each of those passes goes to memory.
 *
 * rms_norm_f32: out[r] = weight * (x[r] * 1 / sqrt(mean(x[r]^2) + eps)), HF's Llama order.
 * add_rms_norm_f32: x[r] += delta[r] in place (the residual add), then out[r] = the norm of it.
 * silu_mul_f32: out = gate / (1 + e^-gate) * up, elementwise; out may alias gate.
 * The _bf16 versions take and give bfloat16 and round where torch's bfloat16 ops round: the
 * norm is computed in float32 and rounded before and after the weight multiply, the SiLU is
 * rounded before the product.
 * rotary_f32 / rotary_bf16: the rotate-half rotary embedding of q or k (below).
 * argmax_f32 / argmax_bf16: row-wise first index of the maximum (greedy sampling).
 * Built here with AVX-512; fused_ops_avx2.c has them for AVX2 + FMA. fused_ops_available()
 * says whether the library has them (0: the caller keeps torch's ops).
 */
#include <math.h>
#include <stdint.h>

/* below this, waking the second thread costs more than it saves; a batch-64 decode's rows
 * (64 x 576) are above it, and there the second thread is cheap to use because the worker's
 * OpenMP threads spin between ops */
#define PARALLEL_MIN_FLOATS 8192

#if defined(__AVX512F__)
#include <immintrin.h>

#include "simd_math.h"

int fused_ops_available(void) { return 1; }

static inline __mmask16 first_lanes(int64_t n) {
    return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1);
}

/* 16 values at p (the first `m` lanes) as float32, for either element type */
static inline __attribute__((always_inline)) __m512 load_lanes(const int bf16, const void *p,
                                                          int64_t i, __mmask16 m) {
    return bf16 ? maskz_load_bf16x16(m, (const uint16_t *)p + i)
                : _mm512_maskz_loadu_ps(m, (const float *)p + i);
}

static inline __attribute__((always_inline)) void store_lanes(const int bf16, void *p, int64_t i,
                                                         __mmask16 m, __m512 v) {
    if (bf16)
        _mm256_mask_storeu_epi16((uint16_t *)p + i, m, round_to_bf16x16(v));
    else
        _mm512_mask_storeu_ps((float *)p + i, m, v);
}

/* in bfloat16, the value torch holds after an op's result is stored */
static inline __attribute__((always_inline)) __m512 as_stored(const int bf16, __m512 v) {
    return bf16 ? through_bf16(v) : v;
}

/* With `delta` (add_rms_norm), x[r] += delta[r] first, stored rounded to x's dtype (torch's
 * `residual + hidden`), and the norm is of that sum: the decoder layer's residual add and the
 * next norm in one pass over the row instead of two ops. */
static inline __attribute__((always_inline)) void rms_norm(const int bf16, void *x,
                                                          const void *delta, int64_t rows,
                                                          int64_t dim, int64_t x_stride,
                                                          int64_t delta_stride,
                                                          const void *weight, float eps,
                                                          void *out, int64_t out_stride,
                                                          int64_t num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (rows * dim >= PARALLEL_MIN_FLOATS && num_threads > 1)
    for (int64_t r = 0; r < rows; r++) {
        /* four sums: with one, the FMA chain's latency, not the loads, bounds a 576-wide row */
        __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                         _mm512_setzero_ps()};
        int64_t d = 0;
        for (; d + 64 <= dim; d += 64)
            for (int j = 0; j < 4; j++) {
                __m512 v = load_lanes(bf16, x, r * x_stride + d + 16 * j, 0xFFFF);
                if (delta) {
                    v = as_stored(bf16, _mm512_add_ps(v, load_lanes(bf16, delta, r * delta_stride + d + 16 * j, 0xFFFF)));
                    store_lanes(bf16, x, r * x_stride + d + 16 * j, 0xFFFF, v);
                }
                acc[j] = _mm512_fmadd_ps(v, v, acc[j]);
            }
        for (; d < dim; d += 16) {
            const __mmask16 m = first_lanes(dim - d);
            __m512 v = load_lanes(bf16, x, r * x_stride + d, m);
            if (delta) {
                v = as_stored(bf16, _mm512_add_ps(v, load_lanes(bf16, delta, r * delta_stride + d, m)));
                store_lanes(bf16, x, r * x_stride + d, m, v);
            }
            acc[0] = _mm512_fmadd_ps(v, v, acc[0]);
        }
        const __m512 total = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
        const __m512 scale =
            _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(total) / (float)dim + eps));
        for (int64_t d = 0; d < dim; d += 16) {
            const __mmask16 m = first_lanes(dim - d);
            const __m512 h = as_stored(bf16, _mm512_mul_ps(load_lanes(bf16, x, r * x_stride + d, m), scale));
            store_lanes(bf16, out, r * out_stride + d, m, _mm512_mul_ps(load_lanes(bf16, weight, d, m), h));
        }
    }
}

static inline __attribute__((always_inline)) void silu_mul(const int bf16, const void *gate,
                                                          const void *up, void *out, int64_t n,
                                                          int64_t num_threads) {
    const int64_t chunks = (n + 15) / 16;
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (n >= PARALLEL_MIN_FLOATS && num_threads > 1)
    for (int64_t i = 0; i < chunks; i++) {
        const __mmask16 m = first_lanes(n - 16 * i);
        const __m512 g = load_lanes(bf16, gate, 16 * i, m);
        const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));
        const __m512 s = as_stored(bf16, _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
        store_lanes(bf16, out, 16 * i, m, _mm512_mul_ps(s, load_lanes(bf16, up, 16 * i, m)));
    }
}

/* Rotary position embedding, rotate-half form (Llama): for each token t and head h,
 *   out[d]        = x[d] * cos[d]        - x[d + half] * sin[d]
 *   out[d + half] = x[d + half] * cos[d + half] + x[d] * sin[d + half]     (d < half)
 * as HF's q * cos + rotate_half(q) * sin: two products and a sum, each rounded (no FMA, so
 * float32 gives torch's bits; bfloat16 rounds after each op as torch does).
 * x element (t, h, d) at x[t * x_tok + h * x_head + d]; out likewise; cos/sin at
 * [t * cs_tok + d]. head_dim even, half a multiple of 16 (the caller checks). */
static inline __attribute__((always_inline, optimize("fp-contract=off"))) void rotary(
    const int bf16, const void *x, void *out, int64_t tokens, int64_t heads, int64_t head_dim,
    int64_t x_tok, int64_t x_head, int64_t out_tok, int64_t out_head, const void *cos,
    const void *sin, int64_t cs_tok, int64_t num_threads) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (tokens * heads * head_dim >= PARALLEL_MIN_FLOATS && num_threads > 1)
    for (int64_t t = 0; t < tokens; t++) {
        for (int64_t d = 0; d < half; d += 16) {
            const __m512 c_lo = load_lanes(bf16, cos, t * cs_tok + d, 0xFFFF);
            const __m512 c_hi = load_lanes(bf16, cos, t * cs_tok + half + d, 0xFFFF);
            const __m512 s_lo = load_lanes(bf16, sin, t * cs_tok + d, 0xFFFF);
            const __m512 s_hi = load_lanes(bf16, sin, t * cs_tok + half + d, 0xFFFF);
            for (int64_t h = 0; h < heads; h++) {
                const int64_t xi = t * x_tok + h * x_head + d, oi = t * out_tok + h * out_head + d;
                const __m512 lo = load_lanes(bf16, x, xi, 0xFFFF);
                const __m512 hi = load_lanes(bf16, x, xi + half, 0xFFFF);
                const __m512 a_lo = as_stored(bf16, _mm512_mul_ps(lo, c_lo));
                const __m512 b_lo = as_stored(bf16, _mm512_mul_ps(hi, s_lo));
                const __m512 a_hi = as_stored(bf16, _mm512_mul_ps(hi, c_hi));
                const __m512 b_hi = as_stored(bf16, _mm512_mul_ps(lo, s_hi));
                store_lanes(bf16, out, oi, 0xFFFF, _mm512_sub_ps(a_lo, b_lo));
                store_lanes(bf16, out, oi + half, 0xFFFF, _mm512_add_ps(a_hi, b_hi));
            }
        }
    }
}

/* Row-wise argmax, the first index of the maximum (torch.max(dim=-1).indices), for greedy
 * sampling straight from the logits in their own dtype. Returns -1 when a row holds a NaN
 * (torch ranks NaN above everything; the caller leaves such batches to torch). */
static inline __attribute__((always_inline)) int argmax_rows(const int bf16, const void *x,
                                                            int64_t rows, int64_t cols,
                                                            int64_t stride, int64_t *out,
                                                            int64_t num_threads) {
    int nan_seen = 0;
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (rows * cols >= PARALLEL_MIN_FLOATS && num_threads > 1) reduction(| : nan_seen)
    for (int64_t r = 0; r < rows; r++) {
        __m512 best = _mm512_set1_ps(-INFINITY);
        __mmask16 unordered = 0;
        for (int64_t c = 0; c < cols; c += 16) {
            const __mmask16 m = first_lanes(cols - c); /* lanes past the row keep -inf */
            const __m512 v = load_lanes(bf16, x, r * stride + c, m);
            unordered |= _mm512_mask_cmp_ps_mask(m, v, v, _CMP_UNORD_Q);
            best = _mm512_mask_max_ps(best, m, best, v);
        }
        if (unordered) {
            nan_seen = 1;
            continue;
        }
        const float top = _mm512_reduce_max_ps(best);
        int64_t index = 0;
        for (int64_t c = 0; c < cols; c += 16) { /* the first lane equal to the maximum */
            const __mmask16 hit = _mm512_mask_cmp_ps_mask(
                first_lanes(cols - c), load_lanes(bf16, x, r * stride + c, first_lanes(cols - c)),
                _mm512_set1_ps(top), _CMP_EQ_OQ);
            if (hit) {
                index = c + __builtin_ctz(hit);
                break;
            }
        }
        out[r] = index;
    }
    return nan_seen ? -1 : 0;
}

#include "fused_ops_entries.h"
#elif !(defined(__AVX2__) && defined(__FMA__))
int fused_ops_available(void) { return 0; }
#endif
