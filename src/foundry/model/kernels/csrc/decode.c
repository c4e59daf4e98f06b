/* The rest of a decode step: RMSNorm, rotation, router, expert grouping. */

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

/* out (n, d) = x / sqrt(sum(x^2) / d + eps) * w: as layers.rmsnorm_forward, (x * rstd) * w. */
void rmsnorm(const float *x, const float *w, int n, int d, float eps, float *out) {
    float (*dot8)(const float *, const float *, int) = dot8_for(d);
    for (int r = 0; r < n; r++) {
        const float *xr = x + (size_t)r * d;
        float *o = out + (size_t)r * d;
        const float rstd = 1.0f / sqrtf(dot8(xr, xr, d) / (float)d + eps);
        for (int i = 0; i < d; i++) o[i] = (xr[i] * rstd) * w[i];
    }
}

/* Pairs of each of n rows of `heads` heads of dh values turned by the row's angles:
 * (x0 c - x1 s, x0 s + x1 c), as rope_forward. The pairs are adjacent, (2i, 2i + 1), or with
 * ``neox`` (i, i + dh/2), the same operations on each pair. */
void rope(const float *x, const float *cos, const float *sin, int n, int heads, int dh, int neox,
          float *out) {
    const int half = dh / 2;
    const int step = neox ? 1 : 2, other = neox ? half : 1;
    for (int r = 0; r < n; r++) {
        const float *c = cos + (size_t)r * half, *s = sin + (size_t)r * half;
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

/* out (n, f) = gelu(g) * u of each row [g | u] of gu (n, 2f), as ggml's geglu: gelu looked up
 * in ``table`` (gelu of every float16 value, by its bits) at the float16 nearest g; 0 for
 * g <= -10, g itself for g >= 10 (arch.geglu). */
void geglu(const float *gu, const float *table, int n, int f, float *out) {
    for (int r = 0; r < n; r++) {
        const float *g = gu + (size_t)r * 2 * f, *u = g + f;
        float *o = out + (size_t)r * f;
        for (int i = 0; i < f; i++) {
            const float x = g[i];
            const float act = x <= -10.0f ? 0.0f : (x >= 10.0f ? x : table[f16_bits(x)]);
            o[i] = act * u[i];
        }
    }
}

/* out (n, f) = silu(g) * u of each row [g | u] of gu (n, 2f) (silu_mul). */
void swiglu(const float *gu, int n, int f, float *out) {
    void (*silu_mul)(const float *, const float *, int, float *) = silu_mul_portable;
#if defined(FOUNDRY_X86)
    if (use_avx2) silu_mul = silu_mul_avx2;
#endif
    for (int r = 0; r < n; r++)
        silu_mul(gu + (size_t)r * 2 * f, gu + (size_t)r * 2 * f + f, f, out + (size_t)r * f);
}

/* Each row's router: logits z_e = x . w_e, probabilities softmax(z) (the maximum taken off
 * before exp_f, each divided by their sum), the k largest (ties to the lower id, as a stable
 * sort), and their weights renormalised to sum 1 (layers.router_forward). */
void route(const float *x, const float *w, int n, int d, int n_expert, int k, float *weights,
           int64_t *top) {
    float (*dot8)(const float *, const float *, int) = dot8_for(d);
    float p[MAX_EXPERTS];
    for (int r = 0; r < n; r++) {
        const float *xr = x + (size_t)r * d;
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
        int64_t *t = top + (size_t)r * k;
        float *wt = weights + (size_t)r * k, total = 0.0f;
        for (int j = 0; j < k; j++) {
            int best = -1;
            for (int e = 0; e < n_expert; e++) {
                int taken = 0;
                for (int i = 0; i < j; i++) taken |= t[i] == e;
                if (!taken && (best < 0 || p[e] > p[best])) best = e;
            }
            t[j] = best;
            wt[j] = p[best];
            total = total + p[best];
        }
        for (int j = 0; j < k; j++) wt[j] = wt[j] / total;
    }
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
void combine(const float *ys, const float *weights, const int64_t *slot, int n, int k, int d,
             float *out) {
    for (int r = 0; r < n; r++) {
        float *o = out + (size_t)r * d;
        for (int j = 0; j < k; j++) {
            const int64_t a = (int64_t)r * k + j, i = slot[a];
            const float c = weights[a];
            const float *y = i >= 0 ? ys + (size_t)i * d : NULL;
            for (int c_ = 0; c_ < d; c_++) {
                const float v = y ? y[c_] * c : 0.0f;
                o[c_] = j ? o[c_] + v : v;
            }
        }
    }
}
