/* One query row's attention, and a block of rows', on the pool (pool.c): a task per kv head
 * and its query heads, or per fewer query heads where the threads outnumber the kv heads; one
 * row over a long window split by positions, then by heads, then by value columns; the parts
 * of a layer's split in one call. Every head's operations are attention.c's for that head
 * alone, so the bits never depend on the split or the thread count (tests/test_threads.py). */

#include "kernels.h"

EXP_LOOPS(_portable, )
#if defined(FOUNDRY_X86)
EXP_LOOPS(_avx2, AVX2)
#endif

/* ---- on the pool: a task per kv head (its group of query heads) ------------------------------ */

size_t attend_room(int n_pos, int n_head, int n_kv, int dh) {
    return (size_t)n_pos * n_head + (size_t)n_kv * dh;
}

typedef struct {
    const float *q;    /* (rows, n_head, dh) */
    const void *k, *v; /* the cache from position 0 */
    int half, pos, window, group, n_kv, dh;
    float *out; /* (rows, n_head, dh) */
} attend_job;

/* Task i: row i / n_kv (at position pos + row) for kv head i mod n_kv and its query heads,
 * over the positions of its window (the Engine's loop of one row at a time). */
static int attend_task(void *ctx, int i) {
    const attend_job *j = ctx;
    const int t = i / j->n_kv, g = i % j->n_kv;
    const int n_pos = j->pos + t + 1,
              first = j->window && n_pos > j->window ? n_pos - j->window : 0;
    const size_t size = j->half ? 2 : 4, hd = (size_t)j->group * j->dh,
                 stride = (size_t)j->n_kv * j->dh,
                 at = ((size_t)first * stride + (size_t)g * j->dh) * size,
                 row = (size_t)t * j->n_kv * hd + g * hd;
    float *p = malloc(attend_room(n_pos - first, j->group, 1, j->dh) * sizeof(float));
    if (p == NULL) return -1;
    attend_strided(j->q + row, (const uint8_t *)j->k + at, (const uint8_t *)j->v + at, j->half,
                   n_pos - first, j->group, 1, j->dh, stride, p, j->out + row);
    free(p);
    return 0;
}

/* ---- one row over a long cache: split by positions, then by heads, then by values --------- */

/* attend's portable operations for one row in three pool calls, so that more threads than kv
 * heads share it: (1) the scores p[h][s], a task per kv head and block of positions (each
 * score is its own dot product); (2) each head's softmax, a task per head (its maximum, exp_f,
 * the sum in position order, the divisions); (3) each output value's sum over the positions
 * in order, a task per head and block of 8-value columns. Every value is computed as attend
 * computes it, so the bits are attend's (tests/test_threads.py). */
typedef struct {
    const float *q;
    const void *k, *v;
    int half, n_pos, group, dh, per_kv, pos_block, per_head, col_block;
    size_t stride;
    float scale, *p, *out;
} split_job;

static float (*score_fn(int dh))(const float *, const float *, int) {
#if defined(FOUNDRY_X86)
    if (use_avx2 && dh % 8 == 0) return score_avx2;
#endif
    (void)dh;
    return score_portable;
}

static void (*f16_row_fn(void))(const uint16_t *, int, float *) {
#if defined(FOUNDRY_X86)
    if (use_avx2) return f16_row_avx2;
#endif
    return f16_row_portable;
}

static int split_scores(void *ctx, int i) {
    const split_job *j = ctx;
    const int g = i / j->per_kv, s0 = (i % j->per_kv) * j->pos_block;
    const int s1 = s0 + j->pos_block < j->n_pos ? s0 + j->pos_block : j->n_pos;
    float (*score)(const float *, const float *, int) = score_fn(j->dh);
    void (*f16_row)(const uint16_t *, int, float *) = f16_row_fn();
    float *row = malloc((size_t)j->dh * sizeof(float));
    if (row == NULL) return -1;
    for (int s = s0; s < s1; s++) {
        const size_t at = (size_t)s * j->stride + (size_t)g * j->dh;
        const float *ks = row;
        if (j->half)
            f16_row((const uint16_t *)j->k + at, j->dh, row);
        else
            ks = (const float *)j->k + at;
        for (int h = g * j->group; h < (g + 1) * j->group; h++)
            j->p[(size_t)h * j->n_pos + s] = score(j->q + (size_t)h * j->dh, ks, j->dh) * j->scale;
    }
    free(row);
    return 0;
}

static int split_softmax(void *ctx, int h) {
    const split_job *j = ctx;
    void (*exp_shifted)(float *, int, float) = exp_shifted_portable;
#if defined(FOUNDRY_X86)
    if (use_avx2) exp_shifted = exp_shifted_avx2;
#endif
    float *ph = j->p + (size_t)h * j->n_pos;
    float m = -INFINITY;
    for (int s = 0; s < j->n_pos; s++) m = fmaxf(m, ph[s]);
    exp_shifted(ph, j->n_pos, m);
    float sum = 0.0f;
    for (int s = 0; s < j->n_pos; s++) sum = sum + ph[s];
    for (int s = 0; s < j->n_pos; s++) ph[s] = ph[s] / sum;
    return 0;
}

static int split_values(void *ctx, int i) {
    const split_job *j = ctx;
    const int h = i / j->per_head, c0 = (i % j->per_head) * j->col_block;
    const int width = c0 + j->col_block < j->dh ? j->col_block : j->dh - c0;
    void (*add_scaled)(float *, float, const float *, int) = add_scaled_portable;
#if defined(FOUNDRY_X86)
    if (use_avx2 && width % 8 == 0) add_scaled = add_scaled_avx2;
#endif
    void (*f16_row)(const uint16_t *, int, float *) = f16_row_fn();
    float *row = malloc((size_t)width * sizeof(float));
    if (row == NULL) return -1;
    float *o = j->out + (size_t)h * j->dh + c0;
    const float *ph = j->p + (size_t)h * j->n_pos;
    for (int c = 0; c < width; c++) o[c] = 0.0f;
    for (int s = 0; s < j->n_pos; s++) {
        const size_t at = (size_t)s * j->stride + (size_t)(h / j->group) * j->dh + c0;
        const float *vs = row;
        if (j->half)
            f16_row((const uint16_t *)j->v + at, width, row);
        else
            vs = (const float *)j->v + at;
        add_scaled(o, ph[s], vs, width);
    }
    free(row);
    return 0;
}

/* Positions from which one row's attention with fewer query heads than threads is split so
 * (below, a task per query head is enough). Its three pool calls and narrow column tasks cost
 * more than they give over a window of hundreds of positions: the bench preset at position
 * 512-576 spent 225 us a layer in them at 16 threads, against 64 us a layer for 4 tasks at
 * 4 threads (bench/performance/engine.py --profile, docs/benchmarks.md). */
#define SPLIT_POSITIONS 4096

static int attend_split(const float *q, const void *k, const void *v, int half, int n_pos,
                        int n_head, int n_kv, int dh, float *out) {
    const int threads = pool_threads();
    const int per_kv = (2 * threads + n_kv - 1) / n_kv;
    const int pos_block = (n_pos + per_kv - 1) / per_kv;
    int per_head = (2 * threads + n_head - 1) / n_head;
    per_head = per_head > dh / 8 ? (dh / 8 > 0 ? dh / 8 : 1) : per_head;
    int col_block = (dh + per_head - 1) / per_head;
    col_block = (col_block + 7) / 8 * 8;
    split_job job = {q,
                     k,
                     v,
                     half,
                     n_pos,
                     n_head / n_kv,
                     dh,
                     per_kv,
                     pos_block,
                     (dh + col_block - 1) / col_block,
                     col_block,
                     (size_t)n_kv * dh,
                     (float)(1.0 / sqrt((double)dh)),
                     NULL,
                     out};
    job.p = malloc((size_t)n_head * n_pos * sizeof(float));
    if (job.p == NULL) return -1;
    int rc = pool_run(split_scores, &job, n_kv * ((n_pos + pos_block - 1) / pos_block));
    if (rc == 0) rc = pool_run(split_softmax, &job, n_head);
    if (rc == 0) rc = pool_run(split_values, &job, n_head * job.per_head);
    free(job.p);
    return rc;
}

/* ---- one row, several blocks of heads, one pool call ------------------------------------- */

typedef struct {
    const attend_item *items;
    const int *first; /* the first task of each item; first[count] = the tasks */
    int half, n_pos, dh, per_group;
} many_attend_job;

/* One row's attention for block c of the `per` blocks kv head g's query heads split into
 * (per at most the group): attend_strided over n_pos positions of k and v, which begin at the
 * row's first position, so each head's bits are one-row decoding's whatever the split. */
static int attend_head_block(const float *q, const void *k, const void *v, int half, int n_pos,
                             int n_head, int n_kv, int dh, int g, int c, int per, float *out) {
    const int group = n_head / n_kv, chunk = (group + per - 1) / per;
    const int h0 = g * group + c * chunk;
    const int h1 = h0 + chunk < (g + 1) * group ? h0 + chunk : (g + 1) * group;
    if (h0 >= h1) return 0;
    const size_t at = (size_t)g * dh * (half ? 2 : 4);
    float *p = malloc(attend_room(n_pos, h1 - h0, 1, dh) * sizeof(float));
    if (p == NULL) return -1;
    attend_strided(q + (size_t)h0 * dh, (const uint8_t *)k + at, (const uint8_t *)v + at, half,
                   n_pos, h1 - h0, 1, dh, (size_t)n_kv * dh, p, out + (size_t)h0 * dh);
    free(p);
    return 0;
}

static int attend_many_task(void *ctx, int i) {
    const many_attend_job *j = ctx;
    int it = 0;
    while (j->first[it + 1] <= i) it++;
    const attend_item *a = &j->items[it];
    const int group = a->n_head / a->n_kv, local = i - j->first[it];
    const int per = j->per_group < group ? j->per_group : group;
    return attend_head_block(a->q, a->k, a->v, j->half, j->n_pos, a->n_head, a->n_kv, j->dh,
                             local / per, local % per, per, a->out);
}

#define MAX_ATTEND_ITEMS STEP_MAX_PARTS

int attend_many(const attend_item *items, int count, int half, int n_pos, int dh) {
    if (count < 1 || count > MAX_ATTEND_ITEMS) return -1;
    int kv = 0, heads = 0;
    for (int i = 0; i < count; i++) {
        kv += items[i].n_kv;
        heads += items[i].n_head;
    }
    const int threads = pool_threads();
    if (n_pos >= SPLIT_POSITIONS && threads > heads) { /* a long window, few heads */
        for (int i = 0; i < count; i++) {
            const attend_item *a = &items[i];
            if (attend_split(a->q, a->k, a->v, half, n_pos, a->n_head, a->n_kv, dh, a->out) < 0)
                return -1;
        }
        return 0;
    }
    /* tasks a kv head's query heads split into: enough for every thread to have one */
    const int per_group = kv >= threads ? 1 : (threads + kv - 1) / kv;
    int first[MAX_ATTEND_ITEMS + 1];
    first[0] = 0;
    for (int i = 0; i < count; i++) {
        const int group = items[i].n_head / items[i].n_kv;
        first[i + 1] = first[i] + items[i].n_kv * (per_group < group ? per_group : group);
    }
    many_attend_job job = {items, first, half, n_pos, dh, per_group};
    return pool_run(attend_many_task, &job, first[count]);
}

int attend_rows(const float *q, const void *k, const void *v, int half, int pos, int window,
                int rows, int n_head, int n_kv, int dh, float *out) {
    if (rows == 1) {
        const int n_pos = pos + 1, first = window && n_pos > window ? n_pos - window : 0;
        const size_t at = (size_t)first * n_kv * dh * (half ? 2 : 4);
        const attend_item item = {
            q, (const uint8_t *)k + at, (const uint8_t *)v + at, n_head, n_kv, out};
        return attend_many(&item, 1, half, n_pos - first, dh);
    }
    attend_job job = {q, k, v, half, pos, window, n_head / n_kv, n_kv, dh, out};
    return pool_run(attend_task, &job, rows * n_kv);
}

/* ---- a batch of sequences: their rows stored, then every row's attention in one pool call -- */

typedef struct {
    const float *q;
    const attend_seq *seqs;
    const int *seq_of; /* each row's sequence */
    int half, window, n_head, n_kv, dh, per;
    float *out;
} seqs_job;

/* Task i: row r = i / (n_kv per), kv head g, its c-th block of query heads, over the row's
 * window of its sequence's caches. */
static int seqs_task(void *ctx, int i) {
    const seqs_job *j = ctx;
    const int r = i / (j->n_kv * j->per), g = i / j->per % j->n_kv, c = i % j->per;
    const attend_seq *s = &j->seqs[j->seq_of[r]];
    const int n_pos = s->pos + r - s->row + 1,
              first = j->window && n_pos > j->window ? n_pos - j->window : 0;
    const size_t at = (size_t)first * j->n_kv * j->dh * (j->half ? 2 : 4),
                 row = (size_t)r * j->n_head * j->dh;
    return attend_head_block(j->q + row, (const uint8_t *)s->k + at, (const uint8_t *)s->v + at,
                             j->half, n_pos - first, j->n_head, j->n_kv, j->dh, g, c, j->per,
                             j->out + row);
}

int store_attend(const float *q, const float *kx, size_t k_ld, const float *vx, size_t v_ld,
                 const attend_seq *seqs, int count, int half, int window, int n_head, int n_kv,
                 int dh, float *out) {
    const int width = n_kv * dh;
    const size_t at = (size_t)width * (half ? 2 : 4);
    int n = 0;
    /* Every sequence's rows in its caches first (on the caller where they are few: a decode
     * step's are one row each), so that no task reads a position another task writes. */
    for (int i = 0; i < count; i++) {
        const attend_seq *s = &seqs[i];
        store_rows(kx + (size_t)s->row * k_ld, k_ld, s->rows, width, half,
                   (uint8_t *)s->k + (size_t)s->pos * at);
        store_rows(vx + (size_t)s->row * v_ld, v_ld, s->rows, width, half,
                   (uint8_t *)s->v + (size_t)s->pos * at);
        n += s->rows;
    }
    if (count == 1) /* one sequence: attend_rows' split (a long window's by positions) */
        return attend_rows(q, seqs->k, seqs->v, half, seqs->pos, window, seqs->rows, n_head, n_kv,
                           dh, out);
    int *seq_of = malloc((size_t)n * sizeof(int));
    if (seq_of == NULL) return -1;
    for (int i = 0; i < count; i++)
        for (int t = 0; t < seqs[i].rows; t++) seq_of[seqs[i].row + t] = i;
    /* blocks a kv head's query heads split into: enough tasks for every thread to have one */
    const int threads = pool_threads(), group = n_head / n_kv, base = n * n_kv;
    int per = base >= threads ? 1 : (threads + base - 1) / base;
    per = per < group ? per : group;
    seqs_job job = {q, seqs, seq_of, half, window, n_head, n_kv, dh, per, out};
    const int rc = pool_run(seqs_task, &job, base * per);
    free(seq_of);
    return rc;
}
