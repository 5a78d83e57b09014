/* Rotate-half RoPE in one pass: out = x * cos + rotate_half(x) * sin, the same floats as transformers'.
 *
 * transformers computes `(q * cos) + (rotate_half(q) * sin)` as five float32 tensor ops (a cat, a neg, two
 * muls, an add), each rounding to float32; per element that is fl(fl(x_i c_i) + fl(r_i s_i)) with
 * r = (-x[h:], x[:h]).  This file is compiled with -ffp-contract=off, so the one expression below rounds the
 * two products and the sum exactly as those ops do (no fused multiply-add), and negation is exact: the
 * same bits (tests/services/models/test_fused_rope.py checks them against transformers' functions).
 *
 * x: [tokens, heads, dim] at any token and head strides (a row of `dim` contiguous), cos/sin: [tokens, dim]
 * rows `cs_stride` apart (the same for every head), out: [tokens, heads, dim] contiguous.
 */
#include <stdint.h>

void epd_rope(const float *x, int64_t tok_stride, int64_t head_stride, const float *cos, const float *sin,
              int64_t cs_stride, float *out, int64_t tokens, int64_t heads, int64_t dim, int threads) {
    const int64_t half = dim / 2;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && tokens * heads * dim >= 32768)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos + t * cs_stride, *s = sin + t * cs_stride;
        for (int64_t h = 0; h < heads; h++) {
            const float *row = x + t * tok_stride + h * head_stride;
            float *o = out + (t * heads + h) * dim;
            for (int64_t i = 0; i < half; i++) {
                const float a = row[i] * c[i];
                const float b = (-row[i + half]) * s[i];
                o[i] = a + b;
            }
            for (int64_t i = half; i < dim; i++) {
                const float a = row[i] * c[i];
                const float b = row[i - half] * s[i];
                o[i] = a + b;
            }
        }
    }
}
