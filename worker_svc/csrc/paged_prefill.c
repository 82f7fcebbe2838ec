/* Paged prefill attention on the CPU: every prefill chunk of a step in one call, reading K/V
 * from the block-structured cache (the chunk's own K/V already written there), causal by
 * position, whatever number of tokens the request had cached before the chunk.
 *
 * The torch path runs one SDPA per chunk (after gathering the cached blocks when the chunk
 * follows cached tokens). Here a work item is (chunk, tile of QT query tokens, kv head): the
 * tile's QT x group query vectors meet each 16-token slice of keys once, the slice's K
 * transposed into [head_dim][16] so that a query's 16 scores are head_dim FMAs into one vector
 * (no horizontal sums) and its V staged as float32, then an online softmax and the weighted V
 * sum, accumulated in a per-item scratch that stays in L1. Measured on a W64 prefill step
 * (2048 tokens in 15 chunks, 30 layers of SmolLM2): float32 108 ms against SDPA's 200, bfloat16
 * even (105-113 vs 103-112); tiles of 16 queries were slower (133 / 119 ms: the per-slice
 * transpose and staging are shared by fewer queries), of 64 no better.
 *
 * Layout: caches [num_blocks, block_size, kv_heads, head_dim] (float32 or bfloat16); q and out
 * float32 [tokens, heads, head_dim]; per chunk c: q_start[c] (its first token in q), q_len[c],
 * cached[c] (tokens before it: query i sits at position cached + i and sees keys 0..that),
 * block table row c of block_table [chunks, block_table_stride]. AVX-512 and head_dim a
 * multiple of 16 up to 256 (the caller checks paged_prefill_available()).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QT 32 /* query tokens per work item */

#if defined(__AVX512F__)
#include <immintrin.h>

#include "simd_math.h"

#define MAX_HEAD_DIM 256
#define QB 8 /* query vectors scored together (independent FMA chains) */
#define MAX_GROUP 8 /* query heads per kv head */
/* Online softmax with a lazily moved reference max: a query's probabilities are e^(s - m) for a
 * reference m that moves (rescaling the sums so far) only when a score exceeds it by this much,
 * so most key slices need no max reduction, no scalar exp and no rescale; e^8 keeps every term
 * far from float32 overflow. */
#define RESCALE_MARGIN 8.0f

typedef struct {
    const float *q;
    const void *k_cache, *v_cache;
    const int64_t *block_table;
    int64_t block_table_stride;
    const int64_t *q_start, *q_len, *cached;
    float *out;
    int64_t heads, kv_heads, head_dim, block_size;
    float scale;
    int bf16;
} Args;

int paged_prefill_available(void) { return 1; }

/* r[0..15] (rows) -> c[0..15] (columns): a 16 x 16 float transpose in 64 shuffles */
static inline void transpose16(const __m512 *r, __m512 *c) {
    __m512 t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) { /* per 128-bit lane k: u[4i + j] = rows 4i..4i+3, column 4k + j */
        u[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        u[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
        u[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        u[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    for (int j = 0; j < 4; j++) {
        const __m512 v0 = _mm512_shuffle_f32x4(u[j], u[4 + j], 0x88);
        const __m512 w0 = _mm512_shuffle_f32x4(u[j], u[4 + j], 0xDD);
        const __m512 v1 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0x88);
        const __m512 w1 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0xDD);
        c[j] = _mm512_shuffle_f32x4(v0, v1, 0x88);
        c[8 + j] = _mm512_shuffle_f32x4(v0, v1, 0xDD);
        c[4 + j] = _mm512_shuffle_f32x4(w0, w1, 0x88);
        c[12 + j] = _mm512_shuffle_f32x4(w0, w1, 0xDD);
    }
}

/* K of `n` tokens (element offsets off[t]) for one kv head, transposed: kt[d * 16 + t]; rows
 * past n are zero (their scores are masked; the cache there may hold anything). */
static inline void transpose_k(const Args *a, const int64_t *off, int64_t n, float *kt) {
    for (int64_t d0 = 0; d0 < a->head_dim; d0 += 16) {
        __m512 rows[16], cols[16];
        for (int64_t t = 0; t < 16; t++)
            rows[t] = t < n ? load_f32x16(a->bf16, a->k_cache, off[t] + d0) : _mm512_setzero_ps();
        transpose16(rows, cols);
        for (int64_t d = 0; d < 16; d++) _mm512_storeu_ps(kt + (d0 + d) * 16, cols[d]);
    }
}

/* nv = head_dim / 16 is a constant of each inlined copy (4: head_dim 64, 8: 128), so that a
 * query's accumulators stay in registers while a key slice's V rows stream past. */
static inline __attribute__((always_inline)) void attend_item_nv(const Args *a, int64_t chunk,
                                                                int64_t i0, int64_t kh,
                                                                float *scratch, const int64_t nv) {
    const int64_t hd = a->head_dim, heads = a->heads, group = heads / a->kv_heads;
    const int64_t bs = a->block_size;
    const int64_t c = a->cached[chunk], len = a->q_len[chunk];
    const int64_t i1 = i0 + QT < len ? i0 + QT : len, nq = (i1 - i0) * group;
    const int64_t nq_padded = (nq + QB - 1) / QB * QB;
    const int64_t *blocks = a->block_table + chunk * a->block_table_stride;
    /* scratch: queries [nq_padded][hd] (zero past nq), acc [nq][hd], m [nq], l [nq][16], K slice
     * transposed kt [hd][16], V slice vs [16][hd] */
    float *qs = scratch, *acc = qs + QT * MAX_GROUP * hd;
    float *m = acc + nq * hd, *l = m + nq, *kt = l + 16 * nq, *vs = kt + 16 * hd;
    int64_t pos[QT * MAX_GROUP];
    for (int64_t i = i0, v = 0; i < i1; i++)
        for (int64_t g = 0; g < group; g++, v++) {
            memcpy(qs + v * hd, a->q + ((a->q_start[chunk] + i) * heads + kh * group + g) * hd,
                   sizeof(float) * hd);
            pos[v] = c + i;
            m[v] = -INFINITY;
        }
    memset(l, 0, sizeof(float) * 16 * nq);
    memset(qs + nq * hd, 0, sizeof(float) * (nq_padded - nq) * hd);
    memset(acc, 0, sizeof(float) * nq * hd);
    const __m512 scale = _mm512_set1_ps(a->scale);
    const int64_t keys = c + i1; /* the last query sees keys 0 .. c + i1 - 1 */
    for (int64_t t0 = 0; t0 < keys; t0 += 16) {
        const int64_t n = keys - t0 < 16 ? keys - t0 : 16;
        int64_t off[16];
        for (int64_t t = 0; t < n; t++) {
            const int64_t p = t0 + t;
            off[t] = ((blocks[p / bs] * bs + p % bs) * a->kv_heads + kh) * hd;
        }
        transpose_k(a, off, n, kt);
        for (int64_t t = 0; t < n; t++) /* V rows as float32, read by every query of the tile */
            for (int64_t j = 0; j < nv; j++)
                _mm512_storeu_ps(vs + t * hd + 16 * j, load_f32x16(a->bf16, a->v_cache, off[t] + 16 * j));
        for (int64_t v0 = 0; v0 < nq; v0 += QB) {
            __m512 s[QB];
            for (int64_t b = 0; b < QB; b++) s[b] = _mm512_setzero_ps();
            const float *qb = qs + v0 * hd;
            for (int64_t d = 0; d < nv * 16; d++) {
                const __m512 kd = _mm512_loadu_ps(kt + d * 16);
                for (int64_t b = 0; b < QB; b++)
                    s[b] = _mm512_fmadd_ps(_mm512_set1_ps(qb[b * hd + d]), kd, s[b]);
            }
            const int64_t nb = nq - v0 < QB ? nq - v0 : QB;
            for (int64_t b = 0; b < nb; b++) {
                const int64_t v = v0 + b, seen = pos[v] - t0 + 1; /* keys of this slice it sees */
                if (seen <= 0) continue;
                const __mmask16 valid = seen >= 16 ? 0xFFFF : (__mmask16)((1u << seen) - 1);
                const __m512 sc = _mm512_mul_ps(s[b], scale);
                float *av = acc + v * hd;
                __m512 lv = _mm512_loadu_ps(l + 16 * v);
                __m512 o[MAX_HEAD_DIM / 16];
                for (int64_t j = 0; j < nv; j++) o[j] = _mm512_loadu_ps(av + 16 * j);
                /* the reference max moves only when a score passes it by RESCALE_MARGIN */
                if (m[v] == -INFINITY) {
                    m[v] = _mm512_mask_reduce_max_ps(valid, sc);
                } else if (_mm512_mask_cmp_ps_mask(valid, sc, _mm512_set1_ps(m[v] + RESCALE_MARGIN),
                                                   _CMP_GT_OQ)) {
                    const float m_new = _mm512_mask_reduce_max_ps(valid, sc);
                    const __m512 al = _mm512_set1_ps(expf(m[v] - m_new));
                    m[v] = m_new;
                    lv = _mm512_mul_ps(lv, al);
                    for (int64_t j = 0; j < nv; j++) o[j] = _mm512_mul_ps(o[j], al);
                }
                const __m512 p = _mm512_maskz_mov_ps(valid, exp512(_mm512_sub_ps(sc, _mm512_set1_ps(m[v]))));
                _mm512_storeu_ps(l + 16 * v, _mm512_add_ps(lv, p));
                float pw[16];
                _mm512_storeu_ps(pw, p);
                const int64_t used = seen < n ? seen : n;
                /* even and odd keys into separate sums: twice the independent FMA chains */
                __m512 o2[MAX_HEAD_DIM / 16];
                for (int64_t j = 0; j < nv; j++) o2[j] = _mm512_setzero_ps();
                int64_t t = 0;
                for (; t + 1 < used; t += 2) {
                    const __m512 p0 = _mm512_set1_ps(pw[t]), p1 = _mm512_set1_ps(pw[t + 1]);
                    for (int64_t j = 0; j < nv; j++) {
                        o[j] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(vs + t * hd + 16 * j), o[j]);
                        o2[j] = _mm512_fmadd_ps(p1, _mm512_loadu_ps(vs + (t + 1) * hd + 16 * j), o2[j]);
                    }
                }
                if (t < used) {
                    const __m512 p0 = _mm512_set1_ps(pw[t]);
                    for (int64_t j = 0; j < nv; j++)
                        o[j] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(vs + t * hd + 16 * j), o[j]);
                }
                for (int64_t j = 0; j < nv; j++) _mm512_storeu_ps(av + 16 * j, _mm512_add_ps(o[j], o2[j]));
            }
        }
    }
    for (int64_t i = i0, v = 0; i < i1; i++)
        for (int64_t g = 0; g < group; g++, v++) {
            float *o = a->out + ((a->q_start[chunk] + i) * heads + kh * group + g) * hd;
            const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(_mm512_loadu_ps(l + 16 * v)));
            for (int64_t j = 0; j < nv; j++)
                _mm512_storeu_ps(o + 16 * j, _mm512_mul_ps(_mm512_loadu_ps(acc + v * hd + 16 * j), inv));
        }
}

static void attend_item(const Args *a, int64_t chunk, int64_t i0, int64_t kh, float *scratch) {
    const int64_t nv = a->head_dim / 16;
    if (nv == 4)
        attend_item_nv(a, chunk, i0, kh, scratch, 4);
    else if (nv == 8)
        attend_item_nv(a, chunk, i0, kh, scratch, 8);
    else
        attend_item_nv(a, chunk, i0, kh, scratch, nv);
}

static int paged_prefill(const Args *a, int64_t chunks) {
    const int64_t group = a->heads / a->kv_heads;
    if (a->head_dim % 16 || a->head_dim > MAX_HEAD_DIM || group > MAX_GROUP) return -1;
    int64_t items = 0;
    for (int64_t ch = 0; ch < chunks; ch++) items += (a->q_len[ch] + QT - 1) / QT;
    /* (chunk, first query) of each tile, so that the items can be split evenly */
    int64_t *tiles = malloc(sizeof(int64_t) * 2 * (items ? items : 1));
    if (!tiles) return -1;
    for (int64_t ch = 0, k = 0; ch < chunks; ch++)
        for (int64_t i0 = 0; i0 < a->q_len[ch]; i0 += QT, k++) tiles[2 * k] = ch, tiles[2 * k + 1] = i0;
    int failed = 0;
#pragma omp parallel
    {
        const int64_t nq = QT * group, hd = a->head_dim;
        float *scratch = malloc(sizeof(float) * ((QT * MAX_GROUP + nq) * hd + 17 * nq + 32 * hd));
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
        /* the longest tiles (late in a long chunk) first would balance better; dynamic is enough */
#pragma omp for schedule(dynamic, 1) collapse(2)
        for (int64_t k = 0; k < items; k++)
            for (int64_t kh = 0; kh < a->kv_heads; kh++)
                if (scratch) attend_item(a, tiles[2 * k], tiles[2 * k + 1], kh, scratch);
        free(scratch);
    }
    free(tiles);
    return failed ? -1 : 0;
}

#define DEFINE_ENTRY(NAME, IS_BF16)                                                              \
    int NAME(const float *q, const void *k_cache, const void *v_cache, const int64_t *block_table, \
             int64_t block_table_stride, const int64_t *q_start, const int64_t *q_len,           \
             const int64_t *cached, int64_t chunks, float *out, int64_t heads, int64_t kv_heads,  \
             int64_t head_dim, int64_t block_size, float scale) {                                \
        Args a = {q,      k_cache, v_cache, block_table, block_table_stride, q_start,            \
                  q_len,  cached,  out,     heads,       kv_heads,           head_dim,           \
                  block_size, scale, IS_BF16};                                                   \
        return paged_prefill(&a, chunks);                                                        \
    }

DEFINE_ENTRY(paged_prefill_f32, 0)
DEFINE_ENTRY(paged_prefill_bf16, 1)
#else
int paged_prefill_available(void) { return 0; }
#endif
