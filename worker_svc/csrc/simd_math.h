/* Vector math shared by the worker's AVX-512 kernels. */
#ifndef SPLITSERVE_SIMD_MATH_H
#define SPLITSERVE_SIMD_MATH_H
#include <immintrin.h>

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

#endif
