/* The fused elementwise ops of fused_ops.c (which see for what each computes and where it
 * rounds) for CPUs with AVX2 and FMA but no AVX-512: 8 lanes instead of 16, scalar tails
 * instead of masked lanes. Same entry points, so the decode stack and the native backend call
 * them as they call the AVX-512 ones.
 */
#include <math.h>
#include <stdint.h>

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>

#define PARALLEL_MIN_FLOATS 8192

int fused_ops_available(void) { return 1; }

static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v = {(uint32_t)h << 16};
    return v.f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch */
    union { float f; uint32_t u; } v = {f};
    return (uint16_t)((v.u + 0x7FFF + ((v.u >> 16) & 1)) >> 16);
}

static inline __attribute__((always_inline)) __m256 load8(const int bf16, const void *p, int64_t i) {
    if (!bf16) return _mm256_loadu_ps((const float *)p + i);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline __m128i round8_to_bf16(__m256 v) {
    __m256i bits = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    bits = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), 0xD8);
    return _mm256_castsi256_si128(packed);
}

static inline __attribute__((always_inline)) void store8(const int bf16, void *p, int64_t i, __m256 v) {
    if (bf16)
        _mm_storeu_si128((__m128i *)((uint16_t *)p + i), round8_to_bf16(v));
    else
        _mm256_storeu_ps((float *)p + i, v);
}

/* in bfloat16, the value torch holds after an op's result is stored */
static inline __attribute__((always_inline)) __m256 as_stored8(const int bf16, __m256 v) {
    if (!bf16) return v;
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(round8_to_bf16(v)), 16));
}

static inline __attribute__((always_inline)) float load1(const int bf16, const void *p, int64_t i) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline __attribute__((always_inline)) void store1(const int bf16, void *p, int64_t i, float v) {
    if (bf16)
        ((uint16_t *)p)[i] = f32_to_bf16(v);
    else
        ((float *)p)[i] = v;
}

static inline __attribute__((always_inline)) float as_stored1(const int bf16, float v) {
    return bf16 ? bf16_to_f32(f32_to_bf16(v)) : v;
}

/* e^x as in simd_math.h's exp512, 8 lanes: x = n ln2 + r, a degree-7 polynomial of e^r, 2^n
 * built in the exponent bits */
static inline __m256 exp256(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f)); /* 2^n stays a normal float */
    x = _mm256_min_ps(x, _mm256_set1_ps(88.3f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187045e-06f), r);
    __m256 p = _mm256_set1_ps(1.f / 5040.f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 720.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}

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
        const int64_t xo = r * x_stride, dl = r * delta_stride, oo = r * out_stride;
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                         _mm256_setzero_ps()};
        int64_t d = 0;
        for (; d + 32 <= dim; d += 32)
            for (int j = 0; j < 4; j++) {
                __m256 v = load8(bf16, x, xo + d + 8 * j);
                if (delta) {
                    v = as_stored8(bf16, _mm256_add_ps(v, load8(bf16, delta, dl + d + 8 * j)));
                    store8(bf16, x, xo + d + 8 * j, v);
                }
                acc[j] = _mm256_fmadd_ps(v, v, acc[j]);
            }
        for (; d + 8 <= dim; d += 8) {
            __m256 v = load8(bf16, x, xo + d);
            if (delta) {
                v = as_stored8(bf16, _mm256_add_ps(v, load8(bf16, delta, dl + d)));
                store8(bf16, x, xo + d, v);
            }
            acc[0] = _mm256_fmadd_ps(v, v, acc[0]);
        }
        const __m256 t = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
        s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        s4 = _mm_add_ss(s4, _mm_movehdup_ps(s4));
        float sum = _mm_cvtss_f32(s4);
        for (; d < dim; d++) {
            float v = load1(bf16, x, xo + d);
            if (delta) {
                v = as_stored1(bf16, v + load1(bf16, delta, dl + d));
                store1(bf16, x, xo + d, v);
            }
            sum += v * v;
        }
        const float scale = 1.0f / sqrtf(sum / (float)dim + eps);
        const __m256 vs = _mm256_set1_ps(scale);
        int64_t e = 0;
        for (; e + 8 <= dim; e += 8) {
            const __m256 h = as_stored8(bf16, _mm256_mul_ps(load8(bf16, x, xo + e), vs));
            store8(bf16, out, oo + e, _mm256_mul_ps(load8(bf16, weight, e), h));
        }
        for (; e < dim; e++)
            store1(bf16, out, oo + e, load1(bf16, weight, e) * as_stored1(bf16, load1(bf16, x, xo + e) * scale));
    }
}

static inline __attribute__((always_inline)) void silu_mul(const int bf16, const void *gate,
                                                          const void *up, void *out, int64_t n,
                                                          int64_t num_threads) {
    const int64_t chunks = n / 8;
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (n >= PARALLEL_MIN_FLOATS && num_threads > 1)
    for (int64_t i = 0; i < chunks; i++) {
        const __m256 g = load8(bf16, gate, 8 * i);
        const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), g));
        const __m256 s = as_stored8(bf16, _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)));
        store8(bf16, out, 8 * i, _mm256_mul_ps(s, load8(bf16, up, 8 * i)));
    }
    for (int64_t i = 8 * chunks; i < n; i++) {
        const float g = load1(bf16, gate, i);
        const float s = as_stored1(bf16, g / (1.0f + expf(-g)));
        store1(bf16, out, i, s * load1(bf16, up, i));
    }
}

/* fused_ops.c's rotary: two products and a sum, each rounded, no FMA (float32 gives torch's
 * bits); half a multiple of 8 here (the caller asks for a multiple of 16) */
static inline __attribute__((always_inline, optimize("fp-contract=off"))) void rotary(
    const int bf16, const void *x, void *out, int64_t tokens, int64_t heads, int64_t head_dim,
    int64_t x_tok, int64_t x_head, int64_t out_tok, int64_t out_head, const void *cos,
    const void *sin, int64_t cs_tok, int64_t num_threads) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (tokens * heads * head_dim >= PARALLEL_MIN_FLOATS && num_threads > 1)
    for (int64_t t = 0; t < tokens; t++) {
        for (int64_t d = 0; d < half; d += 8) {
            const __m256 c_lo = load8(bf16, cos, t * cs_tok + d);
            const __m256 c_hi = load8(bf16, cos, t * cs_tok + half + d);
            const __m256 s_lo = load8(bf16, sin, t * cs_tok + d);
            const __m256 s_hi = load8(bf16, sin, t * cs_tok + half + d);
            for (int64_t h = 0; h < heads; h++) {
                const int64_t xi = t * x_tok + h * x_head + d, oi = t * out_tok + h * out_head + d;
                const __m256 lo = load8(bf16, x, xi), hi = load8(bf16, x, xi + half);
                const __m256 a_lo = as_stored8(bf16, _mm256_mul_ps(lo, c_lo));
                const __m256 b_lo = as_stored8(bf16, _mm256_mul_ps(hi, s_lo));
                const __m256 a_hi = as_stored8(bf16, _mm256_mul_ps(hi, c_hi));
                const __m256 b_hi = as_stored8(bf16, _mm256_mul_ps(lo, s_hi));
                store8(bf16, out, oi, _mm256_sub_ps(a_lo, b_lo));
                store8(bf16, out, oi + half, _mm256_add_ps(a_hi, b_hi));
            }
        }
    }
}

/* first index of each row's maximum; -1 when a row holds a NaN (torch's ranking of NaN is
 * left to torch) */
static inline __attribute__((always_inline)) int argmax_rows(const int bf16, const void *x,
                                                            int64_t rows, int64_t cols,
                                                            int64_t stride, int64_t *out,
                                                            int64_t num_threads) {
    int nan_seen = 0;
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (rows * cols >= PARALLEL_MIN_FLOATS && num_threads > 1) reduction(| : nan_seen)
    for (int64_t r = 0; r < rows; r++) {
        __m256 best = _mm256_set1_ps(-INFINITY), unordered = _mm256_setzero_ps();
        int64_t c = 0;
        for (; c + 8 <= cols; c += 8) {
            const __m256 v = load8(bf16, x, r * stride + c);
            unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            best = _mm256_max_ps(best, v);
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, best);
        float top = -INFINITY;
        int nan_row = _mm256_movemask_ps(unordered) != 0;
        for (int j = 0; j < 8; j++) top = lanes[j] > top ? lanes[j] : top;
        for (int64_t k = c; k < cols; k++) {
            const float v = load1(bf16, x, r * stride + k);
            if (v != v) nan_row = 1;
            top = v > top ? v : top;
        }
        if (nan_row) {
            nan_seen = 1;
            continue;
        }
        int64_t index = 0;
        for (int64_t k = 0; k < cols; k++)
            if (load1(bf16, x, r * stride + k) == top) {
                index = k;
                break;
            }
        out[r] = index;
    }
    return nan_seen ? -1 : 0;
}

#include "fused_ops_entries.h"
#endif
