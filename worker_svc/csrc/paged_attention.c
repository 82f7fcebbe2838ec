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
 *
 * This file: the entry points, the dispatch and the float32/generic bodies (AVX-512 and plain).
 * The AVX2 body: paged_decode_avx2.c. The AVX512-BF16 bodies: paged_decode_bf16.c; what both share: paged_attention.h; the KV
 * write (write_kv): kv_write.c.
 */
#include "paged_attention.h"

static inline float bf16_to_f32(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline float load_at(const Args *a, const void *cache, int64_t off) {
    return a->bf16 ? bf16_to_f32(((const uint16_t *)cache)[off]) : ((const float *)cache)[off];
}

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
    __m512 dots[4][16]; /* fixed sizes: G <= 4, NV <= 8 (see qk_dots_bf16) */
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
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
    if (paged_decode_avx2_applies(a)) return paged_decode_avx2(a, rows);
#endif
#if defined(__AVX512F__)
    if (vectorised) { /* one work item per request row, every kv head */
#pragma omp parallel
        {
            /* m, l, acc, and the queries as bfloat16 (half a float each) for the AVX512-BF16 bodies */
            int64_t floats = a->heads * (2 + a->head_dim + a->head_dim / 2 + 16);
#if defined(HAVE_BF16_DOT)
            if (a->bf16) floats += two_pass_floats(a);
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
