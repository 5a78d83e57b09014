/* One pass of torch's uint8 antialiased resize (the Pillow-SIMD kernel torchvision runs for a uint8 CPU
 * tensor), along the middle axis of a contiguous [outer, n_in, inner] uint8 array:
 *
 *   dst[o, j, i] = clamp((2^(precision-1) + sum_k src[o, min(first[j] + k, n_in - 1), i] * w[j, k]) >> precision)
 *
 * accumulated in int32 exactly as torch's kernel and services/render/qwen_pixels.py's numpy port do
 * (the weights and precision come from that module; |acc| < 2^31 for every precision it picks).
 * Single-threaded on purpose: render runs one image per worker process. */
#include <stdint.h>

static inline uint8_t clamp_shift(int32_t sum, int32_t precision) {
    sum >>= precision;
    return (uint8_t)(sum < 0 ? 0 : (sum > 255 ? 255 : sum));
}

void epd_resample_uint8(const uint8_t *src, int64_t outer, int64_t n_in, int64_t inner, uint8_t *dst,
                        int64_t n_out, const int64_t *first, const int32_t *weights, int64_t taps,
                        int32_t precision, int32_t *acc) {
    const int32_t half = (int32_t)1 << (precision - 1);
    const int64_t last = n_in - 1;
    for (int64_t o = 0; o < outer; o++) {
        const uint8_t *in = src + o * n_in * inner;
        uint8_t *out = dst + o * n_out * inner;
        for (int64_t j = 0; j < n_out; j++) {
            const int32_t *w = weights + j * taps;
            uint8_t *row = out + j * inner;
            if (inner == 3) {  /* the horizontal pass of RGB pixels: the three channels together */
                int32_t r = half, g = half, b = half;
                for (int64_t k = 0; k < taps; k++) {
                    int64_t x = first[j] + k;
                    const uint8_t *px = in + (x < last ? x : last) * 3;
                    r += (int32_t)px[0] * w[k];
                    g += (int32_t)px[1] * w[k];
                    b += (int32_t)px[2] * w[k];
                }
                row[0] = clamp_shift(r, precision);
                row[1] = clamp_shift(g, precision);
                row[2] = clamp_shift(b, precision);
                continue;
            }
            /* the vertical pass (or any other layout): whole rows, vectorised over the row (acc: the caller's int32[inner]) */
            for (int64_t i = 0; i < inner; i++) acc[i] = half;
            for (int64_t k = 0; k < taps; k++) {
                int64_t x = first[j] + k;
                const uint8_t *line = in + (x < last ? x : last) * inner;
                const int32_t wk = w[k];
                if (wk == 0) continue;
                for (int64_t i = 0; i < inner; i++) acc[i] += (int32_t)line[i] * wk;
            }
            for (int64_t i = 0; i < inner; i++) row[i] = clamp_shift(acc[i], precision);
        }
    }
}
