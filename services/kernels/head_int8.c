/* The int8 first stage of the LM head screen (services/models/head_int8.py): greedy tokens of a float32 panel
 * head, decided exactly, from an int8 copy of its weights (a quarter of the bytes) and AVX512-VNNI.
 *
 * Stage 1 (`epd_i8_argmax`, first parallel region), per row m and column j:
 *   s      = sum_k xu[m, k] q[j, k]                      vpdpbusd: uint8 xu (x quantized, + 128) x int8 q, int32
 *   L      = (s - 128 colsum_j) scale_j t_m               = q_j . x^_m exactly, here in double
 *   E      = ew_j A_m + nw_j B_m + C_m                    the proven bound on |L - float32 head logit| (head_int8.py)
 *   U      = L + E, rounded up to float32                 no column's float32 logit is above its U
 *   lower  = max over j of (L - E)                        no row's float32 top logit is below it
 * A column whose U is below the row's lower so far cannot be the float32 argmax; the others go to this
 * thread's list for the row (a running lower only rises, so the final lower prunes at least as much).
 *
 * Stage 2 (second parallel region, one row per iteration): the columns whose U reaches the row's final lower
 * (rounded down to float32) are the candidates: the float32 argmax is among them, and so is every column tied
 * with it.  Their float32 logits are computed from the head's own panels, 16 columns per panel in one
 * in-order fused multiply-add chain per column (the full head's kernel does the same: the same bits), and
 * the first largest wins.  A row with more than `cap` candidates, a full list, a NaN logit or a non-finite
 * lower answers -1: the caller runs the full head for it.
 *
 * xp     [M, K4]        int32: each row's uint8 xu in groups of 4 along k
 * w      [Q8, K4, 16]   int32: panel q holds rows 16q .. 16q + 15 of q, 4 int8 along k per lane; Q8 even,
 *                       64-byte aligned; columns past N are zero
 * colsum [16 Q8]        int32: 128 sum_k q[j, k]
 * scale, ew, nw [16 Q8] double
 * rowc   [M, 4]         double: t, A, B, C per row (t NaN: the row is not screened)
 * panels [ceil(N/16), K, 16] float32: the head's own panels
 * lists  [threads, M, listcap] int32 and uvals (float) the same, lens [threads, M] int32, lows [threads, M]
 *        double: scratch */
#if !defined(__AVX512F__) || !defined(__AVX512VNNI__) || !defined(__AVX512DQ__)
#error "the int8 LM head screen needs AVX512-VNNI"
#endif
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>

#define NR 16

typedef struct {
    const int32_t *colsum;
    const double *scale, *ew, *nw, *rowc;
    int32_t *list;      /* this thread's [M, listcap] */
    float *uval;
    int32_t *len;       /* this thread's [M] */
    double *low;        /* this thread's [M] */
    int listcap, N;
    float *out;         /* epd_i8_upper: U of every column goes here ([M, ldo]); no lists */
    int64_t ldo;
} Epi;

/* Keep the entries of row r's list whose U reaches the row's lower now; returns the new length. */
static int compact(Epi *e, int r) {
    int32_t *list = e->list + (int64_t)r * e->listcap;
    float *uval = e->uval + (int64_t)r * e->listcap;
    const double low = e->low[r];
    int kept = 0;
    for (int i = 0; i < e->len[r]; i++)
        if ((double)uval[i] >= low) { list[kept] = list[i]; uval[kept] = uval[i]; kept++; }
    return kept;
}

/* Row r's 16 int32 sums of columns n0 .. n0 + 15: their U and L - E; the columns that may still win join the
 * list.  A full list (even after compacting) sets len = listcap + 1: the row overflowed. */
static inline void epilogue(__m512i acc, int r, int n0, Epi *e) {
    if (!e->out && e->len[r] > e->listcap) return;
    const double *rc = e->rowc + (int64_t)r * 4;
    const __m512d t = _mm512_set1_pd(rc[0]), A = _mm512_set1_pd(rc[1]), B = _mm512_set1_pd(rc[2]);
    const __m512d C = _mm512_set1_pd(rc[3]);
    const __m512i s = _mm512_sub_epi32(acc, _mm512_loadu_si512((const void *)(e->colsum + n0)));
    const int valid = e->N - n0 >= NR ? NR : e->N - n0;
    if (valid <= 0) return;
    __m512d low = _mm512_set1_pd(-INFINITY);
    float u[NR];
    for (int h = 0; h < 2; h++) {
        const __m256i part = h ? _mm512_extracti64x4_epi64(s, 1) : _mm512_castsi512_si256(s);
        const __m512d d = _mm512_cvtepi32_pd(part);
        const __m512d L = _mm512_mul_pd(_mm512_mul_pd(d, _mm512_loadu_pd(e->scale + n0 + 8 * h)), t);
        const __m512d E = _mm512_fmadd_pd(_mm512_loadu_pd(e->ew + n0 + 8 * h), A,
                                          _mm512_fmadd_pd(_mm512_loadu_pd(e->nw + n0 + 8 * h), B, C));
        _mm256_storeu_ps(u + 8 * h, _mm512_cvt_roundpd_ps(_mm512_add_pd(L, E), _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC));
        const int lanes = valid - 8 * h;
        const __mmask8 mask = lanes >= 8 ? 0xff : lanes <= 0 ? 0 : (__mmask8)((1u << lanes) - 1);
        low = _mm512_mask_max_pd(low, mask, low, _mm512_sub_pd(L, E));
    }
    if (e->out) {
        float *o = e->out + (int64_t)r * e->ldo + n0;
        for (int j = 0; j < valid; j++) o[j] = u[j];
        return;
    }
    const double lo = _mm512_reduce_max_pd(low);
    if (lo > e->low[r]) e->low[r] = lo;
    float threshold = (float)e->low[r];          /* rounded down: it keeps every column U >= low keeps */
    if ((double)threshold > e->low[r]) threshold = nextafterf(threshold, -INFINITY);
    const __mmask16 keep = _mm512_cmp_ps_mask(_mm512_loadu_ps(u), _mm512_set1_ps(threshold), _CMP_GE_OQ) &
                           (__mmask16)((1u << valid) - 1);
    for (int j = 0; keep && j < valid; j++) {
        if (!((keep >> j) & 1)) continue;
        if (e->len[r] == e->listcap) {
            e->len[r] = compact(e, r);
            if (e->len[r] == e->listcap) { e->len[r] = e->listcap + 1; return; }
        }
        const int64_t at = (int64_t)r * e->listcap + e->len[r]++;
        e->list[at] = n0 + j;
        e->uval[at] = u[j];
    }
}

#define DPI(i)                                                                                              \
    if ((i) < MR * 2)                                                                                       \
        c##i = _mm512_dpbusd_epi32(c##i, _mm512_set1_epi32(xp[(int64_t)((i) / 2) * ldx + k]), (i) % 2 ? w1 : w0);
#define EPI(i)                                                                                              \
    if ((i) < MR * 2) epilogue(c##i, m + (i) / 2, (q + (i) % 2) * NR, e);

/* Rows m .. m + MR - 1 (MR <= 8) against panels q, q + 1: 16 int32 accumulators. */
static inline __attribute__((always_inline)) void tile(const int32_t *xp0, int64_t ldx, int m, const int32_t *w,
                                                       int K4, int q, Epi *e, const int MR) {
    __m512i c0 = _mm512_setzero_si512(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0, c8 = c0;
    __m512i c9 = c0, c10 = c0, c11 = c0, c12 = c0, c13 = c0, c14 = c0, c15 = c0;
    const int64_t stride = (int64_t)K4 * NR;
    const int32_t *p = w + (int64_t)q * stride, *xp = xp0 + (int64_t)m * ldx;
    for (int k = 0; k < K4; k++) {
        const __m512i w0 = _mm512_load_si512((const void *)(p + (int64_t)k * NR));
        const __m512i w1 = _mm512_load_si512((const void *)(p + stride + (int64_t)k * NR));
        DPI(0) DPI(1) DPI(2) DPI(3) DPI(4) DPI(5) DPI(6) DPI(7) DPI(8) DPI(9) DPI(10) DPI(11) DPI(12) DPI(13) DPI(14)
        DPI(15)
    }
    EPI(0) EPI(1) EPI(2) EPI(3) EPI(4) EPI(5) EPI(6) EPI(7) EPI(8) EPI(9) EPI(10) EPI(11) EPI(12) EPI(13) EPI(14)
    EPI(15)
}

static __attribute__((noinline)) void rows_tile(const int32_t *xp, int64_t ldx, int m, int MR, const int32_t *w,
                                                int K4, int q, Epi *e) {
    switch (MR) {
        case 1: tile(xp, ldx, m, w, K4, q, e, 1); break;
        case 2: tile(xp, ldx, m, w, K4, q, e, 2); break;
        case 3: tile(xp, ldx, m, w, K4, q, e, 3); break;
        case 4: tile(xp, ldx, m, w, K4, q, e, 4); break;
        case 5: tile(xp, ldx, m, w, K4, q, e, 5); break;
        case 6: tile(xp, ldx, m, w, K4, q, e, 6); break;
        case 7: tile(xp, ldx, m, w, K4, q, e, 7); break;
        default: tile(xp, ldx, m, w, K4, q, e, 8); break;
    }
}

/* The float32 logits of up to 4 panels (16 columns each) for one row: each lane one in-order fma chain. */
static void exact_panels(const float *panels, int K, const int *ids, int n, const float *x, float *out) {
    __m512 c0 = _mm512_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;
    const float *p0 = panels + (int64_t)ids[0] * K * NR;
    const float *p1 = n > 1 ? panels + (int64_t)ids[1] * K * NR : p0;
    const float *p2 = n > 2 ? panels + (int64_t)ids[2] * K * NR : p0;
    const float *p3 = n > 3 ? panels + (int64_t)ids[3] * K * NR : p0;
    for (int k = 0; k < K; k++) {
        const __m512 xb = _mm512_set1_ps(x[k]);
        c0 = _mm512_fmadd_ps(_mm512_loadu_ps(p0 + (int64_t)k * NR), xb, c0);
        if (n > 1) c1 = _mm512_fmadd_ps(_mm512_loadu_ps(p1 + (int64_t)k * NR), xb, c1);
        if (n > 2) c2 = _mm512_fmadd_ps(_mm512_loadu_ps(p2 + (int64_t)k * NR), xb, c2);
        if (n > 3) c3 = _mm512_fmadd_ps(_mm512_loadu_ps(p3 + (int64_t)k * NR), xb, c3);
    }
    const __m512 zero = _mm512_setzero_ps();   /* + 0: the full head's -0 becomes +0 as there */
    _mm512_storeu_ps(out, _mm512_add_ps(c0, zero));
    _mm512_storeu_ps(out + NR, _mm512_add_ps(c1, zero));
    _mm512_storeu_ps(out + 2 * NR, _mm512_add_ps(c2, zero));
    _mm512_storeu_ps(out + 3 * NR, _mm512_add_ps(c3, zero));
}

/* 0, or 1 for arguments it refuses. */
int epd_i8_argmax(const int32_t *xp, int64_t ldx, int M, const int32_t *w, int N, int Q8, int K4,
                  const int32_t *colsum, const double *scale, const double *ew, const double *nw, const double *rowc,
                  const float *x, int64_t ldxf, const float *panels, int K, int cap, int listcap,
                  int32_t *lists, float *uvals, int32_t *lens, double *lows, int32_t *cands, int64_t *tokens,
                  int64_t *counts, int threads) {
    if (M <= 0 || N <= 0 || Q8 <= 0 || Q8 % 2 || N > Q8 * NR || K4 <= 0 || ldx < K4 || K <= 0 || K > 4 * K4 ||
        ldxf < K || cap <= 0 || listcap < cap || threads <= 0 || ((uintptr_t)w % 64))
        return 1;
    int used = 1;
#pragma omp parallel num_threads(threads < Q8 / 2 ? threads : 1)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        Epi e = {colsum, scale, ew, nw, rowc, lists + (int64_t)t * M * listcap, uvals + (int64_t)t * M * listcap,
                 lens + (int64_t)t * M, lows + (int64_t)t * M, listcap, N, 0, 0};
        for (int r = 0; r < M; r++) { e.len[r] = 0; e.low[r] = -INFINITY; }
        const int pairs = Q8 / 2, per = (pairs + nt - 1) / nt;
        const int q0 = 2 * t * per, q1 = 2 * (t + 1) * per > Q8 ? Q8 : 2 * (t + 1) * per;
        for (int q = q0; q < q1; q += 2)
            for (int m = 0; m < M; m += 8) rows_tile(xp, ldx, m, M - m < 8 ? M - m : 8, w, K4, q, &e);
        if (t == 0) used = nt;
    }
#pragma omp parallel for num_threads(threads < M ? threads : M) schedule(dynamic, 1)
    for (int r = 0; r < M; r++) {
        tokens[r] = -1;
        counts[r] = 0;
        double low = -INFINITY;
        int overflow = 0;
        for (int t = 0; t < used; t++) {
            low = lows[(int64_t)t * M + r] > low ? lows[(int64_t)t * M + r] : low;
            overflow |= lens[(int64_t)t * M + r] > listcap;
        }
        if (overflow || !(low > -INFINITY) || !(low < INFINITY)) continue;
        float threshold = (float)low;
        if ((double)threshold > low) threshold = nextafterf(threshold, -INFINITY);
        int32_t *cand = cands + (int64_t)r * cap;
        int count = 0;
        for (int t = 0; t < used && count <= cap; t++) {   /* thread t's panels follow thread t - 1's: ascending */
            const int64_t base = ((int64_t)t * M + r) * listcap;
            for (int i = 0; i < lens[(int64_t)t * M + r]; i++) {
                if (!(uvals[base + i] >= threshold)) continue;
                if (count == cap) { count = cap + 1; break; }
                cand[count++] = lists[base + i];
            }
        }
        counts[r] = count;
        if (count > cap) continue;
        const float *xr = x + (int64_t)r * ldxf;
        int64_t best = -1;
        float best_logit = 0.f;
        int ok = 1;
        for (int i = 0; i < count && ok;) {
            int ids[4], n = 0, j = i;
            while (j < count && n < 4) {          /* the next up to 4 distinct panels */
                const int panel = cand[j] / NR;
                if (n == 0 || ids[n - 1] != panel) ids[n++] = panel;
                while (j < count && cand[j] / NR == panel) j++;
            }
            float out[4 * NR];
            exact_panels(panels, K, ids, n, xr, out);
            for (int a = i; a < j; a++) {
                int slot = 0;
                while (ids[slot] != cand[a] / NR) slot++;
                const float c = out[slot * NR + cand[a] % NR];
                if (c != c) { ok = 0; break; }
                if (best < 0 || c > best_logit) { best = cand[a]; best_logit = c; }
            }
            i = j;
        }
        if (ok) tokens[r] = best;
    }
    return 0;
}

/* Every column's upper value U = L + E (rounded up to float32) of rows x: out [M, ldo] float32, N columns a row.
 * No column's float32 logit is above its U (the bound above); the sampled draw through the screen
 * (services/sampling/screened.py) proposes from exp(U / T) and accepts by the column's float32 logit.
 * A row with t NaN (not screened) gets NaN.  0, or 1 for arguments it refuses. */
int epd_i8_upper(const int32_t *xp, int64_t ldx, int M, const int32_t *w, int N, int Q8, int K4,
                 const int32_t *colsum, const double *scale, const double *ew, const double *nw, const double *rowc,
                 float *out, int64_t ldo, int threads) {
    if (M <= 0 || N <= 0 || Q8 <= 0 || Q8 % 2 || N > Q8 * NR || K4 <= 0 || ldx < K4 || ldo < N || threads <= 0 ||
        ((uintptr_t)w % 64))
        return 1;
#pragma omp parallel num_threads(threads < Q8 / 2 ? threads : 1)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        Epi e = {colsum, scale, ew, nw, rowc, 0, 0, 0, 0, 0, N, out, ldo};
        const int pairs = Q8 / 2, per = (pairs + nt - 1) / nt;
        const int q0 = 2 * t * per, q1 = 2 * (t + 1) * per > Q8 ? Q8 : 2 * (t + 1) * per;
        for (int q = q0; q < q1; q += 2)
            for (int m = 0; m < M; m += 8) rows_tile(xp, ldx, m, M - m < 8 ? M - m : 8, w, K4, q, &e);
    }
    return 0;
}

/* For n (row, column) pairs: the column's float32 logit as the full head computes it (its panel's in-order fused
 * multiply-add chain, as exact_panels: the same bits) and its upper value U as epd_i8_upper computes it (the same
 * double arithmetic, rounded up to float32).  The sampled draw through the screen (services/sampling/screened.py)
 * accepts a proposed column by these two.  0, or 1 for arguments it refuses. */
int epd_i8_at(const int32_t *xp, int64_t ldx, const int32_t *w, int N, int Q8, int K4, const int32_t *colsum,
              const double *scale, const double *ew, const double *nw, const double *rowc, const float *x,
              int64_t ldxf, const float *panels, int K, const int32_t *rows, const int32_t *cols, int n, float *logit,
              float *upper, int threads) {
    if (n < 0 || N <= 0 || Q8 <= 0 || N > Q8 * NR || K4 <= 0 || ldx < K4 || K <= 0 || K > 4 * K4 || ldxf < K ||
        threads <= 0)
        return 1;
    for (int i = 0; i < n; i++)
        if (cols[i] < 0 || cols[i] >= N || rows[i] < 0) return 1;
#pragma omp parallel for num_threads(threads < n ? threads : (n > 0 ? n : 1)) schedule(static)
    for (int i = 0; i < n; i++) {
        const int r = rows[i], j = cols[i], q = j / NR, lane = j % NR;
        const float *p = panels + (int64_t)q * K * NR, *xr = x + (int64_t)r * ldxf;
        __m512 c = _mm512_setzero_ps();
        for (int k = 0; k < K; k++) c = _mm512_fmadd_ps(_mm512_loadu_ps(p + (int64_t)k * NR), _mm512_set1_ps(xr[k]), c);
        float lanes[NR];
        _mm512_storeu_ps(lanes, _mm512_add_ps(c, _mm512_setzero_ps()));
        logit[i] = lanes[lane];
        const int32_t *wq = w + (int64_t)q * K4 * NR, *xq = xp + (int64_t)r * ldx;
        __m512i acc = _mm512_setzero_si512();
        for (int k = 0; k < K4; k++)
            acc = _mm512_dpbusd_epi32(acc, _mm512_set1_epi32(xq[k]), _mm512_load_si512((const void *)(wq + (int64_t)k * NR)));
        int32_t sums[NR];
        _mm512_storeu_si512((void *)sums, acc);
        const double *rc = rowc + (int64_t)r * 4;
        const double L = ((double)(sums[lane] - colsum[j]) * scale[j]) * rc[0];
        const double v = L + fma(ew[j], rc[1], fma(nw[j], rc[2], rc[3]));
        float u = (float)v;
        if ((double)u < v) u = nextafterf(u, INFINITY);
        upper[i] = u;
    }
    return 0;
}
