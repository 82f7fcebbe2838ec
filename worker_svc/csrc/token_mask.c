/* Grammar masks on the logits (structured output), from the packed masks llguidance fills:
 * bit t of word w allows token 32w + t. Every token a row's mask does not allow becomes -inf,
 * in place. A word that allows everything is skipped and one that allows nothing is filled
 * whole, so a row costs in proportion to its mixed words; torch's path would first unpack the
 * masks to one byte per token and then masked_fill the [rows, vocab] logits through them.
 * Plain C: built at every x86-64 level the library is.
 *
 * logits: float32, row r at logits + r * stride, `cols` tokens (columns past the masks' words,
 * a vocabulary padded for the hardware, are never allowed). rows: the logits rows the num_rows
 * masks belong to. */
#include <math.h>
#include <stdint.h>

int apply_packed_mask_f32(float *logits, int64_t stride, int64_t cols, const int64_t *rows,
                          int64_t num_rows, const int32_t *masks, int64_t words,
                          int64_t num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && num_rows > 1)
    for (int64_t i = 0; i < num_rows; i++) {
        float *row = logits + rows[i] * stride;
        const uint32_t *mask = (const uint32_t *)masks + i * words;
        const int64_t covered = words * 32 < cols ? words * 32 : cols;
        for (int64_t start = 0; start < covered; start += 32) {
            const uint32_t bits = mask[start / 32];
            if (bits == 0xFFFFFFFFu)
                continue;
            const int64_t n = covered - start < 32 ? covered - start : 32;
            float *out = row + start;
            if (bits == 0) {
                for (int64_t t = 0; t < n; t++)
                    out[t] = -INFINITY;
                continue;
            }
            for (int64_t t = 0; t < n; t++)
                out[t] = ((bits >> t) & 1u) ? out[t] : -INFINITY;
        }
        for (int64_t c = covered; c < cols; c++)
            row[c] = -INFINITY;
    }
    return 0;
}
