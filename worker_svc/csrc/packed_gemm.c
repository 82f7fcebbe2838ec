/* float32 y = x @ W^T (+ bias) with W packed once at load, for the CPU forward's linear layers.
 *
 * A decode step multiplies a few dozen rows by every weight of the model, and those weights
 * (540 MB for SmolLM2 in float32) come from DRAM each step. MKL re-packs the weight into its own
 * buffer on every call and does not overlap that stream with the arithmetic: measured here at
 * 64 rows over the whole model's weights it reaches ~160 GFLOP/s of a ~290 peak. Packing once
 * removes the copy; each panel is read in one contiguous stream while the next one is
 * prefetched, and a register tile of MR rows x NR columns keeps both FMA ports busy.
 *
 * Layout: x [M, lda] row-major; the packed weight [ceil(N / NR)][K][NR] (panel p holds output
 * columns p*NR .. p*NR+NR-1, zero-padded past N); y [M, ldy]; bias [N] or NULL.
 * Every output is bias + sum over k in order 0..K-1 (one FMA chain), whatever M or the row's
 * place in the batch: a row's result does not depend on what it is batched with.
 */
#define _POSIX_C_SOURCE 199309L /* clock_gettime */
#include <stdint.h>
#include <time.h>

#define NV 3             /* 16-float vectors per panel row */
#define NR (16 * NV)     /* panel width: 48 columns */
#define MR 8             /* rows per register tile: 8 x 3 accumulators */
#define MC 192           /* rows per block; a block's rows stay in L2 while panels stream */

/* Wall time spent inside packed_sgemm since load, for measuring the linear layers' FLOP/s
 * without a profiler (whose per-call bookkeeping is larger than a decode-sized GEMM's noise). */
static int64_t elapsed_ns;

int64_t packed_sgemm_elapsed_ns(void) { return __atomic_load_n(&elapsed_ns, __ATOMIC_RELAXED); }

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

int packed_sgemm_panel_width(void) {
#if defined(__AVX512F__)
    return NR;
#else
    return 0;
#endif
}

#if defined(__AVX512F__)
#include <immintrin.h>
#include <omp.h>

/* This tile's share of the next panel: `burst` lines every `every` k steps from `next` until
 * `end`, spread over all of the panel's tiles rather than issued by the first ones (a run of
 * prefetches holds the core's line-fill buffers that the tile's own loads need). Without any
 * software prefetch the 64-row case ran 10-20 % slower here. */
typedef struct {
    const char *next, *end;
    int64_t every, burst, countdown;
} Prefetch;

static inline __attribute__((always_inline)) void tile(const int mr, const int prefetch,
                                                       const float *x, int64_t lda,
                                                       const float *panel, int64_t K, float *y,
                                                       int64_t ldy, const float *bias,
                                                       const __mmask16 *mask, Prefetch pf) {
    __m512 acc[MR][NV];
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < NV; v++)
            acc[r][v] = bias ? _mm512_maskz_loadu_ps(mask[v], bias + 16 * v) : _mm512_setzero_ps();
#pragma GCC unroll 4
    for (int64_t k = 0; k < K; k++) {
        __m512 b[NV];
        for (int v = 0; v < NV; v++) b[v] = _mm512_loadu_ps(panel + k * NR + 16 * v);
        if (prefetch && pf.next < pf.end && --pf.countdown == 0) {
            pf.countdown = pf.every;
            for (int64_t l = 0; l < pf.burst; l++, pf.next += 64) _mm_prefetch(pf.next, _MM_HINT_T0);
        }
        for (int r = 0; r < mr; r++) {
            const __m512 a = _mm512_set1_ps(x[r * lda + k]);
            for (int v = 0; v < NV; v++) acc[r][v] = _mm512_fmadd_ps(a, b[v], acc[r][v]);
        }
    }
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < NV; v++) _mm512_mask_storeu_ps(y + r * ldy + 16 * v, mask[v], acc[r][v]);
}

#define TILE(n)                                                           \
    case n:                                                               \
        if (pf.next)                                                      \
            tile(n, 1, x, lda, panel, K, y, ldy, bias, mask, pf);         \
        else                                                              \
            tile(n, 0, x, lda, panel, K, y, ldy, bias, mask, pf);         \
        break;

static void tile_rows(int mr, const float *x, int64_t lda, const float *panel, int64_t K, float *y,
                      int64_t ldy, const float *bias, const __mmask16 *mask, Prefetch pf) {
    switch (mr) {
        TILE(8) TILE(7) TILE(6) TILE(5) TILE(4) TILE(3) TILE(2) TILE(1)
    }
}

/* Work items are (row block, panel) pairs. With at least as many panels as threads, each thread
 * owns a contiguous stretch of panels and walks it once per row block: at decode sizes (one row
 * block) it streams its own part of the weight, and for long prefills that part (half of a
 * 576 x 1536 weight with 2 threads) stays in its L2 across row blocks; splitting the items
 * row-block-major instead re-read the whole weight per block (measured 15 % slower at 2048
 * rows). With fewer panels than threads, the items themselves are split. */
typedef struct {
    int64_t panels, row_blocks, first_panel, own_panels; /* own_panels 0: split items */
} Split;

static inline void item_at(const Split *s, int64_t i, int64_t *row_block, int64_t *panel) {
    if (s->own_panels) {
        *row_block = i / s->own_panels;
        *panel = s->first_panel + i % s->own_panels;
    } else {
        *row_block = i / s->panels;
        *panel = i % s->panels;
    }
}

int packed_sgemm(const float *x, int64_t M, int64_t K, int64_t lda, const float *packed,
                 int64_t N, const float *bias, float *y, int64_t ldy, int64_t num_threads) {
    const int64_t panels = (N + NR - 1) / NR, row_blocks = (M + MC - 1) / MC;
    const int64_t items = panels * row_blocks, panel_lines = K * NR * 4 / 64;
    const int64_t started = now_ns();
    if (num_threads < 1) num_threads = 1;
    if (num_threads > items) num_threads = items;
#pragma omp parallel num_threads(num_threads)
    {
        const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
        Split split = {panels, row_blocks, 0, 0};
        int64_t first = items * t / threads, last = items * (t + 1) / threads;
        if (panels >= threads) {
            split.first_panel = panels * t / threads;
            split.own_panels = panels * (t + 1) / threads - split.first_panel;
            first = 0, last = split.own_panels * row_blocks;
        }
        for (int64_t item = first; item < last; item++) {
            int64_t row_block, p, next_block, next_p;
            item_at(&split, item, &row_block, &p);
            const int64_t m_begin = row_block * MC;
            const int64_t rows = M - m_begin < MC ? M - m_begin : MC;
            const int64_t col = p * NR, valid = N - col < NR ? N - col : NR;
            __mmask16 mask[NV];
            for (int v = 0; v < NV; v++) {
                const int64_t n = valid - 16 * v;
                mask[v] = n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? 0 : (__mmask16)((1u << n) - 1);
            }
            const float *panel = packed + p * K * NR;
            /* only the first pass over a thread's panels streams them from memory; on later row
             * blocks they come from L2, where prefetching them cost 15 % at 2048 rows */
            const char *next = NULL;
            if (row_block == 0 && item + 1 < last) {
                item_at(&split, item + 1, &next_block, &next_p);
                next = (const char *)(packed + next_p * K * NR);
            }
            const int64_t tiles = (rows + MR - 1) / MR;
            const int64_t share = (panel_lines + tiles - 1) / tiles; /* lines per tile */
            const int64_t burst = (share + K - 1) / K;
            const int64_t every = K * burst / share > 1 ? K * burst / share : 1;
            for (int64_t i = 0; i < tiles; i++) {
                const int64_t m = m_begin + i * MR, mr = rows - i * MR < MR ? rows - i * MR : MR;
                Prefetch pf = {NULL, NULL, every, burst, 1};
                if (next && i * share < panel_lines) {
                    pf.next = next + i * share * 64;
                    const int64_t lines = panel_lines - i * share < share ? panel_lines - i * share
                                                                          : share;
                    pf.end = pf.next + lines * 64;
                }
                tile_rows((int)mr, x + m * lda, lda, panel, K, y + m * ldy + col, ldy,
                          bias ? bias + col : NULL, mask, pf);
            }
        }
    }
    __atomic_fetch_add(&elapsed_ns, now_ns() - started, __ATOMIC_RELAXED);
    return 0;
}
#else
int packed_sgemm(const float *x, int64_t M, int64_t K, int64_t lda, const float *packed,
                 int64_t N, const float *bias, float *y, int64_t ldy, int64_t num_threads) {
    (void)x, (void)M, (void)K, (void)lda, (void)packed, (void)N, (void)bias, (void)y, (void)ldy;
    (void)num_threads;
    return -1; /* built without AVX-512: the caller keeps its BLAS path */
}
#endif
