/* The grouped low-rank product of multi-LoRA serving (worker_svc/lora/): for each token that
 * runs an adapter, in one call for every such token of a step and every part of one input,
 *
 *     t = A[slot, p] x                               (shrink: rank[slot, p] dot products)
 *     out_p += scale[slot, p] * B[slot, p]^T t        (expand: along out_p's features)
 *
 * x rows and out rows are float32 or bfloat16 (one dtype: `bf16`), the math float32 (PEFT's
 * delta under a bfloat16 model), each bfloat16 output rounded once after the add.
 * a: [slots, parts * max_rank, in] float32; b[p]: [slots, max_rank, widths[p]] float32;
 * scale, rank: [slots, parts]. Tokens come grouped by slot and go through in tiles of up to
 * TILE tokens of one slot: each row of A and B is read once per tile, not once per token (a
 * slot's A and B for one site are hundreds of KB, so per token the product would be bound by
 * cache bandwidth). Threads split the tiles. The tile's sums are GCC vectors as wide as the
 * library's level has (AVX-512: 16 floats, else 8), so they stay in registers: plain loops
 * over arrays of sums were left scalar or spilled by the vectorizer.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TILE 8
#if defined(__AVX512F__)
#define VEC 16
#else
#define VEC 8
#endif
/* unaligned loads and stores of VEC floats */
typedef float vec __attribute__((vector_size(VEC * sizeof(float)), aligned(4)));

static inline float bf16_to_float(uint16_t v) {
    uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) /* NaN stays NaN */
        return (uint16_t)((bits >> 16) | 0x40);
    bits += 0x7fffu + ((bits >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(bits >> 16);
}

/* t[j * max_rank + r] = A_r . x_j for the m rows of a tile */
static inline __attribute__((always_inline)) void shrink(const int m, const float *const *xs,
                                                         const float *a, int64_t rank, int64_t in,
                                                         int64_t max_rank, float *t) {
    const int64_t body = in - in % VEC;
    for (int64_t r = 0; r < rank; r++) {
        const float *restrict a_r = a + r * in;
        vec sums[TILE];
        for (int j = 0; j < m; j++)
            sums[j] = (vec){0};
        for (int64_t k = 0; k < body; k += VEC) {
            const vec a_k = *(const vec *)(a_r + k);
            for (int j = 0; j < m; j++)
                sums[j] += a_k * *(const vec *)(xs[j] + k);
        }
        for (int j = 0; j < m; j++) {
            float sum = 0.0f;
            for (int u = 0; u < VEC; u++)
                sum += sums[j][u];
            for (int64_t k = body; k < in; k++)
                sum += a_r[k] * xs[j][k];
            t[j * max_rank + r] = sum;
        }
    }
}

static inline __attribute__((always_inline)) void add_out(const int bf16, void *y, int64_t o,
                                                          float delta) {
    if (bf16)
        ((uint16_t *)y)[o] = float_to_bf16(bf16_to_float(((uint16_t *)y)[o]) + delta);
    else
        ((float *)y)[o] += delta;
}

/* ys[j][o] += scale * sum_r t[j][r] * B[r][o] for the m rows of a tile */
static inline __attribute__((always_inline)) void expand(const int m, const int bf16,
                                                         const float *t, const float *b,
                                                         int64_t rank, int64_t width,
                                                         int64_t max_rank, float scale,
                                                         void *const *ys) {
    const int64_t body = width - width % VEC;
    for (int64_t o = 0; o < body; o += VEC) {
        vec sums[TILE];
        for (int j = 0; j < m; j++)
            sums[j] = (vec){0};
        for (int64_t r = 0; r < rank; r++) {
            const vec b_r = *(const vec *)(b + r * width + o);
            for (int j = 0; j < m; j++)
                sums[j] += t[j * max_rank + r] * b_r;
        }
        for (int j = 0; j < m; j++) {
            if (bf16) {
                for (int u = 0; u < VEC; u++)
                    add_out(1, ys[j], o + u, scale * sums[j][u]);
            } else {
                *(vec *)((float *)ys[j] + o) += scale * sums[j];
            }
        }
    }
    for (int64_t o = body; o < width; o++)
        for (int j = 0; j < m; j++) {
            float sum = 0.0f;
            for (int64_t r = 0; r < rank; r++)
                sum += t[j * max_rank + r] * b[r * width + o];
            add_out(bf16, ys[j], o, scale * sum);
        }
}

/* one tile through one part: the sums' sizes known to the compiler for each m */
static void tile_part(const int m, const int bf16, const float *const *xs, const float *a,
                      const float *b, int64_t rank, int64_t in, int64_t width, int64_t max_rank,
                      float scale, void *const *ys, float *t) {
#define TILE_PART(M)                                                                            \
    case M:                                                                                     \
        shrink(M, xs, a, rank, in, max_rank, t);                                                \
        if (bf16)                                                                               \
            expand(M, 1, t, b, rank, width, max_rank, scale, ys);                               \
        else                                                                                    \
            expand(M, 0, t, b, rank, width, max_rank, scale, ys);                               \
        break;
    switch (m) {
        TILE_PART(1)
        TILE_PART(2)
        TILE_PART(3)
        TILE_PART(4)
        TILE_PART(5)
        TILE_PART(6)
        TILE_PART(7)
        TILE_PART(8)
    }
#undef TILE_PART
}

int lora_available(void) { return 1; }

/* The tiles of the token list: runs of one slot, cut every TILE tokens; returns their count,
 * starts[0..count] their bounds. */
static int64_t tiles_of(const int32_t *slots, int64_t n, int64_t *starts) {
    int64_t count = 0;
    for (int64_t i = 0; i < n; i++)
        if (i == 0 || slots[i] != slots[i - 1] || i - starts[count - 1] == TILE)
            starts[count++] = i;
    starts[count] = n;
    return count;
}

int lora_add(int bf16, const void *x, int64_t in, int64_t ldx, const int64_t *tokens,
             const int32_t *slots, int64_t n, const float *a, int64_t max_rank, int64_t parts,
             const int64_t *b, const int64_t *widths, const float *scale, const int32_t *rank,
             const int64_t *out, const int64_t *ldo, int64_t num_threads) {
    int64_t *starts = malloc(sizeof(int64_t) * (size_t)(n + 1));
    if (!starts)
        return -1;
    const int64_t num_tiles = tiles_of(slots, n, starts);
    const size_t elem = bf16 ? 2 : 4;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_tiles > 1 && num_threads > 1)
    {
        float *rows = bf16 ? malloc(sizeof(float) * (size_t)(TILE * in)) : NULL;
        float *t = malloc(sizeof(float) * (size_t)(TILE * max_rank));
        const int ok = t && (rows || !bf16);
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t tile = 0; tile < num_tiles; tile++) {
            if (!ok)
                continue;
            const int64_t first = starts[tile], slot = slots[first];
            const int m = (int)(starts[tile + 1] - first);
            const float *xs[TILE];
            for (int j = 0; j < m; j++) {
                const int64_t token = tokens[first + j];
                xs[j] = (const float *)x + token * ldx;
                if (bf16) {
                    const uint16_t *xb = (const uint16_t *)x + token * ldx;
                    for (int64_t k = 0; k < in; k++)
                        rows[j * in + k] = bf16_to_float(xb[k]);
                    xs[j] = rows + j * in;
                }
            }
            for (int64_t p = 0; p < parts; p++) {
                const int64_t part = slot * parts + p;
                if (rank[part] == 0)
                    continue;
                void *ys[TILE];
                for (int j = 0; j < m; j++)
                    ys[j] = (char *)out[p] + (size_t)(tokens[first + j] * ldo[p]) * elem;
                tile_part(m, bf16, xs, a + part * max_rank * in,
                          (const float *)b[p] + slot * max_rank * widths[p], rank[part], in,
                          widths[p], max_rank, scale[part], ys, t);
            }
        }
        free(rows);
        free(t);
    }
    free(starts);
    return failed ? -1 : 0;
}
