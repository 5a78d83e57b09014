/* Paged decode attention over a block pool, one query token per row (services/decode/attention.py).
 *
 * q      [B, Hq, D]              float32, contiguous
 * k, v   [num_blocks, Hkv, BS, D] float32, contiguous (one layer of the pool)
 * tables [B, table_stride]        int32: row b's blocks in order
 * lens   [B]                      int32: tokens row b attends to (its new token included)
 * out    [B, Hq, D]              float32
 *
 * Cost is proportional to the sum of lens (no padding to the longest row).  Softmax is computed
 * online, one rescale per block (running max and sum), accumulating in float32, so no scratch of
 * the row's length is needed.  Rows x kv-heads are split over `num_threads` OpenMP threads.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_GROUP 32
#define MAX_DIM 256
#define MAX_THREADS 64
#define MAX_BLOCK 256

static inline int j_len_guard(int x) { return x > 0 ? x : 0; }

typedef struct {
    const float *q, *k, *v;
    const int32_t *tables, *lens;
    float *out;
    int64_t table_stride;
    int B, Hq, Hkv, D, BS;
    float scale;
    int first, last; /* work items [first, last): item = b * Hkv + h */
} job_t;

static void one_item(const job_t *j, int b, int h) {
    const int G = j->Hq / j->Hkv, D = j->D, BS = j->BS;
    const int len = j->lens[b];
    const int32_t *table = j->tables + (int64_t)b * j->table_stride;
    float m[MAX_GROUP], l[MAX_GROUP], acc[MAX_GROUP][MAX_DIM], s[MAX_GROUP][MAX_BLOCK];
    const float *qh = j->q + ((int64_t)b * j->Hq + (int64_t)h * G) * D;
    for (int g = 0; g < G; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
        memset(acc[g], 0, sizeof(float) * D);
    }
    for (int t0 = 0; t0 < len; t0 += BS) {
        const int64_t block = table[t0 / BS];
        const int n = len - t0 < BS ? len - t0 : BS;
        const float *kb = j->k + (block * j->Hkv + h) * (int64_t)BS * D;
        const float *vb = j->v + (block * j->Hkv + h) * (int64_t)BS * D;
        for (int t = 0; t < n; t++) {      /* scores of the block's tokens, every query head of the group */
            const float *kt = kb + (int64_t)t * D;
            for (int g = 0; g < G; g++) {
                const float *qg = qh + (int64_t)g * D;
                float dot = 0.0f;
                for (int d = 0; d < D; d++) dot += qg[d] * kt[d];
                s[g][t] = dot * j->scale;
            }
        }
        for (int g = 0; g < G; g++) {      /* one rescale per block: the new running max */
            float top = m[g];
            for (int t = 0; t < n; t++) top = s[g][t] > top ? s[g][t] : top;
            const float c = expf(m[g] - top);
            l[g] *= c;
            for (int d = 0; d < D; d++) acc[g][d] *= c;
            m[g] = top;
            for (int t = 0; t < n; t++) {
                s[g][t] = expf(s[g][t] - top);
                l[g] += s[g][t];
            }
        }
        for (int t = 0; t < n; t++) {      /* each value row is read once for the whole group */
            const float *vt = vb + (int64_t)t * D;
            for (int g = 0; g < G; g++) {
                const float p = s[g][t];
                for (int d = 0; d < D; d++) acc[g][d] += p * vt[d];
            }
        }
    }
    float *oh = j->out + ((int64_t)b * j->Hq + (int64_t)h * G) * D;
    for (int g = 0; g < G; g++) {
        const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
        for (int d = 0; d < D; d++) oh[(int64_t)g * D + d] = acc[g][d] * inv;
    }
}

static void *run_job(void *arg) {
    const job_t *j = (const job_t *)arg;
    for (int item = j->first; item < j->last; item++) one_item(j, item / j->Hkv, item % j->Hkv);
    return NULL;
}

/* Returns 0 on success, -1 if a size is beyond the kernel's fixed limits (caller falls back). */
int epd_paged_attention(const float *q, const float *k, const float *v, const int32_t *tables,
                        int64_t table_stride, const int32_t *lens, int B, int Hq, int Hkv, int D, int BS,
                        float scale, float *out, int num_threads) {
    if (Hkv <= 0 || Hq % Hkv != 0 || Hq / Hkv > MAX_GROUP || D > MAX_DIM || BS > MAX_BLOCK || B <= 0) return -1;
    const int items = B * Hkv;
    int threads = num_threads < 1 ? 1 : (num_threads > MAX_THREADS ? MAX_THREADS : num_threads);
    if (threads > items) threads = items;
    /* Split by attended tokens, not by item count: rows differ in length. */
    int64_t total = 0;
    for (int b = 0; b < B; b++) total += (int64_t)j_len_guard(lens[b]) * Hkv;
    job_t jobs[MAX_THREADS];
    int64_t done = 0;
    int item = 0;
    for (int t = 0; t < threads; t++) {
        job_t j = {q, k, v, tables, lens, out, table_stride, B, Hq, Hkv, D, BS, scale, item, item};
        const int64_t goal = total * (t + 1) / threads;
        while (item < items && (done < goal || t == threads - 1)) {
            done += j_len_guard(lens[item / Hkv]);
            item++;
        }
        j.last = item;
        jobs[t] = j;
    }
    /* On torch's OpenMP pool (the library links the libgomp torch loaded): no thread is created per
     * call, and no second set of threads competes with torch's spinning workers for the cores. */
#pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int t = 0; t < threads; t++) run_job(&jobs[t]);
    return 0;
}
