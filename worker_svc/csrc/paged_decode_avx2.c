/* Paged decode attention for CPUs with AVX2 and FMA but no AVX-512 (see paged_attention.c for
 * the layout and the AVX-512 bodies). One work item per request row: its blocks are walked once
 * for the scores and once for the weighted V, each block's tokens read with every kv head's
 * vectors side by side (a token's K for all kv heads is one contiguous run), so memory serves
 * whole runs; the queries of a kv head's group share each K and V vector. head_dim a multiple of
 * 8, up to 256; float32 or bfloat16 caches (widened to float32 in registers).
 */
#include "paged_attention.h"

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>

#define MAX_VECS8 32 /* head_dim up to 256 */

static inline __attribute__((always_inline)) __m256 load8(const int bf16, const void *p, int64_t i) {
    if (!bf16) return _mm256_loadu_ps((const float *)p + i);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

INTERNAL int paged_decode_avx2_applies(const Args *a) {
    return a->head_dim % 8 == 0 && a->head_dim / 8 <= MAX_VECS8 && !a->io_bf16;
}

/* scores [heads, len] (scratch), then softmax per head, then out [heads, head_dim] */
static void attend_row(const Args *a, const int64_t *blocks, int64_t len, const float *q,
                       float *scores, float *out) {
    const int bf16 = a->bf16;
    const int64_t hd = a->head_dim, nv = hd / 8, kvh = a->kv_heads, heads = a->heads;
    const int64_t group = heads / kvh, bs = a->block_size, stride = kvh * hd;
    const int64_t ld = a->max_seq_len > 0 ? a->max_seq_len : 1;
    for (int64_t start = 0, b = 0; start < len; start += bs, b++) {
        const int64_t n = min64(bs, len - start);
        const int64_t base = blocks[b] * bs * stride;
        for (int64_t t = 0; t < n; t++) {
            for (int64_t kh = 0; kh < kvh; kh++) {
                const int64_t off = base + t * stride + kh * hd;
                __m256 k[MAX_VECS8];
                for (int64_t c = 0; c < nv; c++) k[c] = load8(bf16, a->k_cache, off + 8 * c);
                for (int64_t g = 0; g < group; g++) {
                    const int64_t h = kh * group + g;
                    const float *qh = q + h * hd;
                    __m256 acc0 = _mm256_mul_ps(_mm256_loadu_ps(qh), k[0]);
                    __m256 acc1 = _mm256_setzero_ps();
                    int64_t c = 1;
                    for (; c + 1 < nv; c += 2) {
                        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 8 * c), k[c], acc1);
                        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 8 * c + 8), k[c + 1], acc0);
                    }
                    if (c < nv) acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 8 * c), k[c], acc1);
                    scores[h * ld + start + t] = hsum8(_mm256_add_ps(acc0, acc1)) * a->scale;
                }
            }
        }
    }
    for (int64_t h = 0; h < heads; h++) {
        float *s = scores + h * ld, m = -INFINITY, sum = 0.f;
        for (int64_t j = 0; j < len; j++) m = s[j] > m ? s[j] : m;
        for (int64_t j = 0; j < len; j++) {
            s[j] = expf(s[j] - m);
            sum += s[j];
        }
        const float inv = 1.f / sum;
        for (int64_t j = 0; j < len; j++) s[j] *= inv;
    }
    for (int64_t i = 0; i < heads * hd; i += 8) _mm256_storeu_ps(out + i, _mm256_setzero_ps());
    for (int64_t start = 0, b = 0; start < len; start += bs, b++) {
        const int64_t n = min64(bs, len - start);
        const int64_t base = blocks[b] * bs * stride;
        for (int64_t t = 0; t < n; t++) {
            for (int64_t kh = 0; kh < kvh; kh++) {
                const int64_t off = base + t * stride + kh * hd;
                for (int64_t c = 0; c < nv; c++) {
                    const __m256 v = load8(bf16, a->v_cache, off + 8 * c);
                    for (int64_t g = 0; g < group; g++) {
                        const int64_t h = kh * group + g;
                        float *o = out + h * hd + 8 * c;
                        const __m256 p = _mm256_set1_ps(scores[h * ld + start + t]);
                        _mm256_storeu_ps(o, _mm256_fmadd_ps(p, v, _mm256_loadu_ps(o)));
                    }
                }
            }
        }
    }
}

INTERNAL int paged_decode_avx2(const Args *a, int64_t rows) {
    int failed = 0;
    const int64_t ld = a->max_seq_len > 0 ? a->max_seq_len : 1;
#pragma omp parallel
    {
        float *scores = malloc(sizeof(float) * a->heads * ld);
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < rows; r++) {
            if (!scores) continue;
            const int64_t at = r * a->heads * a->head_dim;
            attend_row(a, a->block_table + r * a->block_table_stride, a->seq_lens[r], a->q + at,
                       scores, a->out + at);
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
#endif
