/* Paged prefill attention: the AVX-512 bodies (float32 or bfloat16 caches, head_dim a multiple
 * of 16 up to 256), one work item (chunk, tile of QT query tokens, kv head) per call of
 * attend_item from paged_prefill.c's work-item loop, which holds the entry points and the AMX
 * bodies; shared declarations: paged_prefill.h.
 */
#include "paged_prefill.h"

#if defined(__AVX512F__)
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

void attend_item(const Args *a, int64_t chunk, int64_t i0, int64_t kh, float *scratch) {
    const int64_t nv = a->head_dim / 16;
    if (nv == 4)
        attend_item_nv(a, chunk, i0, kh, scratch, 4);
    else if (nv == 8)
        attend_item_nv(a, chunk, i0, kh, scratch, 8);
    else
        attend_item_nv(a, chunk, i0, kh, scratch, nv);
}
#endif
