/* Paged decode attention on the CPU, reading K/V straight from the block-structured cache.
 *
 * The torch path gathers every decode row's blocks into a contiguous copy (index_select) before
 * SDPA: at batch 64 that copy is most of the attention time, as it moves the whole context
 * through memory twice more. Here each request row walks its block table once, block by block,
 * reading each block's K and V for every kv head in two sequential runs (per (row, kv head)
 * items would read them as 256-byte pieces 768 bytes apart, which memory serves worse, and
 * decode attention at long contexts is bound by the memory read rate); per query head
 * an online softmax over the scores, then the weighted sum of V. Rows are spread over the
 * OpenMP threads torch already runs (same libgomp). The plain path (no AVX-512) splits the
 * work by (row, kv head) and keeps a scores buffer.
 *
 * Layout: caches [num_blocks, block_size, kv_heads, head_dim] (float32 or bfloat16), queries
 * and outputs float32 [rows, heads, head_dim], block_table int64 [rows, block_table_stride],
 * seq_lens int64 [rows] (tokens to attend to, the new one included, already written).
 * With AVX-512 and head_dim a multiple of 16 (up to 256) the dot products and the V sum run
 * on 16-float vectors; otherwise a plain loop the compiler vectorises as it can. bfloat16
 * caches on CPUs with AVX512-BF16 (checked at run time, so the portable x86-64-v4 build has them
 * too) take dot-product bodies that never widen K or V to float32.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>

#include "simd_math.h"
#define MAX_VECS 16 /* head_dim up to 256 */
#endif

typedef struct {
    const float *q;
    const void *k_cache, *v_cache;
    const int64_t *block_table;
    int64_t block_table_stride;
    const int64_t *seq_lens;
    float *out;
    int64_t heads, kv_heads, head_dim, block_size;
    float scale;
    int64_t max_seq_len;
    int bf16;
    int io_bf16; /* q and out bfloat16 (the AVX512-BF16 bodies only), else float32 */
} Args;

static inline float bf16_to_f32(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Element offset of the first token of block slot b (head kh) in a cache; the tokens of a block
 * follow each other kv_heads * head_dim elements apart. Walking block by block keeps integer
 * division out of the inner loops (a division by a runtime divisor is slow, and one per token
 * would be a large share of the kernel's time). */
static inline int64_t block_offset(const Args *a, const int64_t *blocks, int64_t b, int64_t kh) {
    return (blocks[b] * a->block_size * a->kv_heads + kh) * a->head_dim;
}

static inline float load_at(const Args *a, const void *cache, int64_t off) {
    return a->bf16 ? bf16_to_f32(((const uint16_t *)cache)[off]) : ((const float *)cache)[off];
}

static inline int64_t min64(int64_t x, int64_t y) { return x < y ? x : y; }

static void softmax_rows(float *scores, int64_t group, int64_t stride, int64_t len) {
    for (int64_t g = 0; g < group; g++) {
        float *sg = scores + g * stride;
        float m = -INFINITY;
        for (int64_t j = 0; j < len; j++) m = sg[j] > m ? sg[j] : m;
        float sum = 0.f;
        for (int64_t j = 0; j < len; j++) {
            sg[j] = expf(sg[j] - m);
            sum += sg[j];
        }
        const float inv = 1.f / sum;
        for (int64_t j = 0; j < len; j++) sg[j] *= inv;
    }
}

#if defined(__AVX512F__)
/* q . k for one cached token, as 16 partial sums (reduced 16 tokens at a time by hsum16). */
static inline __attribute__((always_inline)) __m512 dot_k(const int bf16, const void *k_cache,
                                                         int64_t off, const __m512 *qv,
                                                         const int64_t nv) {
    __m512 d = _mm512_mul_ps(qv[0], load_f32x16(bf16, k_cache, off));
    for (int64_t c = 1; c < nv; c++) d = _mm512_fmadd_ps(qv[c], load_f32x16(bf16, k_cache, off + 16 * c), d);
    return d;
}

/* The sums of 16 vectors, as the 16 lanes of one (lane i = sum of v[i]): a transpose-and-add
 * tree, ~2 shuffles per vector where a reduction per vector costs ~4. */
static inline __attribute__((always_inline)) __m512 hsum16(const __m512 *v) {
    __m512 t[8], u[4];
    for (int i = 0; i < 8; i++)
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++)
        u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88),
                                    _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
    const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88),
                                    _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xDD));
}

/* One chunk of up to 16 cached tokens (from element offset off0, one kv head) into the online
 * softmax of the `group` query heads sharing that kv head: the chunk's scores, the running max
 * m and sum l, and V weighted into accumulators rescaled when the max grows. K and V of the
 * chunk are read while in L1, and no scores buffer is written and read back.
 * nv (head_dim / 16) is a parameter of always-inlined bodies so that the dispatch below can
 * pass a constant (4: head_dim 64, 8: 128): loops unroll and accumulators stay in registers. */
static inline __attribute__((always_inline)) void attend_chunk(
    const Args *a, int64_t off0, int64_t n, const float *qh, int64_t group, float *m, float *l,
    float *acc, const int64_t nv, const int bf16) {
    const int64_t stride = a->kv_heads * a->head_dim, hd = a->head_dim;
    const __m512 scale = _mm512_set1_ps(a->scale);
    const __mmask16 valid = n == 16 ? 0xFFFF : (__mmask16)((1u << n) - 1);
    for (int64_t g = 0; g < group; g++) {
        __m512 qv[MAX_VECS], dots[16];
        for (int64_t c = 0; c < nv; c++) qv[c] = _mm512_loadu_ps(qh + g * hd + 16 * c);
        if (n == 16) { /* the usual case: no per-token test, the loop unrolls */
            for (int64_t t = 0; t < 16; t++)
                dots[t] = dot_k(bf16, a->k_cache, off0 + t * stride, qv, nv);
        } else {
            for (int64_t t = 0; t < 16; t++)
                dots[t] = t < n ? dot_k(bf16, a->k_cache, off0 + t * stride, qv, nv)
                                : _mm512_setzero_ps();
        }
        const __m512 s = _mm512_mul_ps(hsum16(dots), scale);
        const float m_new = fmaxf(m[g], _mm512_mask_reduce_max_ps(valid, s));
        const float alpha = expf(m[g] - m_new); /* 0 on the first chunk (m = -inf) */
        const __m512 p = _mm512_maskz_mov_ps(valid, exp512(_mm512_sub_ps(s, _mm512_set1_ps(m_new))));
        m[g] = m_new;
        l[g] = l[g] * alpha + _mm512_reduce_add_ps(p);
        float pw[16];
        _mm512_storeu_ps(pw, p);
        float *ag = acc + g * hd;
        __m512 av[MAX_VECS];
        const __m512 al = _mm512_set1_ps(alpha);
        for (int64_t c = 0; c < nv; c++) av[c] = _mm512_mul_ps(_mm512_loadu_ps(ag + 16 * c), al);
        for (int64_t t = 0; t < n; t++) {
            const int64_t off = off0 + t * stride;
            const __m512 pt = _mm512_set1_ps(pw[t]);
            for (int64_t c = 0; c < nv; c++)
                av[c] = _mm512_fmadd_ps(pt, load_f32x16(bf16, a->v_cache, off + 16 * c), av[c]);
        }
        for (int64_t c = 0; c < nv; c++) _mm512_storeu_ps(ag + 16 * c, av[c]);
    }
}

/* attend_chunk for a bfloat16 cache, all G query heads of the kv head together: each K and V
 * row is converted to float32 once instead of once per query head (the conversions, not the
 * memory, bound a bfloat16 kernel that converts per head). G x NV accumulators must fit the
 * registers (<= 16). */
static inline __attribute__((always_inline)) void attend_chunk_bf16_group(
    const Args *a, int64_t off0, int64_t n, const float *qh, float *m, float *l, float *acc,
    const int G, const int NV) {
    const int64_t stride = a->kv_heads * a->head_dim, hd = a->head_dim;
    const __m512 scale = _mm512_set1_ps(a->scale);
    const __mmask16 valid = n == 16 ? 0xFFFF : (__mmask16)((1u << n) - 1);
    __m512 dots[4][16]; /* fixed sizes: G <= 4, NV <= 8 (see attend_chunk_bf16_dot) */
    for (int64_t t = 0; t < 16; t++) {
        if (t >= n) {
            for (int g = 0; g < G; g++) dots[g][t] = _mm512_setzero_ps();
            continue;
        }
        __m512 k[8];
        for (int c = 0; c < NV; c++) k[c] = load_f32x16(1, a->k_cache, off0 + t * stride + 16 * c);
        for (int g = 0; g < G; g++) {
            __m512 d = _mm512_mul_ps(_mm512_loadu_ps(qh + g * hd), k[0]);
            for (int c = 1; c < NV; c++) d = _mm512_fmadd_ps(_mm512_loadu_ps(qh + g * hd + 16 * c), k[c], d);
            dots[g][t] = d;
        }
    }
    float pw[4][16], alpha[4];
    for (int g = 0; g < G; g++) {
        const __m512 sc = _mm512_mul_ps(hsum16(dots[g]), scale);
        const float m_new = fmaxf(m[g], _mm512_mask_reduce_max_ps(valid, sc));
        alpha[g] = expf(m[g] - m_new); /* 0 on the first chunk (m = -inf) */
        const __m512 p = _mm512_maskz_mov_ps(valid, exp512(_mm512_sub_ps(sc, _mm512_set1_ps(m_new))));
        m[g] = m_new;
        l[g] = l[g] * alpha[g] + _mm512_reduce_add_ps(p);
        _mm512_storeu_ps(pw[g], p);
    }
    __m512 av[4][8];
    for (int g = 0; g < G; g++)
        for (int c = 0; c < NV; c++)
            av[g][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * hd + 16 * c), _mm512_set1_ps(alpha[g]));
    for (int64_t t = 0; t < n; t++) {
        __m512 v[8];
        for (int c = 0; c < NV; c++) v[c] = load_f32x16(1, a->v_cache, off0 + t * stride + 16 * c);
        for (int g = 0; g < G; g++) {
            const __m512 pt = _mm512_set1_ps(pw[g][t]);
            for (int c = 0; c < NV; c++) av[g][c] = _mm512_fmadd_ps(pt, v[c], av[g][c]);
        }
    }
    for (int g = 0; g < G; g++)
        for (int c = 0; c < NV; c++) _mm512_storeu_ps(acc + g * hd + 16 * c, av[g][c]);
}

/* Blocks sit wherever the block table put them: hardware prefetchers cannot guess the next
 * one, so its K and V (every kv head: two contiguous runs) are fetched by hand while the
 * current one is scored. */
static inline void prefetch_whole_block(const Args *a, const int64_t *blocks, int64_t b, int64_t n) {
    const int64_t esz = a->bf16 ? 2 : 4, bytes = n * a->kv_heads * a->head_dim * esz;
    const int64_t off = block_offset(a, blocks, b, 0) * esz;
    const char *k = (const char *)a->k_cache + off, *v = (const char *)a->v_cache + off;
    for (int64_t c = 0; c < bytes; c += 64) {
        __builtin_prefetch(k + c, 0, 3);
        __builtin_prefetch(v + c, 0, 3);
    }
}

#if defined(__GNUC__) && __GNUC__ >= 10
#include <cpuid.h>
#define BF16_DOT_TARGET __attribute__((target("avx512f,avx512bw,avx512bf16")))
#define HAVE_BF16_DOT 1

/* -1: not asked yet; 0: off (no AVX512-BF16, or switched off); 1: on */
static int bf16_dot_state = -1;

static int bf16_dot_supported(void) {
    unsigned eax, ebx, ecx, edx;
    return __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) && (eax & (1u << 5));
}

static int bf16_dot_enabled(void) {
    if (bf16_dot_state < 0) bf16_dot_state = bf16_dot_supported();
    return bf16_dot_state;
}

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

/* A bfloat16 cache's chunk of up to 16 tokens with AVX512-BF16 dot products (vdpbf16ps), all G
 * query heads of the kv head together. K and V are never widened to float32: q . k takes the
 * K row's bfloat16 pairs as they are (q is bfloat16 already in a bfloat16 model, so exact), and
 * V is summed two tokens at a time, the rows interleaved pairwise (unpack) and weighted by the
 * probabilities rounded to bfloat16 (as torch's bfloat16 attention rounds P before P.V), with
 * float32 accumulation. The accumulators hold the dims of each 32-dim slice permuted (what
 * the unpacks give); attend_row_bf16_dot puts them back in order once per row. */
BF16_DOT_TARGET static inline __attribute__((always_inline)) void attend_chunk_bf16_dot(
    const Args *a, int64_t off0, int64_t n, const uint16_t *qb, float *m, float *l, float *acc,
    const int G, const int NV) {
    const int H = NV / 2; /* 32-value slices of a row */
    const int64_t stride = a->kv_heads * a->head_dim, hd = a->head_dim;
    const uint16_t *kc = (const uint16_t *)a->k_cache + off0, *vc = (const uint16_t *)a->v_cache + off0;
    const __m512 scale = _mm512_set1_ps(a->scale);
    const __mmask16 valid = n == 16 ? 0xFFFF : (__mmask16)((1u << n) - 1);
    __m512i q[4][4];
    for (int g = 0; g < G; g++)
        for (int c = 0; c < H; c++) q[g][c] = _mm512_loadu_si512(qb + g * hd + 32 * c);
    __m512 dots[4][16];
    qk_dots_bf16(kc, stride, n, q, dots, G, H);
    uint16_t pw[4][16];
    float alpha[16], shift[16] = {0};
    __m512 sc[4];
    for (int g = 0; g < G; g++) {
        sc[g] = _mm512_mul_ps(hsum16(dots[g]), scale);
        const float chunk_max = _mm512_mask_reduce_max_ps(valid, sc[g]);
        const float m_new = chunk_max > m[g] ? chunk_max : m[g];
        shift[g] = m[g] - m_new; /* -inf on the first chunk: alpha ~0 against a zero state */
        m[g] = m_new;
    }
    _mm512_storeu_ps(alpha, exp512(_mm512_loadu_ps(shift))); /* 1 exactly where m stays */
    for (int g = 0; g < G; g++) {
        const __m512 p = _mm512_maskz_mov_ps(valid, exp512(_mm512_sub_ps(sc[g], _mm512_set1_ps(m[g]))));
        l[g] = l[g] * alpha[g] + _mm512_reduce_add_ps(p);
        _mm256_storeu_si256((__m256i *)pw[g], round_to_bf16x16(p)); /* invalid tokens: 0 */
    }
    __m512 av[4][8];
    for (int g = 0; g < G; g++)
        for (int c = 0; c < NV; c++)
            av[g][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * hd + 16 * c), _mm512_set1_ps(alpha[g]));
    for (int64_t t = 0; t < n; t += 2) v_pair_bf16(vc, stride, t, n, &pw[0][0], 16, av, G, H);
    for (int g = 0; g < G; g++)
        for (int c = 0; c < NV; c++) _mm512_storeu_ps(acc + g * hd + 16 * c, av[g][c]);
}

/* attend_row_avx512_nv for a bfloat16 cache through attend_chunk_bf16_dot. state holds
 * [heads] m, [heads] l, [heads][head_dim] acc and the queries as bfloat16. */
BF16_DOT_TARGET static inline __attribute__((always_inline)) void attend_row_bf16_dot_gn(
    const Args *a, const int64_t *blocks, int64_t len, const float *q, float *state, float *o,
    const int G, const int NV) {
    const int64_t bs = a->block_size, hd = a->head_dim, heads = a->heads;
    const int64_t nblocks = (len + bs - 1) / bs;
    float *m = state, *l = state + heads, *acc = state + 2 * heads;
    uint16_t *qb = (uint16_t *)(acc + heads * hd);
    for (int64_t h = 0; h < heads; h++) m[h] = -INFINITY, l[h] = 0.f;
    memset(acc, 0, sizeof(float) * heads * hd);
    queries_bf16(a, q, qb);
    prefetch_whole_block(a, blocks, 0, min64(bs, len));
    for (int64_t b = 0; b < nblocks; b++) {
        const int64_t block_start = b * bs, block_n = min64(bs, len - block_start);
        if (b + 1 < nblocks) prefetch_whole_block(a, blocks, b + 1, min64(bs, len - block_start - bs));
        for (int64_t kh = 0; kh < a->kv_heads; kh++) {
            const int64_t base = block_offset(a, blocks, b, kh), h0 = kh * G;
            for (int64_t c0 = 0; c0 < block_n; c0 += 16)
                attend_chunk_bf16_dot(a, base + c0 * a->kv_heads * hd, min64(16, block_n - c0),
                                      qb + h0 * hd, m + h0, l + h0, acc + h0 * hd, G, NV);
        }
    }
    for (int64_t kh = 0; kh < a->kv_heads; kh++) {
        __m512 av[4][8];
        for (int g = 0; g < G; g++)
            for (int c = 0; c < NV; c++) av[g][c] = _mm512_loadu_ps(acc + (kh * G + g) * hd + 16 * c);
        finish_heads_bf16(a, av, l + kh * G, o, kh * G, G, NV / 2);
    }
}

/* 1: two passes (below), 0: the one-pass online softmax, for comparison */
static int two_pass_state = 1;

/* The two-pass body's row length in its scratch: max_seq_len padded to whole pairs of
 * 16-vectors. */
static inline int64_t two_pass_len(const Args *a) {
    return ((a->max_seq_len > 0 ? a->max_seq_len : 1) + 31) & ~(int64_t)31;
}

/* Scratch floats a row needs in the two-pass body beyond the one-pass state: a score and a
 * bfloat16 weight per head and token. */
static inline int64_t two_pass_floats(const Args *a) {
    return a->heads * two_pass_len(a) * 3 / 2;
}

/* A row in two passes for a bfloat16 cache with AVX512-BF16. Pass 1 scores every token for
 * every head (block by block, all kv heads of a block together as they lie in memory); then a
 * softmax per head over the whole row with its one maximum (the probabilities rounded to
 * bfloat16 as torch's bfloat16 attention rounds P); pass 2 sums V per kv head, its group's
 * accumulators held in registers from the first token to the last. The one-pass online softmax
 * (kept for comparison) rescales, reloads and stores every head's accumulators and reduces a
 * running maximum for every 16 tokens, which costs more than a second pass over the row: the
 * row's V is ~0.4 KB per token, so after the first kv head's pass the others read it from L2.
 * scratch: the one-pass state's layout (m, l, acc, bfloat16 q), then scores and weights. */
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

/* the (group, head_dim / 16) pairs with an AVX512-BF16 body; G x NV accumulators <= 16 */
#define DOT_BODIES(X) X(1, 4) X(2, 4) X(3, 4) X(4, 4) X(1, 8) X(2, 8)

static int bf16_dot_has_body(int64_t group, int64_t nv) {
#define HAS_BODY(G, NV) if (group == G && nv == NV) return 1;
    DOT_BODIES(HAS_BODY)
#undef HAS_BODY
    return 0;
}

/* 1 where a body exists for this group and head_dim (and the row was done), else 0 */
BF16_DOT_TARGET static int attend_row_bf16_dot(const Args *a, const int64_t *blocks, int64_t len,
                                               const float *q, float *state, float *o) {
    const int64_t group = a->heads / a->kv_heads, nv = a->head_dim / 16;
#define DOT_BODY(G, NV)                                                     \
    if (group == G && nv == NV) {                                           \
        if (two_pass_state)                                                 \
            attend_row_bf16_2pass_gn(a, blocks, len, q, state, o, G, NV);   \
        else                                                                \
            attend_row_bf16_dot_gn(a, blocks, len, q, state, o, G, NV);     \
        return 1;                                                           \
    }
    DOT_BODIES(DOT_BODY)
#undef DOT_BODY
    return 0;
}
#endif

/* The AVX512-BF16 bodies in two passes (1, the default) or as the one-pass online softmax (0),
 * for comparison. Returns the setting. */
int paged_decode_set_two_pass(int on) {
#if defined(HAVE_BF16_DOT)
    two_pass_state = on ? 1 : 0;
    return two_pass_state;
#else
    (void)on;
    return 0;
#endif
}

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

/* One request row, every kv head: block by block, each block's K and V (contiguous across the
 * kv heads) read once in two sequential runs, the next block prefetched meanwhile. State per
 * query head: running max, sum and accumulator ([heads] m, [heads] l, [heads][head_dim] acc). */
static inline __attribute__((always_inline)) void attend_row_avx512_nv(
    const Args *a, const int64_t *blocks, int64_t len, const float *q, float *state, float *o,
    const int64_t nv, const int bf16) {
    const int64_t bs = a->block_size, hd = a->head_dim, heads = a->heads;
    const int64_t group = heads / a->kv_heads, nblocks = (len + bs - 1) / bs;
    float *m = state, *l = state + heads, *acc = state + 2 * heads;
    for (int64_t h = 0; h < heads; h++) m[h] = -INFINITY, l[h] = 0.f;
    memset(acc, 0, sizeof(float) * heads * hd);
    prefetch_whole_block(a, blocks, 0, min64(bs, len));
    for (int64_t b = 0; b < nblocks; b++) {
        const int64_t block_start = b * bs, block_n = min64(bs, len - block_start);
        if (b + 1 < nblocks) prefetch_whole_block(a, blocks, b + 1, min64(bs, len - block_start - bs));
        for (int64_t kh = 0; kh < a->kv_heads; kh++) {
            const int64_t base = block_offset(a, blocks, b, kh), h0 = kh * group;
            for (int64_t c0 = 0; c0 < block_n; c0 += 16) {
                const int64_t off = base + c0 * a->kv_heads * hd, n = min64(16, block_n - c0);
                if (bf16 && nv == 4 && group == 3)
                    attend_chunk_bf16_group(a, off, n, q + h0 * hd, m + h0, l + h0, acc + h0 * hd, 3, 4);
                else if (bf16 && nv == 4 && group == 4)
                    attend_chunk_bf16_group(a, off, n, q + h0 * hd, m + h0, l + h0, acc + h0 * hd, 4, 4);
                else if (bf16 && nv == 8 && group == 2)
                    attend_chunk_bf16_group(a, off, n, q + h0 * hd, m + h0, l + h0, acc + h0 * hd, 2, 8);
                else
                    attend_chunk(a, off, n, q + h0 * hd, group, m + h0, l + h0, acc + h0 * hd, nv, bf16);
            }
        }
    }
    for (int64_t h = 0; h < heads; h++) {
        const __m512 inv = _mm512_set1_ps(1.f / l[h]);
        for (int64_t c = 0; c < nv; c++)
            _mm512_storeu_ps(o + h * hd + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(acc + h * hd + 16 * c), inv));
    }
}

static void attend_row_avx512(const Args *a, const int64_t *blocks, int64_t len, const float *q,
                              float *state, float *o) {
    const int64_t nv = a->head_dim / 16;
#if defined(HAVE_BF16_DOT)
    if (a->bf16 && bf16_dot_enabled() && attend_row_bf16_dot(a, blocks, len, q, state, o)) return;
#endif
#define ROW_NV(BF16)                                                            \
    do {                                                                        \
        if (nv == 4)                                                            \
            attend_row_avx512_nv(a, blocks, len, q, state, o, 4, BF16);         \
        else if (nv == 8)                                                       \
            attend_row_avx512_nv(a, blocks, len, q, state, o, 8, BF16);         \
        else                                                                    \
            attend_row_avx512_nv(a, blocks, len, q, state, o, nv, BF16);        \
    } while (0)
    if (a->bf16)
        ROW_NV(1);
    else
        ROW_NV(0);
#undef ROW_NV
}

#endif

static void scores_plain(const Args *a, const int64_t *blocks, int64_t len, int64_t kh,
                         const float *qh, int64_t group, float *scores) {
    const int64_t bs = a->block_size, stride = a->kv_heads * a->head_dim;
    for (int64_t start = 0, b = 0; start < len; start += bs, b++) {
        const int64_t base = block_offset(a, blocks, b, kh), n = min64(bs, len - start);
        for (int64_t t = 0; t < n; t++) {
            const int64_t off = base + t * stride;
            for (int64_t g = 0; g < group; g++) {
                const float *qg = qh + g * a->head_dim;
                float s = 0.f;
                for (int64_t d = 0; d < a->head_dim; d++)
                    s += qg[d] * load_at(a, a->k_cache, off + d);
                scores[g * a->max_seq_len + start + t] = s * a->scale;
            }
        }
    }
}

static void weighted_v_plain(const Args *a, const int64_t *blocks, int64_t len, int64_t kh,
                             int64_t group, const float *scores, float *o) {
    const int64_t bs = a->block_size, stride = a->kv_heads * a->head_dim;
    memset(o, 0, sizeof(float) * group * a->head_dim);
    for (int64_t start = 0, b = 0; start < len; start += bs, b++) {
        const int64_t base = block_offset(a, blocks, b, kh), n = min64(bs, len - start);
        for (int64_t t = 0; t < n; t++) {
            const int64_t off = base + t * stride;
            for (int64_t g = 0; g < group; g++) {
                const float p = scores[g * a->max_seq_len + start + t];
                float *og = o + g * a->head_dim;
                for (int64_t d = 0; d < a->head_dim; d++)
                    og[d] += p * load_at(a, a->v_cache, off + d);
            }
        }
    }
}

static int paged_decode(const Args *a, int64_t rows) {
    const int64_t group = a->heads / a->kv_heads;
    int vectorised = 0;
#if defined(__AVX512F__)
    vectorised = a->head_dim % 16 == 0 && a->head_dim / 16 <= MAX_VECS;
#endif
    if (a->io_bf16) { /* only the AVX512-BF16 bodies take bfloat16 q and out */
        int ok = 0;
#if defined(HAVE_BF16_DOT)
        ok = vectorised && a->bf16 && bf16_dot_enabled() && bf16_dot_has_body(group, a->head_dim / 16);
#endif
        if (!ok) return -2;
    }
    int failed = 0;
#if defined(__AVX512F__)
    if (vectorised) { /* one work item per request row, every kv head */
#pragma omp parallel
        {
            /* m, l, acc, and the queries as bfloat16 (half a float each) for the AVX512-BF16 bodies */
            int64_t floats = a->heads * (2 + a->head_dim + a->head_dim / 2 + 16);
#if defined(HAVE_BF16_DOT)
            if (a->bf16 && two_pass_state) floats += two_pass_floats(a);
#endif
            float *state = malloc(sizeof(float) * floats);
            if (!state) {
#pragma omp atomic write
                failed = 1;
            }
#pragma omp for schedule(dynamic, 1)
            for (int64_t r = 0; r < rows; r++) {
                if (!state) continue;
                const int64_t at = r * a->heads * a->head_dim * (a->io_bf16 ? 2 : 4); /* bytes */
                attend_row_avx512(a, a->block_table + r * a->block_table_stride, a->seq_lens[r],
                                  (const float *)((const char *)a->q + at), state,
                                  (float *)((char *)a->out + at));
            }
            free(state);
        }
        return failed ? -1 : 0;
    }
#endif
#pragma omp parallel
    {
        float *scores = malloc(sizeof(float) * group * (a->max_seq_len > 0 ? a->max_seq_len : 1));
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1) collapse(2)
        for (int64_t r = 0; r < rows; r++) {
            for (int64_t kh = 0; kh < a->kv_heads; kh++) {
                if (!scores) continue;
                const int64_t len = a->seq_lens[r];
                const int64_t *blocks = a->block_table + r * a->block_table_stride;
                const float *qh = a->q + (r * a->heads + kh * group) * a->head_dim;
                float *o = a->out + (r * a->heads + kh * group) * a->head_dim;
                scores_plain(a, blocks, len, kh, qh, group, scores);
                softmax_rows(scores, group, a->max_seq_len, len);
                weighted_v_plain(a, blocks, len, kh, group, scores, o);
            }
        }
        free(scores);
    }
    (void)vectorised;
    return failed ? -1 : 0;
}

#define DEFINE_ENTRY(NAME, IS_BF16, IO_BF16)                                                   \
    int NAME(const float *q, const void *k_cache, const void *v_cache,                         \
             const int64_t *block_table, int64_t block_table_stride, const int64_t *seq_lens,  \
             float *out, int64_t rows, int64_t heads, int64_t kv_heads, int64_t head_dim,      \
             int64_t block_size, float scale, int64_t max_seq_len) {                           \
        Args a = {q,     k_cache,  v_cache,  block_table, block_table_stride,                  \
                  seq_lens, out,   heads,    kv_heads,    head_dim,                            \
                  block_size, scale, max_seq_len, IS_BF16, IO_BF16};                           \
        return paged_decode(&a, rows);                                                         \
    }

DEFINE_ENTRY(paged_decode_f32, 0, 0)
DEFINE_ENTRY(paged_decode_bf16, 1, 0)
/* q and out bfloat16 too (no conversions around the call); -2 where no body takes them */
DEFINE_ENTRY(paged_decode_bf16_io, 1, 1)

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
