/* A prototype for benchmarks/int8_screen.py (not used by the servers): y[M, N] = xu[M, K] . w[N, K] in int32,
 * xu as uint8 (x quantized, + 128) and w as int8, with AVX512-VNNI's vpdpbusd (4 products per int32 lane).
 *
 * xp    [M, K4]        int32: each row's uint8 x in groups of 4 along k (K4 = K / 4)
 * w     [Q, K4, 16]    int32: panel q holds rows 16q .. 16q + 15 of w, 4 int8 along k per lane; 64-byte aligned
 * y     [M, N]         int32, row stride ldy; N a multiple of 32 (whole pairs of panels)
 *
 * Tiles of up to 8 rows x 2 panels (16 accumulators), as the bfloat16 pair kernel's in
 * services/models/panel_kernel.c. */
#if !defined(__AVX512F__) || !defined(__AVX512VNNI__)
#error "the int8 screen prototype needs AVX512-VNNI"
#endif
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#define NR 16
#define DPI(i)                                                                                              \
    if ((i) < MR * 2)                                                                                       \
        c##i = _mm512_dpbusd_epi32(c##i, _mm512_set1_epi32(xp[(int64_t)((i) / 2) * ldx + k]), (i) % 2 ? w1 : w0);
#define ST(i)                                                                                               \
    if ((i) < MR * 2) _mm512_storeu_si512((void *)(y + (int64_t)((i) / 2) * ldy + (q + (i) % 2) * NR), c##i);

static inline __attribute__((always_inline)) void tile(const int32_t *xp, int64_t ldx, const int32_t *w, int K4,
                                                       int32_t *y, int64_t ldy, int q, const int MR) {
    __m512i c0 = _mm512_setzero_si512(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0, c8 = c0;
    __m512i c9 = c0, c10 = c0, c11 = c0, c12 = c0, c13 = c0, c14 = c0, c15 = c0;
    const int64_t stride = (int64_t)K4 * NR;
    const int32_t *p = w + (int64_t)q * stride;
    for (int k = 0; k < K4; k++) {
        const __m512i w0 = _mm512_load_si512((const void *)(p + (int64_t)k * NR));
        const __m512i w1 = _mm512_load_si512((const void *)(p + stride + (int64_t)k * NR));
        DPI(0) DPI(1) DPI(2) DPI(3) DPI(4) DPI(5) DPI(6) DPI(7) DPI(8) DPI(9) DPI(10) DPI(11) DPI(12) DPI(13) DPI(14)
        DPI(15)
    }
    ST(0) ST(1) ST(2) ST(3) ST(4) ST(5) ST(6) ST(7) ST(8) ST(9) ST(10) ST(11) ST(12) ST(13) ST(14) ST(15)
}

/* 0, or 1 for shapes it refuses. */
int epd_int8_screen(const int32_t *xp, int64_t ldx, int M, const int32_t *w, int N, int K4, int32_t *y, int64_t ldy,
                    int threads) {
    if (M <= 0 || N <= 0 || N % (2 * NR) || K4 <= 0 || ldx < K4 || ldy < N || threads <= 0 || ((uintptr_t)w % 64))
        return 1;
    const int Q = N / NR;
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int per = ((Q + nt - 1) / nt + 1) / 2 * 2, q0 = t * per, q1 = q0 + per > Q ? Q : q0 + per;
        for (int q = q0; q + 2 <= q1; q += 2)
            for (int m = 0; m < M; m += 8) {
                const int32_t *xm = xp + (int64_t)m * ldx;
                int32_t *ym = y + (int64_t)m * ldy;
                switch (M - m < 8 ? M - m : 8) {
                    case 1: tile(xm, ldx, w, K4, ym, ldy, q, 1); break;
                    case 2: tile(xm, ldx, w, K4, ym, ldy, q, 2); break;
                    case 3: tile(xm, ldx, w, K4, ym, ldy, q, 3); break;
                    case 4: tile(xm, ldx, w, K4, ym, ldy, q, 4); break;
                    case 5: tile(xm, ldx, w, K4, ym, ldy, q, 5); break;
                    case 6: tile(xm, ldx, w, K4, ym, ldy, q, 6); break;
                    case 7: tile(xm, ldx, w, K4, ym, ldy, q, 7); break;
                    default: tile(xm, ldx, w, K4, ym, ldy, q, 8); break;
                }
            }
    }
    return 0;
}
