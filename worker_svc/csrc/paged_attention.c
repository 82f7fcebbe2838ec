/* Paged decode attention on the CPU, reading K/V straight from the block-structured cache.
 *
 * The torch path gathers every decode row's blocks into a contiguous copy (index_select) before
 * SDPA: at batch 64 that copy is most of the attention time, as it moves the whole context
 * through memory twice more. Here each (request, kv head) pair walks its block table once:
 * scores for the query heads sharing that kv head, a max-subtracted softmax, then the weighted
 * sum of V. Work items are spread over the OpenMP threads torch already runs (same libgomp).
 *
 * Layout: caches [num_blocks, block_size, kv_heads, head_dim] (float32 or bfloat16), queries
 * and outputs float32 [rows, heads, head_dim], block_table int64 [rows, block_table_stride],
 * seq_lens int64 [rows] (tokens to attend to, the new one included, already written).
 * With AVX-512 and head_dim a multiple of 16 (up to 256) the dot products and the V sum run
 * on 16-float vectors; otherwise a plain loop the compiler vectorises as it can.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>
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
} Args;

static inline float bf16_to_f32(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Address of token j's head kh in a cache, as an element offset. */
static inline int64_t token_offset(const Args *a, const int64_t *blocks, int64_t j, int64_t kh) {
    const int64_t bs = a->block_size;
    return ((blocks[j / bs] * bs + j % bs) * a->kv_heads + kh) * a->head_dim;
}

static inline float load_at(const Args *a, const void *cache, int64_t off) {
    return a->bf16 ? bf16_to_f32(((const uint16_t *)cache)[off]) : ((const float *)cache)[off];
}

/* The next tokens' rows are 256-byte pieces 768+ bytes apart, scattered by the block table:
 * hardware prefetchers miss them, so fetch a few tokens ahead by hand. */
#define PREFETCH_AHEAD 16
static inline void prefetch_token(const Args *a, const void *cache, const int64_t *blocks,
                                  int64_t j, int64_t len, int64_t kh) {
    if (j >= len) return;
    const char *p = (const char *)cache + token_offset(a, blocks, j, kh) * (a->bf16 ? 2 : 4);
    const int64_t bytes = a->head_dim * (a->bf16 ? 2 : 4);
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 3);
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
static inline __m512 load16(const Args *a, const void *cache, int64_t off) {
    if (a->bf16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)cache + off));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)cache + off);
}

/* nv (head_dim / 16) is a parameter of always-inlined bodies so that the dispatch below can
 * pass a constant (4: head_dim 64, 8: 128): loops unroll and accumulators stay in registers. */
static inline __attribute__((always_inline)) void scores_avx512(
    const Args *a, const int64_t *blocks, int64_t len, int64_t kh, const float *qh, int64_t group,
    float *scores, const int64_t nv) {
    for (int64_t j = 0; j < PREFETCH_AHEAD; j++) {
        prefetch_token(a, a->k_cache, blocks, j, len, kh);
        prefetch_token(a, a->v_cache, blocks, j, len, kh);
    }
    for (int64_t g = 0; g < group; g++) {
        __m512 qv[MAX_VECS];
        for (int64_t c = 0; c < nv; c++) qv[c] = _mm512_loadu_ps(qh + g * a->head_dim + 16 * c);
        float *sg = scores + g * a->max_seq_len;
        for (int64_t j = 0; j < len; j++) {
            if (g == 0) {
                prefetch_token(a, a->k_cache, blocks, j + PREFETCH_AHEAD, len, kh);
                prefetch_token(a, a->v_cache, blocks, j + PREFETCH_AHEAD, len, kh);
            }
            const int64_t off = token_offset(a, blocks, j, kh);
            __m512 acc = _mm512_mul_ps(qv[0], load16(a, a->k_cache, off));
            for (int64_t c = 1; c < nv; c++)
                acc = _mm512_fmadd_ps(qv[c], load16(a, a->k_cache, off + 16 * c), acc);
            sg[j] = _mm512_reduce_add_ps(acc) * a->scale;
        }
    }
}

static inline __attribute__((always_inline)) void weighted_v_avx512(
    const Args *a, const int64_t *blocks, int64_t len, int64_t kh, int64_t group,
    const float *scores, float *o, const int64_t nv) {
    for (int64_t g = 0; g < group; g++) {
        __m512 acc[MAX_VECS];
        for (int64_t c = 0; c < nv; c++) acc[c] = _mm512_setzero_ps();
        const float *pg = scores + g * a->max_seq_len;
        for (int64_t j = 0; j < len; j++) {
            const int64_t off = token_offset(a, blocks, j, kh);
            const __m512 p = _mm512_set1_ps(pg[j]);
            for (int64_t c = 0; c < nv; c++)
                acc[c] = _mm512_fmadd_ps(p, load16(a, a->v_cache, off + 16 * c), acc[c]);
        }
        for (int64_t c = 0; c < nv; c++) _mm512_storeu_ps(o + g * a->head_dim + 16 * c, acc[c]);
    }
}

static void attend_avx512(const Args *a, const int64_t *blocks, int64_t len, int64_t kh,
                          const float *qh, int64_t group, float *scores, float *o) {
    const int64_t nv = a->head_dim / 16;
    if (nv == 4) {
        scores_avx512(a, blocks, len, kh, qh, group, scores, 4);
        softmax_rows(scores, group, a->max_seq_len, len);
        weighted_v_avx512(a, blocks, len, kh, group, scores, o, 4);
    } else if (nv == 8) {
        scores_avx512(a, blocks, len, kh, qh, group, scores, 8);
        softmax_rows(scores, group, a->max_seq_len, len);
        weighted_v_avx512(a, blocks, len, kh, group, scores, o, 8);
    } else {
        scores_avx512(a, blocks, len, kh, qh, group, scores, nv);
        softmax_rows(scores, group, a->max_seq_len, len);
        weighted_v_avx512(a, blocks, len, kh, group, scores, o, nv);
    }
}
#endif

static void scores_plain(const Args *a, const int64_t *blocks, int64_t len, int64_t kh,
                         const float *qh, int64_t group, float *scores) {
    for (int64_t j = 0; j < len; j++) {
        const int64_t off = token_offset(a, blocks, j, kh);
        for (int64_t g = 0; g < group; g++) {
            const float *qg = qh + g * a->head_dim;
            float s = 0.f;
            for (int64_t d = 0; d < a->head_dim; d++) s += qg[d] * load_at(a, a->k_cache, off + d);
            scores[g * a->max_seq_len + j] = s * a->scale;
        }
    }
}

static void weighted_v_plain(const Args *a, const int64_t *blocks, int64_t len, int64_t kh,
                             int64_t group, const float *scores, float *o) {
    memset(o, 0, sizeof(float) * group * a->head_dim);
    for (int64_t j = 0; j < len; j++) {
        const int64_t off = token_offset(a, blocks, j, kh);
        for (int64_t g = 0; g < group; g++) {
            const float p = scores[g * a->max_seq_len + j];
            float *og = o + g * a->head_dim;
            for (int64_t d = 0; d < a->head_dim; d++) og[d] += p * load_at(a, a->v_cache, off + d);
        }
    }
}

static int paged_decode(const Args *a, int64_t rows) {
    const int64_t group = a->heads / a->kv_heads;
    int vectorised = 0;
#if defined(__AVX512F__)
    vectorised = a->head_dim % 16 == 0 && a->head_dim / 16 <= MAX_VECS;
#endif
    int failed = 0;
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
#if defined(__AVX512F__)
                if (vectorised) {
                    attend_avx512(a, blocks, len, kh, qh, group, scores, o);
                    continue;
                }
#endif
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

#define DEFINE_ENTRY(NAME, IS_BF16)                                                            \
    int NAME(const float *q, const void *k_cache, const void *v_cache,                         \
             const int64_t *block_table, int64_t block_table_stride, const int64_t *seq_lens,  \
             float *out, int64_t rows, int64_t heads, int64_t kv_heads, int64_t head_dim,      \
             int64_t block_size, float scale, int64_t max_seq_len) {                           \
        Args a = {q,     k_cache,  v_cache,  block_table, block_table_stride,                  \
                  seq_lens, out,   heads,    kv_heads,    head_dim,                            \
                  block_size, scale, max_seq_len, IS_BF16};                                    \
        return paged_decode(&a, rows);                                                         \
    }

DEFINE_ENTRY(paged_decode_f32, 0)
DEFINE_ENTRY(paged_decode_bf16, 1)

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
