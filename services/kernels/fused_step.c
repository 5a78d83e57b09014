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
 * threads split each matmul's panels (q, k and v as one list of panels; gate and up by the same
 * columns, so each thread applies the SiLU product to its own) and meet at five barriers per layer
 * (epd_fused_step says which).  Fewer barriers matter on a busy box: a thread the scheduler preempts
 * holds up the whole team at the next one.
 *
 * Yielding to prompt work (epd_fused_yield_to): where decode shares the cores with encode and prefill
 * (`epd serve` on one machine), the compute lease's board (services/hostcpu/compute_lease.py) says when a
 * prompt-side forward holds or waits for the cores; at the start of every layer each thread then sleeps
 * until the board clears, for at most the budget per step, and the step goes on where it stopped.  A
 * niced decode team otherwise runs in every gap the prompt forward's threads leave and, once running,
 * holds the core for a scheduler slice while the prompt forward's team waits at its next barrier
 * (benchmarks/results/open_loop_stages.json: encode and prefill forwards at 2 req/s, 110 and 128 ms
 * at epd@311e186 with decode only niced, 69 and 103 ms with it yielding among the changes since).
 *
 * Numerics: float32 throughout (built with -DEPD_PANEL_BF16 the weights are bfloat16 panels, widened
 * exactly in registers; activations, KV and sums stay float32).  Norms sum squares in double; each matmul output is the panel
 * kernel's in-order float32 sum.  Outputs agree with the eager step to ~1e-6 relative, not bit for
 * bit (tests/services/decode/test_fused.py).
 */
#include "paged_attention.c"
#include "panel.c"

#include <stdint.h>
#include <time.h>

#define NUM_LINEARS 7   /* q, k, v, o, gate, up, down */
enum { LQ, LK, LV, LO, LG, LU, LD };

typedef struct {
    const float *in_norm, *post_norm;     /* [H] */
    const float *q_norm, *k_norm;         /* [D], or NULL (no per-head q/k norm) */
    const wt_t *w[NUM_LINEARS];           /* panels [ceil(N/16), K, 16] (float32, or bfloat16: panel_kernel.c) */
    const float *b[NUM_LINEARS];          /* bias [N] or NULL */
    float *keys, *values;                 /* this layer's pool: [num_blocks, Hkv, BS, D] */
} fused_layer_t;

typedef struct {
    float *x;       /* [threads, B, H]  each thread's own copy of a sublayer's normed input */
    float *alt;     /* [B, H]      the residual stream's second buffer (the caller's `hidden` is the first) */
    float *q;       /* [B, Hq*D] */
    float *k;       /* [B, Hkv*D] */
    float *v;       /* [B, Hkv*D] */
    float *attn;    /* [B, Hq*D]   attention output */
    float *tmp;     /* [B, H]      a sublayer's output before the residual add */
    float *gate;    /* [B, I]      gate, then silu(gate) * up */
    float *up;      /* [B, I] */
    int x_threads;  /* threads the x buffer has room for */
} fused_scratch_t;

typedef struct {
    const float *x;
    int64_t ldx;
    const wt_t *panels;
    const float *bias;
    int N, K;
    float *y;
    int64_t ldy;
} mm_t;

/* This thread's share [*lo, *hi) of `total` panels (whole 4-panel groups for one row). */
static void share(int total, int M, int *lo, int *hi) {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    int per = (total + nt - 1) / nt;
    if (M == 1) per = (per + 3) / 4 * 4;   /* whole 4-panel groups for the one-row path */
    *lo = t * per > total ? total : t * per;
    *hi = *lo + per > total ? total : *lo + per;
}

/* Rows 0..M-1 of up to three matmuls, their panels taken as one list split evenly over the team
 * (called by every thread of the parallel region; no barrier inside). */
static void mm_share(const mm_t *mms, int count, int M) {
    int total = 0, lo, hi;
    for (int i = 0; i < count; i++) total += (mms[i].N + NR - 1) / NR;
    share(total, M, &lo, &hi);
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

/* x = RMSNorm(h + add) for every row, into this thread's own x (every thread computes all of it, so no
 * barrier is needed before the matmul that reads it); the rows this thread owns (b % threads) also
 * store h + add into `out`, the residual stream's next buffer.  add == NULL: x = RMSNorm(h). */
static void norm_rows(const float *h, const float *add, float *out, float *x, const float *w, int B, int H,
                      float eps) {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    for (int b = 0; b < B; b++) {
        const float *hb = h + (int64_t)b * H;
        float *xb = x + (int64_t)b * H;
        if (add) {
            const float *ab = add + (int64_t)b * H;
            for (int i = 0; i < H; i++) xb[i] = hb[i] + ab[i];
            if (b % nt == t) memcpy(out + (int64_t)b * H, xb, sizeof(float) * H);
            rms_norm(xb, w, xb, H, eps);
        } else {
            rms_norm(hb, w, xb, H, eps);
        }
    }
}

/* Where the step yields (epd_fused_yield_to): the lease board (a byte per prompt-side process, nonzero while
 * it waits for or holds the cores), the long-prompt board (a byte per prefill, nonzero while a chunked prompt
 * prefills: then decode goes first and does not yield), and the most a step pauses, in ns (0: never). */
static const volatile uint8_t *yield_board = NULL, *long_board = NULL;
static int yield_bytes = 0, long_bytes = 0;
static int64_t yield_budget_ns = 0;
static volatile int64_t yielded_ns = 0;   /* the pauses' total (thread 0's), read by epd_fused_yielded_ns */

void epd_fused_yield_to(const void *board, int bytes, const void *longs, int nlong, int64_t budget_ns) {
    yield_board = (const volatile uint8_t *)board;
    yield_bytes = board ? bytes : 0;
    long_board = (const volatile uint8_t *)longs;
    long_bytes = longs ? nlong : 0;
    yield_budget_ns = budget_ns > 0 ? budget_ns : 0;
}

int64_t epd_fused_yielded_ns(void) { return yielded_ns; }

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static int any_set(const volatile uint8_t *board, int bytes) {
    for (int i = 0; i < bytes; i++)
        if (board[i]) return 1;
    return 0;
}

/* Sleeps while a prompt-side forward holds or waits for the cores, until `deadline`: 100 us first, doubling to
 * YIELD_SLEEP_MAX_NS.  A fixed 100 us woke each thread 10,000 times a second through the whole forward, and a
 * woken thread takes a core from the forward's team unless its niceness is far above theirs. */
#define YIELD_SLEEP_MAX_NS 2000000L
static void yield_to_prompt(int64_t deadline) {
    if (!deadline || !any_set(yield_board, yield_bytes)) return;
    const int64_t began = now_ns();
    int64_t at = began;
    long sleep_ns = 100000;
    while (at < deadline && any_set(yield_board, yield_bytes) && !any_set(long_board, long_bytes)) {
        const struct timespec pause = {0, sleep_ns};
        nanosleep(&pause, NULL);
        if (sleep_ns < YIELD_SLEEP_MAX_NS) sleep_ns *= 2;
        at = now_ns();
    }
    if (omp_get_thread_num() == 0) yielded_ns += at - began;
}

/* Returns 0, or -1 for sizes beyond the kernels' fixed limits (the caller runs the eager step).
 *
 * Per layer the team meets at five barriers: after q/k/v, after attention, after o_proj, after gate/up
 * (each thread takes the same columns of both and applies silu * up to them itself) and after down.
 * The norms need no barrier of their own: every thread computes the whole normed input into its own
 * buffer, and the residual stream alternates between two buffers, so the rows a thread adds into the
 * next buffer are never read in the same phase. */
int epd_fused_step(const fused_layer_t *layers, int L, float *hidden, int B, int H, int Hq, int Hkv, int D, int I,
                   float eps, float qk_eps, const float *cos, const float *sin, const int64_t *write_blocks,
                   const int64_t *write_offsets, const int32_t *tables, int64_t table_stride, const int32_t *lens,
                   int BS, float scale, const fused_scratch_t *s, int threads) {
    if (B <= 0 || L <= 0 || Hkv <= 0 || Hq % Hkv != 0 || Hq / Hkv > MAX_GROUP || D > MAX_DIM || D % 2
        || BS > MAX_BLOCK || BS <= 0 || threads <= 0)
        return -1;
    const int QD = Hq * D, KD = Hkv * D, G = Hq / Hkv;
    int T = threads > MAX_THREADS ? MAX_THREADS : threads;
    if (T > s->x_threads) T = s->x_threads;
    const int64_t deadline = yield_bytes && yield_budget_ns && !any_set(long_board, long_bytes)
                             ? now_ns() + yield_budget_ns : 0;   /* one deadline for the whole team */
#pragma omp parallel num_threads(T)
    {
        float *x = s->x + (int64_t)omp_get_thread_num() * B * H;
        float *h = hidden, *next = s->alt;
        const float *pending = NULL;     /* the last sublayer's output, not yet added into h */
        for (int l = 0; l < L; l++) {
            const fused_layer_t *ly = &layers[l];
            yield_to_prompt(deadline);
            norm_rows(h, pending, next, x, ly->in_norm, B, H, eps);
            {
                const mm_t qkv[3] = {{x, H, ly->w[LQ], ly->b[LQ], QD, H, s->q, QD},
                                     {x, H, ly->w[LK], ly->b[LK], KD, H, s->k, KD},
                                     {x, H, ly->w[LV], ly->b[LV], KD, H, s->v, KD}};
                mm_share(qkv, 3, B);
            }
#pragma omp barrier
            if (pending) {
                float *was = h;
                h = next;
                next = was;
            }
            /* Per (row, KV head): q/k norms and RoPE of its heads, this token's K/V into the pool, attention. */
            {
                const job_t job = {s->q, ly->keys, ly->values, tables, lens, s->attn, table_stride,
                                   B, Hq, Hkv, D, BS, scale, 0, 0};
#pragma omp for schedule(dynamic, 1) nowait
                for (int item = 0; item < B * Hkv; item++) {
                    const int b = item / Hkv, kh = item % Hkv;
                    const float *c = cos + (int64_t)b * D, *sn = sin + (int64_t)b * D;
                    for (int g = 0; g < G; g++) {
                        float *qh = s->q + (int64_t)b * QD + (int64_t)(kh * G + g) * D;
                        if (ly->q_norm) rms_norm(qh, ly->q_norm, qh, D, qk_eps);
                        rope(qh, c, sn, D);
                    }
                    float *kv_k = s->k + (int64_t)b * KD + (int64_t)kh * D;
                    const float *kv_v = s->v + (int64_t)b * KD + (int64_t)kh * D;
                    if (ly->k_norm) rms_norm(kv_k, ly->k_norm, kv_k, D, qk_eps);
                    rope(kv_k, c, sn, D);
                    const int64_t at = ((write_blocks[b] * Hkv + kh) * BS + write_offsets[b]) * (int64_t)D;
                    memcpy(ly->keys + at, kv_k, sizeof(float) * D);
                    memcpy(ly->values + at, kv_v, sizeof(float) * D);
                    one_item(&job, b, kh);
                }
            }
#pragma omp barrier
            {
                const mm_t o[1] = {{s->attn, QD, ly->w[LO], ly->b[LO], H, QD, s->tmp, H}};
                mm_share(o, 1, B);
            }
#pragma omp barrier
            norm_rows(h, s->tmp, next, x, ly->post_norm, B, H, eps);
            {
                int lo, hi;
                share((I + NR - 1) / NR, B, &lo, &hi);
                if (lo < hi) {
                    panel_range(x, H, B, ly->w[LG], H, s->gate, I, ly->b[LG], I, lo, hi);
                    panel_range(x, H, B, ly->w[LU], H, s->up, I, ly->b[LU], I, lo, hi);
                    const int c0 = lo * NR, c1 = hi * NR < I ? hi * NR : I;
                    for (int b = 0; b < B; b++) {
                        float *gb = s->gate + (int64_t)b * I;
                        const float *ub = s->up + (int64_t)b * I;
                        for (int i = c0; i < c1; i++) gb[i] = (gb[i] / (1.0f + expf(-gb[i]))) * ub[i];
                    }
                }
            }
#pragma omp barrier
            {
                float *was = h;
                h = next;
                next = was;
            }
            {
                const mm_t down[1] = {{s->gate, I, ly->w[LD], ly->b[LD], H, I, s->tmp, H}};
                mm_share(down, 1, B);
            }
            pending = s->tmp;
#pragma omp barrier
        }
        /* hidden = h + the last MLP's output, each thread its own rows (h may be `hidden` itself: a row is
         * read and written by its owner only). */
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        for (int b = t; b < B; b += nt) {
            const float *hb = h + (int64_t)b * H, *ab = pending + (int64_t)b * H;
            float *ob = hidden + (int64_t)b * H;
            for (int i = 0; i < H; i++) ob[i] = hb[i] + ab[i];
        }
    }
    return 0;
}
