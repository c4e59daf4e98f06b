/* The K-quants: Q4_K, Q5_K, Q6_K on super-blocks of 256 (theory in kernels.h). */

#include "kernels.h"

/* ---- the K-quants' integer dot product: exact per super-block ---------------------------- */

/* The inputs of a K-quant product: int8 values in blocks of 256 (one scale each, as ggml's
 * Q8_K), and their exact sums over each 4 (``s4``) and each 32 (``s32``) values. */
static void quantize_input_k(const float *x, int k, int8_t *q, float *d, int32_t *s4, int32_t *s32) {
    quantize_input(x, k, QK_K, q, d);
    for (int g = 0; g < k / 4; g++) s4[g] = q[4 * g] + q[4 * g + 1] + q[4 * g + 2] + q[4 * g + 3];
    for (int c = 0; c < k / QK; c++) {
        int32_t t = 0;
        for (int g = 0; g < 8; g++) t += s4[8 * c + g];
        s32[c] = t;
    }
}

/* A super-block's scales as integers: sc[16] (for chunk c of 32 values, lanes 0-3 take
 * sc[2c] and lanes 4-7 sc[2c + 1]: the two sub-blocks of 16 of Q6_K, the same scale twice for
 * Q4_K and Q5_K) and m[8] (the minimum of each chunk; 0 for Q6_K). The float16 d is at byte
 * KQ_D of the block, dmin (Q4_K, Q5_K) at byte 2. */
#define KQ_D(type) ((type) == T_Q6_K ? 208 : 0)
static inline void kq_scales(int type, const uint8_t *blk, int32_t *sc, int32_t *m) {
    if (type == T_Q6_K) {
        for (int i = 0; i < 16; i++) sc[i] = ((const int8_t *)(blk + 192))[i];
        for (int c = 0; c < 8; c++) m[c] = 0;
        return;
    }
    for (int c = 0; c < 8; c++) {
        uint8_t a, b;
        get_scale_min_k4(c, blk + 4, &a, &b);
        sc[2 * c] = sc[2 * c + 1] = a;
        m[c] = b;
    }
}

/* Chunk c (values 32c .. 32c + 31) of a super-block as int8: Q4_K 0..15, Q5_K 0..31, Q6_K
 * -32..31 (its stored 0..63 less 32). */
static void kq_chunk(int type, const uint8_t *blk, int c, int8_t *q) {
    const int j = c / 2, odd = c & 1;
    if (type == T_Q6_K) {
        const int n = c / 4, cc = c % 4;
        const uint8_t *ql = blk + 64 * n + (cc & 1 ? 32 : 0), *qh = blk + 128 + 32 * n;
        for (int l = 0; l < 32; l++) {
            const int lo = cc < 2 ? ql[l] & 0xF : ql[l] >> 4;
            q[l] = (int8_t)((lo | (((qh[l] >> (2 * cc)) & 3) << 4)) - 32);
        }
        return;
    }
    const int five = type == T_Q5_K;
    const uint8_t *qs = blk + (five ? 48 : 16) + 32 * j, *qh = blk + 16;
    for (int l = 0; l < 32; l++) {
        const int lo = odd ? qs[l] >> 4 : qs[l] & 0xF;
        q[l] = (int8_t)(lo | (five ? ((qh[l] >> c) & 1) << 4 : 0));
    }
}

/* A super-block b adds (d * xd_b) * L[l] into accumulator 8 (b mod 2) + l of sixteen, L[l] the
 * exact sum over its chunks of sc * (lane l of the chunk's int8 products); the minimums add
 * (dmin * xd_b) * M into one more float, M = sum over chunks of m_c * (the chunk's input sum),
 * which comes off at the end: finish(acc) - acc_min. */
static float dot_k_portable(int type, const uint8_t *w, int bsize, const int8_t *xq,
                            const float *xd, const int32_t *s32, int nsb) {
    float acc[LANES_Q] = {0}, acc_min = 0.0f;
    int8_t q[QK];
    int32_t sc[16], m[8], s[8];
    for (int b = 0; b < nsb; b++) {
        const uint8_t *blk = w + (size_t)b * bsize;
        const float d = f16(blk + KQ_D(type)), dmin = type == T_Q6_K ? 0.0f : f16(blk + 2);
        kq_scales(type, blk, sc, m);
        int32_t L[8] = {0}, M = 0;
        for (int c = 0; c < 8; c++) {
            kq_chunk(type, blk, c, q);
            idot_lanes(q, xq + b * QK_K + c * QK, s);
            for (int l = 0; l < 8; l++) L[l] += sc[2 * c + l / 4] * s[l];
            M += m[c] * s32[b * 8 + c];
        }
        float *a = acc + 8 * (b & 1);
        const float f = d * xd[b];
        for (int l = 0; l < 8; l++) a[l] = a[l] + f * (float)L[l];
        acc_min = acc_min + (dmin * xd[b]) * (float)M;
    }
    return finish(acc, LANES_Q) - acc_min;
}

#if defined(FOUNDRY_X86)
#define KQ_AHEAD 4 /* super-blocks prefetched ahead */

/* The K-quants on x86: a chunk's 32 unsigned values (Q6_K: 0..63, with 32 x the input's sums
 * of 4 taken off again) against the input's int8 values, the same exact lanes, times the
 * chunk's scales, summed in int32; then dot_k_portable's float operations. */
AVX2 INLINE __m256i kq_chunk_avx2(int type, const uint8_t *blk, int c) {
    const __m256i m4 = _mm256_set1_epi8(0xF);
    if (type == T_Q6_K) {
        const int n = c / 4, cc = c % 4;
        const __m256i ql = _mm256_loadu_si256((const __m256i *)(blk + 64 * n + (cc & 1 ? 32 : 0)));
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * n));
        const __m256i lo = cc < 2 ? _mm256_and_si256(ql, m4)
                                  : _mm256_and_si256(_mm256_srli_epi16(ql, 4), m4);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * cc), _mm256_set1_epi8(3));
        return _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
    }
    const int five = type == T_Q5_K;
    const __m256i qs = _mm256_loadu_si256((const __m256i *)(blk + (five ? 48 : 16) + 32 * (c / 2)));
    __m256i v = c & 1 ? _mm256_and_si256(_mm256_srli_epi16(qs, 4), m4) : _mm256_and_si256(qs, m4);
    if (five) {
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 16));
        const __m256i bit = _mm256_and_si256(_mm256_srli_epi16(qh, c), _mm256_set1_epi8(1));
        v = _mm256_or_si256(v, _mm256_slli_epi16(bit, 4));
    }
    return v;
}

#define DOT_K_X86(NAME, TARGET, LANES8U)                                                           \
    TARGET static float NAME(int type, const uint8_t *w, int bsize, const int8_t *xq,         \
                             const float *xd, const int32_t *s4, const int32_t *s32, int nsb) { \
        __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;                                       \
        float acc_min = 0.0f;                                                                  \
        int32_t sc[16], m[8];                                                                  \
        for (int b = 0; b < nsb; b++) {                                                        \
            const uint8_t *blk = w + (size_t)b * bsize;                                        \
            for (int o = 0; o < bsize; o += 64)                                                \
                _mm_prefetch((const char *)(blk + KQ_AHEAD * bsize + o), _MM_HINT_T0);          \
            const float d = f16c(blk + KQ_D(type));                                            \
            const float dmin = type == T_Q6_K ? 0.0f : f16c(blk + 2);                          \
            kq_scales(type, blk, sc, m);                                                       \
            __m256i L = _mm256_setzero_si256();                                                \
            int32_t M = 0;                                                                     \
            for (int c = 0; c < 8; c++) {                                                      \
                const __m256i u = kq_chunk_avx2(type, blk, c);                                 \
                const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + b * QK_K + c * QK)); \
                __m256i lanes = LANES8U(u, x);                                                 \
                if (type == T_Q6_K)                                                            \
                    lanes = _mm256_sub_epi32(lanes, _mm256_slli_epi32(_mm256_loadu_si256(      \
                        (const __m256i *)(s4 + (b * QK_K + c * QK) / 4)), 5));                 \
                const __m256i scv = _mm256_set_m128i(_mm_set1_epi32(sc[2 * c + 1]),            \
                                                     _mm_set1_epi32(sc[2 * c]));               \
                L = _mm256_add_epi32(L, _mm256_mullo_epi32(lanes, scv));                       \
                M += m[c] * s32[b * 8 + c];                                                    \
            }                                                                                  \
            const __m256 f = _mm256_set1_ps(d * xd[b]);                                        \
            const __m256 t = _mm256_mul_ps(f, _mm256_cvtepi32_ps(L));                          \
            if (b & 1)                                                                         \
                acc1 = _mm256_add_ps(acc1, t);                                                 \
            else                                                                               \
                acc0 = _mm256_add_ps(acc0, t);                                                 \
            acc_min = acc_min + (dmin * xd[b]) * (float)M;                                     \
        }                                                                                      \
        float lanes[LANES_Q];                                                                  \
        _mm256_storeu_ps(lanes, acc0);                                                         \
        _mm256_storeu_ps(lanes + 8, acc1);                                                     \
        return finish(lanes, LANES_Q) - acc_min;                                               \
    }

/* u unsigned (at most 63: maddubs cannot saturate), v signed */
AVX2 INLINE __m256i lanes8u_avx2(__m256i u, __m256i v) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, v), _mm256_set1_epi16(1));
}
VNNI INLINE __m256i lanes8u_vnni(__m256i u, __m256i v) {
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, v);
}
DOT_K_X86(dot_k_avx2, AVX2, lanes8u_avx2)
DOT_K_X86(dot_k_vnni, VNNI, lanes8u_vnni)
#endif

static float dot_k(int type, const uint8_t *w, int bsize, const int8_t *xq, const float *xd,
                   const int32_t *s4, const int32_t *s32, int nsb) {
#if defined(FOUNDRY_X86)
    if (use_vnni) return dot_k_vnni(type, w, bsize, xq, xd, s4, s32, nsb);
    if (use_avx2) return dot_k_avx2(type, w, bsize, xq, xd, s4, s32, nsb);
#endif
    (void)s4;
    return dot_k_portable(type, w, bsize, xq, xd, s32, nsb);
}

int matmul_k(int type, const uint8_t *w, size_t row_bytes, int n_out, int k, const float *x,
             int n, float *y) {
    const int bytes = type == T_Q4_K ? 144 : type == T_Q5_K ? 176 : 210;
    const int nsb = k / QK_K;
    int8_t *xq = malloc((size_t)n * k);
    float *xd = malloc((size_t)n * nsb * sizeof(float));
    int32_t *s4 = malloc((size_t)n * (k / 4) * sizeof(int32_t));
    int32_t *s32 = malloc((size_t)n * (k / QK) * sizeof(int32_t));
    if (xq == NULL || xd == NULL || s4 == NULL || s32 == NULL) {
        free(xq);
        free(xd);
        free(s4);
        free(s32);
        return -1;
    }
    for (int t = 0; t < n; t++)
        quantize_input_k(x + (size_t)t * k, k, xq + (size_t)t * k, xd + (size_t)t * nsb,
                         s4 + (size_t)t * (k / 4), s32 + (size_t)t * (k / QK));
    for (int r = 0; r < n_out; r++)
        for (int t = 0; t < n; t++)
            y[(size_t)t * n_out + r] = dot_k(type, w + r * row_bytes, bytes, xq + (size_t)t * k,
                                             xd + (size_t)t * nsb, s4 + (size_t)t * (k / 4),
                                             s32 + (size_t)t * (k / QK), nsb);
    free(xq);
    free(xd);
    free(s4);
    free(s32);
    return 0;
}
