/* bfloat16 y = x @ W^T (+ bias) on Intel AMX, for the decode-sized linear layers of a bfloat16
 * model on the CPU.
 *
 * At decode sizes (a few dozen rows) a linear layer is a stream of its weights, so the memory
 * read rate bounds it, and oneDNN's prepacked path stays far from that bound at these row
 * counts. Here the weight is packed once into AMX B tiles, each panel of 16 output columns one
 * contiguous run, and each thread streams its own panels once per call while the tile unit
 * multiplies: per 32-deep slice of K, one B tile (1 KB) and up to four A tiles (16 rows each,
 * read straight from x with its row stride).
 *
 * Layout: x [M, lda] bfloat16 row-major; packed [N / 16][K / 32][16][16][2] (panel, K slice,
 * K pair, column, pair element: the tile unit's VNNI order); y [M, ldy] bfloat16; bias [N]
 * bfloat16 or NULL. K % 32 == 0 and N % 16 == 0 (the caller checks). Sums in float32, rounded
 * once to bfloat16 (nearest even) after the bias is added, as oneDNN does.
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#if defined(__x86_64__) && defined(__AVX512F__) && defined(__GNUC__) && __GNUC__ >= 11
#include <immintrin.h>
#include <omp.h>

#include "amx_tiles.h"
#include "simd_math.h"
#include "work_runs.h"

/* rows per block: a block's rows of x stay in L2 while the thread's panels pass (below) */
#define ROW_BLOCK 64
#define PREFETCH_BYTES 4096 /* B read ahead: four K slices */

int amx_gemm_available(void) { return amx_permitted(); }

/* 16 float32 sums of a row (+ bias) rounded to bfloat16 into y */
AMX_TARGET static inline void store_row(const float *sums, const uint16_t *bias, uint16_t *y) {
    __m512 v = _mm512_loadu_ps(sums);
    if (bias)
        v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(
                                 _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)bias)), 16)));
    _mm256_storeu_si256((__m256i *)y, (__m256i)_mm512_cvtneps_pbh(v));
}

AMX_TARGET static inline __m512 bf16_round_trip(__m512 v) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

/* the gated MLP's product from a row's 16 gate sums and 16 up sums, rounded where torch's
 * bfloat16 ops round: gate and up (the projections' outputs), silu(gate), the product */
AMX_TARGET static inline void store_silu_mul(const float *gate, const float *up, uint16_t *y) {
    const __m512 g = bf16_round_trip(_mm512_loadu_ps(gate));
    const __m512 u = bf16_round_trip(_mm512_loadu_ps(up));
    const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));
    const __m512 s = bf16_round_trip(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
    _mm256_storeu_si256((__m256i *)y, (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(s, u)));
}

/* A finished 2 x 2 block's sums still to be rounded into y: the next block's tile products run
 * on the tile unit while the vector unit writes these rows out, so the writing hides behind the
 * products instead of adding to them. */
typedef struct {
    const float *sums; /* [32 rows][32 columns] */
    uint16_t *y;       /* the block's first row and column in y */
    const uint16_t *bias;
    int64_t ldy, rows, done;
    int silu;
} Pending;

AMX_TARGET static inline void write_rows(Pending *p, int64_t upto) {
    if (upto > p->rows) upto = p->rows;
    for (; p->done < upto; p->done++) {
        const float *s = p->sums + p->done * 32;
        uint16_t *yr = p->y + p->done * p->ldy;
        if (p->silu) {
            store_silu_mul(s, s + 16, yr);
            continue;
        }
        store_row(s, p->bias, yr);
        store_row(s + 16, p->bias ? p->bias + 16 : NULL, yr + 16);
    }
}

/* Two row tiles (32 rows) x two panels (32 columns) over all of K: C tiles 0..3, A tiles 4..5,
 * B tiles 6..7; four products per K slice for four tile loads. `prev` (or NULL): the block
 * before, written out a few rows per K slice meanwhile. */
AMX_TARGET static void block_2x2(const uint16_t *x, int64_t lda, const uint16_t *panel0,
                                 const uint16_t *panel1, int64_t kblocks, float *sums,
                                 Pending *prev) {
    const int64_t astride = lda * 2, rows_per_slice = (32 + kblocks - 1) / kblocks;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kb = 0; kb < kblocks; kb++) {
        const uint16_t *b0 = panel0 + kb * 512, *b1 = panel1 + kb * 512;
        for (int l = 0; l < 1024; l += 64) {
            _mm_prefetch((const char *)b0 + PREFETCH_BYTES + l, _MM_HINT_T0);
            _mm_prefetch((const char *)b1 + PREFETCH_BYTES + l, _MM_HINT_T0);
        }
        _tile_loadd(4, x + kb * 32, astride);
        _tile_loadd(6, b0, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, b1, 64);
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(5, x + 16 * lda + kb * 32, astride);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
        if (prev) write_rows(prev, (kb + 1) * rows_per_slice);
    }
    if (prev) write_rows(prev, 32);
    _tile_stored(0, sums, 128); /* sums [32 rows][32 columns] */
    _tile_stored(1, sums + 16, 128);
    _tile_stored(2, sums + 512, 128);
    _tile_stored(3, sums + 528, 128);
}

/* silu: the panel pairs are (gate, up) column groups and y gets silu(gate) * up, N / 2 wide */
AMX_TARGET static int gemm(const uint16_t *x, int64_t M, int64_t K, int64_t lda,
                           const uint16_t *packed, int64_t N, const uint16_t *bias, uint16_t *y,
                           int64_t ldy, int64_t num_threads, const int silu) {
    if (!amx_gemm_available() || K % 32 || N % 32 || M <= 0) return -1;
    const int64_t panels = N / 16, kblocks = K / 32, row_tiles = (M + 31) / 32 * 2;
    /* rows past M in the last tile: read from a zero-padded copy, not past x's end */
    uint16_t *padded = NULL;
    const uint16_t *xs = x;
    int64_t ld = lda;
    if (M % 32) {
        padded = calloc((size_t)(row_tiles * 16 * K), sizeof(uint16_t));
        if (!padded) return -1;
        for (int64_t r = 0; r < M; r++) memcpy(padded + r * K, x + r * lda, K * sizeof(uint16_t));
        xs = padded, ld = K;
    }
    if (num_threads < 1) num_threads = 1;
    if (num_threads > panels / 2) num_threads = panels / 2;
    if (num_threads > WORK_RUNS_MAX_THREADS) num_threads = WORK_RUNS_MAX_THREADS;
    /* rows in blocks of ROW_BLOCK (their x stays in L2 while the thread's panels pass); each
     * thread's run is its panel pairs for each row block in turn, so its pairs, streamed once,
     * stay in its L2 across row blocks; a thread done early steals (work_runs.h) */
    const int64_t pairs = panels / 2, tiles_per_block = ROW_BLOCK / 16;
    const int64_t row_blocks = (row_tiles + tiles_per_block - 1) / tiles_per_block;
    WorkRun runs[WORK_RUNS_MAX_THREADS];
    for (int64_t t = 0; t < num_threads; t++)
        work_run_init(&runs[t], 0, (pairs * (t + 1) / num_threads - pairs * t / num_threads) * row_blocks);
#pragma omp parallel num_threads(num_threads)
    {
        const int64_t t = omp_get_thread_num();
        /* one buffer: block_2x2 writes out the block before it fully before storing its own */
        float sums[32 * 32] __attribute__((aligned(64)));
        Pending pending = {0}, *prev = NULL;
        amx_configure_tiles();
        int64_t owner, item;
        while ((item = work_runs_take(runs, num_threads, t, &owner)) >= 0) {
            const int64_t first = pairs * owner / num_threads;
            const int64_t own = pairs * (owner + 1) / num_threads - first;
            const int64_t q = first + item % own, rb = item / own * tiles_per_block;
            const uint16_t *p0 = packed + 2 * q * kblocks * 512, *p1 = p0 + kblocks * 512;
            const int64_t rb_end = rb + tiles_per_block < row_tiles ? rb + tiles_per_block : row_tiles;
            for (int64_t r0 = rb; r0 < rb_end; r0 += 2) {
                block_2x2(xs + r0 * 16 * ld, ld, p0, p1, kblocks, sums, prev);
                pending.sums = sums;
                pending.rows = M - r0 * 16 < 32 ? M - r0 * 16 : 32;
                pending.done = 0;
                pending.ldy = ldy;
                pending.silu = silu;
                pending.y = y + r0 * 16 * ldy + q * (silu ? 16 : 32);
                pending.bias = bias ? bias + q * 32 : NULL;
                prev = &pending;
            }
        }
        if (prev) write_rows(prev, 32);
        _tile_release();
    }
    free(padded);
    return 0;
}

AMX_TARGET int amx_gemm_bf16(const uint16_t *x, int64_t M, int64_t K, int64_t lda,
                             const uint16_t *packed, int64_t N, const uint16_t *bias, uint16_t *y,
                             int64_t ldy, int64_t num_threads) {
    return gemm(x, M, K, lda, packed, N, bias, y, ldy, num_threads, 0);
}

/* y [M, ldy] = silu(x @ gate^T) * (x @ up^T), N outputs; packed holds 2N columns in panel
 * pairs (gate columns 16j..16j+15, then up's): the gated MLP's two projections and product in
 * one pass, the projections never written out. */
AMX_TARGET int amx_gemm_bf16_silu_mul(const uint16_t *x, int64_t M, int64_t K, int64_t lda,
                                      const uint16_t *packed, int64_t N, uint16_t *y, int64_t ldy,
                                      int64_t num_threads) {
    return gemm(x, M, K, lda, packed, 2 * N, NULL, y, ldy, num_threads, 1);
}
#else
int amx_gemm_available(void) { return 0; }

int amx_gemm_bf16(const uint16_t *x, int64_t M, int64_t K, int64_t lda, const uint16_t *packed,
                  int64_t N, const uint16_t *bias, uint16_t *y, int64_t ldy, int64_t num_threads) {
    (void)x, (void)M, (void)K, (void)lda, (void)packed, (void)N, (void)bias, (void)y, (void)ldy;
    (void)num_threads;
    return -1;
}

int amx_gemm_bf16_silu_mul(const uint16_t *x, int64_t M, int64_t K, int64_t lda,
                           const uint16_t *packed, int64_t N, uint16_t *y, int64_t ldy,
                           int64_t num_threads) {
    (void)x, (void)M, (void)K, (void)lda, (void)packed, (void)N, (void)y, (void)ldy;
    (void)num_threads;
    return -1;
}
#endif
