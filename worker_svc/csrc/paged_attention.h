/* Paged decode attention: what its files share (internal, not part of the library's interface).
 * paged_attention.c holds the entry points, the dispatch and the float32/generic bodies;
 * paged_decode_bf16.c the AVX512-BF16 bodies. Here: the call's arguments (Args), the hot
 * helpers both use (static inline: no call between files inside a loop), the AVX512-BF16
 * switches' state (defined once, in paged_decode_bf16.c) and that file's entry for a row.
 * Functions and variables shared between the files are hidden: not exported from the library,
 * and called directly rather than through the PLT (see amx_tiles.h). */
#ifndef SPLITSERVE_PAGED_ATTENTION_H
#define SPLITSERVE_PAGED_ATTENTION_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>

#include "simd_math.h"
#define MAX_VECS 16 /* head_dim up to 256 */
#endif

#define INTERNAL __attribute__((visibility("hidden")))

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

/* Element offset of the first token of block slot b (head kh) in a cache; the tokens of a block
 * follow each other kv_heads * head_dim elements apart. Walking block by block keeps integer
 * division out of the inner loops (a division by a runtime divisor is slow, and one per token
 * would be a large share of the kernel's time). */
static inline int64_t block_offset(const Args *a, const int64_t *blocks, int64_t b, int64_t kh) {
    return (blocks[b] * a->block_size * a->kv_heads + kh) * a->head_dim;
}

static inline int64_t min64(int64_t x, int64_t y) { return x < y ? x : y; }

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
INTERNAL int paged_decode_avx2_applies(const Args *a);
INTERNAL int paged_decode_avx2(const Args *a, int64_t rows);
#endif

#if defined(__AVX512F__)
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
extern INTERNAL int bf16_dot_state;

static inline int bf16_dot_supported(void) {
    unsigned eax, ebx, ecx, edx;
    return __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) && (eax & (1u << 5));
}

static inline int bf16_dot_enabled(void) {
    if (bf16_dot_state < 0) bf16_dot_state = bf16_dot_supported();
    return bf16_dot_state;
}

/* The two-pass body's row length in its scratch: max_seq_len padded to whole pairs of
 * 16-vectors. */
static inline int64_t two_pass_len(const Args *a) {
    return ((a->max_seq_len > 0 ? a->max_seq_len : 1) + 31) & ~(int64_t)31;
}

/* Scratch floats a row needs in the two-pass body beyond the other bodies' state: a score and
 * a bfloat16 weight per head and token. */
static inline int64_t two_pass_floats(const Args *a) {
    return a->heads * two_pass_len(a) * 3 / 2;
}

/* the (group, head_dim / 16) pairs with an AVX512-BF16 body; G x NV accumulators <= 16 */
#define DOT_BODIES(X) X(1, 4) X(2, 4) X(3, 4) X(4, 4) X(1, 8) X(2, 8)

static inline int bf16_dot_has_body(int64_t group, int64_t nv) {
#define HAS_BODY(G, NV) if (group == G && nv == NV) return 1;
    DOT_BODIES(HAS_BODY)
#undef HAS_BODY
    return 0;
}

/* A row through an AVX512-BF16 body: 1 where a body exists for this group and head_dim (and
 * the row was done), else 0 (paged_decode_bf16.c). */
BF16_DOT_TARGET INTERNAL int attend_row_bf16_dot(const Args *a, const int64_t *blocks, int64_t len,
                                                 const float *q, float *state, float *o);
#endif /* AVX512-BF16 */
#endif /* AVX-512 */
#endif
