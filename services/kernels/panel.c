/* Small-batch linear layers (services/models/panel_linear.py): y[M, N] = x[M, K] W^T (+ bias).
 *
 * x      [M, K]            float32, row stride ldx
 * panels [ceil(N/16), K, 16] float32, contiguous, 32-byte aligned: W's rows in groups of 16,
 *                          interleaved by k (panel q holds W[16q .. 16q+15, k] at [q, k, 0..15]);
 *                          rows past N are zero
 * bias   [N] or NULL
 * y      [M, N]            float32, row stride ldy
 *
 * Built with -DEPD_PANEL_BF16 the panels hold bfloat16 (the top 16 bits of a float32) instead:
 * each 16-wide slice is widened to float32 in registers (a zero-extend and a 16-bit shift, exact)
 * before the same FMAs, so the arithmetic stays float32 while half the bytes stream from memory.
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
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define NR 16
#define MAX_MR 6

#ifdef EPD_PANEL_BF16
typedef uint16_t wt_t;
/* 8 bfloat16 at p -> 8 float32 (exact: a bfloat16 is the top half of a float32) */
static inline __m256 load8(const wt_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
#else
typedef float wt_t;
static inline __m256 load8(const wt_t *p) { return _mm256_load_ps(p); }
#endif

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
static inline __attribute__((always_inline)) void tile(const float *x, int64_t ldx, const wt_t *panels, int K,
                                                       float *y, int64_t ldy, const float *bias, int N, int q,
                                                       const int MR, const int prefetch) {
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
    __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
    const wt_t *w = panels + (int64_t)q * K * NR, *next = w + (int64_t)K * NR;
    for (int k = 0; k < K; k++) {
        /* One 64-byte line of this panel per k; fetch the same line of the next panel meanwhile, so
         * a batch of several tiles (which rereads this panel from cache) keeps memory busy. */
        if (prefetch) _mm_prefetch((const char *)(next + (int64_t)k * NR), _MM_HINT_T0);
        const __m256 lo = load8(w + (int64_t)k * NR), hi = load8(w + (int64_t)k * NR + 8);
        ROW_FMA(0) ROW_FMA(1) ROW_FMA(2) ROW_FMA(3) ROW_FMA(4) ROW_FMA(5)
    }
    const int n0 = q * NR, width = N - n0 < NR ? N - n0 : NR;
    float out[NR];
    ROW_STORE(0) ROW_STORE(1) ROW_STORE(2) ROW_STORE(3) ROW_STORE(4) ROW_STORE(5)
}

/* One row against NP panels at once (NP independent accumulator pairs hide the FMA latency). */
static inline __attribute__((always_inline)) void wide(const float *x, const wt_t *panels, int K, float *y,
                                                       const float *bias, int N, int q, const int NP) {
    __m256 a0 = _mm256_setzero_ps(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0, a3 = a0, b3 = a0;
    const int64_t stride = (int64_t)K * NR;
    const wt_t *w = panels + (int64_t)q * stride;
    for (int k = 0; k < K; k++) {
        const __m256 xb = _mm256_broadcast_ss(x + k);
        const wt_t *wk = w + (int64_t)k * NR;
        a0 = _mm256_fmadd_ps(load8(wk), xb, a0);
        b0 = _mm256_fmadd_ps(load8(wk + 8), xb, b0);
        if (NP > 1) {
            a1 = _mm256_fmadd_ps(load8(wk + stride), xb, a1);
            b1 = _mm256_fmadd_ps(load8(wk + stride + 8), xb, b1);
        }
        if (NP > 2) {
            a2 = _mm256_fmadd_ps(load8(wk + 2 * stride), xb, a2);
            b2 = _mm256_fmadd_ps(load8(wk + 2 * stride + 8), xb, b2);
        }
        if (NP > 3) {
            a3 = _mm256_fmadd_ps(load8(wk + 3 * stride), xb, a3);
            b3 = _mm256_fmadd_ps(load8(wk + 3 * stride + 8), xb, b3);
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

#ifdef __AVX512F__
/* With AVX-512 a tile is up to 16 rows x one 16-wide zmm per row (16 accumulators of the 32 registers):
 * half the FMA instructions of the AVX2 tile per output and more rows per read of the panel (the
 * many-row steps are bound by the FMAs, not by the weights' bytes), so a 16-row decode step runs as one
 * tile, not 12 + 4.  Each output is the same in-order float32 sum over k, bit for bit. */
#define MAX_MR16 16
static inline __m512 load16(const wt_t *p) {
#ifdef EPD_PANEL_BF16
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
#else
    return _mm512_loadu_ps(p);
#endif
}
#define ROW_FMA16(m)                                                                  \
    if (MR > m) c##m = _mm512_fmadd_ps(w16, _mm512_set1_ps(x[(m) * ldx + k]), c##m);
#define ROW_STORE16(m)                                                                \
    if (MR > m) {                                                                     \
        _mm512_storeu_ps(out, c##m);                                                  \
        store_row(y + (m) * ldy + n0, out, bias ? bias + n0 : 0, width);              \
    }

static inline __attribute__((always_inline)) void tile16(const float *x, int64_t ldx, const wt_t *panels, int K,
                                                         float *y, int64_t ldy, const float *bias, int N, int q,
                                                         const int MR, const int prefetch) {
    __m512 c0 = _mm512_setzero_ps(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0, c8 = c0;
    __m512 c9 = c0, c10 = c0, c11 = c0, c12 = c0, c13 = c0, c14 = c0, c15 = c0;
    const wt_t *w = panels + (int64_t)q * K * NR, *next = w + (int64_t)K * NR;
    for (int k = 0; k < K; k++) {
        if (prefetch) _mm_prefetch((const char *)(next + (int64_t)k * NR), _MM_HINT_T0);
        const __m512 w16 = load16(w + (int64_t)k * NR);
        ROW_FMA16(0) ROW_FMA16(1) ROW_FMA16(2) ROW_FMA16(3) ROW_FMA16(4) ROW_FMA16(5) ROW_FMA16(6) ROW_FMA16(7) ROW_FMA16(8) ROW_FMA16(9) ROW_FMA16(10) ROW_FMA16(11)
        ROW_FMA16(12) ROW_FMA16(13) ROW_FMA16(14) ROW_FMA16(15)
    }
    const int n0 = q * NR, width = N - n0 < NR ? N - n0 : NR;
    float out[NR];
    ROW_STORE16(0) ROW_STORE16(1) ROW_STORE16(2) ROW_STORE16(3) ROW_STORE16(4) ROW_STORE16(5) ROW_STORE16(6) ROW_STORE16(7) ROW_STORE16(8) ROW_STORE16(9) ROW_STORE16(10) ROW_STORE16(11)
    ROW_STORE16(12) ROW_STORE16(13) ROW_STORE16(14) ROW_STORE16(15)
}
#endif

/* A tile reads its rows' x[m, k] for each k from as many cache lines.  When the rows lie a multiple of
 * 1 KiB apart (a hidden size of 256 * j floats) the lines of more than 8 rows share L1 sets, and an
 * 8-way L1 evicts them on every k: a 16-row tile then ran at half speed.  Such rows are copied first
 * into this thread's buffer 64 bytes further apart (grown on demand, kept for the thread's life;
 * bounded by the largest M x K it has seen). */
static __thread float *pad_buf;
static __thread size_t pad_cap;

static __attribute__((noinline)) const float *padded_rows(const float *x, int64_t *ldx, int M, int K) {
    const int64_t ld = (int64_t)K + 16;
    const size_t need = (size_t)M * (size_t)ld;
    if (need > pad_cap) {
        free(pad_buf);
        pad_buf = aligned_alloc(64, (need * sizeof(float) + 63) / 64 * 64);
        pad_cap = pad_buf ? need : 0;
        if (!pad_buf) return x;
    }
    for (int m = 0; m < M; m++) memcpy(pad_buf + m * ld, x + m * *ldx, sizeof(float) * K);
    *ldx = ld;
    return pad_buf;
}

#ifdef __AVX512F__
/* Tiles of 13-16 rows, kept out of panel_range's body: inlined there they changed the code of the
 * smaller tiles' loops enough to cost 4-8 rows a few % (benchmarks.panel_ref). */
static __attribute__((noinline)) void big_tile(const float *x, int64_t ldx, const wt_t *panels, int K, float *y,
                                               int64_t ldy, const float *bias, int N, int q, int MR, int prefetch) {
    switch (MR) {
        case 16: tile16(x, ldx, panels, K, y, ldy, bias, N, q, 16, prefetch); break;
        case 15: tile16(x, ldx, panels, K, y, ldy, bias, N, q, 15, prefetch); break;
        case 14: tile16(x, ldx, panels, K, y, ldy, bias, N, q, 14, prefetch); break;
        case 13: tile16(x, ldx, panels, K, y, ldy, bias, N, q, 13, prefetch); break;
        default: break;
    }
}
#endif

/* Rows 0..M-1 against panels [q0, q1). */
static void panel_range(const float *x, int64_t ldx, int M, const wt_t *panels, int K, float *y, int64_t ldy,
                        const float *bias, int N, int q0, int q1) {
    int q = q0;
    if (M > 8 && ldx % 256 == 0) x = padded_rows(x, &ldx, M, K);
    if (M == 1) {
        for (; q + 4 <= q1; q += 4) wide(x, panels, K, y, bias, N, q, 4);
        for (; q < q1; q++) wide(x, panels, K, y, bias, N, q, 1);
        return;
    }
    for (; q < q1; q++) {
        int m = 0;
        const int prefetch = q + 1 < q1;
#ifdef __AVX512F__
        for (; m + MAX_MR16 <= M; m += MAX_MR16)
            big_tile(x + m * ldx, ldx, panels, K, y + m * ldy, ldy, bias, N, q, MAX_MR16, prefetch);
        const float *xm = x + m * ldx;
        float *ym = y + m * ldy;
        if (M - m > 12) {
            big_tile(xm, ldx, panels, K, ym, ldy, bias, N, q, M - m, prefetch);
            continue;
        }
        switch (M - m) {
            case 12: tile16(xm, ldx, panels, K, ym, ldy, bias, N, q, 12, prefetch); break;
            case 11: tile16(xm, ldx, panels, K, ym, ldy, bias, N, q, 11, prefetch); break;
            case 10: tile16(xm, ldx, panels, K, ym, ldy, bias, N, q, 10, prefetch); break;
            case 9: tile16(xm, ldx, panels, K, ym, ldy, bias, N, q, 9, prefetch); break;
            case 8: tile16(xm, ldx, panels, K, ym, ldy, bias, N, q, 8, prefetch); break;
            case 7: tile16(xm, ldx, panels, K, ym, ldy, bias, N, q, 7, prefetch); break;
            case 6: tile16(xm, ldx, panels, K, ym, ldy, bias, N, q, 6, prefetch); break;
            case 5: tile16(xm, ldx, panels, K, ym, ldy, bias, N, q, 5, prefetch); break;
            case 4: tile16(xm, ldx, panels, K, ym, ldy, bias, N, q, 4, prefetch); break;
            case 3: tile16(xm, ldx, panels, K, ym, ldy, bias, N, q, 3, prefetch); break;
            case 2: tile16(xm, ldx, panels, K, ym, ldy, bias, N, q, 2, prefetch); break;
            case 1: tile16(xm, ldx, panels, K, ym, ldy, bias, N, q, 1, prefetch); break;
            default: break;
        }
#else
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
#endif
    }
}

/* Returns 0, or 1 for shapes it refuses. */
int epd_panel_linear(const float *x, int64_t ldx, int M, const wt_t *panels, int N, int K, const float *bias,
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

#ifndef EPD_PANEL_BF16
/* Greedy tokens of a float32 panel LM head, decided from a cheaper screen (services/models/head_screen.py).
 *
 * s [R, N] (row stride lds): the screen's logits of each row (the same head over bfloat16 panels);
 * eps[R]: a proven bound on |screen - float32 logit| for every column of the row.  The float32 argmax
 * j* has l(j*) >= l(j_s) for the screen's own argmax j_s, so s(j*) >= max(s) - 2 eps: every column whose
 * screen value reaches that threshold is a candidate, and only the candidates' float32 logits are
 * computed, each as this kernel's tiles compute it (one in-order fmaf chain over k from 0, then + 0.f:
 * the same bits).  The first candidate with the largest logit wins, as the full row's argmax picks the
 * first index among ties.  tokens[r] = -1 (the caller runs the full head) when the row's screen holds a
 * NaN or an infinity, its bound is not finite, a candidate's logit is NaN, or more than `cap` columns are
 * candidates.  counts[r]: the candidates seen (up to cap + 1). */
/* The largest float below f (f finite). */
static float next_down(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if (f == 0.f) bits = 0x80000001u;
    else if (f > 0.f) bits -= 1;
    else bits += 1;
    memcpy(&f, &bits, sizeof bits);
    return f;
}

int epd_screen_argmax(const float *s, int64_t lds, int R, int N, const double *eps, const float *x, int64_t ldx,
                      const float *panels, int K, int cap, int64_t *tokens, int64_t *counts, int threads) {
    if (R <= 0 || N <= 0 || K <= 0 || lds < N || ldx < K || cap <= 0 || threads <= 0) return 1;
#pragma omp parallel for num_threads(threads < R ? threads : R) schedule(static)
    for (int r = 0; r < R; r++) {
        const float *row = s + (int64_t)r * lds, *xr = x + (int64_t)r * ldx;
        float top = -INFINITY;
        int finite = 1;
        for (int j = 0; j < N; j++) {
            const float v = row[j];
            finite &= isfinite(v);
            top = v > top ? v : top;
        }
        tokens[r] = -1;
        counts[r] = 0;
        if (!finite || !isfinite(eps[r]) || !(eps[r] >= 0.0)) continue;
        const double bound = (double)top - 2.0 * eps[r];
        float threshold = (float)bound;
        if ((double)threshold > bound) threshold = next_down(threshold);
        int64_t count = 0, best = -1;
        float best_logit = 0.f;
        int ok = 1;
        for (int j = 0; j < N && ok; j++) {
            if (row[j] < threshold) continue;
            if (++count > cap) { ok = 0; break; }
            const float *w = panels + (int64_t)(j / NR) * K * NR + j % NR;
            float c = 0.f;
            for (int k = 0; k < K; k++) c = fmaf(w[(int64_t)k * NR], xr[k], c);
            c = c + 0.f;
            if (c != c) { ok = 0; break; }
            if (best < 0 || c > best_logit) { best = j; best_logit = c; }
        }
        counts[r] = count;
        if (ok) tokens[r] = best;
    }
    return 0;
}
#endif

#if defined(EPD_PANEL_BF16) && defined(__AVX512BF16__)
/* bfloat16 x bfloat16 panels for the LM head screen (services/models/head_screen.py) at many rows.
 *
 * pairs [Q, K2, 16] uint32: panel q, k-pair p, output lane j holds W[16q + j, 2p] (low half) and
 * W[16q + j, 2p + 1] (high half) as bfloat16; xp [M, K2] uint32: each row's x rounded to bfloat16, in the
 * same pairs.  One vdpbf16ps per (row, panel, k-pair) adds both products into a float32 lane: half the
 * instructions of the float32 FMA tiles, whose many-row steps are bound by their FMAs.  The sums are not
 * float32's (x is rounded, and the pair sums in an unspecified order): the screen's bound accounts for
 * both.  Tiles: MR rows x NP panels of accumulators (MR * NP <= 16), NP = 4 for 1-4 rows and 2 for 5-8
 * rows, so enough independent chains hide the instruction's latency; 9-16 rows run as an 8-row tile and a
 * tile of the rest over the same two panels (dp_range). */
#define DP(i)                                                                                     \
    if ((i) < MR * NP)                                                                            \
        c##i = _mm512_dpbf16_ps(c##i, (__m512bh)((i) % NP == 0 ? w0 : (i) % NP == 1 ? w1 : (i) % NP == 2 ? w2 : w3), \
                                (__m512bh)_mm512_set1_epi32((int)xp[(int64_t)((i) / NP) * ldx + k]));
#define DP_STORE(i)                                                                               \
    if ((i) < MR * NP) {                                                                          \
        const int n0 = (q + (i) % NP) * NR, width = N - n0 < NR ? N - n0 : NR;                    \
        _mm512_storeu_ps(out, c##i);                                                              \
        float *row = y + (int64_t)((i) / NP) * ldy + n0;                                          \
        for (int j = 0; j < width; j++) row[j] = out[j];                                          \
    }

static inline __attribute__((always_inline)) void dp_tile(const uint32_t *xp, int64_t ldx, const uint32_t *pairs,
                                                          int K2, float *y, int64_t ldy, int N, int q,
                                                          const int MR, const int NP) {
    __m512 c0 = _mm512_setzero_ps(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0, c8 = c0;
    __m512 c9 = c0, c10 = c0, c11 = c0, c12 = c0, c13 = c0, c14 = c0, c15 = c0;
    const int64_t stride = (int64_t)K2 * NR;
    const uint32_t *w = pairs + (int64_t)q * stride;
    for (int k = 0; k < K2; k++) {
        const uint32_t *wk = w + (int64_t)k * NR;
        const __m512i w0 = _mm512_load_si512((const void *)wk);
        const __m512i w1 = NP > 1 ? _mm512_load_si512((const void *)(wk + stride)) : w0;
        const __m512i w2 = NP > 2 ? _mm512_load_si512((const void *)(wk + 2 * stride)) : w0;
        const __m512i w3 = NP > 3 ? _mm512_load_si512((const void *)(wk + 3 * stride)) : w0;
        DP(0) DP(1) DP(2) DP(3) DP(4) DP(5) DP(6) DP(7) DP(8) DP(9) DP(10) DP(11) DP(12) DP(13) DP(14) DP(15)
    }
    float out[NR];
    DP_STORE(0) DP_STORE(1) DP_STORE(2) DP_STORE(3) DP_STORE(4) DP_STORE(5) DP_STORE(6) DP_STORE(7)
    DP_STORE(8) DP_STORE(9) DP_STORE(10) DP_STORE(11) DP_STORE(12) DP_STORE(13) DP_STORE(14) DP_STORE(15)
}

/* Rows 0..MR-1 (MR <= 8) against panels q .. q + NP - 1. */
static inline __attribute__((always_inline)) void dp_rows(const uint32_t *xp, int64_t ldx, int MR, const uint32_t *pairs,
                                                          int K2, float *y, int64_t ldy, int N, int q, const int NP) {
    switch (MR) {
        case 1: dp_tile(xp, ldx, pairs, K2, y, ldy, N, q, 1, NP); break;
        case 2: dp_tile(xp, ldx, pairs, K2, y, ldy, N, q, 2, NP); break;
        case 3: dp_tile(xp, ldx, pairs, K2, y, ldy, N, q, 3, NP); break;
        case 4: dp_tile(xp, ldx, pairs, K2, y, ldy, N, q, 4, NP); break;
        case 5: dp_tile(xp, ldx, pairs, K2, y, ldy, N, q, 5, NP < 4 ? NP : 2); break;
        case 6: dp_tile(xp, ldx, pairs, K2, y, ldy, N, q, 6, NP < 4 ? NP : 2); break;
        case 7: dp_tile(xp, ldx, pairs, K2, y, ldy, N, q, 7, NP < 4 ? NP : 2); break;
        default: dp_tile(xp, ldx, pairs, K2, y, ldy, N, q, 8, NP < 4 ? NP : 2); break;
    }
}

/* Rows m0.. (at most 16) against panels [q0, q1): tiles of at most 8 rows (NP = 4 panels for 1-4 rows, 2 for
 * more), 9-16 rows as an 8-row tile and one of the rest over the same panels (they read them from L2).  One
 * 16-row tile over one panel ran 2.3x slower per product than the 8 x 2 tiles on Zen 4; its 16 rows of x, 2 KiB
 * apart at K = 1024, fall in two sets of the 8-way L1 (the float32 tiles copy such rows apart, `padded_rows`). */
static __attribute__((noinline)) void dp_range(const uint32_t *xp, int64_t ldx, int M, const uint32_t *pairs, int K2,
                                               float *y, int64_t ldy, int N, int q0, int q1) {
    const int top = M > 8 ? 8 : M, rest = M - top;
    const uint32_t *xr = xp + 8 * ldx;
    float *yr = y + 8 * ldy;
    int q = q0;
    if (M <= 4) {
        for (; q + 4 <= q1; q += 4) dp_rows(xp, ldx, M, pairs, K2, y, ldy, N, q, 4);
    } else {
        for (; q + 2 <= q1; q += 2) {
            dp_rows(xp, ldx, top, pairs, K2, y, ldy, N, q, 2);
            if (rest) dp_rows(xr, ldx, rest, pairs, K2, yr, ldy, N, q, 2);
        }
    }
    for (; q < q1; q++) {
        dp_rows(xp, ldx, top, pairs, K2, y, ldy, N, q, 1);
        if (rest) dp_rows(xr, ldx, rest, pairs, K2, yr, ldy, N, q, 1);
    }
}

/* y[M, N] from bfloat16 pairs; 0, or 1 for shapes it refuses.  pairs 64-byte aligned. */
int epd_panel_dp(const uint32_t *xp, int64_t ldx, int M, const uint32_t *pairs, int N, int K2, float *y, int64_t ldy,
                 int threads) {
    if (M <= 0 || N <= 0 || K2 <= 0 || threads <= 0 || ldx < K2 || ldy < N || ((uintptr_t)pairs % 64)) return 1;
    const int Q = (N + NR - 1) / NR;
    const int T = threads < Q ? threads : 1;
#pragma omp parallel num_threads(T)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int per = ((Q + nt - 1) / nt + 3) / 4 * 4;
        const int q0 = t * per, q1 = q0 + per > Q ? Q : q0 + per;
        for (int m = 0; m < M && q0 < q1; m += 16)
            dp_range(xp + (int64_t)m * ldx, ldx, M - m < 16 ? M - m : 16, pairs, K2, y + (int64_t)m * ldy, ldy, N,
                     q0, q1);
    }
    return 0;
}
#endif
