/* Causal attention of one prompt chunk on AVX-512, for prefill (services/models/attention_kernel.py).
 *
 * Row i of the chunk (prompt position past + i) attends to keys 0 .. past + i.  Shapes, any strides
 * along tokens and heads (a head's D floats contiguous):
 *   q    [T, Hq, D]     the chunk's queries (after RoPE)
 *   k, v [L, Hkv, D]    the prompt's keys/values so far, L >= past + T
 *   out  [T, Hq, D]
 * GQA: query head g reads kv head g / (Hq / Hkv).
 *
 * Why (measured on this project's AMD box): torch's CPU flash attention runs its GEMMs through a BLAS
 * that takes AVX2 code on AMD CPUs and, below its block size, computes the masked upper triangle too;
 * at 200 tokens x 16 heads x 64 it spent ~1.1 ms a layer.  Here a work item is R query rows of one head:
 * scores for 16 keys at a time from a transposed copy of the keys (each key vector load feeds R rows),
 * only the keys the rows may see, an exact max, exp by a degree-7 polynomial after Cody-Waite reduction
 * (relative error ~1e-7, the size of float32 rounding), the sum, and P V accumulated in float32.
 * Float32 throughout; the order of the sums differs from torch's, so results agree to float32 rounding
 * (the prefill tests compare logits at 1e-4 and require the same greedy tokens).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef __AVX512F__
#error "the prefill attention kernel needs AVX-512 (the caller falls back to torch's SDPA)"
#endif

#ifndef R
#define R 8            /* query rows per work item (8: 0.8x the time of 4 at 1,024 keys, here) */
#endif
#define MAX_DIM 256

static inline __m512 exp512(__m512 x) {
    /* e^x for x <= 0 (scores minus their max); below -87.3 the result is 0 as expf's underflows */
    const __m512 lo = _mm512_set1_ps(-87.33654f);
    const __mmask16 tiny = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    x = _mm512_max_ps(x, lo);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_maskz_mov_ps((__mmask16)~tiny, _mm512_scalef_ps(p, n));
}

typedef struct {
    const float *q, *kt, *v;
    float *out;
    int64_t q_tok, q_head, v_tok, v_head, o_tok, o_head, kt_head;   /* strides in floats */
    int T, Hq, Hkv, D, past, Lpad;
    float scale;
} job_t;

/* rows [r0, r0 + n) of query head g; s: this thread's scratch of R x Lpad floats */
static void tile(const job_t *j, int g, int r0, int n, float *s) {
    const int D = j->D, h = g / (j->Hq / j->Hkv);
    const int keys = j->past + r0 + n;                   /* the last row's keys; earlier rows see fewer */
    const float *kt = j->kt + (int64_t)h * j->kt_head;   /* [D][Lpad] */
    const float *qr[R];
    for (int r = 0; r < R; r++) qr[r] = j->q + (int64_t)(r0 + (r < n ? r : 0)) * j->q_tok + (int64_t)g * j->q_head;
    for (int c = 0; c < keys; c += 16) {
        __m512 acc[R];
        for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
        for (int d = 0; d < D; d++) {
            const __m512 kv = _mm512_loadu_ps(kt + (int64_t)d * j->Lpad + c);
            for (int r = 0; r < R; r++) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(qr[r][d]), kv, acc[r]);
        }
        for (int r = 0; r < R; r++) _mm512_storeu_ps(s + (int64_t)r * j->Lpad + c, acc[r]);
    }
    float inv[R];
    for (int r = 0; r < R; r++) {
        float *sr = s + (int64_t)r * j->Lpad;
        if (r >= n) {                                     /* a row past the chunk's end: zero weights */
            memset(sr, 0, sizeof(float) * keys);
            inv[r] = 0.0f;
            continue;
        }
        const int len = j->past + r0 + r + 1;            /* keys this row sees */
        const __m512 scale = _mm512_set1_ps(j->scale);
        __m512 top = _mm512_set1_ps(-INFINITY);
        for (int c = 0; c < len; c += 16) {
            const __mmask16 m = len - c >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (len - c)) - 1);
            const __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, sr + c), scale);
            _mm512_mask_storeu_ps(sr + c, m, x);
            top = _mm512_mask_max_ps(top, m, top, x);
        }
        const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(top));
        __m512 sum = _mm512_setzero_ps();
        for (int c = 0; c < len; c += 16) {
            const __mmask16 m = len - c >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (len - c)) - 1);
            const __m512 e = _mm512_maskz_mov_ps(m, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, sr + c), mx)));
            _mm512_mask_storeu_ps(sr + c, m, e);
            sum = _mm512_add_ps(sum, e);
        }
        for (int t = len; t < keys; t++) sr[t] = 0.0f;     /* keys after this row's own: weight 0 */
        inv[r] = 1.0f / _mm512_reduce_add_ps(sum);
    }
    /* P V for the R rows at once, 64 floats of D at a time: each value vector load feeds R rows */
    const float *vh = j->v + (int64_t)h * j->v_head;
    const int vecs = D / 16;
    for (int w0 = 0; w0 < vecs; w0 += 4) {
        __mmask16 wm[4];
        for (int w = 0; w < 4; w++) wm[w] = w0 + w < vecs ? (__mmask16)0xFFFF : (__mmask16)0;
        __m512 o[R][4];
        for (int r = 0; r < R; r++)
            for (int w = 0; w < 4; w++) o[r][w] = _mm512_setzero_ps();
        for (int t = 0; t < keys; t++) {
            const float *vt = vh + (int64_t)t * j->v_tok + 16 * w0;
            __m512 vv[4];
            for (int w = 0; w < 4; w++) vv[w] = _mm512_maskz_loadu_ps(wm[w], vt + 16 * w);
            for (int r = 0; r < R; r++) {
                const __m512 p = _mm512_set1_ps(s[(int64_t)r * j->Lpad + t]);
                for (int w = 0; w < 4; w++) o[r][w] = _mm512_fmadd_ps(p, vv[w], o[r][w]);
            }
        }
        for (int r = 0; r < n; r++) {
            float *dst = j->out + (int64_t)(r0 + r) * j->o_tok + (int64_t)g * j->o_head + 16 * w0;
            const __m512 iv = _mm512_set1_ps(inv[r]);
            for (int w = 0; w < 4; w++) _mm512_mask_storeu_ps(dst + 16 * w, wm[w], _mm512_mul_ps(o[r][w], iv));
        }
    }
}

/* Returns 0, or -1 where the kernel does not apply (the caller runs torch's SDPA). */
int epd_prefill_attention(const float *q, int64_t q_tok, int64_t q_head, const float *k, int64_t k_tok,
                          int64_t k_head, const float *v, int64_t v_tok, int64_t v_head, float *out, int64_t o_tok,
                          int64_t o_head, int T, int Hq, int Hkv, int D, int past, float scale, int threads) {
    if (T <= 0 || Hkv <= 0 || Hq % Hkv != 0 || D % 16 != 0 || D > MAX_DIM || past < 0) return -1;
    const int L = past + T, Lpad = (L + 15) / 16 * 16;
    float *kt = aligned_alloc(64, sizeof(float) * (size_t)Hkv * D * Lpad);
    if (kt == NULL) return -1;
    /* keys transposed per kv head, [Hkv][D][Lpad], the padding zero (its scores are never read) */
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int h = 0; h < Hkv; h++) {
        float *dst = kt + (int64_t)h * D * Lpad;
        for (int d = 0; d < D; d++) memset(dst + (int64_t)d * Lpad + L, 0, sizeof(float) * (Lpad - L));
        for (int t = 0; t < L; t++) {
            const float *src = k + (int64_t)t * k_tok + (int64_t)h * k_head;
            for (int d = 0; d < D; d++) dst[(int64_t)d * Lpad + t] = src[d];
        }
    }
    job_t j = {q, kt, v, out, q_tok, q_head, v_tok, v_head, o_tok, o_head, (int64_t)D * Lpad,
               T, Hq, Hkv, D, past, Lpad, scale};
    const int blocks = (T + R - 1) / R, items = blocks * Hq;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *s = aligned_alloc(64, sizeof(float) * (size_t)R * Lpad);
        if (s == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        /* the last row blocks see the most keys: hand them out first */
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < items; item++) {
            if (s == NULL) continue;
            const int block = blocks - 1 - item / Hq, g = item % Hq;
            const int r0 = block * R, n = T - r0 < R ? T - r0 : R;
            tile(&j, g, r0, n, s);
        }
        free(s);
    }
    free(kt);
    return failed ? -1 : 0;
}
