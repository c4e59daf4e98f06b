/* One query row's attention against a KV cache. */

#include "kernels.h"

EXP_LOOPS(_portable, )
#if defined(FOUNDRY_X86)
EXP_LOOPS(_avx2, AVX2)
#endif

/* ---- one query row's attention against a KV cache ------------------------------------------ */

/* out[h] = softmax(q[h] . k[s][g] * scale over s < n_pos) . v[s][g], g = h / (n_head / n_kv):
 * the decode step of causal grouped-query attention (layers.attention_forward's operations for
 * one row at the end of its cache, in one fixed order: each score a dot product in 8 lanes
 * halved at the end, then times the scale; the maximum taken off before exp_f; each probability
 * divided by their sum; each output value summed over the positions in order). The cache holds
 * float32 values, or float16 ones (``half``: llama.cpp's default cache type) converted exactly
 * to float32 a position at a time, so the float operations are the same either way. ``p`` is
 * room for n_head x n_pos + n_kv x dh floats (the last for a converted position). */
/* attend's two inner loops: a score (q . k in 8 lanes, halved) and o += c v. */
float score_portable(const float *q, const float *k, int dh) {
    float acc[8] = {0};
    int i = 0;
    for (; i + 8 <= dh; i += 8)
        for (int j = 0; j < 8; j++) acc[j] = acc[j] + q[i + j] * k[i + j];
    for (; i < dh; i++) acc[i % 8] = acc[i % 8] + q[i] * k[i];
    return finish(acc, 8);
}

static void add_scaled_portable(float *o, float c, const float *v, int dh) {
    for (int i = 0; i < dh; i++) o[i] = o[i] + c * v[i];
}

/* n float16 values as float32 (exact). */
static void f16_row_portable(const uint16_t *h, int n, float *out) {
    for (int i = 0; i < n; i++) out[i] = f16_table[h[i]];
}

#if defined(FOUNDRY_X86)
AVX2 static void f16_row_avx2(const uint16_t *h, int n, float *out) {
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
    for (; i < n; i++) out[i] = f16_table[h[i]];
}

/* the same operations eight lanes at a time (dh a multiple of 8) */
AVX2 float score_avx2(const float *q, const float *k, int dh) {
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < dh; i += 8)
        acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(k + i)));
    return finish8_avx2(acc);
}

AVX2 static void add_scaled_avx2(float *o, float c, const float *v, int dh) {
    const __m256 cv = _mm256_set1_ps(c);
    for (int i = 0; i < dh; i += 8)
        _mm256_storeu_ps(o + i, _mm256_add_ps(_mm256_loadu_ps(o + i),
                                              _mm256_mul_ps(cv, _mm256_loadu_ps(v + i))));
}
#endif

void attend(const float *q, const void *k, const void *v, int half, int n_pos, int n_head,
            int n_kv, int dh, float *p, float *out) {
    float (*score)(const float *, const float *, int) = score_portable;
    void (*add_scaled)(float *, float, const float *, int) = add_scaled_portable;
    void (*exp_shifted)(float *, int, float) = exp_shifted_portable;
    void (*f16_row)(const uint16_t *, int, float *) = f16_row_portable;
#if defined(FOUNDRY_X86)
    if (use_avx2 && dh % 8 == 0) {
        score = score_avx2;
        add_scaled = add_scaled_avx2;
    }
    if (use_avx2) {
        exp_shifted = exp_shifted_avx2;
        f16_row = f16_row_avx2;
    }
#endif
    const float scale = (float)(1.0 / sqrt((double)dh));
    const int group = n_head / n_kv;
    const size_t stride = (size_t)n_kv * dh; /* values from one position to the next */
    float *row = p + (size_t)n_head * n_pos; /* a float16 position as float32 */
    /* Position by position through the cache (each K and V row read once, in order), every
     * head's own operations in the same order as one head alone: p[h][s], then softmax per
     * head, then o[h] += p[h][s] / sum[h] v[s] for s in order. */
    for (int s = 0; s < n_pos; s++) {
        const float *ks = row;
        if (half)
            f16_row((const uint16_t *)k + s * stride, (int)stride, row);
        else
            ks = (const float *)k + s * stride;
        for (int h = 0; h < n_head; h++)
            p[(size_t)h * n_pos + s] =
                score(q + (size_t)h * dh, ks + (size_t)(h / group) * dh, dh) * scale;
    }
    for (int h = 0; h < n_head; h++) {
        float *ph = p + (size_t)h * n_pos;
        float m = -INFINITY;
        for (int s = 0; s < n_pos; s++) m = fmaxf(m, ph[s]);
        exp_shifted(ph, n_pos, m);
        float sum = 0.0f;
        for (int s = 0; s < n_pos; s++) sum = sum + ph[s];
        for (int s = 0; s < n_pos; s++) ph[s] = ph[s] / sum;
    }
    for (size_t i = 0; i < (size_t)n_head * dh; i++) out[i] = 0.0f;
    for (int s = 0; s < n_pos; s++) {
        const float *vs = row;
        if (half)
            f16_row((const uint16_t *)v + s * stride, (int)stride, row);
        else
            vs = (const float *)v + s * stride;
        for (int h = 0; h < n_head; h++)
            add_scaled(out + (size_t)h * dh, p[(size_t)h * n_pos + s],
                       vs + (size_t)(h / group) * dh, dh);
    }
}
