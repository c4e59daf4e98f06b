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

void add_scaled_portable(float *o, float c, const float *v, int dh) {
    for (int i = 0; i < dh; i++) o[i] = o[i] + c * v[i];
}

/* n float16 values as float32 (exact). */
void f16_row_portable(const uint16_t *h, int n, float *out) {
    for (int i = 0; i < n; i++) out[i] = f16_table[h[i]];
}

#if defined(FOUNDRY_X86)
AVX2 void f16_row_avx2(const uint16_t *h, int n, float *out) {
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

AVX2 void add_scaled_avx2(float *o, float c, const float *v, int dh) {
    const __m256 cv = _mm256_set1_ps(c);
    for (int i = 0; i < dh; i += 8)
        _mm256_storeu_ps(o + i, _mm256_add_ps(_mm256_loadu_ps(o + i),
                                              _mm256_mul_ps(cv, _mm256_loadu_ps(v + i))));
}
#endif

#if defined(FOUNDRY_X86)
/* attend's operations, the same on every value, arranged for AVX2's latencies (dh a multiple of
 * 8): scores of up to four heads of one kv head at two positions at once (eight independent
 * 8-lane sums, each score's additions in its own order, finish8 after), float16 rows converted
 * in registers (exactly, as f16_row), the maximum in vector registers (maxps keeps its second
 * operand when the first is NaN: fmaxf's choice, and a maximum is exact in any order), and each
 * output value summed over the positions in order in registers, four heads by 16 values. */

#define AVX512A __attribute__((target("avx2,f16c,avx512f,avx512vl")))

/* Eight values of each of two position rows (at0, at1) from i: one register, at0's low. */
AVX512A INLINE __m512 rows8x2(const void *base, int half, size_t at0, size_t at1, int i) {
    if (half) {
        const uint16_t *h = (const uint16_t *)base;
        return _mm512_cvtph_ps(_mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(h + at0 + i))),
            _mm_loadu_si128((const __m128i *)(h + at1 + i)), 1));
    }
    const float *f = (const float *)base;
    return _mm512_castpd_ps(
        _mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(_mm256_loadu_ps(f + at0 + i))),
                           _mm256_castps_pd(_mm256_loadu_ps(f + at1 + i)), 1));
}

/* scores_avx2 on AVX-512: eight positions of up to four heads, two positions a register (each
 * position's eight lanes in a half, the same additions), finish8 of each half after. */
AVX512A INLINE void scores_512_t(const float *qh, const void *k, int half, size_t stride,
                                 size_t off, int s, int dh, int nh, float scale, float *ph,
                                 int n_pos) {
    __m512 acc[4][4];
    for (int h = 0; h < 4; h++)
        for (int b = 0; b < 4; b++) acc[h][b] = _mm512_setzero_ps();
    for (int i = 0; i < dh; i += 8) {
        __m512 kz[4];
        for (int b = 0; b < 4; b++)
            kz[b] = rows8x2(k, half, (size_t)(s + 2 * b) * stride + off,
                            (size_t)(s + 2 * b + 1) * stride + off, i);
        for (int h = 0; h < nh; h++) {
            const __m512 qz = _mm512_castpd_ps(
                _mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(qh + (size_t)h * dh + i))));
            for (int b = 0; b < 4; b++)
                acc[h][b] = _mm512_add_ps(acc[h][b], _mm512_mul_ps(qz, kz[b]));
        }
    }
    for (int h = 0; h < nh; h++)
        for (int b = 0; b < 4; b++) {
            const __m256 lo = _mm512_castps512_ps256(acc[h][b]),
                         hi = _mm256_castpd_ps(
                             _mm512_extractf64x4_pd(_mm512_castps_pd(acc[h][b]), 1));
            ph[(size_t)h * n_pos + s + 2 * b] = finish8_avx2(lo) * scale;
            ph[(size_t)h * n_pos + s + 2 * b + 1] = finish8_avx2(hi) * scale;
        }
}

/* The positions scores_512_t takes (eight at a time); returns where the rest start. */
AVX512A static int scores_heads_512(const float *qh, const void *k, int half, size_t stride,
                                    size_t off, int n_pos, int dh, int nh, float scale, float *ph) {
    int s = 0;
    for (; s + 8 <= n_pos; s += 8) {
        switch (nh) {
        case 4: scores_512_t(qh, k, half, stride, off, s, dh, 4, scale, ph, n_pos); break;
        case 3: scores_512_t(qh, k, half, stride, off, s, dh, 3, scale, ph, n_pos); break;
        case 2: scores_512_t(qh, k, half, stride, off, s, dh, 2, scale, ph, n_pos); break;
        default: scores_512_t(qh, k, half, stride, off, s, dh, 1, scale, ph, n_pos); break;
        }
    }
    return s;
}

/* Eight values of position row `at` (float32, or float16 converted) from i. */
AVX2 INLINE __m256 row8(const void *base, int half, size_t at, int i) {
    if (half)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + at + i)));
    return _mm256_loadu_ps((const float *)base + at + i);
}

/* p[h][s], p[h][s + 1] (NP positions) of NH heads from q rows qh (NH x dh) */
AVX2 INLINE void scores_avx2(const float *qh, const void *k, int half, size_t at0, size_t at1,
                             int dh, int nh, int np, float scale, float *ph, int n_pos, int s) {
    __m256 acc[4][2];
    for (int h = 0; h < 4; h++) acc[h][0] = acc[h][1] = _mm256_setzero_ps();
    for (int i = 0; i < dh; i += 8) {
        const __m256 k0 = row8(k, half, at0, i), k1 = np > 1 ? row8(k, half, at1, i) : k0;
        for (int h = 0; h < nh; h++) {
            const __m256 qv = _mm256_loadu_ps(qh + (size_t)h * dh + i);
            acc[h][0] = _mm256_add_ps(acc[h][0], _mm256_mul_ps(qv, k0));
            if (np > 1) acc[h][1] = _mm256_add_ps(acc[h][1], _mm256_mul_ps(qv, k1));
        }
    }
    for (int h = 0; h < nh; h++)
        for (int b = 0; b < np; b++)
            ph[(size_t)h * n_pos + s + b] = finish8_avx2(acc[h][b]) * scale;
}

AVX2 static void scores_heads(const float *qh, const void *k, int half, size_t stride, size_t off,
                              int from, int n_pos, int dh, int nh, float scale, float *ph) {
    int s = from;
    for (; s + 2 <= n_pos; s += 2) {
        const size_t at0 = (size_t)s * stride + off, at1 = at0 + stride;
        switch (nh) { /* constant head counts: the accumulators stay in registers */
        case 4: scores_avx2(qh, k, half, at0, at1, dh, 4, 2, scale, ph, n_pos, s); break;
        case 3: scores_avx2(qh, k, half, at0, at1, dh, 3, 2, scale, ph, n_pos, s); break;
        case 2: scores_avx2(qh, k, half, at0, at1, dh, 2, 2, scale, ph, n_pos, s); break;
        default: scores_avx2(qh, k, half, at0, at1, dh, 1, 2, scale, ph, n_pos, s); break;
        }
    }
    for (; s < n_pos; s++) {
        const size_t at0 = (size_t)s * stride + off;
        for (int h = 0; h < nh; h++)
            scores_avx2(qh + (size_t)h * dh, k, half, at0, at0, dh, 1, 1, scale,
                        ph + (size_t)h * n_pos, n_pos, s);
    }
}

/* o[h][i .. i + 16) = sum over s in order of p[h][s] v[s][i ..] for NH heads */
AVX2 INLINE void values_avx2(const float *ph, const void *v, int half, size_t stride, size_t off,
                             int n_pos, int dh, int nh, float *o) {
    for (int i = 0; i < dh; i += 16) {
        const int two = i + 16 <= dh;
        __m256 acc[4][2];
        for (int h = 0; h < 4; h++) acc[h][0] = acc[h][1] = _mm256_setzero_ps();
        for (int s = 0; s < n_pos; s++) {
            const size_t at = (size_t)s * stride + off;
            const __m256 v0 = row8(v, half, at, i), v1 = two ? row8(v, half, at, i + 8) : v0;
            for (int h = 0; h < nh; h++) {
                const __m256 c = _mm256_set1_ps(ph[(size_t)h * n_pos + s]);
                acc[h][0] = _mm256_add_ps(acc[h][0], _mm256_mul_ps(c, v0));
                if (two) acc[h][1] = _mm256_add_ps(acc[h][1], _mm256_mul_ps(c, v1));
            }
        }
        for (int h = 0; h < nh; h++) {
            _mm256_storeu_ps(o + (size_t)h * dh + i, acc[h][0]);
            if (two) _mm256_storeu_ps(o + (size_t)h * dh + i + 8, acc[h][1]);
        }
    }
}

AVX2 static void values_heads(const float *ph, const void *v, int half, size_t stride, size_t off,
                              int n_pos, int dh, int nh, float *o) {
    switch (nh) {
    case 4: values_avx2(ph, v, half, stride, off, n_pos, dh, 4, o); break;
    case 3: values_avx2(ph, v, half, stride, off, n_pos, dh, 3, o); break;
    case 2: values_avx2(ph, v, half, stride, off, n_pos, dh, 2, o); break;
    default: values_avx2(ph, v, half, stride, off, n_pos, dh, 1, o); break;
    }
}

/* values_avx2 on AVX-512 (32 registers): 64 values of four heads at once, so each position's
 * probabilities are broadcast once per 64 values and its row read in whole cache lines; the
 * same multiplications and additions on every value. */

AVX512A INLINE __m512 row16(const void *base, int half, size_t at, int i) {
    if (half)
        return _mm512_cvtph_ps(
            _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + at + i)));
    return _mm512_loadu_ps((const float *)base + at + i);
}

AVX512A INLINE void values_512(const float *ph, const void *v, int half, size_t stride, size_t off,
                               int n_pos, int dh, int nh, float *o) {
    for (int i = 0; i < dh; i += 64) {
        __m512 acc[4][4];
        for (int h = 0; h < 4; h++)
            for (int c = 0; c < 4; c++) acc[h][c] = _mm512_setzero_ps();
        for (int s = 0; s < n_pos; s++) {
            const size_t at = (size_t)s * stride + off;
            __m512 vs[4];
            for (int c = 0; c < 4; c++) vs[c] = row16(v, half, at, i + 16 * c);
            for (int h = 0; h < nh; h++) {
                const __m512 cv = _mm512_set1_ps(ph[(size_t)h * n_pos + s]);
                for (int c = 0; c < 4; c++)
                    acc[h][c] = _mm512_add_ps(acc[h][c], _mm512_mul_ps(cv, vs[c]));
            }
        }
        for (int h = 0; h < nh; h++)
            for (int c = 0; c < 4; c++)
                _mm512_storeu_ps(o + (size_t)h * dh + i + 16 * c, acc[h][c]);
    }
}

AVX512A static void values_heads_512(const float *ph, const void *v, int half, size_t stride,
                                     size_t off, int n_pos, int dh, int nh, float *o) {
    switch (nh) {
    case 4: values_512(ph, v, half, stride, off, n_pos, dh, 4, o); break;
    case 3: values_512(ph, v, half, stride, off, n_pos, dh, 3, o); break;
    case 2: values_512(ph, v, half, stride, off, n_pos, dh, 2, o); break;
    default: values_512(ph, v, half, stride, off, n_pos, dh, 1, o); break;
    }
}

AVX2 static float max_avx2(const float *p, int n) {
    __m256 m8 = _mm256_set1_ps(-INFINITY);
    int s = 0;
    for (; s + 8 <= n; s += 8) m8 = _mm256_max_ps(_mm256_loadu_ps(p + s), m8);
    float lanes[8], m = -INFINITY;
    _mm256_storeu_ps(lanes, m8);
    for (int j = 0; j < 8; j++) m = lanes[j] > m ? lanes[j] : m;
    for (; s < n; s++) m = p[s] > m ? p[s] : m; /* NaN is not greater: kept out, as fmaxf */
    return m;
}

AVX2 static void attend_avx2(const float *q, const void *k, const void *v, int half, int n_pos,
                             int n_head, int n_kv, int dh, size_t stride, float *p, float *out) {
    const float scale = (float)(1.0 / sqrt((double)dh));
    const int group = n_head / n_kv;
    for (int g = 0; g < n_kv; g++)
        for (int h = g * group; h < (g + 1) * group; h += 4) {
            const int nh = (g + 1) * group - h < 4 ? (g + 1) * group - h : 4;
            const int from =
                use_512 ? scores_heads_512(q + (size_t)h * dh, k, half, stride, (size_t)g * dh,
                                           n_pos, dh, nh, scale, p + (size_t)h * n_pos)
                        : 0;
            scores_heads(q + (size_t)h * dh, k, half, stride, (size_t)g * dh, from, n_pos, dh, nh,
                         scale, p + (size_t)h * n_pos);
        }
    for (int h = 0; h < n_head; h++) {
        float *ph = p + (size_t)h * n_pos;
        const float m = max_avx2(ph, n_pos);
        exp_shifted_avx2(ph, n_pos, m);
        float sum = 0.0f;
        for (int s = 0; s < n_pos; s++) sum = sum + ph[s];
        for (int s = 0; s < n_pos; s++) ph[s] = ph[s] / sum;
    }
    for (int g = 0; g < n_kv; g++)
        for (int h = g * group; h < (g + 1) * group; h += 4) {
            const int nh = (g + 1) * group - h < 4 ? (g + 1) * group - h : 4;
            if (use_512 && dh % 64 == 0)
                values_heads_512(p + (size_t)h * n_pos, v, half, stride, (size_t)g * dh, n_pos, dh,
                                 nh, out + (size_t)h * dh);
            else
                values_heads(p + (size_t)h * n_pos, v, half, stride, (size_t)g * dh, n_pos, dh, nh,
                             out + (size_t)h * dh);
        }
}
#endif

void attend_strided(const float *q, const void *k, const void *v, int half, int n_pos, int n_head,
                    int n_kv, int dh, size_t stride, float *p, float *out) {
#if defined(FOUNDRY_X86)
    if (use_avx2 && dh % 8 == 0) {
        attend_avx2(q, k, v, half, n_pos, n_head, n_kv, dh, stride, p, out);
        return;
    }
#endif
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
    const int width = n_kv * dh;             /* the values of one position of these kv heads */
    float *row = p + (size_t)n_head * n_pos; /* a float16 position as float32 */
    /* Position by position through the cache (each K and V row read once, in order), every
     * head's own operations in the same order as one head alone: p[h][s], then softmax per
     * head, then o[h] += p[h][s] / sum[h] v[s] for s in order. */
    for (int s = 0; s < n_pos; s++) {
        const float *ks = row;
        if (half)
            f16_row((const uint16_t *)k + s * stride, width, row);
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
            f16_row((const uint16_t *)v + s * stride, width, row);
        else
            vs = (const float *)v + s * stride;
        for (int h = 0; h < n_head; h++)
            add_scaled(out + (size_t)h * dh, p[(size_t)h * n_pos + s],
                       vs + (size_t)(h / group) * dh, dh);
    }
}

void attend(const float *q, const void *k, const void *v, int half, int n_pos, int n_head, int n_kv,
            int dh, float *p, float *out) {
    attend_strided(q, k, v, half, n_pos, n_head, n_kv, dh, (size_t)n_kv * dh, p, out);
}
