/* Matrix-vector and small matrix-matrix products over GGUF weight blocks, read in place.
 *
 * Theory of operation (docs/quantization.md has the reasons and the figures):
 *
 * y[t, r] = sum_i W[r, i] x[t, i] for weights W (n_out rows of k values, stored as ggml blocks
 * along each row) and float32 inputs x (n rows of k). Every output is one row's dot product, so
 * a result does not depend on how many rows or inputs a call holds (batch invariance) nor on
 * which process computes it (the tensor-parallel pair equals one process bit for bit).
 *
 * Each dot product has ONE definition, written out in the portable C below; the AVX2 and NEON
 * paths compute exactly the same float operations in the same order, only several at a time, so
 * an x86-64 rank and an arm64 rank give the same bits:
 *
 * - Q8_0 and Q4_0 (the bandwidth-bound cases): x is quantized once per call to int8 blocks of
 *   32 with a float scale (d = max|x| / 127, q = round(x / d), as ggml's Q8_0). Per block the
 *   integer dot product is exact (any SIMD grouping gives the same int32); the block adds
 *   (d_w * d_x) * sum into lane (block mod 4) of four float accumulators, finished as
 *   (a0 + a2) + (a1 + a3).
 * - F16 and the other block types (Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K): the weight row is turned
 *   into float32 (exact for F16; ggml's dequantization for blocks), then multiplied with x in
 *   float32: element i adds w * x into lane (i mod 32) of 32 accumulators, finished by halving
 *   (lane j += lane j + 16, then + 8, + 4, + 2, + 1).
 *
 * Multiplications and additions are never fused (built with -ffp-contract=off; the SIMD paths
 * use separate multiply and add instructions) since a fused multiply-add rounds once instead of
 * twice and would make the paths differ.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>
#define FOUNDRY_X86 1
#endif
#if defined(__ARM_NEON)
#include <arm_neon.h>
#endif

/* ggml_type codes (gguf.GGMLQuantizationType). */
enum {
    T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8,
    T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14,
};

#define QK 32    /* values per block of the 32-blocks */
#define QK_K 256 /* values per super-block of the K-quants */
#define LANES_F 32
#define LANES_Q 4

/* ---- float16 ------------------------------------------------------------------------------ */

static float f16_table[65536];

static float f16_bits_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
    float f;
    if (exp == 0) {
        f = ldexpf((float)man, -24); /* zero or subnormal: exact */
        memcpy(&bits, &f, 4);
        bits |= sign;
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    }
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t rd16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

static inline float f16(const uint8_t *p) { return f16_table[rd16(p)]; }

/* ---- block layouts (bytes per block; values per block) ------------------------------------ */

static int type_block(int type, int *values, int *bytes) {
    switch (type) {
    case T_F32: *values = 1; *bytes = 4; return 1;
    case T_F16: *values = 1; *bytes = 2; return 1;
    case T_Q4_0: *values = QK; *bytes = 18; return 1;
    case T_Q4_1: *values = QK; *bytes = 20; return 1;
    case T_Q5_0: *values = QK; *bytes = 22; return 1;
    case T_Q5_1: *values = QK; *bytes = 24; return 1;
    case T_Q8_0: *values = QK; *bytes = 34; return 1;
    case T_Q4_K: *values = QK_K; *bytes = 144; return 1;
    case T_Q5_K: *values = QK_K; *bytes = 176; return 1;
    case T_Q6_K: *values = QK_K; *bytes = 210; return 1;
    default: return 0;
    }
}

/* ---- dequantization of one row (ggml's formulas) ------------------------------------------ */

static void get_scale_min_k4(int j, const uint8_t *q, uint8_t *d, uint8_t *m) {
    if (j < 4) {
        *d = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *d = (uint8_t)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
        *m = (uint8_t)((q[j + 4] >> 4) | ((q[j - 0] >> 6) << 4));
    }
}

static void dequant_row(int type, const uint8_t *w, int k, float *y) {
    int nb;
    switch (type) {
    case T_F32:
        memcpy(y, w, (size_t)k * 4);
        return;
    case T_F16:
        for (int i = 0; i < k; i++) y[i] = f16(w + 2 * i);
        return;
    case T_Q8_0:
        nb = k / QK;
        for (int b = 0; b < nb; b++, w += 34, y += QK) {
            const float d = f16(w);
            for (int i = 0; i < QK; i++) y[i] = d * (float)(int8_t)w[2 + i];
        }
        return;
    case T_Q4_0:
        nb = k / QK;
        for (int b = 0; b < nb; b++, w += 18, y += QK) {
            const float d = f16(w);
            for (int i = 0; i < QK / 2; i++) {
                y[i] = d * (float)((w[2 + i] & 0xF) - 8);
                y[i + QK / 2] = d * (float)((w[2 + i] >> 4) - 8);
            }
        }
        return;
    case T_Q4_1:
        nb = k / QK;
        for (int b = 0; b < nb; b++, w += 20, y += QK) {
            const float d = f16(w), m = f16(w + 2);
            for (int i = 0; i < QK / 2; i++) {
                y[i] = (float)(w[4 + i] & 0xF) * d + m;
                y[i + QK / 2] = (float)(w[4 + i] >> 4) * d + m;
            }
        }
        return;
    case T_Q5_0:
    case T_Q5_1: {
        const int has_min = type == T_Q5_1, size = has_min ? 24 : 22;
        nb = k / QK;
        for (int b = 0; b < nb; b++, w += size, y += QK) {
            const float d = f16(w), m = has_min ? f16(w + 2) : 0.0f;
            uint32_t qh;
            memcpy(&qh, w + (has_min ? 4 : 2), 4);
            const uint8_t *qs = w + (has_min ? 8 : 6);
            for (int i = 0; i < QK / 2; i++) {
                const int h0 = (int)(((qh >> i) << 4) & 0x10);
                const int h1 = (int)((qh >> (i + 12)) & 0x10);
                const int x0 = (qs[i] & 0xF) | h0, x1 = (qs[i] >> 4) | h1;
                if (has_min) {
                    y[i] = (float)x0 * d + m;
                    y[i + QK / 2] = (float)x1 * d + m;
                } else {
                    y[i] = (float)(x0 - 16) * d;
                    y[i + QK / 2] = (float)(x1 - 16) * d;
                }
            }
        }
        return;
    }
    case T_Q4_K:
    case T_Q5_K: {
        const int five = type == T_Q5_K, size = five ? 176 : 144;
        nb = k / QK_K;
        for (int b = 0; b < nb; b++, w += size) {
            const float d = f16(w), dmin = f16(w + 2);
            const uint8_t *scales = w + 4, *qh = w + 16, *ql = w + (five ? 48 : 16);
            uint8_t u1 = 1, u2 = 2;
            for (int j = 0, is = 0; j < QK_K; j += 64, is += 2, ql += 32) {
                uint8_t sc, m;
                get_scale_min_k4(is, scales, &sc, &m);
                const float d1 = d * sc, m1 = dmin * m;
                get_scale_min_k4(is + 1, scales, &sc, &m);
                const float d2 = d * sc, m2 = dmin * m;
                for (int l = 0; l < 32; l++) {
                    const int hi = five && (qh[l] & u1) ? 16 : 0;
                    *y++ = d1 * (float)((ql[l] & 0xF) + hi) - m1;
                }
                for (int l = 0; l < 32; l++) {
                    const int hi = five && (qh[l] & u2) ? 16 : 0;
                    *y++ = d2 * (float)((ql[l] >> 4) + hi) - m2;
                }
                u1 <<= 2;
                u2 <<= 2;
            }
        }
        return;
    }
    case T_Q6_K:
        nb = k / QK_K;
        for (int b = 0; b < nb; b++, w += 210) {
            const uint8_t *ql = w, *qh = w + 128;
            const int8_t *sc = (const int8_t *)(w + 192);
            const float d = f16(w + 208);
            for (int n = 0; n < QK_K; n += 128, y += 128, ql += 64, qh += 32, sc += 8) {
                for (int l = 0; l < 32; l++) {
                    const int is = l / 16;
                    const int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
                    const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
                    const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                    const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                    y[l] = d * (float)sc[is + 0] * (float)q1;
                    y[l + 32] = d * (float)sc[is + 2] * (float)q2;
                    y[l + 64] = d * (float)sc[is + 4] * (float)q3;
                    y[l + 96] = d * (float)sc[is + 6] * (float)q4;
                }
            }
        }
        return;
    }
}

/* ---- the float32 dot product: 32 lanes, halved at the end --------------------------------- */

static float finish_f(float *acc) {
    for (int width = LANES_F / 2; width >= 1; width /= 2)
        for (int j = 0; j < width; j++) acc[j] = acc[j] + acc[j + width];
    return acc[0];
}

static float dot_f32_portable(const float *w, const float *x, int k) {
    float acc[LANES_F] = {0};
    int i = 0;
    for (; i + LANES_F <= k; i += LANES_F)
        for (int j = 0; j < LANES_F; j++) acc[j] = acc[j] + w[i + j] * x[i + j];
    for (; i < k; i++) acc[i % LANES_F] = acc[i % LANES_F] + w[i] * x[i];
    return finish_f(acc);
}

/* ---- the int8 block dot product: exact per block, 4 float lanes across blocks -------------- */

/* Inputs as int8 blocks of 32: q (k values), d (k / 32 scales). */
static void quantize_input(const float *x, int k, int8_t *q, float *d) {
    for (int b = 0; b < k / QK; b++) {
        float amax = 0.0f;
        for (int i = 0; i < QK; i++) amax = fmaxf(amax, fabsf(x[b * QK + i]));
        const float db = amax / 127.0f, id = db != 0.0f ? 1.0f / db : 0.0f;
        d[b] = db;
        for (int i = 0; i < QK; i++) q[b * QK + i] = (int8_t)roundf(x[b * QK + i] * id);
    }
}

static inline int32_t idot32(const int8_t *a, const int8_t *b) {
#if defined(__ARM_NEON)
    const int8x16_t a0 = vld1q_s8(a), a1 = vld1q_s8(a + 16);
    const int8x16_t b0 = vld1q_s8(b), b1 = vld1q_s8(b + 16);
#if defined(__ARM_FEATURE_DOTPROD)
    const int32x4_t s = vdotq_s32(vdotq_s32(vdupq_n_s32(0), a0, b0), a1, b1);
#else
    int16x8_t p0 = vmull_s8(vget_low_s8(a0), vget_low_s8(b0));
    p0 = vmlal_s8(p0, vget_high_s8(a0), vget_high_s8(b0)); /* |pair| <= 2 * 128 * 127 */
    int16x8_t p1 = vmull_s8(vget_low_s8(a1), vget_low_s8(b1));
    p1 = vmlal_s8(p1, vget_high_s8(a1), vget_high_s8(b1));
    const int32x4_t s = vaddq_s32(vpaddlq_s16(p0), vpaddlq_s16(p1));
#endif
#if defined(__aarch64__)
    return vaddvq_s32(s);
#else
    int32x2_t t = vadd_s32(vget_low_s32(s), vget_high_s32(s));
    t = vpadd_s32(t, t);
    return vget_lane_s32(t, 0);
#endif
#else
    int32_t s = 0;
    for (int i = 0; i < QK; i++) s += (int32_t)a[i] * (int32_t)b[i];
    return s;
#endif
}

/* One block of weights as 32 int8 values and its float scale. */
static inline float unpack_block(int type, const uint8_t *blk, int8_t *q) {
    if (type == T_Q8_0) {
        memcpy(q, blk + 2, QK);
    } else { /* Q4_0 */
        for (int i = 0; i < QK / 2; i++) {
            q[i] = (int8_t)((blk[2 + i] & 0xF) - 8);
            q[i + QK / 2] = (int8_t)((blk[2 + i] >> 4) - 8);
        }
    }
    return f16(blk);
}

static float finish_q(const float *acc) { return (acc[0] + acc[2]) + (acc[1] + acc[3]); }

static float dot_q_portable(int type, const uint8_t *w, int bsize, const int8_t *xq,
                            const float *xd, int nb) {
    float acc[LANES_Q] = {0};
    int8_t q[QK];
    for (int b = 0; b < nb; b++) {
        const float dw = unpack_block(type, w + (size_t)b * bsize, q);
        const float s = (float)idot32(q, xq + b * QK);
        acc[b % LANES_Q] = acc[b % LANES_Q] + (dw * xd[b]) * s;
    }
    return finish_q(acc);
}

/* ---- AVX2 (x86-64 with AVX2 and F16C; chosen at import) ----------------------------------- */

#if defined(FOUNDRY_X86)
#define AVX2 __attribute__((target("avx2,f16c")))

AVX2 static inline __m256i load_block_avx2(int type, const uint8_t *blk) {
    if (type == T_Q8_0) return _mm256_loadu_si256((const __m256i *)(blk + 2));
    const __m128i raw = _mm_loadu_si128((const __m128i *)(blk + 2));
    const __m128i m4 = _mm_set1_epi8(0xF);
    const __m128i lo = _mm_and_si128(raw, m4);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), m4);
    return _mm256_sub_epi8(_mm256_set_m128i(hi, lo), _mm256_set1_epi8(8));
}

/* Eight int32 partial sums of one block's products (exact). */
AVX2 static inline __m256i idot_avx2(__m256i wq, const int8_t *xq) {
    const __m256i xv = _mm256_loadu_si256((const __m256i *)xq);
    const __m256i p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(wq, wq), _mm256_sign_epi8(xv, wq));
    return _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
}

AVX2 static float dot_q_avx2(int type, const uint8_t *w, int bsize, const int8_t *xq,
                             const float *xd, int nb) {
    __m128 acc = _mm_setzero_ps();
    int b = 0;
    for (; b + LANES_Q <= nb; b += LANES_Q) {
        const uint8_t *p = w + (size_t)b * bsize;
        const __m256i s0 = idot_avx2(load_block_avx2(type, p), xq + b * QK);
        const __m256i s1 = idot_avx2(load_block_avx2(type, p + bsize), xq + (b + 1) * QK);
        const __m256i s2 = idot_avx2(load_block_avx2(type, p + 2 * bsize), xq + (b + 2) * QK);
        const __m256i s3 = idot_avx2(load_block_avx2(type, p + 3 * bsize), xq + (b + 3) * QK);
        const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(s0, s1), _mm256_hadd_epi32(s2, s3));
        const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
        const __m128i hw = _mm_set_epi16(0, 0, 0, 0, (short)rd16(p + 3 * bsize),
                                         (short)rd16(p + 2 * bsize), (short)rd16(p + bsize),
                                         (short)rd16(p));
        const __m128 d = _mm_mul_ps(_mm_cvtph_ps(hw), _mm_loadu_ps(xd + b));
        acc = _mm_add_ps(acc, _mm_mul_ps(d, _mm_cvtepi32_ps(s)));
    }
    float lanes[LANES_Q];
    _mm_storeu_ps(lanes, acc);
    int8_t q[QK];
    for (; b < nb; b++) {
        const float dw = unpack_block(type, w + (size_t)b * bsize, q);
        const float s = (float)idot32(q, xq + b * QK);
        lanes[b % LANES_Q] = lanes[b % LANES_Q] + (dw * xd[b]) * s;
    }
    return finish_q(lanes);
}

AVX2 static float dot_f32_avx2(const float *w, const float *x, int k) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int i = 0;
    for (; i + LANES_F <= k; i += LANES_F) {
        a0 = _mm256_add_ps(a0, _mm256_mul_ps(_mm256_loadu_ps(w + i), _mm256_loadu_ps(x + i)));
        a1 = _mm256_add_ps(a1, _mm256_mul_ps(_mm256_loadu_ps(w + i + 8), _mm256_loadu_ps(x + i + 8)));
        a2 = _mm256_add_ps(a2, _mm256_mul_ps(_mm256_loadu_ps(w + i + 16), _mm256_loadu_ps(x + i + 16)));
        a3 = _mm256_add_ps(a3, _mm256_mul_ps(_mm256_loadu_ps(w + i + 24), _mm256_loadu_ps(x + i + 24)));
    }
    float acc[LANES_F];
    _mm256_storeu_ps(acc, a0);
    _mm256_storeu_ps(acc + 8, a1);
    _mm256_storeu_ps(acc + 16, a2);
    _mm256_storeu_ps(acc + 24, a3);
    for (; i < k; i++) acc[i % LANES_F] = acc[i % LANES_F] + w[i] * x[i];
    return finish_f(acc);
}

/* F16 rows straight from their bytes: four rows at a time share each load of x. */
AVX2 static void rows_f16_avx2(const uint8_t *w, size_t row_bytes, int rows, int k,
                               const float *x, float *y, int y_stride) {
    int r = 0;
    for (; r + 4 <= rows && k % LANES_F == 0; r += 4) {
        __m256 acc[4][4];
        for (int a = 0; a < 4; a++)
            for (int c = 0; c < 4; c++) acc[a][c] = _mm256_setzero_ps();
        for (int i = 0; i < k; i += LANES_F) {
            __m256 xv[4];
            for (int c = 0; c < 4; c++) xv[c] = _mm256_loadu_ps(x + i + 8 * c);
            for (int a = 0; a < 4; a++) {
                const uint8_t *wr = w + (size_t)(r + a) * row_bytes + 2 * (size_t)i;
                for (int c = 0; c < 4; c++) {
                    const __m256 wv =
                        _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wr + 16 * c)));
                    acc[a][c] = _mm256_add_ps(acc[a][c], _mm256_mul_ps(wv, xv[c]));
                }
            }
        }
        for (int a = 0; a < 4; a++) {
            float lanes[LANES_F];
            for (int c = 0; c < 4; c++) _mm256_storeu_ps(lanes + 8 * c, acc[a][c]);
            y[(size_t)(r + a) * y_stride] = finish_f(lanes);
        }
    }
    float *row = malloc((size_t)k * sizeof(float));
    if (row == NULL) abort();
    for (; r < rows; r++) {
        dequant_row(T_F16, w + (size_t)r * row_bytes, k, row);
        y[(size_t)r * y_stride] = dot_f32_avx2(row, x, k);
    }
    free(row);
}
#endif

/* ---- dispatch ------------------------------------------------------------------------------ */

static int use_avx2 = 0;

static float dot_q(int type, const uint8_t *w, int bsize, const int8_t *xq, const float *xd,
                   int nb) {
#if defined(FOUNDRY_X86)
    if (use_avx2) return dot_q_avx2(type, w, bsize, xq, xd, nb);
#endif
    return dot_q_portable(type, w, bsize, xq, xd, nb);
}

static float dot_f32(const float *w, const float *x, int k) {
#if defined(FOUNDRY_X86)
    if (use_avx2) return dot_f32_avx2(w, x, k);
#endif
    return dot_f32_portable(w, x, k);
}

/* y (n, n_out) = x (n, k) . W (n_out, k)^T. Returns 0, or -1 when out of memory. */
static int matmul(int type, const uint8_t *w, size_t row_bytes, int n_out, int k, const float *x,
                  int n, float *y) {
    if (type == T_Q8_0 || type == T_Q4_0) {
        const int bytes = type == T_Q8_0 ? 34 : 18;
        const int nb = k / QK;
        int8_t *xq = malloc((size_t)n * k);
        float *xd = malloc((size_t)n * nb * sizeof(float));
        if (xq == NULL || xd == NULL) {
            free(xq);
            free(xd);
            return -1;
        }
        for (int t = 0; t < n; t++) quantize_input(x + (size_t)t * k, k, xq + (size_t)t * k, xd + (size_t)t * nb);
        for (int r = 0; r < n_out; r++)
            for (int t = 0; t < n; t++)
                y[(size_t)t * n_out + r] =
                    dot_q(type, w + r * row_bytes, bytes, xq + (size_t)t * k, xd + (size_t)t * nb, nb);
        free(xq);
        free(xd);
        return 0;
    }
#if defined(FOUNDRY_X86)
    if (type == T_F16 && use_avx2) {
        for (int t = 0; t < n; t++) rows_f16_avx2(w, row_bytes, n_out, k, x + (size_t)t * k, y + t * (size_t)n_out, 1);
        return 0;
    }
#endif
    float *row = malloc((size_t)k * sizeof(float));
    if (row == NULL) return -1;
    for (int r = 0; r < n_out; r++) {
        dequant_row(type, w + r * row_bytes, k, row);
        for (int t = 0; t < n; t++) y[(size_t)t * n_out + r] = dot_f32(row, x + (size_t)t * k, k);
    }
    free(row);
    return 0;
}

/* ---- Python interface ---------------------------------------------------------------------- */

static int check_shape(int type, Py_ssize_t rows, Py_ssize_t k, Py_ssize_t have, size_t *row_bytes) {
    int values, bytes;
    if (!type_block(type, &values, &bytes)) {
        PyErr_Format(PyExc_ValueError, "tensor type %d has no kernel", type);
        return -1;
    }
    if (rows < 0 || k <= 0 || k % values || k > (1 << 30)) {
        PyErr_Format(PyExc_ValueError, "rows of %zd values are not whole blocks of %d", k, values);
        return -1;
    }
    *row_bytes = (size_t)(k / values) * bytes;
    if ((size_t)have != (size_t)rows * *row_bytes) {
        PyErr_Format(PyExc_ValueError, "weights hold %zd bytes, %zd rows of %zd values need %zu",
                     have, rows, k, (size_t)rows * *row_bytes);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(matmul_doc,
             "matmul(type, w, n_out, k, x, n, y): y (n, n_out) = x (n, k) @ W.T, W n_out rows of "
             "k values in ggml type `type`; x and y float32 buffers, y written.");

static PyObject *py_matmul(PyObject *self, PyObject *args) {
    int type;
    Py_ssize_t n_out, k, n;
    Py_buffer w, x, y;
    size_t row_bytes;
    (void)self;
    if (!PyArg_ParseTuple(args, "iy*nny*nw*", &type, &w, &n_out, &k, &x, &n, &y)) return NULL;
    PyObject *result = NULL;
    if (check_shape(type, n_out, k, w.len, &row_bytes) < 0) goto done;
    if (n < 0 || x.len != n * k * 4 || y.len != n * n_out * 4) {
        PyErr_Format(PyExc_ValueError, "x holds %zd bytes and y %zd, expected %zd and %zd",
                     x.len, y.len, n * k * 4, n * n_out * 4);
        goto done;
    }
    if (n_out > INT32_MAX || n > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "too many rows for one call");
        goto done;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = matmul(type, w.buf, row_bytes, (int)n_out, (int)k, x.buf, (int)n, y.buf);
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        PyErr_NoMemory();
        goto done;
    }
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&w);
    PyBuffer_Release(&x);
    PyBuffer_Release(&y);
    return result;
}

PyDoc_STRVAR(dequantize_doc,
             "dequantize(type, w, rows, k, out): the float32 values of `rows` rows of k values of "
             "ggml type `type`, written to `out`.");

static PyObject *py_dequantize(PyObject *self, PyObject *args) {
    int type;
    Py_ssize_t rows, k;
    Py_buffer w, out;
    size_t row_bytes;
    (void)self;
    if (!PyArg_ParseTuple(args, "iy*nnw*", &type, &w, &rows, &k, &out)) return NULL;
    PyObject *result = NULL;
    if (check_shape(type, rows, k, w.len, &row_bytes) < 0) goto done;
    if (out.len != rows * k * 4) {
        PyErr_Format(PyExc_ValueError, "out holds %zd bytes, expected %zd", out.len, rows * k * 4);
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t r = 0; r < rows; r++)
        dequant_row(type, (const uint8_t *)w.buf + r * row_bytes, (int)k, (float *)out.buf + r * k);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&w);
    PyBuffer_Release(&out);
    return result;
}

static PyObject *py_isa(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
#if defined(FOUNDRY_X86)
    return PyUnicode_FromString(use_avx2 ? "avx2" : "portable");
#elif defined(__ARM_NEON) && defined(__ARM_FEATURE_DOTPROD)
    return PyUnicode_FromString("neon-dotprod");
#elif defined(__ARM_NEON)
    return PyUnicode_FromString("neon");
#else
    return PyUnicode_FromString("portable");
#endif
}

static PyObject *py_set_portable(PyObject *self, PyObject *arg) {
    (void)self;
    int portable = PyObject_IsTrue(arg);
    if (portable < 0) return NULL;
#if defined(FOUNDRY_X86)
    use_avx2 = !portable && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
#endif
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"matmul", py_matmul, METH_VARARGS, matmul_doc},
    {"dequantize", py_dequantize, METH_VARARGS, dequantize_doc},
    {"isa", py_isa, METH_NOARGS, "The instruction set the kernels use here."},
    {"set_portable", py_set_portable, METH_O,
     "set_portable(flag): use the portable C path even where SIMD is available (tests)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_kernels",
    "Dot products over GGUF weight blocks (see foundry.model.quant).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__kernels(void) {
    for (uint32_t h = 0; h < 65536; h++) f16_table[h] = f16_bits_to_f32((uint16_t)h);
#if defined(FOUNDRY_X86)
    __builtin_cpu_init();
    use_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
#endif
    return PyModule_Create(&module);
}
