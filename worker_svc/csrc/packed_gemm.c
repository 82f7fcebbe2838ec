/* y = x @ W^T (+ bias) with W packed once at load, for the CPU forward's linear layers:
 * float32 (packed_sgemm) and bfloat16 (packed_bgemm: bfloat16 x, W, bias and y, each weight
 * widened to float32 in the inner loop and summed in float32, for CPUs without bfloat16
 * arithmetic), and int8 weights with one float32 scale per output column (packed_i8gemm with
 * float32 x, bias and y; packed_i8bgemm with bfloat16 ones): each int8 weight is widened to
 * float32 in the inner loop, the sum over k is of the integer weights, and the column's scale
 * multiplies it once at the end, in the same FMA that adds the bias.
 *
 * A decode step multiplies a few dozen rows by every weight of the model, and those weights come
 * from DRAM each step. BLAS libraries re-pack the weight into their own buffer on every call and
 * do not overlap that stream with the arithmetic. Packing once removes the copy; each panel is
 * read in one contiguous stream while the next one is prefetched, and a register tile of MR rows
 * x NR columns keeps both FMA ports busy. Built for AVX-512 (16-float vectors, 8 x 48 tiles) or
 * AVX2 + FMA (8-float vectors, 6 x 16 tiles: 12 accumulators of the 16 registers).
 *
 * Layout: x [M, lda] row-major; the packed weight [ceil(N / NR)][K][NR] (panel p holds output
 * columns p*NR .. p*NR+NR-1, zero-padded past N); y [M, ldy]; bias [N] or NULL; scale [N].
 * Every output is bias + sum over k in order 0..K-1 (int8: scale * that sum + bias), one FMA
 * chain whatever M or the row's place in the batch: a row's result does not depend on what it
 * is batched with.
 */
#define _POSIX_C_SOURCE 199309L /* clock_gettime */
#include <stdint.h>
#include <string.h>
#include <time.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define HAVE_PACKED_GEMM 1
#define VW 16 /* floats per vector */
#define NV 3  /* vectors per panel row */
#define MR 8  /* rows per register tile */
typedef __m512 vec;
typedef __mmask16 vmask;
static inline vec vzero(void) { return _mm512_setzero_ps(); }
static inline vec vload(const float *p) { return _mm512_loadu_ps(p); }
static inline vec vbroadcast(float x) { return _mm512_set1_ps(x); }
static inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline vmask vmask_of(int64_t n) {
    return n >= VW ? (vmask)0xFFFF : n <= 0 ? 0 : (vmask)((1u << n) - 1);
}
static inline void vstore_masked(float *p, vmask m, vec v) { _mm512_mask_storeu_ps(p, m, v); }
static inline vec vload_bf16(const uint16_t *p) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline vec vload_i8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
/* n of the vector's floats, rounded to nearest even bfloat16, into p */
static inline void vstore_bf16(uint16_t *p, vec v, int64_t n) {
    __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    _mm256_mask_storeu_epi16(p, vmask_of(n), _mm512_cvtepi32_epi16(u));
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_PACKED_GEMM 1
#define VW 8
#define NV 2
#define MR 6
typedef __m256 vec;
typedef __m256i vmask;
static inline vec vzero(void) { return _mm256_setzero_ps(); }
static inline vec vload(const float *p) { return _mm256_loadu_ps(p); }
static inline vec vbroadcast(float x) { return _mm256_set1_ps(x); }
static inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline vmask vmask_of(int64_t n) {
    const int32_t lanes = n >= VW ? VW : n <= 0 ? 0 : (int32_t)n;
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(lanes), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
static inline void vstore_masked(float *p, vmask m, vec v) { _mm256_maskstore_ps(p, m, v); }
static inline vec vload_bf16(const uint16_t *p) {
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static inline vec vload_i8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline void vstore_bf16(uint16_t *p, vec v, int64_t n) {
    __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    const __m128i h = _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1));
    if (n >= VW) {
        _mm_storeu_si128((__m128i *)p, h);
    } else if (n > 0) {
        uint16_t lanes[VW];
        _mm_storeu_si128((__m128i *)lanes, h);
        memcpy(p, lanes, (size_t)n * sizeof *p);
    }
}
#endif

#define NR (VW * NV) /* panel width */
enum { F32, BF16, I8 }; /* element types: activations (F32, BF16) and weights (all three) */
#define MC 192       /* rows per block; a block's rows stay in L2 while panels stream */

/* Wall time spent inside the GEMMs since load, for measuring the linear layers' FLOP/s without
 * a profiler (whose per-call bookkeeping is larger than a decode-sized GEMM's noise). */
static int64_t elapsed_ns;

int64_t packed_sgemm_elapsed_ns(void) { return __atomic_load_n(&elapsed_ns, __ATOMIC_RELAXED); }

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

#if defined(HAVE_PACKED_GEMM)
#include <omp.h>

int packed_sgemm_panel_width(void) { return NR; }

static inline float bf16_to_f32(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* This tile's share of the next panel: `burst` lines every `every` k steps from `next` until
 * `end`, spread over all of the panel's tiles rather than issued by the first ones (a run of
 * prefetches holds the core's line-fill buffers that the tile's own loads need). */
typedef struct {
    const char *next, *end;
    int64_t every, burst, countdown;
} Prefetch;

/* One register tile: mr rows x NR columns over all of K. `act` is the type of x and y, `wt` the
 * panel's (compile-time constants in each caller); bias and scale (int8 weights) arrive as
 * float32 in `bias` and `scale` (NR floats each). */
static inline __attribute__((always_inline)) void tile(const int mr, const int prefetch,
                                                       const int act, const int wt,
                                                       const void *x, int64_t lda,
                                                       const void *panel, int64_t K, void *y,
                                                       int64_t ldy, const float *bias,
                                                       const float *scale, int64_t valid,
                                                       Prefetch pf) {
    vec acc[MR][NV];
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < NV; v++) acc[r][v] = bias && wt != I8 ? vload(bias + VW * v) : vzero();
#pragma GCC unroll 4
    for (int64_t k = 0; k < K; k++) {
        vec b[NV];
        for (int v = 0; v < NV; v++)
            b[v] = wt == I8     ? vload_i8((const int8_t *)panel + k * NR + VW * v)
                   : wt == BF16 ? vload_bf16((const uint16_t *)panel + k * NR + VW * v)
                                : vload((const float *)panel + k * NR + VW * v);
        if (prefetch && pf.next < pf.end && --pf.countdown == 0) {
            pf.countdown = pf.every;
            for (int64_t l = 0; l < pf.burst; l++, pf.next += 64) _mm_prefetch(pf.next, _MM_HINT_T0);
        }
        for (int r = 0; r < mr; r++) {
            const vec a = vbroadcast(act == BF16 ? bf16_to_f32(((const uint16_t *)x)[r * lda + k])
                                                 : ((const float *)x)[r * lda + k]);
            for (int v = 0; v < NV; v++) acc[r][v] = vfma(a, b[v], acc[r][v]);
        }
    }
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < NV; v++) {
            if (wt == I8)
                acc[r][v] = vfma(acc[r][v], vload(scale + VW * v), bias ? vload(bias + VW * v)
                                                                         : vzero());
            if (act == BF16)
                vstore_bf16((uint16_t *)y + r * ldy + VW * v, acc[r][v], valid - VW * v);
            else
                vstore_masked((float *)y + r * ldy + VW * v, vmask_of(valid - VW * v), acc[r][v]);
        }
}

#define TILE(n, act, wt)                                                              \
    case n:                                                                           \
        if (pf.next)                                                                  \
            tile(n, 1, act, wt, x, lda, panel, K, y, ldy, bias, scale, valid, pf);    \
        else                                                                          \
            tile(n, 0, act, wt, x, lda, panel, K, y, ldy, bias, scale, valid, pf);    \
        break;
#if MR == 8
#define TILES_ABOVE_6(act, wt) TILE(8, act, wt) TILE(7, act, wt)
#else
#define TILES_ABOVE_6(act, wt)
#endif
#define TILE_ROWS(name, act, wt)                                                                 \
    static void name(int mr, const void *x, int64_t lda, const void *panel, int64_t K, void *y, \
                     int64_t ldy, const float *bias, const float *scale, int64_t valid,          \
                     Prefetch pf) {                                                              \
        switch (mr) {                                                                            \
            TILES_ABOVE_6(act, wt)                                                               \
            TILE(6, act, wt) TILE(5, act, wt) TILE(4, act, wt) TILE(3, act, wt)                  \
            TILE(2, act, wt) TILE(1, act, wt)                                                    \
        }                                                                                        \
    }
TILE_ROWS(tile_rows_f32, F32, F32)
TILE_ROWS(tile_rows_bf16, BF16, BF16)
TILE_ROWS(tile_rows_f32_i8, F32, I8)
TILE_ROWS(tile_rows_bf16_i8, BF16, I8)
typedef void (*TileRows)(int, const void *, int64_t, const void *, int64_t, void *, int64_t,
                         const float *, const float *, int64_t, Prefetch);

/* Work items are (row block, panel) pairs. With at least as many panels as threads, each thread
 * owns a contiguous stretch of panels and walks it once per row block: at decode sizes (one row
 * block) it streams its own part of the weight, and for long prefills that part stays in its L2
 * across row blocks; splitting the items row-block-major instead re-reads the whole weight per
 * block. With fewer panels than threads, the items themselves are split. */
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

static int gemm(const int act, const int wt, const void *x, int64_t M, int64_t K, int64_t lda,
                const void *packed, int64_t N, const void *bias, const float *scale, void *y,
                int64_t ldy, int64_t num_threads) {
    const TileRows rows_of = wt == I8 ? (act == BF16 ? tile_rows_bf16_i8 : tile_rows_f32_i8)
                             : act == BF16 ? tile_rows_bf16
                                           : tile_rows_f32;
    const int64_t esz = act == BF16 ? 2 : 4, wsz = wt == I8 ? 1 : wt == BF16 ? 2 : 4;
    const int64_t panels = (N + NR - 1) / NR, row_blocks = (M + MC - 1) / MC;
    const int64_t items = panels * row_blocks, panel_lines = K * NR * wsz / 64;
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
            float bias_f[NR], scale_f[NR];
            if (bias)
                for (int64_t c = 0; c < NR; c++)
                    bias_f[c] = c >= valid    ? 0.0f
                                : act == BF16 ? bf16_to_f32(((const uint16_t *)bias)[col + c])
                                              : ((const float *)bias)[col + c];
            if (wt == I8)
                for (int64_t c = 0; c < NR; c++) scale_f[c] = c >= valid ? 0.0f : scale[col + c];
            const char *panel = (const char *)packed + p * K * NR * wsz;
            /* only the first pass over a thread's panels streams them from memory; on later row
             * blocks they come from L2, where prefetching them again costs time */
            const char *next = NULL;
            if (row_block == 0 && item + 1 < last) {
                item_at(&split, item + 1, &next_block, &next_p);
                next = (const char *)packed + next_p * K * NR * wsz;
            }
            const int64_t tiles = (rows + MR - 1) / MR;
            const int64_t share = (panel_lines + tiles - 1) / tiles; /* lines per tile */
            const int64_t burst = (share + K - 1) / K;
            const int64_t every = share && K * burst / share > 1 ? K * burst / share : 1;
            for (int64_t i = 0; i < tiles; i++) {
                const int64_t m = m_begin + i * MR, mr = rows - i * MR < MR ? rows - i * MR : MR;
                Prefetch pf = {NULL, NULL, every, burst, 1};
                if (next && i * share < panel_lines) {
                    pf.next = next + i * share * 64;
                    const int64_t lines = panel_lines - i * share < share ? panel_lines - i * share
                                                                          : share;
                    pf.end = pf.next + lines * 64;
                }
                const char *xm = (const char *)x + m * lda * esz;
                char *ym = (char *)y + (m * ldy + col) * esz;
                rows_of((int)mr, xm, lda, panel, K, ym, ldy, bias ? bias_f : NULL, scale_f, valid,
                        pf);
            }
        }
    }
    __atomic_fetch_add(&elapsed_ns, now_ns() - started, __ATOMIC_RELAXED);
    return 0;
}

int packed_sgemm(const float *x, int64_t M, int64_t K, int64_t lda, const float *packed,
                 int64_t N, const float *bias, float *y, int64_t ldy, int64_t num_threads) {
    return gemm(F32, F32, x, M, K, lda, packed, N, bias, NULL, y, ldy, num_threads);
}

int packed_bgemm(const uint16_t *x, int64_t M, int64_t K, int64_t lda, const uint16_t *packed,
                 int64_t N, const uint16_t *bias, uint16_t *y, int64_t ldy, int64_t num_threads) {
    return gemm(BF16, BF16, x, M, K, lda, packed, N, bias, NULL, y, ldy, num_threads);
}

int packed_i8gemm(const float *x, int64_t M, int64_t K, int64_t lda, const int8_t *packed,
                  int64_t N, const float *scale, const float *bias, float *y, int64_t ldy,
                  int64_t num_threads) {
    return gemm(F32, I8, x, M, K, lda, packed, N, bias, scale, y, ldy, num_threads);
}

int packed_i8bgemm(const uint16_t *x, int64_t M, int64_t K, int64_t lda, const int8_t *packed,
                   int64_t N, const float *scale, const uint16_t *bias, uint16_t *y, int64_t ldy,
                   int64_t num_threads) {
    return gemm(BF16, I8, x, M, K, lda, packed, N, bias, scale, y, ldy, num_threads);
}
#else
/* built without AVX2 + FMA: callers keep torch's linear */
int packed_sgemm_panel_width(void) { return 0; }

int packed_sgemm(const float *x, int64_t M, int64_t K, int64_t lda, const float *packed,
                 int64_t N, const float *bias, float *y, int64_t ldy, int64_t num_threads) {
    (void)x, (void)M, (void)K, (void)lda, (void)packed, (void)N, (void)bias, (void)y, (void)ldy;
    (void)num_threads;
    return -1;
}

int packed_bgemm(const uint16_t *x, int64_t M, int64_t K, int64_t lda, const uint16_t *packed,
                 int64_t N, const uint16_t *bias, uint16_t *y, int64_t ldy, int64_t num_threads) {
    (void)x, (void)M, (void)K, (void)lda, (void)packed, (void)N, (void)bias, (void)y, (void)ldy;
    (void)num_threads;
    return -1;
}

int packed_i8gemm(const float *x, int64_t M, int64_t K, int64_t lda, const int8_t *packed,
                  int64_t N, const float *scale, const float *bias, float *y, int64_t ldy,
                  int64_t num_threads) {
    (void)x, (void)M, (void)K, (void)lda, (void)packed, (void)N, (void)scale, (void)bias, (void)y;
    (void)ldy, (void)num_threads;
    return -1;
}

int packed_i8bgemm(const uint16_t *x, int64_t M, int64_t K, int64_t lda, const int8_t *packed,
                   int64_t N, const float *scale, const uint16_t *bias, uint16_t *y, int64_t ldy,
                   int64_t num_threads) {
    (void)x, (void)M, (void)K, (void)lda, (void)packed, (void)N, (void)scale, (void)bias, (void)y;
    (void)ldy, (void)num_threads;
    return -1;
}
#endif
