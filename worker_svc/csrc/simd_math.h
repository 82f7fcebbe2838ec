/* Vector math shared by the worker's AVX-512 kernels. */
#ifndef SPLITSERVE_SIMD_MATH_H
#define SPLITSERVE_SIMD_MATH_H
#include <immintrin.h>
#include <stdint.h>

/* e^x, x clamped to [-103, 88.7] (0 and ~3.3e38 at the ends): x = n ln2 + r, |r| <= ln2 / 2,
 * a degree-7 Taylor polynomial of e^r (relative error ~1e-9, below float32 rounding), scaled
 * by 2^n. */
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-103.0f)); /* e^-103 is 0 in float32 */
    x = _mm512_min_ps(x, _mm512_set1_ps(88.7f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
    __m512 p = _mm512_set1_ps(1.f / 5040.f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

/* 16 bfloat16 values (any alignment) as float32: the bf16 bits are the float's high half. */
static inline __m512 load_bf16x16(const uint16_t *p) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline __m512 maskz_load_bf16x16(__mmask16 mask, const uint16_t *p) {
    const __m256i h = _mm256_maskz_loadu_epi16(mask, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* 16 elements at element offset off of a float32 (bf16 = 0) or bfloat16 (bf16 = 1) array, as
 * float32: the caches' load, for either dtype */
static inline __attribute__((always_inline)) __m512 load_f32x16(const int bf16, const void *p,
                                                               int64_t off) {
    return bf16 ? load_bf16x16((const uint16_t *)p + off) : _mm512_loadu_ps((const float *)p + off);
}

/* float32 -> bfloat16 rounding to nearest even, as torch's conversion does (NaN inputs are not
 * expected here). Integer arithmetic only: no AVX-512 BF16 instructions needed. */
static inline __m256i round_to_bf16x16(__m512 v) {
    __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    bits = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16));
}

/* a float32 value as it is after a round trip through bfloat16 */
static inline __m512 through_bf16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(round_to_bf16x16(v)), 16));
}

#endif
