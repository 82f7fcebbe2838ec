/* Paged decode attention: the AVX512-BF16 bodies for bfloat16 caches, in two passes (scores,
 * one softmax per head, then V), for the (group, head_dim) pairs in DOT_BODIES; their switch
 * (paged_decode_set_bf16_dot). Entry points, dispatch and the other bodies: paged_attention.c;
 * shared declarations: paged_attention.h.
 *
 * Compiled for AVX512-BF16 by target attributes (checked at run time, so the portable
 * x86-64-v4 build has them too); they never widen K or V to float32.
 */
#include "paged_attention.h"

#if defined(HAVE_BF16_DOT)
int bf16_dot_state = -1;

/* The AVX512-BF16 bodies' shared steps. Arrays have fixed sizes (G <= 4, NV <= 8), not
 * [G][H]: sized by a parameter they would be variable-length arrays, kept on the stack even
 * where G and NV are constants. H = NV / 2 is the number of 32-value slices of a row. */

/* q . k of up to 16 tokens (rows `stride` elements apart from kc) for G query heads, as 16
 * partial-sum vectors each (hsum16 reduces them); tokens past n give zeros. */
BF16_DOT_TARGET static inline __attribute__((always_inline)) void qk_dots_bf16(
    const uint16_t *kc, int64_t stride, int64_t n, __m512i q[4][4], __m512 dots[4][16],
    const int G, const int H) {
    for (int64_t t = 0; t < 16; t++) {
        if (t >= n) {
            for (int g = 0; g < G; g++) dots[g][t] = _mm512_setzero_ps();
            continue;
        }
        __m512i k[4];
        for (int c = 0; c < H; c++) k[c] = _mm512_loadu_si512(kc + t * stride + 32 * c);
        for (int g = 0; g < G; g++) {
            __m512 d = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)q[g][0], (__m512bh)k[0]);
            for (int c = 1; c < H; c++) d = _mm512_dpbf16_ps(d, (__m512bh)q[g][c], (__m512bh)k[c]);
            dots[g][t] = d;
        }
    }
}

/* V rows t and t + 1 of n (a zero row past n) into G heads' accumulators, weighted by the
 * bfloat16 probabilities at w + g * w_stride + t (p[t] low half, p[t + 1] high half): the rows
 * interleaved pairwise (unpack), so the accumulators hold each 32-dim slice's dims permuted
 * (finish_heads_bf16 puts them back). */
BF16_DOT_TARGET static inline __attribute__((always_inline)) void v_pair_bf16(
    const uint16_t *vc, int64_t stride, int64_t t, int64_t n, const uint16_t *w, int64_t w_stride,
    __m512 av[4][8], const int G, const int H) {
    __m512i lo[4], hi[4];
    for (int c = 0; c < H; c++) {
        const __m512i v0 = _mm512_loadu_si512(vc + t * stride + 32 * c);
        const __m512i v1 = t + 1 < n ? _mm512_loadu_si512(vc + (t + 1) * stride + 32 * c)
                                     : _mm512_setzero_si512();
        lo[c] = _mm512_unpacklo_epi16(v0, v1);
        hi[c] = _mm512_unpackhi_epi16(v0, v1);
    }
    for (int g = 0; g < G; g++) {
        uint32_t pair;
        memcpy(&pair, w + g * w_stride + t, sizeof pair);
        const __m512bh wp = (__m512bh)_mm512_set1_epi32((int)pair);
        for (int c = 0; c < H; c++) {
            av[g][2 * c] = _mm512_dpbf16_ps(av[g][2 * c], (__m512bh)lo[c], wp);
            av[g][2 * c + 1] = _mm512_dpbf16_ps(av[g][2 * c + 1], (__m512bh)hi[c], wp);
        }
    }
}

/* G heads' outputs from their accumulators: dims back in order, divided by the sums l, as
 * float32 or (io_bf16) bfloat16 rounded as torch's .to(bfloat16) of the float32 result. */
BF16_DOT_TARGET static inline __attribute__((always_inline)) void finish_heads_bf16(
    const Args *a, __m512 av[4][8], const float *l, float *o, int64_t h0, const int G,
    const int H) {
    /* slice c's accumulators: lo lanes = dims {0-3, 8-11, 16-19, 24-27}, hi = the other four */
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    const int64_t hd = a->head_dim;
    for (int g = 0; g < G; g++) {
        const int64_t h = h0 + g;
        const __m512 inv = _mm512_set1_ps(1.f / l[g]);
        for (int c = 0; c < H; c++) {
            const __m512 o0 = _mm512_mul_ps(_mm512_permutex2var_ps(av[g][2 * c], first, av[g][2 * c + 1]), inv);
            const __m512 o1 = _mm512_mul_ps(_mm512_permutex2var_ps(av[g][2 * c], second, av[g][2 * c + 1]), inv);
            if (a->io_bf16) {
                uint16_t *ob = (uint16_t *)o + h * hd + 32 * c;
                _mm256_storeu_si256((__m256i *)ob, round_to_bf16x16(o0));
                _mm256_storeu_si256((__m256i *)(ob + 16), round_to_bf16x16(o1));
            } else {
                _mm512_storeu_ps(o + h * hd + 32 * c, o0);
                _mm512_storeu_ps(o + h * hd + 32 * c + 16, o1);
            }
        }
    }
}

/* The queries of a row as bfloat16 (as they come, or rounded from float32). */
BF16_DOT_TARGET static inline void queries_bf16(const Args *a, const float *q, uint16_t *qb) {
    const int64_t n = a->heads * a->head_dim;
    if (a->io_bf16)
        memcpy(qb, q, sizeof(uint16_t) * n);
    else
        for (int64_t i = 0; i < n; i += 16)
            _mm256_storeu_si256((__m256i *)(qb + i), round_to_bf16x16(_mm512_loadu_ps(q + i)));
}

/* A row in two passes for a bfloat16 cache with AVX512-BF16. Pass 1 scores every token for
 * every head (block by block, all kv heads of a block together as they lie in memory); then a
 * softmax per head over the whole row with its one maximum (the probabilities rounded to
 * bfloat16 as torch's bfloat16 attention rounds P); pass 2 sums V per kv head, its group's
 * accumulators held in registers from the first token to the last. (A one-pass online softmax,
 * which rescales, reloads and stores every head's accumulators and reduces a running maximum
 * for every 16 tokens, cost more than this second pass over the row, docs/benchmarks.md: the
 * row's V is ~0.4 KB per token, so after the first kv head's pass the others read it from L2.)
 * scratch: m, l, acc, bfloat16 q (the other bodies' state layout), then scores and weights. */
BF16_DOT_TARGET static inline __attribute__((always_inline)) void attend_row_bf16_2pass_gn(
    const Args *a, const int64_t *blocks, int64_t len, const float *q, float *state, float *o,
    const int G, const int NV) {
    const int H = NV / 2;
    const int64_t bs = a->block_size, hd = a->head_dim, heads = a->heads, kvh = a->kv_heads;
    const int64_t stride = kvh * hd, nblocks = (len + bs - 1) / bs;
    const int64_t lp = two_pass_len(a);
    float *l = state + heads;
    uint16_t *qb = (uint16_t *)(state + 2 * heads + heads * hd);
    float *scores = state + heads * (2 + hd + hd / 2 + 16);
    uint16_t *pw = (uint16_t *)(scores + heads * lp);
    queries_bf16(a, q, qb);
    const __m512 scale = _mm512_set1_ps(a->scale);
    /* pass 1: scores */
    prefetch_whole_block(a, blocks, 0, min64(bs, len));
    for (int64_t b = 0; b < nblocks; b++) {
        const int64_t block_start = b * bs, block_n = min64(bs, len - block_start);
        if (b + 1 < nblocks) prefetch_whole_block(a, blocks, b + 1, min64(bs, len - block_start - bs));
        for (int64_t kh = 0; kh < kvh; kh++) {
            const int64_t base = block_offset(a, blocks, b, kh);
            __m512i qv[4][4];
            for (int g = 0; g < G; g++)
                for (int c = 0; c < H; c++) qv[g][c] = _mm512_loadu_si512(qb + (kh * G + g) * hd + 32 * c);
            for (int64_t c0 = 0; c0 < block_n; c0 += 16) {
                const int64_t n = min64(16, block_n - c0);
                const uint16_t *kc = (const uint16_t *)a->k_cache + base + c0 * stride;
                __m512 dots[4][16];
                qk_dots_bf16(kc, stride, n, qv, dots, G, H);
                const __mmask16 valid = n == 16 ? 0xFFFF : (__mmask16)((1u << n) - 1);
                for (int g = 0; g < G; g++)
                    _mm512_mask_storeu_ps(scores + (kh * G + g) * lp + block_start + c0, valid,
                                          _mm512_mul_ps(hsum16(dots[g]), scale));
            }
        }
    }
    /* the softmax of each head's row: its maximum, then weights and their sum */
    for (int64_t h = 0; h < heads; h++) {
        float *sh = scores + h * lp;
        __m512 vmax = _mm512_set1_ps(-INFINITY);
        for (int64_t i = 0; i < len; i += 16)
            vmax = _mm512_mask_max_ps(vmax, len - i >= 16 ? 0xFFFF : (__mmask16)((1u << (len - i)) - 1),
                                      vmax, _mm512_loadu_ps(sh + i));
        const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
        __m512 sum = _mm512_setzero_ps();
        for (int64_t i = 0; i < lp; i += 16) {
            const __mmask16 in = i >= len ? 0 : len - i >= 16 ? 0xFFFF : (__mmask16)((1u << (len - i)) - 1);
            const __m512 p = _mm512_maskz_mov_ps(in, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(in, sh + i), m)));
            sum = _mm512_add_ps(sum, p);
            _mm256_storeu_si256((__m256i *)(pw + h * lp + i), round_to_bf16x16(p)); /* past len: 0 */
        }
        l[h] = _mm512_reduce_add_ps(sum);
    }
    /* pass 2: V, one kv head at a time, its group's accumulators in registers */
    for (int64_t kh = 0; kh < kvh; kh++) {
        __m512 av[4][8];
        for (int g = 0; g < G; g++)
            for (int c = 0; c < NV; c++) av[g][c] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nblocks; b++) {
            const int64_t block_start = b * bs, block_n = min64(bs, len - block_start);
            const uint16_t *vc = (const uint16_t *)a->v_cache + block_offset(a, blocks, b, kh);
            const uint16_t *w = pw + kh * G * lp + block_start;
            for (int64_t t = 0; t < block_n; t += 2) v_pair_bf16(vc, stride, t, block_n, w, lp, av, G, H);
        }
        finish_heads_bf16(a, av, l + kh * G, o, kh * G, G, H);
    }
}

/* 1 where a body exists for this group and head_dim (and the row was done), else 0 */
BF16_DOT_TARGET int attend_row_bf16_dot(const Args *a, const int64_t *blocks, int64_t len,
                                        const float *q, float *state, float *o) {
    const int64_t group = a->heads / a->kv_heads, nv = a->head_dim / 16;
#define DOT_BODY(G, NV)                                                     \
    if (group == G && nv == NV) {                                           \
        attend_row_bf16_2pass_gn(a, blocks, len, q, state, o, G, NV);       \
        return 1;                                                           \
    }
    DOT_BODIES(DOT_BODY)
#undef DOT_BODY
    return 0;
}
#endif

#if defined(__AVX512F__)
/* AVX512-BF16 decode bodies for bfloat16 caches: on (1) where the CPU has them, unless switched
 * off (0) for comparison. Returns whether they are on. */
int paged_decode_set_bf16_dot(int on) {
#if defined(HAVE_BF16_DOT)
    bf16_dot_state = on ? bf16_dot_supported() : 0;
    return bf16_dot_state;
#else
    (void)on;
    return 0;
#endif
}
#endif
