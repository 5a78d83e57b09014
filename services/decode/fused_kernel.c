/* The whole decoder stack of one decode step in one call (services/decode/fused.py).
 *
 * For rows b = 0..B-1 (one new token each) and every layer, in the Hugging Face layer's order:
 *   x = RMSNorm_in(h); q, k, v = x Wq^T + bq, x Wk^T + bk, x Wv^T + bv; (Qwen3: per-head RMSNorm of q, k)
 *   rotate-half RoPE of q and k with the row's cos/sin; write k, v at (write_blocks[b], write_offsets[b]);
 *   a = paged attention over the row's first lens[b] tokens (paged_kernel.c's one_item);
 *   h += a Wo^T (+ bo); x = RMSNorm_post(h); h += (silu(x Wg^T) * (x Wu^T)) Wd^T
 * leaving the final norm and the LM head to the caller.  Every matmul is the panel kernel
 * (services/models/panel_kernel.c) over the model's own panelized weights.
 *
 * Why: an eager step is ~25 torch ops per layer, each a Python dispatch and (with two threads) an
 * OpenMP fork/join; SmolLM2's 30 layers make that ~750 dispatches per token, a third of a one-row
 * step's time on this project's 2-core box.  Here one OpenMP parallel region spans the whole stack:
 * threads split each matmul's panels (q, k and v as one list of panels; gate and up likewise) and
 * meet at a barrier between phases; the small per-row work (norms, RoPE, residual adds, SiLU) is
 * split by rows or elements.
 *
 * Numerics: float32 throughout.  Norms sum squares in double; each matmul output is the panel
 * kernel's in-order float32 sum.  Outputs agree with the eager step to ~1e-6 relative, not bit for
 * bit (tests/services/decode/test_fused.py).
 */
#include "paged_kernel.c"
#include "../models/panel_kernel.c"

#define NUM_LINEARS 7   /* q, k, v, o, gate, up, down */
enum { LQ, LK, LV, LO, LG, LU, LD };

typedef struct {
    const float *in_norm, *post_norm;     /* [H] */
    const float *q_norm, *k_norm;         /* [D], or NULL (no per-head q/k norm) */
    const float *w[NUM_LINEARS];          /* panels [ceil(N/16), K, 16] */
    const float *b[NUM_LINEARS];          /* bias [N] or NULL */
    float *keys, *values;                 /* this layer's pool: [num_blocks, Hkv, BS, D] */
} fused_layer_t;

typedef struct {
    float *x;       /* [B, H]      normed input of a sublayer */
    float *q;       /* [B, Hq*D] */
    float *k;       /* [B, Hkv*D] */
    float *v;       /* [B, Hkv*D] */
    float *attn;    /* [B, Hq*D]   attention output */
    float *tmp;     /* [B, H]      a sublayer's output before the residual add */
    float *gate;    /* [B, I] */
    float *up;      /* [B, I] */
} fused_scratch_t;

typedef struct {
    const float *x;
    int64_t ldx;
    const float *panels, *bias;
    int N, K;
    float *y;
    int64_t ldy;
} mm_t;

/* Rows 0..M-1 of up to three matmuls, their panels taken as one list split evenly over the team
 * (called by every thread of the parallel region; no barrier inside). */
static void mm_share(const mm_t *mms, int count, int M) {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    int total = 0;
    for (int i = 0; i < count; i++) total += (mms[i].N + NR - 1) / NR;
    int per = (total + nt - 1) / nt;
    if (M == 1) per = (per + 3) / 4 * 4;   /* whole 4-panel groups for the one-row path */
    const int lo = t * per, hi = lo + per > total ? total : lo + per;
    int offset = 0;
    for (int i = 0; i < count; i++) {
        const int panels = (mms[i].N + NR - 1) / NR;
        const int q0 = lo > offset ? lo - offset : 0;
        const int q1 = hi - offset < panels ? hi - offset : panels;
        if (q0 < q1)
            panel_range(mms[i].x, mms[i].ldx, M, mms[i].panels, mms[i].K, mms[i].y, mms[i].ldy, mms[i].bias,
                        mms[i].N, q0, q1);
        offset += panels;
    }
}

static void rms_norm(const float *x, const float *w, float *y, int n, float eps) {
    double sum = 0.0;
    for (int i = 0; i < n; i++) sum += (double)x[i] * x[i];
    const float r = 1.0f / sqrtf((float)(sum / n) + eps);
    for (int i = 0; i < n; i++) y[i] = w[i] * (x[i] * r);
}

/* In place: x[d] * cos[d] + rotate_half(x)[d] * sin[d] (rotate_half = (-x2, x1)). */
static void rope(float *x, const float *cos, const float *sin, int D) {
    float copy[MAX_DIM];
    memcpy(copy, x, sizeof(float) * D);
    const int half = D / 2;
    for (int d = 0; d < half; d++) x[d] = copy[d] * cos[d] + (-copy[d + half]) * sin[d];
    for (int d = half; d < D; d++) x[d] = copy[d] * cos[d] + copy[d - half] * sin[d];
}

/* Returns 0, or -1 for sizes beyond the kernels' fixed limits (the caller runs the eager step). */
int epd_fused_step(const fused_layer_t *layers, int L, float *hidden, int B, int H, int Hq, int Hkv, int D, int I,
                   float eps, float qk_eps, const float *cos, const float *sin, const int64_t *write_blocks,
                   const int64_t *write_offsets, const int32_t *tables, int64_t table_stride, const int32_t *lens,
                   int BS, float scale, const fused_scratch_t *s, int threads) {
    if (B <= 0 || L <= 0 || Hkv <= 0 || Hq % Hkv != 0 || Hq / Hkv > MAX_GROUP || D > MAX_DIM || D % 2
        || BS > MAX_BLOCK || BS <= 0 || threads <= 0)
        return -1;
    const int QD = Hq * D, KD = Hkv * D;
    const int T = threads > MAX_THREADS ? MAX_THREADS : threads;
#pragma omp parallel num_threads(T)
    for (int l = 0; l < L; l++) {
        const fused_layer_t *ly = &layers[l];
#pragma omp for schedule(static)
        for (int b = 0; b < B; b++) rms_norm(hidden + (int64_t)b * H, ly->in_norm, s->x + (int64_t)b * H, H, eps);
        {
            const mm_t qkv[3] = {{s->x, H, ly->w[LQ], ly->b[LQ], QD, H, s->q, QD},
                                 {s->x, H, ly->w[LK], ly->b[LK], KD, H, s->k, KD},
                                 {s->x, H, ly->w[LV], ly->b[LV], KD, H, s->v, KD}};
            mm_share(qkv, 3, B);
        }
#pragma omp barrier
        /* Per (row, head): q/k norm, RoPE, then this token's K/V into the pool. */
#pragma omp for schedule(static)
        for (int item = 0; item < B * (Hq + Hkv); item++) {
            const int b = item / (Hq + Hkv), h = item % (Hq + Hkv);
            const float *c = cos + (int64_t)b * D, *sn = sin + (int64_t)b * D;
            if (h < Hq) {
                float *qh = s->q + (int64_t)b * QD + (int64_t)h * D;
                if (ly->q_norm) rms_norm(qh, ly->q_norm, qh, D, qk_eps);
                rope(qh, c, sn, D);
            } else {
                const int kh = h - Hq;
                float *kh_ = s->k + (int64_t)b * KD + (int64_t)kh * D;
                const float *vh = s->v + (int64_t)b * KD + (int64_t)kh * D;
                if (ly->k_norm) rms_norm(kh_, ly->k_norm, kh_, D, qk_eps);
                rope(kh_, c, sn, D);
                const int64_t at = ((write_blocks[b] * Hkv + kh) * BS + write_offsets[b]) * (int64_t)D;
                memcpy(ly->keys + at, kh_, sizeof(float) * D);
                memcpy(ly->values + at, vh, sizeof(float) * D);
            }
        }
        {
            const job_t job = {s->q, ly->keys, ly->values, tables, lens, s->attn, table_stride,
                               B, Hq, Hkv, D, BS, scale, 0, 0};
#pragma omp for schedule(dynamic, 1)
            for (int item = 0; item < B * Hkv; item++) one_item(&job, item / Hkv, item % Hkv);
        }
        {
            const mm_t o[1] = {{s->attn, QD, ly->w[LO], ly->b[LO], H, QD, s->tmp, H}};
            mm_share(o, 1, B);
        }
#pragma omp barrier
#pragma omp for schedule(static)
        for (int b = 0; b < B; b++) {
            float *h = hidden + (int64_t)b * H;
            const float *add = s->tmp + (int64_t)b * H;
            for (int i = 0; i < H; i++) h[i] = h[i] + add[i];
            rms_norm(h, ly->post_norm, s->x + (int64_t)b * H, H, eps);
        }
        {
            const mm_t gu[2] = {{s->x, H, ly->w[LG], ly->b[LG], I, H, s->gate, I},
                                {s->x, H, ly->w[LU], ly->b[LU], I, H, s->up, I}};
            mm_share(gu, 2, B);
        }
#pragma omp barrier
#pragma omp for schedule(static)
        for (int64_t i = 0; i < (int64_t)B * I; i++) {
            const float g = s->gate[i];
            s->gate[i] = (g / (1.0f + expf(-g))) * s->up[i];
        }
        {
            const mm_t down[1] = {{s->gate, I, ly->w[LD], ly->b[LD], H, I, s->tmp, H}};
            mm_share(down, 1, B);
        }
#pragma omp barrier
#pragma omp for schedule(static)
        for (int b = 0; b < B; b++) {
            float *h = hidden + (int64_t)b * H;
            const float *add = s->tmp + (int64_t)b * H;
            for (int i = 0; i < H; i++) h[i] = h[i] + add[i];
        }
    }
    return 0;
}
