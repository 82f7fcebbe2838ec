/* Paged prefill attention on the CPU: every prefill chunk of a step in one call, reading K/V
 * from the block-structured cache (the chunk's own K/V already written there), causal by
 * position, whatever number of tokens the request had cached before the chunk.
 *
 * The torch path runs one SDPA per chunk (after gathering the cached blocks when the chunk
 * follows cached tokens). Here a work item is (chunk, tile of QT query tokens, kv head): the
 * tile's QT x group query vectors meet each 16-token slice of keys once, the slice's K
 * transposed into [head_dim][16] so that a query's 16 scores are head_dim FMAs into one vector
 * (no horizontal sums) and its V staged as float32, then an online softmax and the weighted V
 * sum, accumulated in a per-item scratch that stays in L1. QT is 32: a smaller tile shares the
 * per-slice transpose and V staging among fewer queries, a larger one gains nothing more.
 *
 * Layout: caches [num_blocks, block_size, kv_heads, head_dim] (float32 or bfloat16); q and out
 * float32 [tokens, heads, head_dim]; per chunk c: q_start[c] (its first token in q), q_len[c],
 * cached[c] (tokens before it: query i sits at position cached + i and sees keys 0..that),
 * block table row c of block_table [chunks, block_table_stride]. AVX-512 and head_dim a
 * multiple of 16 up to 256 (the caller checks paged_prefill_available()).
 * bfloat16 caches with head_dim 64 on CPUs with AMX (checked at run time) take tile bodies
 * instead (attend_item_amx), which run the score and P.V products on the tile unit.
 *
 * This file: the entry points, the loop over work items and the AMX bodies (in the file that
 * configures the tiles: see amx_tiles.h). The AVX-512 bodies: paged_prefill_avx512.c; what
 * both share: paged_prefill.h.
 */
#define _GNU_SOURCE /* syscall(), for amx_tiles.h */
#include "paged_prefill.h"

#if defined(__AVX512F__)
int paged_prefill_available(void) { return 1; }

#if defined(__x86_64__) && defined(__GNUC__) && __GNUC__ >= 11
#include "amx_tiles.h"
#define AMX_KEYS 32 /* keys per slice: one bfloat16 tile's depth */

/* -1: not asked yet; 0: off; 1: on */
static int amx_prefill_state = -1;

static int amx_prefill_enabled(void) {
    if (amx_prefill_state < 0) amx_prefill_state = amx_permitted();
    return amx_prefill_state;
}

/* attend_item for a bfloat16 cache and head_dim 64 on AMX tiles: per 32-key slice,
 *   S = Q K^T   (row tiles of 16 query vectors; K^T as four B tiles loaded once per slice),
 *   an online softmax over S's rows (AVX-512, the reference max moved lazily: RESCALE_MARGIN), P
 *   rounded to bfloat16 (as torch's bfloat16 attention rounds it before P.V),
 *   O += P V    (O in float32 memory, loaded into and stored from C tiles).
 * The queries are bfloat16 already in a bfloat16 model (rounding them is exact). Tiles: 0-3 B
 * (K^T blocks, then V blocks), 4-5 A (Q, then P), 6-7 C. */
AMX_TARGET static void attend_item_amx(const Args *a, int64_t chunk, int64_t i0, int64_t kh,
                                       float *scratch) {
    enum { HD = 64 };
    const int64_t heads = a->heads, group = heads / a->kv_heads, bs = a->block_size;
    const int64_t c = a->cached[chunk], len = a->q_len[chunk];
    const int64_t i1 = i0 + QT < len ? i0 + QT : len, nq = (i1 - i0) * group;
    const int64_t row_tiles = (nq + 15) / 16, nq_pad = row_tiles * 16;
    const int64_t *blocks = a->block_table + chunk * a->block_table_stride;
    /* scratch: O [nq_pad][HD], l [nq_pad][16], m [nq_pad], S [nq_pad][32] float32; Q
     * [nq_pad][HD] and P [nq_pad][32] bfloat16; K^T and V B tiles, 4 x 256 pairs each */
    float *o = scratch, *l = o + nq_pad * HD, *m = l + 16 * nq_pad, *sc = m + nq_pad;
    uint16_t *qb = (uint16_t *)(sc + 32 * nq_pad), *pb = qb + nq_pad * HD;
    uint32_t *kt = (uint32_t *)(pb + 32 * nq_pad), *vt = kt + 4 * 256;
    int64_t pos[QT * MAX_GROUP];
    for (int64_t i = i0, v = 0; i < i1; i++)
        for (int64_t g = 0; g < group; g++, v++) {
            const int64_t at = ((a->q_start[chunk] + i) * heads + kh * group + g) * HD;
            if (a->io_bf16)
                memcpy(qb + v * HD, (const uint16_t *)a->q + at, sizeof(uint16_t) * HD);
            else
                for (int j = 0; j < HD / 16; j++)
                    _mm256_storeu_si256((__m256i *)(qb + v * HD + 16 * j), round_to_bf16x16(_mm512_loadu_ps(a->q + at + 16 * j)));
            pos[v] = c + i;
            m[v] = -INFINITY;
        }
    for (int64_t v = nq; v < nq_pad; v++) pos[v] = -1, m[v] = -INFINITY; /* padding: sees nothing */
    memset(qb + nq * HD, 0, sizeof(uint16_t) * (nq_pad - nq) * HD);
    memset(o, 0, sizeof(float) * nq_pad * HD);
    memset(l, 0, sizeof(float) * 16 * nq_pad);
    const __m512 scale = _mm512_set1_ps(a->scale);
    const uint16_t *kc = (const uint16_t *)a->k_cache, *vc = (const uint16_t *)a->v_cache;
    /* V rows 2i and 2i + 1 interleaved element by element: 16 dims of each per 64 bytes */
    __m512i inter[2];
    {
        uint16_t lo[32], hi[32];
        for (int j = 0; j < 16; j++) lo[2 * j] = j, lo[2 * j + 1] = 32 + j, hi[2 * j] = 16 + j, hi[2 * j + 1] = 48 + j;
        inter[0] = _mm512_loadu_si512(lo);
        inter[1] = _mm512_loadu_si512(hi);
    }
    const int64_t keys = c + i1;
    for (int64_t t0 = 0; t0 < keys; t0 += AMX_KEYS) {
        const int64_t n = keys - t0 < AMX_KEYS ? keys - t0 : AMX_KEYS;
        int64_t off[AMX_KEYS];
        for (int64_t t = 0; t < n; t++) {
            const int64_t p = t0 + t;
            off[t] = ((blocks[p / bs] * bs + p % bs) * a->kv_heads + kh) * HD;
        }
        /* K^T: B tile (dim block kb, key block ct) row i = dims (2i, 2i + 1) of the block for
         * its 16 keys: a 32-bit transpose of 16 keys x 16 dim pairs; keys past n are zero */
        for (int ct = 0; ct < 2; ct++)
            for (int kb = 0; kb < 2; kb++) {
                __m512 rows[16], cols[16];
                for (int t = 0; t < 16; t++) {
                    const int64_t key = 16 * ct + t;
                    rows[t] = key < n ? _mm512_castsi512_ps(_mm512_loadu_si512(kc + off[key] + 32 * kb))
                                      : _mm512_setzero_ps();
                }
                transpose16(rows, cols);
                for (int i = 0; i < 16; i++) _mm512_storeu_ps((float *)(kt + (2 * kb + ct) * 256 + 16 * i), cols[i]);
            }
        _tile_loadd(0, kt, 64);
        _tile_loadd(1, kt + 256, 64);
        _tile_loadd(2, kt + 512, 64);
        _tile_loadd(3, kt + 768, 64);
        for (int64_t r = 0; r < row_tiles; r++) {
            _tile_loadd(4, qb + r * 16 * HD, 2 * HD);
            _tile_loadd(5, qb + r * 16 * HD + 32, 2 * HD);
            _tile_zero(6);
            _tile_zero(7);
            _tile_dpbf16ps(6, 4, 0); /* keys 0-15: dims 0-31 */
            _tile_dpbf16ps(6, 5, 2); /*            dims 32-63 */
            _tile_dpbf16ps(7, 4, 1); /* keys 16-31 */
            _tile_dpbf16ps(7, 5, 3);
            _tile_stored(6, sc + r * 16 * 32, 128);
            _tile_stored(7, sc + r * 16 * 32 + 16, 128);
        }
        /* V: B tile db (16 dims) row i = (V[2i][d], V[2i + 1][d]) for its 16 dims */
        for (int i = 0; i < 16; i++) {
            for (int half = 0; half < 2; half++) {
                const __m512i va = 2 * i < n ? _mm512_loadu_si512(vc + off[2 * i] + 32 * half) : _mm512_setzero_si512();
                const __m512i vb = 2 * i + 1 < n ? _mm512_loadu_si512(vc + off[2 * i + 1] + 32 * half) : _mm512_setzero_si512();
                _mm512_storeu_si512(vt + (2 * half) * 256 + 16 * i, _mm512_permutex2var_epi16(va, inter[0], vb));
                _mm512_storeu_si512(vt + (2 * half + 1) * 256 + 16 * i, _mm512_permutex2var_epi16(va, inter[1], vb));
            }
        }
        /* softmax over each row's scores of the slice; P as bfloat16 */
        for (int64_t v = 0; v < nq_pad; v++) {
            const int64_t seen = pos[v] - t0 + 1, used = seen < n ? seen : n;
            uint16_t *prow = pb + v * 32;
            if (used <= 0) {
                memset(prow, 0, 64);
                continue;
            }
            const __mmask16 valid0 = used >= 16 ? 0xFFFF : (__mmask16)((1u << used) - 1);
            const __mmask16 valid1 = used >= 32 ? 0xFFFF : used <= 16 ? 0 : (__mmask16)((1u << (used - 16)) - 1);
            const __m512 s0 = _mm512_mul_ps(_mm512_loadu_ps(sc + v * 32), scale);
            const __m512 s1 = _mm512_mul_ps(_mm512_loadu_ps(sc + v * 32 + 16), scale);
            __m512 lv = _mm512_loadu_ps(l + 16 * v);
            const __m512 top = _mm512_max_ps(_mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid0, s0),
                                             _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid1, s1));
            if (m[v] == -INFINITY) {
                m[v] = _mm512_reduce_max_ps(top);
            } else if (_mm512_cmp_ps_mask(top, _mm512_set1_ps(m[v] + RESCALE_MARGIN), _CMP_GT_OQ)) {
                const float m_new = _mm512_reduce_max_ps(top);
                const __m512 al = _mm512_set1_ps(expf(m[v] - m_new));
                m[v] = m_new;
                lv = _mm512_mul_ps(lv, al);
                for (int j = 0; j < HD / 16; j++)
                    _mm512_storeu_ps(o + v * HD + 16 * j, _mm512_mul_ps(_mm512_loadu_ps(o + v * HD + 16 * j), al));
            }
            const __m512 mv = _mm512_set1_ps(m[v]);
            const __m512 p0 = _mm512_maskz_mov_ps(valid0, exp512(_mm512_sub_ps(s0, mv)));
            const __m512 p1 = _mm512_maskz_mov_ps(valid1, exp512(_mm512_sub_ps(s1, mv)));
            _mm512_storeu_ps(l + 16 * v, _mm512_add_ps(lv, _mm512_add_ps(p0, p1)));
            _mm256_storeu_si256((__m256i *)prow, round_to_bf16x16(p0));
            _mm256_storeu_si256((__m256i *)(prow + 16), round_to_bf16x16(p1));
        }
        /* O += P V, two 16-dim blocks at a time */
        _tile_loadd(0, vt, 64);
        _tile_loadd(1, vt + 256, 64);
        _tile_loadd(2, vt + 512, 64);
        _tile_loadd(3, vt + 768, 64);
        for (int64_t r = 0; r < row_tiles; r++) {
            float *orow = o + r * 16 * HD;
            _tile_loadd(4, pb + r * 16 * 32, 64);
            _tile_loadd(6, orow, 4 * HD);
            _tile_loadd(7, orow + 16, 4 * HD);
            _tile_dpbf16ps(6, 4, 0);
            _tile_dpbf16ps(7, 4, 1);
            _tile_stored(6, orow, 4 * HD);
            _tile_stored(7, orow + 16, 4 * HD);
            _tile_loadd(6, orow + 32, 4 * HD);
            _tile_loadd(7, orow + 48, 4 * HD);
            _tile_dpbf16ps(6, 4, 2);
            _tile_dpbf16ps(7, 4, 3);
            _tile_stored(6, orow + 32, 4 * HD);
            _tile_stored(7, orow + 48, 4 * HD);
        }
    }
    for (int64_t i = i0, v = 0; i < i1; i++)
        for (int64_t g = 0; g < group; g++, v++) {
            const int64_t at = ((a->q_start[chunk] + i) * heads + kh * group + g) * HD;
            const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(_mm512_loadu_ps(l + 16 * v)));
            for (int j = 0; j < HD / 16; j++) {
                const __m512 r = _mm512_mul_ps(_mm512_loadu_ps(o + v * HD + 16 * j), inv);
                if (a->io_bf16) /* rounded as torch's .to(bfloat16) of the float32 result */
                    _mm256_storeu_si256((__m256i *)((uint16_t *)a->out + at + 16 * j), round_to_bf16x16(r));
                else
                    _mm512_storeu_ps(a->out + at + 16 * j, r);
            }
        }
}

/* scratch floats attend_item_amx needs (head_dim 64, up to QT * MAX_GROUP query vectors) */
#define AMX_SCRATCH_FLOATS ((QT * MAX_GROUP) * (64 + 16 + 1 + 32 + 32 + 16) + 8 * 256 + 64)

#define HAVE_AMX_PREFILL 1
#endif

/* AMX bodies for bfloat16 prefill (head_dim 64): on (1) where the CPU and kernel allow AMX,
 * unless switched off (0) for comparison. Returns whether they are on. */
int paged_prefill_set_amx(int on) {
#if defined(HAVE_AMX_PREFILL)
    amx_prefill_state = on ? amx_permitted() : 0;
    return amx_prefill_state;
#else
    (void)on;
    return 0;
#endif
}

static int paged_prefill(const Args *a, int64_t chunks) {
    const int64_t group = a->heads / a->kv_heads;
    if (a->head_dim % 16 || a->head_dim > MAX_HEAD_DIM || group > MAX_GROUP) return -1;
    int amx = 0;
#if defined(HAVE_AMX_PREFILL)
    amx = a->bf16 && a->head_dim == 64 && amx_prefill_enabled();
#endif
    if (a->io_bf16 && !amx) return -2; /* only the AMX bodies take bfloat16 q and out */
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
        int64_t floats = (QT * MAX_GROUP + nq) * hd + 17 * nq + 32 * hd;
#if defined(HAVE_AMX_PREFILL)
        if (amx && floats < AMX_SCRATCH_FLOATS) floats = AMX_SCRATCH_FLOATS;
        if (amx) amx_configure_tiles();
#endif
        float *scratch = malloc(sizeof(float) * floats);
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
        /* the longest tiles (late in a long chunk) first would balance better; dynamic is enough */
#pragma omp for schedule(dynamic, 1) collapse(2)
        for (int64_t k = 0; k < items; k++)
            for (int64_t kh = 0; kh < a->kv_heads; kh++) {
                if (!scratch) continue;
#if defined(HAVE_AMX_PREFILL)
                if (amx) {
                    attend_item_amx(a, tiles[2 * k], tiles[2 * k + 1], kh, scratch);
                    continue;
                }
#endif
                attend_item(a, tiles[2 * k], tiles[2 * k + 1], kh, scratch);
            }
        free(scratch);
#if defined(HAVE_AMX_PREFILL)
        if (amx) amx_release_tiles();
#endif
    }
    (void)amx;
    free(tiles);
    return failed ? -1 : 0;
}

#define DEFINE_ENTRY(NAME, IS_BF16, IO_BF16)                                                     \
    int NAME(const float *q, const void *k_cache, const void *v_cache, const int64_t *block_table, \
             int64_t block_table_stride, const int64_t *q_start, const int64_t *q_len,           \
             const int64_t *cached, int64_t chunks, float *out, int64_t heads, int64_t kv_heads,  \
             int64_t head_dim, int64_t block_size, float scale) {                                \
        Args a = {q,      k_cache, v_cache, block_table, block_table_stride, q_start,            \
                  q_len,  cached,  out,     heads,       kv_heads,           head_dim,           \
                  block_size, scale, IS_BF16, IO_BF16};                                          \
        return paged_prefill(&a, chunks);                                                        \
    }

DEFINE_ENTRY(paged_prefill_f32, 0, 0)
DEFINE_ENTRY(paged_prefill_bf16, 1, 0)
/* q and out bfloat16 too (no conversions around the call); -2 where no body takes them */
DEFINE_ENTRY(paged_prefill_bf16_io, 1, 1)
#else
int paged_prefill_available(void) { return 0; }
#endif
