/* The rest of a decode step: RMSNorm, rotation, router, expert grouping; and a prefill
 * block's rows of each on the pool. */

#include "kernels.h"

EXP_LOOPS(_portable, )
#if defined(FOUNDRY_X86)
EXP_LOOPS(_avx2, AVX2)
#endif

/* The engine's small operations per row, each a fixed order of float operations (the same on
 * every path and architecture, like the products): a row's result does not depend on the other
 * rows of the call, so blocks and the TP pair keep their bits. Sums of squares and the router's
 * logits are dot products in 8 lanes halved at the end (attend's score). */

static float (*dot8_for(int d))(const float *, const float *, int) {
#if defined(FOUNDRY_X86)
    if (use_avx2 && d % 8 == 0) return score_avx2;
#endif
    (void)d;
    return score_portable;
}

/* ---- a block's rows on the pool ------------------------------------------------------------ */

/* A prompt's block calls these operations with hundreds of rows: run on the caller alone, they
 * capped a prefill's scaling with threads (docs/quantization.md, "Threads"). Each row's result
 * depends on that row alone, computed by the one-row code, so a block is cut into tasks of
 * whole rows and the bits do not depend on the cut nor on the thread count. A task holds at
 * least a quarter of the products' split_below in float32 values (16384 by default), so one
 * decoded row, or a small block, stays on the caller without a pool call; the tests' bound of
 * 0 cuts every block into rows. */

typedef struct rows_job rows_job;
struct rows_job {
    void (*run)(const rows_job *j, int r0, int r1); /* the operation on rows r0 .. r1 - 1 */
    const float *x, *w, *cos, *sin; /* the operation's inputs, as its arguments name them */
    const int64_t *slot;
    float *out, *weights;
    int64_t *top;
    int d, heads, dh, neox, n_expert, k, half;
    size_t ld;
    float eps;
    int n, per_task;
};

static int rows_task(void *ctx, int i) {
    const rows_job *j = ctx;
    const int r0 = i * j->per_task, r1 = r0 + j->per_task < j->n ? r0 + j->per_task : j->n;
    j->run(j, r0, r1);
    return 0;
}

/* j's n rows, each of about `work` values, in tasks of whole rows on the pool. */
static void on_rows(rows_job *j, int n, size_t work) {
    const size_t least = (size_t)pool_split_work() / 4;
    const size_t per = work && least ? (least + work - 1) / work : 1;
    j->n = n;
    j->per_task = per > (size_t)n ? n : (int)per;
    if (n <= j->per_task || pool_threads() == 1) {
        if (n > 0) j->run(j, 0, n);
        return;
    }
    pool_run(rows_task, j, (n + j->per_task - 1) / j->per_task);
}

/* out (n, d) = x / sqrt(sum(x^2) / d + eps) * w: as layers.rmsnorm_forward, (x * rstd) * w. */
static void rmsnorm_run(const rows_job *j, int r0, int r1) {
    const int d = j->d;
    const float *w = j->w, eps = j->eps;
    float (*dot8)(const float *, const float *, int) = dot8_for(d);
    for (int r = r0; r < r1; r++) {
        const float *xr = j->x + (size_t)r * d;
        float *o = j->out + (size_t)r * d;
        const float rstd = 1.0f / sqrtf(dot8(xr, xr, d) / (float)d + eps);
        for (int i = 0; i < d; i++) o[i] = (xr[i] * rstd) * w[i];
    }
}

void rmsnorm(const float *x, const float *w, int n, int d, float eps, float *out) {
    rows_job j = {.run = rmsnorm_run, .x = x, .w = w, .out = out, .d = d, .eps = eps};
    on_rows(&j, n, (size_t)d);
}

/* Pairs of each of n rows of `heads` heads of dh values turned by the row's angles:
 * (x0 c - x1 s, x0 s + x1 c), as rope_forward. The pairs are adjacent, (2i, 2i + 1), or with
 * ``neox`` (i, i + dh/2), the same operations on each pair. */
static void rope_run(const rows_job *j, int r0, int r1) {
    const int heads = j->heads, dh = j->dh, half = dh / 2;
    const int step = j->neox ? 1 : 2, other = j->neox ? half : 1;
    const float *x = j->x;
    float *out = j->out;
    for (int r = r0; r < r1; r++) {
        const float *c = j->cos + (size_t)r * half, *s = j->sin + (size_t)r * half;
        for (int h = 0; h < heads; h++) {
            const float *xh = x + ((size_t)r * heads + h) * dh;
            float *o = out + ((size_t)r * heads + h) * dh;
            for (int i = 0; i < half; i++) {
                const int a = step * i, b = a + other;
                const float x0 = xh[a], x1 = xh[b];
                o[a] = x0 * c[i] - x1 * s[i];
                o[b] = x0 * s[i] + x1 * c[i];
            }
        }
    }
}

void rope(const float *x, const float *cos, const float *sin, int n, int heads, int dh, int neox,
          float *out) {
    rows_job j = {.run = rope_run,
                  .x = x,
                  .cos = cos,
                  .sin = sin,
                  .out = out,
                  .heads = heads,
                  .dh = dh,
                  .neox = neox};
    on_rows(&j, n, (size_t)heads * dh);
}

/* out (n, f) = gelu(g) * u of each row [g | u] of gu (n, 2f), as ggml's geglu: gelu looked up
 * in ``table`` (gelu of every float16 value, by its bits) at the float16 nearest g; 0 for
 * g <= -10, g itself for g >= 10 (arch.geglu). */
static void geglu_run(const rows_job *j, int r0, int r1) {
    const int f = j->d;
    const float *table = j->w;
#if defined(FOUNDRY_X86)
    if (j->k) { /* the table's float16 copy, F16C's conversion: the same values, fewer lines */
        for (int r = r0; r < r1; r++)
            geglu16_avx2(j->x + (size_t)r * 2 * f, f, j->out + (size_t)r * f);
        return;
    }
#endif
    for (int r = r0; r < r1; r++) {
        const float *g = j->x + (size_t)r * 2 * f, *u = g + f;
        float *o = j->out + (size_t)r * f;
        for (int i = 0; i < f; i++) {
            const float x = g[i];
            const float act = x <= -10.0f ? 0.0f : (x >= 10.0f ? x : table[f16_bits(x)]);
            o[i] = act * u[i];
        }
    }
}

void geglu(const float *gu, const float *table, int n, int f, float *out) {
    int half = 0; /* k: rows look the table up in its float16 copy (step.c's gelu16) */
#if defined(FOUNDRY_X86)
    half = use_avx2 && gelu16_for(table);
#endif
    rows_job j = {.run = geglu_run, .x = gu, .w = table, .out = out, .d = f, .k = half};
    on_rows(&j, n, 3 * (size_t)f);
}

/* out (n, f) = silu(g) * u of each row [g | u] of gu (n, 2f) (silu_mul). */
static void swiglu_run(const rows_job *j, int r0, int r1) {
    void (*silu_mul)(const float *, const float *, int, float *) = silu_mul_portable;
#if defined(FOUNDRY_X86)
    if (use_avx2) silu_mul = silu_mul_avx2;
#endif
    const int f = j->d;
    for (int r = r0; r < r1; r++)
        silu_mul(j->x + (size_t)r * 2 * f, j->x + (size_t)r * 2 * f + f, f, j->out + (size_t)r * f);
}

void swiglu(const float *gu, int n, int f, float *out) {
    rows_job j = {.run = swiglu_run, .x = gu, .out = out, .d = f};
    on_rows(&j, n, 3 * (size_t)f);
}

/* Each row's router: logits z_e = x . w_e, probabilities softmax(z) (the maximum taken off
 * before exp_f, each divided by their sum), the k largest (ties to the lower id, as a stable
 * sort), and their weights renormalised to sum 1 (layers.router_forward). */
static void route_run(const rows_job *j, int r0, int r1) {
    const int d = j->d, n_expert = j->n_expert, k = j->k;
    const float *w = j->w;
    float (*dot8)(const float *, const float *, int) = dot8_for(d);
    float p[MAX_EXPERTS];
    for (int r = r0; r < r1; r++) {
        const float *xr = j->x + (size_t)r * d;
        float m = -INFINITY;
        for (int e = 0; e < n_expert; e++) {
            p[e] = dot8(xr, w + (size_t)e * d, d);
            m = fmaxf(m, p[e]);
        }
        float sum = 0.0f;
        for (int e = 0; e < n_expert; e++) {
            p[e] = exp_f(p[e] - m);
            sum = sum + p[e];
        }
        for (int e = 0; e < n_expert; e++) p[e] = p[e] / sum;
        int64_t *t = j->top + (size_t)r * k;
        float *wt = j->weights + (size_t)r * k, total = 0.0f;
        for (int c = 0; c < k; c++) {
            int best = -1;
            for (int e = 0; e < n_expert; e++) {
                int taken = 0;
                for (int i = 0; i < c; i++) taken |= t[i] == e;
                if (!taken && (best < 0 || p[e] > p[best])) best = e;
            }
            t[c] = best;
            wt[c] = p[best];
            total = total + p[best];
        }
        for (int c = 0; c < k; c++) wt[c] = wt[c] / total;
    }
}

void route(const float *x, const float *w, int n, int d, int n_expert, int k, float *weights,
           int64_t *top) {
    rows_job j = {.run = route_run,
                  .x = x,
                  .w = w,
                  .weights = weights,
                  .top = top,
                  .d = d,
                  .n_expert = n_expert,
                  .k = k};
    on_rows(&j, n, (size_t)d * n_expert);
}

/* The assignments (flat index row * k + j) of `m` to experts first .. first + n_local - 1,
 * grouped by expert in index order: order (the local count, returned), bounds (n_local + 1). */
int64_t assign(const int64_t *top, int64_t m, int64_t first, int n_local, int64_t *order,
               int64_t *bounds) {
    for (int e = 0; e <= n_local; e++) bounds[e] = 0;
    for (int64_t a = 0; a < m; a++) {
        const int64_t e = top[a] - first;
        if (e >= 0 && e < n_local) bounds[e + 1]++;
    }
    for (int e = 0; e < n_local; e++) bounds[e + 1] += bounds[e];
    int64_t next[MAX_EXPERTS];
    for (int e = 0; e < n_local; e++) next[e] = bounds[e];
    for (int64_t a = 0; a < m; a++) {
        const int64_t e = top[a] - first;
        if (e >= 0 && e < n_local) order[next[e]++] = a;
    }
    return bounds[n_local];
}

/* out (n, d) = sum over slots j in top-k order of weights[r, j] * ys[the assignment's row],
 * a slot of another part's expert adding 0 (layers.combine_expert_outputs). ``slot`` maps each
 * of the n * k assignments to its row of ys, -1 where another part holds the expert. */
static void combine_run(const rows_job *j, int r0, int r1) {
    const int k = j->k, d = j->d;
    const float *ys = j->x, *weights = j->w;
    for (int r = r0; r < r1; r++) {
        float *o = j->out + (size_t)r * d;
        for (int s = 0; s < k; s++) {
            const int64_t a = (int64_t)r * k + s, i = j->slot[a];
            const float c = weights[a];
            const float *y = i >= 0 ? ys + (size_t)i * d : NULL;
            for (int c_ = 0; c_ < d; c_++) {
                const float v = y ? y[c_] * c : 0.0f;
                o[c_] = s ? o[c_] + v : v;
            }
        }
    }
}

void combine(const float *ys, const float *weights, const int64_t *slot, int n, int k, int d,
             float *out) {
    rows_job j = {
        .run = combine_run, .x = ys, .w = weights, .slot = slot, .out = out, .k = k, .d = d};
    on_rows(&j, n, (size_t)k * d);
}

/* out (n, d) = a + b, row by row (out may be a: the residual's x += y). */
static void add_run(const rows_job *j, int r0, int r1) {
    const size_t d = (size_t)j->d;
    const float *a = j->x, *b = j->w;
    float *out = j->out;
    for (size_t i = (size_t)r0 * d; i < (size_t)r1 * d; i++) out[i] = a[i] + b[i];
}

void add_rows(const float *a, const float *b, int n, int d, float *out) {
    rows_job j = {.run = add_run, .x = a, .w = b, .out = out, .d = d};
    on_rows(&j, n, (size_t)d);
}

/* A row's d values as float16 bits (half_bits); on x86 eight at a time by F16C's vcvtps2ph,
 * rounding to nearest even (the same bits: f16_bits' definition), a group holding a NaN by
 * half_bits (numpy's payload, where the instruction would set the quiet bit). */
static void half_row_portable(const float *x, size_t d, uint16_t *o) {
    for (size_t i = 0; i < d; i++) o[i] = half_bits(x[i]);
}

#if defined(FOUNDRY_X86)
AVX2 static void half_row_avx2(const float *x, size_t d, uint16_t *o) {
    size_t i = 0;
    for (; i + 8 <= d; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        if (_mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)))
            half_row_portable(x + i, 8, o + i);
        else
            _mm_storeu_si128((__m128i *)(o + i),
                             _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
    half_row_portable(x + i, d - i, o + i);
}
#endif

/* Rows of d float32 values, ld apart (a column block of a product), into n consecutive rows of
 * a cache: float16 where half (half_bits: numpy's astype), else copied. */
static void store_run(const rows_job *j, int r0, int r1) {
    const size_t d = (size_t)j->d;
    void (*half_row)(const float *, size_t, uint16_t *) = half_row_portable;
#if defined(FOUNDRY_X86)
    if (use_avx2) half_row = half_row_avx2;
#endif
    for (int r = r0; r < r1; r++) {
        const float *x = j->x + (size_t)r * j->ld;
        if (j->half)
            half_row(x, d, (uint16_t *)j->out + (size_t)r * d);
        else
            memcpy(j->out + (size_t)r * d, x, d * sizeof(float));
    }
}

void store_rows(const float *x, size_t ld, int n, int d, int half, void *out) {
    rows_job j = {.run = store_run, .x = x, .ld = ld, .out = out, .d = d, .half = half};
    on_rows(&j, n, (size_t)d);
}

/* out (m, d) = rows idx[0 .. m - 1] of x (the inputs of an expert's assignments, grouped). */
static void take_run(const rows_job *j, int r0, int r1) {
    const size_t d = (size_t)j->d;
    for (int r = r0; r < r1; r++) memcpy(j->out + (size_t)r * d, j->x + j->slot[r] * d, d * 4);
}

void take_rows(const float *x, const int64_t *idx, int m, int d, float *out) {
    rows_job j = {.run = take_run, .x = x, .slot = idx, .out = out, .d = d};
    on_rows(&j, m, (size_t)d);
}
