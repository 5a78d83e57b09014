/* Small-batch linear layers (services/models/panel_linear.py): y[M, N] = x[M, K] W^T (+ bias).
 *
 * x      [M, K]            float32, row stride ldx
 * panels [ceil(N/16), K, 16] float32, contiguous, 32-byte aligned: W's rows in groups of 16,
 *                          interleaved by k (panel q holds W[16q .. 16q+15, k] at [q, k, 0..15]);
 *                          rows past N are zero
 * bias   [N] or NULL
 * y      [M, N]            float32, row stride ldy
 *
 * Why: a decode step multiplies a few rows by every weight of the model, so it is bound by reading
 * the weights once.  Per k the kernel loads one 16-wide slice of a panel (two AVX2 vectors),
 * broadcasts x[m, k] for each row of the tile and issues fused multiply-adds into registers
 * (tiles of up to 6 rows x 16 columns; 1 row x 64 columns for a single row, so enough independent
 * accumulators hide the FMA latency).  Weights stream sequentially; x stays in
 * L1.  Each output is one float32 sum over k in order (a different order from MKL's, so outputs
 * agree with F.linear to ~1e-6 relative, not bit for bit).  Panels are split over the OpenMP
 * threads; the library links the libgomp that torch already loaded (same soname), so it shares
 * torch's thread pool instead of starting a second one.
 */
#if !defined(__AVX2__) || !defined(__FMA__)
#error "the panel linear kernel needs AVX2 and FMA"
#endif
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#define NR 16
#define MAX_MR 6

/* Accumulators are named variables (an array of vectors ends up on the stack): row m of the tile
 * owns c<m>0 (columns 0-7) and c<m>1 (8-15).  MR is a compile-time constant in every caller, so
 * the `MR > m` tests fold away. */
#define ROW_FMA(m)                                                                    \
    if (MR > m) {                                                                     \
        const __m256 xb = _mm256_broadcast_ss(x + (m) * ldx + k);                     \
        c##m##0 = _mm256_fmadd_ps(lo, xb, c##m##0);                                   \
        c##m##1 = _mm256_fmadd_ps(hi, xb, c##m##1);                                   \
    }
#define ROW_STORE(m)                                                                  \
    if (MR > m) {                                                                     \
        _mm256_storeu_ps(out, c##m##0);                                               \
        _mm256_storeu_ps(out + 8, c##m##1);                                           \
        store_row(y + (m) * ldy + n0, out, bias ? bias + n0 : 0, width);              \
    }

static inline void store_row(float *row, const float *out, const float *bias, int width) {
    for (int j = 0; j < width; j++) row[j] = out[j] + (bias ? bias[j] : 0.f);
}

/* Rows 0..MR-1 (MR <= 6) against panel q: 2*MR accumulators, one panel slice loaded per k. */
static inline __attribute__((always_inline)) void tile(const float *x, int64_t ldx, const float *panels, int K,
                                                       float *y, int64_t ldy, const float *bias, int N, int q,
                                                       const int MR, const int prefetch) {
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
    __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
    const float *w = panels + (int64_t)q * K * NR, *next = w + (int64_t)K * NR;
    for (int k = 0; k < K; k++) {
        /* One 64-byte line of this panel per k; fetch the same line of the next panel meanwhile, so
         * a batch of several tiles (which rereads this panel from cache) keeps memory busy. */
        if (prefetch) _mm_prefetch((const char *)(next + (int64_t)k * NR), _MM_HINT_T0);
        const __m256 lo = _mm256_load_ps(w + (int64_t)k * NR), hi = _mm256_load_ps(w + (int64_t)k * NR + 8);
        ROW_FMA(0) ROW_FMA(1) ROW_FMA(2) ROW_FMA(3) ROW_FMA(4) ROW_FMA(5)
    }
    const int n0 = q * NR, width = N - n0 < NR ? N - n0 : NR;
    float out[NR];
    ROW_STORE(0) ROW_STORE(1) ROW_STORE(2) ROW_STORE(3) ROW_STORE(4) ROW_STORE(5)
}

/* One row against NP panels at once (NP independent accumulator pairs hide the FMA latency). */
static inline __attribute__((always_inline)) void wide(const float *x, const float *panels, int K, float *y,
                                                       const float *bias, int N, int q, const int NP) {
    __m256 a0 = _mm256_setzero_ps(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0, a3 = a0, b3 = a0;
    const int64_t stride = (int64_t)K * NR;
    const float *w = panels + (int64_t)q * stride;
    for (int k = 0; k < K; k++) {
        const __m256 xb = _mm256_broadcast_ss(x + k);
        const float *wk = w + (int64_t)k * NR;
        a0 = _mm256_fmadd_ps(_mm256_load_ps(wk), xb, a0);
        b0 = _mm256_fmadd_ps(_mm256_load_ps(wk + 8), xb, b0);
        if (NP > 1) {
            a1 = _mm256_fmadd_ps(_mm256_load_ps(wk + stride), xb, a1);
            b1 = _mm256_fmadd_ps(_mm256_load_ps(wk + stride + 8), xb, b1);
        }
        if (NP > 2) {
            a2 = _mm256_fmadd_ps(_mm256_load_ps(wk + 2 * stride), xb, a2);
            b2 = _mm256_fmadd_ps(_mm256_load_ps(wk + 2 * stride + 8), xb, b2);
        }
        if (NP > 3) {
            a3 = _mm256_fmadd_ps(_mm256_load_ps(wk + 3 * stride), xb, a3);
            b3 = _mm256_fmadd_ps(_mm256_load_ps(wk + 3 * stride + 8), xb, b3);
        }
    }
    float out[NR];
    const __m256 lo[4] = {a0, a1, a2, a3}, hi[4] = {b0, b1, b2, b3};
    for (int p = 0; p < NP; p++) {
        const int n0 = (q + p) * NR, width = N - n0 < NR ? N - n0 : NR;
        _mm256_storeu_ps(out, lo[p]);
        _mm256_storeu_ps(out + 8, hi[p]);
        store_row(y + n0, out, bias ? bias + n0 : 0, width);
    }
}

/* Rows 0..M-1 against panels [q0, q1). */
static void panel_range(const float *x, int64_t ldx, int M, const float *panels, int K, float *y, int64_t ldy,
                        const float *bias, int N, int q0, int q1) {
    int q = q0;
    if (M == 1) {
        for (; q + 4 <= q1; q += 4) wide(x, panels, K, y, bias, N, q, 4);
        for (; q < q1; q++) wide(x, panels, K, y, bias, N, q, 1);
        return;
    }
    for (; q < q1; q++) {
        int m = 0;
        const int prefetch = q + 1 < q1;
        for (; m + MAX_MR <= M; m += MAX_MR)
            tile(x + m * ldx, ldx, panels, K, y + m * ldy, ldy, bias, N, q, 6, prefetch);
        const float *xm = x + m * ldx;
        float *ym = y + m * ldy;
        switch (M - m) {
            case 5: tile(xm, ldx, panels, K, ym, ldy, bias, N, q, 5, prefetch); break;
            case 4: tile(xm, ldx, panels, K, ym, ldy, bias, N, q, 4, prefetch); break;
            case 3: tile(xm, ldx, panels, K, ym, ldy, bias, N, q, 3, prefetch); break;
            case 2: tile(xm, ldx, panels, K, ym, ldy, bias, N, q, 2, prefetch); break;
            case 1: tile(xm, ldx, panels, K, ym, ldy, bias, N, q, 1, prefetch); break;
            default: break;
        }
    }
}

/* Returns 0, or 1 for shapes it refuses. */
int epd_panel_linear(const float *x, int64_t ldx, int M, const float *panels, int N, int K, const float *bias,
                     float *y, int64_t ldy, int threads) {
    if (M <= 0 || N <= 0 || K <= 0 || threads <= 0 || ldx < K || ldy < N) return 1;
    const int Q = (N + NR - 1) / NR;
    const int T = threads < Q ? threads : 1;
#pragma omp parallel num_threads(T)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        int per = (Q + nt - 1) / nt;
        if (M == 1) per = (per + 3) / 4 * 4;   /* whole 4-panel groups: the one-row path takes 4 at once */
        const int q0 = t * per, q1 = q0 + per > Q ? Q : q0 + per;
        if (q0 < q1) panel_range(x, ldx, M, panels, K, y, ldy, bias, N, q0, q1);
    }
    return 0;
}
