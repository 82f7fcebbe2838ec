/* Paged prefill attention: what its files share (internal, not part of the library's
 * interface). paged_prefill.c holds the entry points, the work-item loop and the AMX bodies
 * (kept in the file that configures the tiles: see amx_tiles.h); paged_prefill_avx512.c the
 * AVX-512 bodies. Here: the call's arguments (Args), the tile sizes, the 16 x 16 transpose
 * both use (static inline: no call between files inside a loop) and the AVX-512 work item,
 * hidden: not exported from the library, and called directly rather than through the PLT. */
#ifndef SPLITSERVE_PAGED_PREFILL_H
#define SPLITSERVE_PAGED_PREFILL_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define INTERNAL __attribute__((visibility("hidden")))
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
    int io_bf16; /* q and out bfloat16 (the AMX bodies only), else float32 */
} Args;

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

/* One work item, (chunk, tile of QT query tokens from i0, kv head), on AVX-512: its queries'
 * outputs written to out (paged_prefill_avx512.c). scratch: the work item's floats. */
INTERNAL void attend_item(const Args *a, int64_t chunk, int64_t i0, int64_t kh, float *scratch);
#endif
#endif
