/* Matrix-vector and small matrix-matrix products over GGUF weight blocks, read in place.
 *
 * Theory of operation (docs/quantization.md has the reasons and the figures):
 *
 * y[t, r] = sum_i W[r, i] x[t, i] for weights W (n_out rows of k values, stored as ggml blocks
 * along each row) and float32 inputs x (n rows of k). Every output is one row's dot product, so
 * a result does not depend on how many rows or inputs a call holds (batch invariance) nor on
 * which process computes it (the tensor-parallel pair equals one process bit for bit).
 *
 * Each dot product has ONE definition, written out in the portable C below; the AVX2, AVX-512 and
 * NEON paths compute exactly the same float operations in the same order, only several at a time
 * (and several rows at a time), so an x86-64 rank and an arm64 rank give the same bits:
 *
 * - Q8_0, Q4_0 and Q5_0 (the bandwidth-bound cases): x is quantized once per call to int8 blocks of
 *   32 with a float scale (d = max|x| / 127, q = round(x / d), as ggml's Q8_0). A block's
 *   products are summed exactly in eight int32 lanes, lane j holding values 4j .. 4j + 3 (what
 *   AVX2's maddubs + madd, AVX-512 VNNI's dpbusd and NEON's sdot all give); the block then
 *   adds (d_w * d_x) * lane_j into float accumulator 8 (block mod 2) + j of sixteen, finished
 *   by halving like the float path. Q4_0 folds a block's eight lanes to four first (lane j +
 *   lane j + 4: values 4j .. 4j + 3 and 16 + 4j .. 19 + 4j, still exact) and adds
 *   (d_w * d_x) * lane_j into accumulator 4 (block mod 4) + j: half the float work per block,
 *   which is most of Q4_0's time (its AVX-512 kernel takes four blocks per register).
 * - Q4_K, Q5_K and Q6_K: x is quantized once per call to int8 blocks of 256 (one scale per
 *   super-block, as ggml's Q8_K). Each 32 values of a super-block give the same eight exact
 *   int32 lanes (weights as int8: Q4_K 0..15, Q5_K 0..31, Q6_K q - 32), times the sub-block's
 *   integer scale, summed over the super-block in int32; the super-block adds (d * d_x) * lane_j
 *   into accumulator 8 (super-block mod 2) + j of sixteen, and (dmin * d_x) * M (M: the exact
 *   sum of each sub-block's minimum times its input sum) into one more float, subtracted after
 *   the halving (dot_k_portable).
 * - F16 and the other block types (Q4_1, Q5_1): the weight row is turned into float32
 *   (exact for F16; ggml's dequantization for blocks), then multiplied with x in float32:
 *   element i adds w * x into lane (i mod 32) of 32 accumulators, finished by halving
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

/* Always inlined: a helper is compiled in its caller's encoding (a SIMD path's VEX), never
 * called as a function of another one (add_blocks' comment says what that cost). */
#define INLINE static inline __attribute__((always_inline))

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
#define LANES_Q 16 /* 2 block parities x 8 int32 lanes */

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

static float finish(float *acc, int lanes) {
    for (int width = lanes / 2; width >= 1; width /= 2)
        for (int j = 0; j < width; j++) acc[j] = acc[j] + acc[j + width];
    return acc[0];
}

static float dot_f32_portable(const float *w, const float *x, int k) {
    float acc[LANES_F] = {0};
    int i = 0;
    for (; i + LANES_F <= k; i += LANES_F)
        for (int j = 0; j < LANES_F; j++) acc[j] = acc[j] + w[i + j] * x[i + j];
    for (; i < k; i++) acc[i % LANES_F] = acc[i % LANES_F] + w[i] * x[i];
    return finish(acc, LANES_F);
}

/* ---- the int8 block dot product: exact per block, 4 float lanes across blocks -------------- */

/* Inputs as int8 blocks of bs values (32; 256 for the K-quants): q (k values), d (k / bs scales). */
static void quantize_input(const float *x, int k, int bs, int8_t *q, float *d) {
    for (int b = 0; b < k / bs; b++) {
        float amax = 0.0f;
        for (int i = 0; i < bs; i++) amax = fmaxf(amax, fabsf(x[b * bs + i]));
        const float db = amax / 127.0f, id = db != 0.0f ? 1.0f / db : 0.0f;
        d[b] = db;
        for (int i = 0; i < bs; i++) q[b * bs + i] = (int8_t)roundf(x[b * bs + i] * id);
    }
}

/* The eight int32 lanes of one block's products: lane j = sum of a[i] b[i], i in 4j .. 4j+3. */
static inline void idot_lanes(const int8_t *a, const int8_t *b, int32_t *s) {
#if defined(__ARM_NEON)
    int32x4_t lo, hi;
#if defined(__ARM_FEATURE_DOTPROD)
    lo = vdotq_s32(vdupq_n_s32(0), vld1q_s8(a), vld1q_s8(b));
    hi = vdotq_s32(vdupq_n_s32(0), vld1q_s8(a + 16), vld1q_s8(b + 16));
#else
    int32x4_t pairs[4];
    for (int h = 0; h < 4; h++) /* products of 8 values, summed in pairs */
        pairs[h] = vpaddlq_s16(vmull_s8(vld1_s8(a + 8 * h), vld1_s8(b + 8 * h)));
#if defined(__aarch64__)
    lo = vpaddq_s32(pairs[0], pairs[1]);
    hi = vpaddq_s32(pairs[2], pairs[3]);
#else
    lo = vcombine_s32(vpadd_s32(vget_low_s32(pairs[0]), vget_high_s32(pairs[0])),
                      vpadd_s32(vget_low_s32(pairs[1]), vget_high_s32(pairs[1])));
    hi = vcombine_s32(vpadd_s32(vget_low_s32(pairs[2]), vget_high_s32(pairs[2])),
                      vpadd_s32(vget_low_s32(pairs[3]), vget_high_s32(pairs[3])));
#endif
#endif
    vst1q_s32(s, lo);
    vst1q_s32(s + 4, hi);
#else
    for (int j = 0; j < 8; j++) {
        int32_t t = 0;
        for (int i = 4 * j; i < 4 * j + 4; i++) t += (int32_t)a[i] * (int32_t)b[i];
        s[j] = t;
    }
#endif
}

/* One block of weights as 32 int8 values and its float scale. */
static inline float unpack_block(int type, const uint8_t *blk, int8_t *q) {
    if (type == T_Q8_0) {
        memcpy(q, blk + 2, QK);
    } else if (type == T_Q5_0) { /* value v's fifth bit is bit v of qh */
        uint32_t qh;
        memcpy(&qh, blk + 2, 4);
        for (int i = 0; i < QK / 2; i++) {
            q[i] = (int8_t)(((blk[6 + i] & 0xF) | (((qh >> i) & 1) << 4)) - 16);
            q[i + QK / 2] = (int8_t)(((blk[6 + i] >> 4) | (((qh >> (i + 16)) & 1) << 4)) - 16);
        }
    } else { /* Q4_0 */
        for (int i = 0; i < QK / 2; i++) {
            q[i] = (int8_t)((blk[2 + i] & 0xF) - 8);
            q[i + QK / 2] = (int8_t)((blk[2 + i] >> 4) - 8);
        }
    }
    return f16(blk);
}

static inline void add_block(int type, float *acc, int b, float d, const int32_t *s) {
    if (type == T_Q4_0) { /* four lanes: lane j holds values 4j .. 4j + 3 and 16 + 4j .. 19 + 4j */
        float *a = acc + 4 * (b & 3);
        for (int j = 0; j < 4; j++) a[j] = a[j] + d * (float)(s[j] + s[j + 4]);
        return;
    }
    float *a = acc + 8 * (b & 1);
    for (int j = 0; j < 8; j++) a[j] = a[j] + d * (float)s[j];
}

/* Blocks from .. nb - 1 of a row added into its sixteen float lanes, then the lanes halved:
 * the whole dot product from 0, the SIMD paths' last blocks from where they stop. Always
 * inlined, so in a SIMD path it is compiled with that path's (VEX) encoding: called as a
 * function of plain SSE with the 512-bit registers' upper halves dirty (gcc 13 left out the
 * vzeroupper), every row paid Intel's transition penalty (AVX-512 Q8_0 at 4 GB/s, not 13). */
INLINE float add_blocks(int type, float *acc, const uint8_t *w, int bsize, const int8_t *xq,
                        const float *xd, int from, int nb) {
    int8_t q[QK];
    int32_t s[8];
    for (int b = from; b < nb; b++) {
        const float dw = unpack_block(type, w + (size_t)b * bsize, q);
        idot_lanes(q, xq + b * QK, s);
        add_block(type, acc, b, dw * xd[b], s);
    }
    return finish(acc, LANES_Q);
}

static float dot_q_portable(int type, const uint8_t *w, int bsize, const int8_t *xq,
                            const float *xd, int nb) {
    float acc[LANES_Q] = {0};
    return add_blocks(type, acc, w, bsize, xq, xd, 0, nb);
}

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

/* ---- AVX2 (x86-64 with AVX2 and F16C; chosen at import) ----------------------------------- */

#if defined(FOUNDRY_X86)
#define AVX2 __attribute__((target("avx2,f16c")))

/* float16 to float32 by the F16C instruction: the table's value (both are exact), without a
 * load from a 256 KB table that the streamed weights keep evicting from the caches. */
AVX2 INLINE float f16c(const uint8_t *p) { return _cvtsh_ss(rd16(p)); }
#define KQ_AHEAD 4 /* super-blocks prefetched ahead */

/* Q5_0's 32 values of one block as unsigned bytes 0..31: the nibbles (values 0-15 low, 16-31
 * high) and, as 16, bit v of the block's 32-bit qh for value v. */
AVX2 INLINE __m256i q5_unsigned_avx2(const uint8_t *blk) {
    uint32_t qh;
    memcpy(&qh, blk + 2, 4);
    const __m128i raw = _mm_loadu_si128((const __m128i *)(blk + 6));
    const __m128i m4 = _mm_set1_epi8(0xF);
    const __m256i nib = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), m4),
                                         _mm_and_si128(raw, m4));
    /* byte v takes byte v / 8 of qh, keeps its bit v mod 8 */
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32((int)qh),
        _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
    return _mm256_or_si256(nib, _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
}

AVX2 INLINE __m256i load_block_avx2(int type, const uint8_t *blk) {
    if (type == T_Q8_0) return _mm256_loadu_si256((const __m256i *)(blk + 2));
    if (type == T_Q5_0) return _mm256_sub_epi8(q5_unsigned_avx2(blk), _mm256_set1_epi8(16));
    const __m128i raw = _mm_loadu_si128((const __m128i *)(blk + 2));
    const __m128i m4 = _mm_set1_epi8(0xF);
    const __m128i lo = _mm_and_si128(raw, m4);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), m4);
    return _mm256_sub_epi8(_mm256_set_m128i(hi, lo), _mm256_set1_epi8(8));
}

/* The int8 dot product, AVX2 (maddubs + madd) or AVX-512 VNNI (dpbusd): the same eight exact
 * int32 lanes, so the same bits; two accumulators, one per block parity. */
#define DOT_Q_X86(NAME, TARGET, LOAD, LANES8)                                                      \
    TARGET static float NAME(int type, const uint8_t *w, int bsize, const int8_t *xq,         \
                             const float *xd, int nb) {                                        \
        __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;                                       \
        int b = 0;                                                                             \
        for (; b + 2 <= nb; b += 2) {                                                          \
            const uint8_t *p = w + (size_t)b * bsize;                                          \
            const __m256i w0 = LOAD(type, p), w1 = LOAD(type, p + bsize);                     \
            const __m256i x0 = _mm256_loadu_si256((const __m256i *)(xq + b * QK));             \
            const __m256i x1 = _mm256_loadu_si256((const __m256i *)(xq + (b + 1) * QK));       \
            const __m256i s0 = LANES8(_mm256_sign_epi8(w0, w0), _mm256_sign_epi8(x0, w0));      \
            const __m256i s1 = LANES8(_mm256_sign_epi8(w1, w1), _mm256_sign_epi8(x1, w1));      \
            const __m256 d0 = _mm256_set1_ps(f16c(p) * xd[b]);                                  \
            const __m256 d1 = _mm256_set1_ps(f16c(p + bsize) * xd[b + 1]);                      \
            acc0 = _mm256_add_ps(acc0, _mm256_mul_ps(d0, _mm256_cvtepi32_ps(s0)));             \
            acc1 = _mm256_add_ps(acc1, _mm256_mul_ps(d1, _mm256_cvtepi32_ps(s1)));             \
        }                                                                                      \
        float acc[LANES_Q];                                                                    \
        _mm256_storeu_ps(acc, acc0);                                                           \
        _mm256_storeu_ps(acc + 8, acc1);                                                       \
        return add_blocks(type, acc, w, bsize, xq, xd, b, nb);                                 \
    }

AVX2 INLINE __m256i lanes8_avx2(__m256i u, __m256i v) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, v), _mm256_set1_epi16(1));
}
DOT_Q_X86(dot_q_avx2, AVX2, load_block_avx2, lanes8_avx2)

#define VNNI __attribute__((target("avx2,f16c,avx512f,avx512vl,avx512vnni")))
VNNI INLINE __m256i lanes8_vnni(__m256i u, __m256i v) {
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, v);
}
VNNI INLINE __m256i load_block_vnni(int type, const uint8_t *blk) {
    return load_block_avx2(type, blk);
}
DOT_Q_X86(dot_q_vnni, VNNI, load_block_vnni, lanes8_vnni)

/* Q4_0, AVX2 or VNNI on 256 bits: a block's eight exact lanes folded to add_block's four (lane
 * j + lane j + 4), into four accumulators of four floats by block mod 4. */
#define DOT_Q4_X86(NAME, TARGET, LANES8)                                                           \
    TARGET static float NAME(const uint8_t *w, int bsize, const int8_t *xq, const float *xd,   \
                             int nb) {                                                         \
        __m128 acc[4];                                                                         \
        for (int m = 0; m < 4; m++) acc[m] = _mm_setzero_ps();                                 \
        int b = 0;                                                                             \
        for (; b + 4 <= nb; b += 4)                                                            \
            for (int m = 0; m < 4; m++) {                                                      \
                const uint8_t *p = w + (size_t)(b + m) * bsize;                                \
                const __m256i wv = load_block_avx2(T_Q4_0, p);                                 \
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + (b + m) * QK));   \
                const __m256i s8 = LANES8(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv)); \
                const __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8),                  \
                                                 _mm256_extracti128_si256(s8, 1));            \
                acc[m] = _mm_add_ps(acc[m], _mm_mul_ps(_mm_set1_ps(f16c(p) * xd[b + m]),       \
                                                       _mm_cvtepi32_ps(s4)));                  \
            }                                                                                  \
        float lanes[LANES_Q];                                                                  \
        for (int m = 0; m < 4; m++) _mm_storeu_ps(lanes + 4 * m, acc[m]);                      \
        return add_blocks(T_Q4_0, lanes, w, bsize, xq, xd, b, nb);                             \
    }
DOT_Q4_X86(dot_q4_avx2, AVX2, lanes8_avx2)
DOT_Q4_X86(dot_q4_vnni, VNNI, lanes8_vnni)

/* AVX-512: two blocks per step, their 16 lanes one register, which is also the order of the
 * sixteen accumulators (8 (block mod 2) + j). Weights are unsigned for dpbusd (Q8_0: w + 128,
 * an exclusive or of the sign bit; Q4_0: its stored nibbles, 0..15, before the - 8), and 128
 * (Q8_0) or 8 (Q4_0) times the input's sums over each 4 values (``corr``, computed once per
 * input row) come off again: the same exact lanes. */
#define AVX512 __attribute__((target("avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))
AVX512 INLINE __m512i load_pair_512(int type, const uint8_t *p, int bsize) {
    if (type == T_Q8_0) {
        const __m512i v = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(p + 2))),
            _mm256_loadu_si256((const __m256i *)(p + bsize + 2)), 1);
        return _mm512_xor_si512(v, _mm512_set1_epi8((char)0x80));
    }
    return _mm512_inserti64x4(_mm512_castsi256_si512(q5_unsigned_avx2(p)), /* Q5_0 */
                              q5_unsigned_avx2(p + bsize), 1);
}

AVX512 static float dot_q_512(int type, const uint8_t *w, int bsize, const int8_t *xq,
                              const float *xd, const int32_t *corr, int nb) {
    __m512 acc = _mm512_setzero_ps();
    int b = 0;
    for (; b + 2 <= nb; b += 2) {
        const uint8_t *p = w + (size_t)b * bsize;
        const __m512i xv = _mm512_loadu_si512((const void *)(xq + b * QK));
        __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), load_pair_512(type, p, bsize), xv);
        s = _mm512_sub_epi32(s, _mm512_loadu_si512((const void *)(corr + b * 8)));
        const __m512 d = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(f16c(p) * xd[b]),
                                              _mm512_set1_ps(f16c(p + bsize) * xd[b + 1]));
        acc = _mm512_add_ps(acc, _mm512_mul_ps(d, _mm512_cvtepi32_ps(s)));
    }
    float lanes[LANES_Q];
    _mm512_storeu_ps(lanes, acc);
    return add_blocks(type, lanes, w, bsize, xq, xd, b, nb);
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
    return finish(acc, LANES_F);
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
            y[(size_t)(r + a) * y_stride] = finish(lanes, LANES_F);
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
/* finish(acc, 8) of eight lanes in one register: the same additions in the same order (lane
 * j + lane j + 4, then + 2, + 1). */
AVX2 INLINE float finish8_avx2(__m256 v8) {
    const __m128 v4 = _mm_add_ps(_mm256_castps256_ps128(v8), _mm256_extractf128_ps(v8, 1));
    const __m128 v2 = _mm_add_ps(v4, _mm_movehl_ps(v4, v4));
    return _mm_cvtss_f32(_mm_add_ss(v2, _mm_shuffle_ps(v2, v2, 1)));
}

/* finish(acc, 16) of acc = a0 (lanes 0-7), a1 (lanes 8-15): lane j + lane j + 8 first. */
AVX2 INLINE float finish16_avx2(__m256 a0, __m256 a1) {
    return finish8_avx2(_mm256_add_ps(a0, a1));
}

/* AVX2 without AVX-512 (most desktops and laptops: AMD before Zen 4, Intel's client cores): the
 * int8 types four rows at a time, the rows j of each quarter of the matrix (four sequential
 * streams, as rows_q_512_t), sharing the input's loads; each row's operations are exactly
 * dot_q_avx2's (Q8_0, Q5_0) or add_block's for Q4_0, and the sixteen lanes are halved in
 * registers (finish16_avx2). Each lane prefetches its own rows PREFETCH2 ahead. */
#define ROWS2 4
#ifndef PREFETCH2
#define PREFETCH2 4 /* rows ahead */
#endif

/* The four rows' outputs from their lanes: blocks from ``from`` on (an odd last block, or Q4_0's
 * last one to three) added one at a time as dot_q_portable does, then halved. */
AVX2 INLINE void finish_rows_avx2(
    int type, const __m256 *a0, const __m256 *a1, const uint8_t *w, size_t lane_bytes, int bsize,
    const int8_t *xq, const float *xd, int from, int nb, float *y) {
    for (int i = 0; i < ROWS2; i++) {
        if (from == nb) {
            y[i] = finish16_avx2(a0[i], a1[i]);
            continue;
        }
        float lanes[LANES_Q];
        _mm256_storeu_ps(lanes, a0[i]);
        _mm256_storeu_ps(lanes + 8, a1[i]);
        y[i] = add_blocks(type, lanes, w + i * lane_bytes, bsize, xq, xd, from, nb);
    }
}

AVX2 INLINE void rows_q_avx2_t(
    int type, const uint8_t *w, size_t row_bytes, size_t lane_bytes, int bsize, const int8_t *xq,
    const float *xd, int nb, float *y) {
    __m256 a0[ROWS2], a1[ROWS2];
    for (int i = 0; i < ROWS2; i++) a0[i] = a1[i] = _mm256_setzero_ps();
    const int pairs = nb & ~1;
    for (int b = 0; b < pairs; b += 2) {
        const __m256i x0 = _mm256_loadu_si256((const __m256i *)(xq + b * QK));
        const __m256i x1 = _mm256_loadu_si256((const __m256i *)(xq + (b + 1) * QK));
        for (int i = 0; i < ROWS2; i++) {
            const uint8_t *p = w + i * lane_bytes + (size_t)b * bsize;
            _mm_prefetch((const char *)(p + PREFETCH2 * row_bytes), _MM_HINT_T0);
            const __m256i w0 = load_block_avx2(type, p), w1 = load_block_avx2(type, p + bsize);
            const __m256i s0 = lanes8_avx2(_mm256_sign_epi8(w0, w0), _mm256_sign_epi8(x0, w0));
            const __m256i s1 = lanes8_avx2(_mm256_sign_epi8(w1, w1), _mm256_sign_epi8(x1, w1));
            const __m256 d0 = _mm256_set1_ps(f16c(p) * xd[b]);
            const __m256 d1 = _mm256_set1_ps(f16c(p + bsize) * xd[b + 1]);
            a0[i] = _mm256_add_ps(a0[i], _mm256_mul_ps(d0, _mm256_cvtepi32_ps(s0)));
            a1[i] = _mm256_add_ps(a1[i], _mm256_mul_ps(d1, _mm256_cvtepi32_ps(s1)));
        }
    }
    finish_rows_avx2(type, a0, a1, w, lane_bytes, bsize, xq, xd, pairs, nb, y);
}

AVX2 static void rows_q_avx2(int type, const uint8_t *w, size_t row_bytes, size_t lane_bytes,
                             int bsize, const int8_t *xq, const float *xd, int nb, float *y) {
    if (type == T_Q8_0)
        rows_q_avx2_t(T_Q8_0, w, row_bytes, lane_bytes, bsize, xq, xd, nb, y);
    else
        rows_q_avx2_t(T_Q5_0, w, row_bytes, lane_bytes, bsize, xq, xd, nb, y);
}

/* Q4_0, four rows and two blocks per register: the two blocks' low nibbles (values 0-15, as
 * unsigned bytes) against the input's values 0-15 of each, their high nibbles (16-31) against
 * values 16-31, the two maddubs' int16 pairs added (at most 4 x 15 x 127: exact) and summed by
 * madd into four int32 lanes per block, which are add_block's folded lanes j + j + 4 less 8 x
 * the input's sums (``corr4``, from q4_layout, whose ``x4`` order this reads: per four blocks
 * their values 0-15, then 16-31). Blocks 4g and 4g + 1 go to lanes 0-7 (accumulators 0-7),
 * 4g + 2 and 4g + 3 to lanes 8-15. */
AVX2 static void rows_q4_avx2(const uint8_t *w, size_t row_bytes, size_t lane_bytes,
                              const int8_t *xq, const int8_t *x4, const float *xd,
                              const int32_t *corr4, int nb, float *y) {
    const int bsize = 18;
    __m256 a0[ROWS2], a1[ROWS2];
    for (int i = 0; i < ROWS2; i++) a0[i] = a1[i] = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(0xF);
    const __m256i ones = _mm256_set1_epi16(1);
    const int quads = nb & ~3;
    for (int b = 0; b < quads; b += 4) {
        const int8_t *xg = x4 + (size_t)b * QK;
        const __m256i cv0 = _mm256_loadu_si256((const __m256i *)(corr4 + 4 * b));
        const __m256i cv1 = _mm256_loadu_si256((const __m256i *)(corr4 + 4 * b + 8));
        for (int i = 0; i < ROWS2; i++) {
            const uint8_t *p = w + i * lane_bytes + (size_t)b * bsize;
            _mm_prefetch((const char *)(p + PREFETCH2 * row_bytes), _MM_HINT_T0);
            /* the four blocks' scale products, then each pair's [d x 4 | d' x 4] */
            __m128i h = _mm_cvtsi32_si128(rd16(p));
            h = _mm_insert_epi16(h, rd16(p + bsize), 1);
            h = _mm_insert_epi16(h, rd16(p + 2 * bsize), 2);
            h = _mm_insert_epi16(h, rd16(p + 3 * bsize), 3);
            const __m256 d4 = _mm256_castps128_ps256(
                _mm_mul_ps(_mm_cvtph_ps(h), _mm_loadu_ps(xd + b)));
            for (int half = 0; half < 2; half++) {
                const uint8_t *ph = p + 2 * half * bsize;
                const __m256i q = _mm256_loadu2_m128i((const __m128i *)(ph + bsize + 2),
                                                      (const __m128i *)(ph + 2));
                const __m256i xlo = _mm256_loadu_si256((const __m256i *)(xg + 32 * half));
                const __m256i xhi = _mm256_loadu_si256((const __m256i *)(xg + 64 + 32 * half));
                const __m256i lo = _mm256_and_si256(q, m4);
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
                const __m256i p16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xlo),
                                                     _mm256_maddubs_epi16(hi, xhi));
                const __m256i sv = _mm256_sub_epi32(_mm256_madd_epi16(p16, ones), half ? cv1 : cv0);
                const __m256 dv = _mm256_permutevar8x32_ps(
                    d4, _mm256_add_epi32(_mm256_set_epi32(1, 1, 1, 1, 0, 0, 0, 0),
                                         _mm256_set1_epi32(2 * half)));
                const __m256 t = _mm256_mul_ps(dv, _mm256_cvtepi32_ps(sv));
                if (half)
                    a1[i] = _mm256_add_ps(a1[i], t);
                else
                    a0[i] = _mm256_add_ps(a0[i], t);
            }
        }
    }
    finish_rows_avx2(T_Q4_0, a0, a1, w, lane_bytes, bsize, xq, xd, quads, nb, y);
}

/* F16 rows on every x86 machine with AVX2 and F16C (AVX-512 ones too: an AVX-512 version of this,
 * four rows of two 512-bit accumulators, streamed 2-6 % slower inside the engine on the 16-core
 * Xeon, bench/kernel_builds.py): ROWS_F16 rows at a time share each load of x, the rows j of
 * each of ROWS_F16 parts of the matrix (sequential streams, as rows_q_512_t), each prefetching
 * its next row; lanes 0-31 of the 32 float accumulators are four registers per row. */
#ifndef ROWS_F16
#define ROWS_F16 4
#endif
AVX2 static void rows_f16_avx2_streams(const uint8_t *w, size_t row_bytes, int rows, int k,
                                       const float *x, float *y) {
    const int part = k % LANES_F == 0 ? rows / ROWS_F16 : 0;
    for (int j = 0; j < part; j++) {
        __m256 acc[ROWS_F16][4];
        const uint8_t *wr0[ROWS_F16];
        for (int a = 0; a < ROWS_F16; a++) {
            wr0[a] = w + (size_t)(a * part + j) * row_bytes;
            for (int c = 0; c < 4; c++) acc[a][c] = _mm256_setzero_ps();
        }
        for (int i = 0; i < k; i += LANES_F) {
            for (int a = 0; a < ROWS_F16; a++)
                _mm_prefetch((const char *)(wr0[a] + 2 * (size_t)i + row_bytes), _MM_HINT_T0);
            for (int c = 0; c < 4; c++) {
                const __m256 xv = _mm256_loadu_ps(x + i + 8 * c);
                for (int a = 0; a < ROWS_F16; a++) {
                    const __m256 wv = _mm256_cvtph_ps(
                        _mm_loadu_si128((const __m128i *)(wr0[a] + 2 * (size_t)(i + 8 * c))));
                    acc[a][c] = _mm256_add_ps(acc[a][c], _mm256_mul_ps(wv, xv));
                }
            }
        }
        for (int a = 0; a < ROWS_F16; a++) /* finish(acc, 32): lane j + lane j + 16 first */
            y[a * part + j] = finish16_avx2(_mm256_add_ps(acc[a][0], acc[a][2]),
                                            _mm256_add_ps(acc[a][1], acc[a][3]));
    }
    const int r = ROWS_F16 * part;
    if (r < rows) rows_f16_avx2(w + (size_t)r * row_bytes, row_bytes, rows - r, k, x, y + r, 1);
}

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

/* Four rows at a time, each exactly dot_q_512's operations: the input's loads (int8 values,
 * their sums, their scales) are shared by the four rows. The four rows are row j of each
 * quarter of the matrix (lane_bytes apart), so each of the four walks its own quarter from
 * start to end: four long sequential streams, which the L2 streamer prefetches (four adjacent
 * rows, by contrast, share 4 KB pages at different offsets and defeat it; docs/quantization.md
 * has the figures). Each lane also prefetches its own rows PREFETCH ahead in software. Per
 * chunk of up to 16 blocks, each row's float16 scales are converted by one vcvtph2ps and
 * multiplied by the input's scales (d_w * d_x, the same single rounding as dot_q_512), so the block loop only
 * broadcasts the two products of a step. Specialized per type (rows_q_512 below), so the loop
 * holds no test of the type. */
#ifndef ROWS
#define ROWS 4
#endif
#define CHUNK 16 /* blocks whose scales are converted together */
#ifndef PREFETCH
#define PREFETCH ROWS /* rows ahead */
#endif

/* The scale products d_w * d_x of up to 16 blocks (``live``) of a row from p: each block's 4
 * first bytes gathered (its float16 scale in the low half), converted by one vcvtph2ps. */
AVX512 INLINE __m512 block_scales_512(const uint8_t *p, int bsize, __mmask16 live,
                                      __m512 xds) {
    const __m512i at = _mm512_mullo_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
        _mm512_set1_epi32(bsize));
    const __m512i g = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, at, p, 1);
    return _mm512_mul_ps(_mm512_cvtph_ps(_mm512_cvtepi32_epi16(g)), xds);
}

/* The four rows' outputs: their sixteen float lanes, the blocks from ``from`` on added one at a
 * time as dot_q_portable does, then halved. */
AVX512 static void finish_rows(int type, const __m512 *acc, const uint8_t *w, size_t lane_bytes,
                               int bsize, const int8_t *xq, const float *xd, int from, int nb,
                               float *y);

AVX512 INLINE void rows_q_512_t(
    int type, const uint8_t *w, size_t row_bytes, size_t lane_bytes, int bsize, const int8_t *xq,
    const float *xd, const int32_t *corr, int nb, float *y) {
    __m512 acc[ROWS];
    for (int i = 0; i < ROWS; i++) acc[i] = _mm512_setzero_ps();
    const int pairs = nb & ~1;
    int b = 0;
    for (; b < pairs; b += CHUNK) {
        const int n = pairs - b < CHUNK ? pairs - b : CHUNK; /* even */
        const __mmask16 live = (__mmask16)((1u << n) - 1);
        const __m512 xds = _mm512_maskz_loadu_ps(live, xd + b);
        float sp[ROWS][CHUNK];
        for (int i = 0; i < ROWS; i++)
            _mm512_storeu_ps(sp[i], block_scales_512(w + i * lane_bytes + (size_t)b * bsize,
                                                     bsize, live, xds));
        for (int c = 0; c < n; c += 2) {
            const size_t off = (size_t)(b + c) * bsize;
            const __m512i xv = _mm512_loadu_si512((const void *)(xq + (b + c) * QK));
            /* dpbusd onto minus the correction: the same exact int32 lanes as subtracting it */
            const __m512i ncv = _mm512_sub_epi32(
                _mm512_setzero_si512(), _mm512_loadu_si512((const void *)(corr + (b + c) * 8)));
            for (int i = 0; i < ROWS; i++) {
                const uint8_t *p = w + i * lane_bytes + off;
#if PREFETCH
                _mm_prefetch((const char *)(p + PREFETCH * row_bytes), _MM_HINT_T0);
#endif
                const __m512i wv = load_pair_512(type, p, bsize);
                const __m512i sv = _mm512_dpbusd_epi32(ncv, wv, xv);
                const __m512 dv = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(sp[i][c]),
                                                       _mm512_set1_ps(sp[i][c + 1]));
                acc[i] = _mm512_add_ps(acc[i], _mm512_mul_ps(dv, _mm512_cvtepi32_ps(sv)));
            }
        }
    }
    finish_rows(type, acc, w, lane_bytes, bsize, xq, xd, pairs, nb, y);
}

AVX512 static void rows_q_512(int type, const uint8_t *w, size_t row_bytes, size_t lane_bytes,
                              int bsize, const int8_t *xq, const float *xd, const int32_t *corr,
                              int nb, float *y) {
    if (type == T_Q8_0)
        rows_q_512_t(T_Q8_0, w, row_bytes, lane_bytes, bsize, xq, xd, corr, nb, y);
    else
        rows_q_512_t(T_Q5_0, w, row_bytes, lane_bytes, bsize, xq, xd, corr, nb, y);
}

/* Q4_0 on AVX-512, four rows and four blocks per step: the blocks' 4 x 16 bytes one register
 * (block m in 128-bit lane m); its low nibbles (values 0-15) against the input's values 0-15
 * of each block, then its high nibbles (16-31) against values 16-31, both dpbusd into the same
 * int32 lanes onto minus 8 x the input's sums: lane 4m + j is block m's lane j of add_block's
 * four, exactly, and the sixteen float lanes are its accumulators 4 (block mod 4) + j. The input
 * comes in that order (``x4``: per four blocks their values 0-15, then 16-31; ``corr4``: per
 * block four sums of 8 values, times 8), from q4_layout. Scales as in rows_q_512_t. */
AVX512 static void rows_q4_512(const uint8_t *w, size_t row_bytes, size_t lane_bytes,
                               const int8_t *xq, const int8_t *x4, const float *xd,
                               const int32_t *corr4, int nb, float *y) {
    const int bsize = 18;
    __m512 acc[ROWS];
    for (int i = 0; i < ROWS; i++) acc[i] = _mm512_setzero_ps();
    const __m512i m4 = _mm512_set1_epi8(0xF);
    const int quads = nb & ~3;
    for (int b = 0; b < quads; b += CHUNK) {
        const int n = quads - b < CHUNK ? quads - b : CHUNK; /* a multiple of 4 */
        const __mmask16 live = (__mmask16)((1u << n) - 1);
        const __m512 xds = _mm512_maskz_loadu_ps(live, xd + b);
        __m512 sp[ROWS];
        for (int i = 0; i < ROWS; i++)
            sp[i] = block_scales_512(w + i * lane_bytes + (size_t)b * bsize, bsize, live, xds);
        for (int c = 0; c < n; c += 4) {
            const int8_t *xg = x4 + (size_t)(b + c) * QK;
            const __m512i x1 = _mm512_loadu_si512((const void *)xg);
            const __m512i x2 = _mm512_loadu_si512((const void *)(xg + 64));
            const __m512i ncv = _mm512_sub_epi32(
                _mm512_setzero_si512(), _mm512_loadu_si512((const void *)(corr4 + (b + c) * 4)));
            const __m512i idx = _mm512_add_epi32( /* lanes 4m .. 4m + 3 take block c + m's */
                _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0),
                _mm512_set1_epi32(c));
            for (int i = 0; i < ROWS; i++) {
                const uint8_t *p = w + i * lane_bytes + (size_t)(b + c) * bsize;
#if PREFETCH
                _mm_prefetch((const char *)(p + PREFETCH * row_bytes), _MM_HINT_T0);
#endif
                __m512i q = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(p + 2)));
                q = _mm512_inserti32x4(q, _mm_loadu_si128((const __m128i *)(p + bsize + 2)), 1);
                q = _mm512_inserti32x4(q, _mm_loadu_si128((const __m128i *)(p + 2 * bsize + 2)), 2);
                q = _mm512_inserti32x4(q, _mm_loadu_si128((const __m128i *)(p + 3 * bsize + 2)), 3);
                const __m512i lo = _mm512_and_si512(q, m4);
                const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
                const __m512i sv = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(ncv, lo, x1), hi, x2);
                const __m512 dv = _mm512_permutexvar_ps(idx, sp[i]);
                acc[i] = _mm512_add_ps(acc[i], _mm512_mul_ps(dv, _mm512_cvtepi32_ps(sv)));
            }
        }
    }
    finish_rows(T_Q4_0, acc, w, lane_bytes, bsize, xq, xd, quads, nb, y);
}

AVX512 static void finish_rows(int type, const __m512 *acc, const uint8_t *w, size_t lane_bytes,
                               int bsize, const int8_t *xq, const float *xd, int from, int nb,
                               float *y) {
    for (int i = 0; i < ROWS; i++) {
        float lanes[LANES_Q];
        _mm512_storeu_ps(lanes, acc[i]);
        y[i] = add_blocks(type, lanes, w + i * lane_bytes, bsize, xq, xd, from, nb);
    }
}

/* rows_q4_512's input order, from the int8 input (k values) and corr (8 x its sums of 4). */
static void q4_layout(const int8_t *xq, const int32_t *corr, int k, int8_t *x4, int32_t *corr4) {
    const int quads = k / QK / 4;
    for (int g = 0; g < quads; g++)
        for (int m = 0; m < 4; m++) {
            const int8_t *blk = xq + (size_t)(4 * g + m) * QK;
            memcpy(x4 + (size_t)g * 128 + 16 * m, blk, 16);
            memcpy(x4 + (size_t)g * 128 + 64 + 16 * m, blk + 16, 16);
        }
    for (int b = 0; b < k / QK; b++)
        for (int j = 0; j < 4; j++) corr4[4 * b + j] = corr[8 * b + j] + corr[8 * b + j + 4];
}

/* quantize_input's blocks of 32 and the correction's sums (times 2^shift) for the AVX-512 rows,
 * 16 values at a time: the same maximum (exact, NaNs ignored as fmaxf does), the same scalar
 * scale and reciprocal, the same product x * id, and roundf's rounding (half away from zero):
 * truncate, then step away from zero where the exact remainder is at least one half. */
AVX512 static void prepare_input_512(const float *x, int k, int shift, int8_t *q, float *d,
                                     int32_t *corr) {
    const __m512 half = _mm512_set1_ps(0.5f), one = _mm512_set1_ps(1.0f);
    for (int b = 0; b < k / QK; b++) {
        const __m512 x0 = _mm512_loadu_ps(x + b * QK), x1 = _mm512_loadu_ps(x + b * QK + 16);
        const __m512 m = _mm512_max_ps(_mm512_abs_ps(x1),
                                       _mm512_max_ps(_mm512_abs_ps(x0), _mm512_setzero_ps()));
        const float amax = _mm512_reduce_max_ps(m);
        const float db = amax / 127.0f, id = db != 0.0f ? 1.0f / db : 0.0f;
        d[b] = db;
        const __m512 idv = _mm512_set1_ps(id);
        for (int h = 0; h < 2; h++) {
            const __m512 v = _mm512_mul_ps(h ? x1 : x0, idv);
            __m512 t = _mm512_roundscale_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
            const __mmask16 up = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_sub_ps(v, t)), half,
                                                    _CMP_GE_OQ);
            const __m512i sign = _mm512_and_si512(_mm512_castps_si512(v),
                                                  _mm512_set1_epi32((int)0x80000000u));
            const __m512 step = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(one), sign));
            t = _mm512_mask_add_ps(t, up, t, step);
            _mm_storeu_si128((__m128i *)(q + b * QK + 16 * h),
                             _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(t)));
        }
    }
    const __m512i ones = _mm512_set1_epi8(1);
    int g = 0;
    for (; g + 16 <= k / 4; g += 16) {
        const __m512i qv = _mm512_loadu_si512((const void *)(q + 4 * g));
        const __m512i s4 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, qv);
        _mm512_storeu_si512((void *)(corr + g), _mm512_slli_epi32(s4, (unsigned)shift));
    }
    for (; g < k / 4; g++)
        corr[g] = (q[4 * g] + q[4 * g + 1] + q[4 * g + 2] + q[4 * g + 3]) * (1 << shift);
}

#endif

/* ---- dispatch ------------------------------------------------------------------------------ */

static int use_avx2 = 0, use_vnni = 0, use_512 = 0;

static float dot_q(int type, const uint8_t *w, int bsize, const int8_t *xq, const float *xd,
                   const int32_t *corr, int nb) {
#if defined(FOUNDRY_X86)
    if (use_512 && type != T_Q4_0) return dot_q_512(type, w, bsize, xq, xd, corr, nb);
    if (use_vnni)
        return type == T_Q4_0 ? dot_q4_vnni(w, bsize, xq, xd, nb)
                              : dot_q_vnni(type, w, bsize, xq, xd, nb);
    if (use_avx2)
        return type == T_Q4_0 ? dot_q4_avx2(w, bsize, xq, xd, nb)
                              : dot_q_avx2(type, w, bsize, xq, xd, nb);
#endif
    (void)corr;
    return dot_q_portable(type, w, bsize, xq, xd, nb);
}

static float dot_k(int type, const uint8_t *w, int bsize, const int8_t *xq, const float *xd,
                   const int32_t *s4, const int32_t *s32, int nsb) {
#if defined(FOUNDRY_X86)
    if (use_vnni) return dot_k_vnni(type, w, bsize, xq, xd, s4, s32, nsb);
    if (use_avx2) return dot_k_avx2(type, w, bsize, xq, xd, s4, s32, nsb);
#endif
    (void)s4;
    return dot_k_portable(type, w, bsize, xq, xd, s32, nsb);
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
    if (type == T_Q8_0 || type == T_Q4_0 || type == T_Q5_0) {
        const int bytes = type == T_Q8_0 ? 34 : type == T_Q5_0 ? 22 : 18;
        const int nb = k / QK;
        int8_t *xq = malloc((size_t)n * k);
        float *xd = malloc((size_t)n * nb * sizeof(float));
        int32_t *corr = malloc((size_t)n * (k / 4) * sizeof(int32_t)); /* 128 (Q8_0), 16 (Q5_0), 8 (Q4_0) x sums of 4 */
        if (xq == NULL || xd == NULL || corr == NULL) {
            free(xq);
            free(xd);
            free(corr);
            return -1;
        }
        const int shift = type == T_Q8_0 ? 7 : type == T_Q5_0 ? 4 : 3; /* 128, 16 or 8 */
        for (int t = 0; t < n; t++) {
            const int8_t *q = xq + (size_t)t * k;
#if defined(FOUNDRY_X86)
            if (use_512) {
                prepare_input_512(x + (size_t)t * k, k, shift, xq + (size_t)t * k,
                                  xd + (size_t)t * nb, corr + (size_t)t * (k / 4));
                continue;
            }
#endif
            quantize_input(x + (size_t)t * k, k, QK, xq + (size_t)t * k, xd + (size_t)t * nb);
            for (int g = 0; g < k / 4; g++)
                corr[(size_t)t * (k / 4) + g] =
                    (q[4 * g] + q[4 * g + 1] + q[4 * g + 2] + q[4 * g + 3]) * (1 << shift);
        }
        int r = 0;
#if defined(FOUNDRY_X86)
        if (use_avx2) { /* groups of four rows, kept in cache while the inputs pass over them */
            int8_t *x4 = NULL;
            int32_t *corr4 = NULL;
            if (type == T_Q4_0) {
                x4 = malloc((size_t)n * k);
                corr4 = malloc((size_t)n * (k / 8) * sizeof(int32_t));
                if (x4 == NULL || corr4 == NULL) {
                    free(x4);
                    free(corr4);
                    free(xq);
                    free(xd);
                    free(corr);
                    return -1;
                }
                for (int t = 0; t < n; t++)
                    q4_layout(xq + (size_t)t * k, corr + (size_t)t * (k / 4), k,
                              x4 + (size_t)t * k, corr4 + (size_t)t * (k / 8));
            }
            const int per = use_512 ? ROWS : ROWS2, quarter = n_out / per;
            for (int j = 0; j < quarter; j++)
                for (int t = 0; t < n; t++) {
                    float out[ROWS > ROWS2 ? ROWS : ROWS2];
                    const uint8_t *wj = w + (size_t)j * row_bytes;
                    const size_t lane = (size_t)quarter * row_bytes;
                    if (type == T_Q4_0 && use_512)
                        rows_q4_512(wj, row_bytes, lane, xq + (size_t)t * k, x4 + (size_t)t * k,
                                    xd + (size_t)t * nb, corr4 + (size_t)t * (k / 8), nb, out);
                    else if (type == T_Q4_0)
                        rows_q4_avx2(wj, row_bytes, lane, xq + (size_t)t * k, x4 + (size_t)t * k,
                                     xd + (size_t)t * nb, corr4 + (size_t)t * (k / 8), nb, out);
                    else if (use_512)
                        rows_q_512(type, wj, row_bytes, lane, bytes, xq + (size_t)t * k,
                                   xd + (size_t)t * nb, corr + (size_t)t * (k / 4), nb, out);
                    else
                        rows_q_avx2(type, wj, row_bytes, lane, bytes, xq + (size_t)t * k,
                                    xd + (size_t)t * nb, nb, out);
                    for (int i = 0; i < per; i++) y[(size_t)t * n_out + j + i * quarter] = out[i];
                }
            r = per * quarter;
            free(x4);
            free(corr4);
        }
#endif
        for (; r < n_out; r++)
            for (int t = 0; t < n; t++)
                y[(size_t)t * n_out + r] =
                    dot_q(type, w + r * row_bytes, bytes, xq + (size_t)t * k, xd + (size_t)t * nb,
                          corr + (size_t)t * (k / 4), nb);
        free(xq);
        free(xd);
        free(corr);
        return 0;
    }
    if (type == T_Q4_K || type == T_Q5_K || type == T_Q6_K) {
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
#if defined(FOUNDRY_X86)
    if (type == T_F16 && use_avx2) {
        if (n == 1) {
            rows_f16_avx2_streams(w, row_bytes, n_out, k, x, y);
            return 0;
        }
        /* several inputs: each group of rows stays in cache while the inputs pass over it */
        for (int r = 0; r < n_out; r += ROWS_F16) {
            const int rows = n_out - r < ROWS_F16 ? n_out - r : ROWS_F16;
            for (int t = 0; t < n; t++)
                rows_f16_avx2_streams(w + (size_t)r * row_bytes, row_bytes, rows, k,
                                      x + (size_t)t * k, y + t * (size_t)n_out + r);
        }
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

/* ---- e^x without the C library --------------------------------------------------------------- */

/* e^x in single-precision IEEE operations only, so that softmax and SiLU give the same bits on
 * every architecture, path and C library (a libm's expf may differ in the last bit between
 * them): x = n ln2 + r with n = round(x / ln2) (by adding and taking off 1.5 x 2^23) and
 * |r| <= ln2 / 2 (ln2 in two parts, Cody and Waite), e^r by Cephes expf's polynomial (about 1
 * ulp), times 2^n set in the exponent bits (in two factors for n = 128). Below -87.3365, where
 * e^x < FLT_MIN, it is 0; above 88.7228 inf; NaN stays NaN. Branch-free, so loops of it
 * vectorise (the same operations, lane by lane). */
INLINE float exp_f(float x) {
    const float lo = -87.33654475f, hi = 88.72283935f;
    const float c = x == x ? (x < lo ? lo : (x > hi ? hi : x)) : 0.0f;
    const float n = (c * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = c - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    float y = p * (r * r) + r + 1.0f;
    const int32_t e = (int32_t)n;
    const uint32_t bits = (uint32_t)((e > 127 ? 127 : e) + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    y = y * scale;
    y = e > 127 ? y * 2.0f : y;
    return x == x ? (x < lo ? 0.0f : (x > hi ? INFINITY : y)) : x;
}

/* The loops of exp_f: p[i] = e^(p[i] - m) (softmax), and SiLU(g) x u = g (1 / (1 + e^-g)) u (the
 * roundings of layers.silu_and_sigmoid and the product after it); one body, compiled for the
 * portable path and for AVX2 (vectorised by the compiler: the same bits). */
#define EXP_LOOPS(SUFFIX, ATTR)                                                                \
    ATTR static void exp_shifted##SUFFIX(float *p, int n, float m) {                           \
        for (int i = 0; i < n; i++) p[i] = exp_f(p[i] - m);                                    \
    }                                                                                          \
    ATTR static void silu_mul##SUFFIX(const float *g, const float *u, int f, float *o) {       \
        for (int i = 0; i < f; i++) o[i] = g[i] * (1.0f / (1.0f + exp_f(-g[i]))) * u[i];       \
    }
EXP_LOOPS(_portable, )
#if defined(FOUNDRY_X86)
EXP_LOOPS(_avx2, AVX2)
#endif

/* ---- one query row's attention against a KV cache ------------------------------------------ */

/* out[h] = softmax(q[h] . k[s][g] * scale over s < n_pos) . v[s][g], g = h / (n_head / n_kv):
 * the decode step of causal grouped-query attention (layers.attention_forward's operations for
 * one row at the end of its cache, in one fixed order: each score a dot product in 8 lanes
 * halved at the end, then times the scale; the maximum taken off before exp_f; each probability
 * divided by their sum; each output value summed over the positions in order). ``p`` is room
 * for n_head x n_pos floats. */
/* attend's two inner loops: a score (q . k in 8 lanes, halved) and o += c v. */
static float score_portable(const float *q, const float *k, int dh) {
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

#if defined(FOUNDRY_X86)
/* the same operations eight lanes at a time (dh a multiple of 8) */
AVX2 static float score_avx2(const float *q, const float *k, int dh) {
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

static void attend(const float *q, const float *k, const float *v, int n_pos, int n_head,
                   int n_kv, int dh, float *p, float *out) {
    float (*score)(const float *, const float *, int) = score_portable;
    void (*add_scaled)(float *, float, const float *, int) = add_scaled_portable;
    void (*exp_shifted)(float *, int, float) = exp_shifted_portable;
#if defined(FOUNDRY_X86)
    if (use_avx2 && dh % 8 == 0) {
        score = score_avx2;
        add_scaled = add_scaled_avx2;
    }
    if (use_avx2) exp_shifted = exp_shifted_avx2;
#endif
    const float scale = (float)(1.0 / sqrt((double)dh));
    const int group = n_head / n_kv;
    const size_t stride = (size_t)n_kv * dh; /* floats from one position to the next */
    /* Position by position through the cache (each K and V row read once, in order), every
     * head's own operations in the same order as one head alone: p[h][s], then softmax per
     * head, then o[h] += p[h][s] / sum[h] v[s] for s in order. */
    for (int s = 0; s < n_pos; s++)
        for (int h = 0; h < n_head; h++)
            p[(size_t)h * n_pos + s] =
                score(q + (size_t)h * dh, k + s * stride + (size_t)(h / group) * dh, dh) * scale;
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
    for (int s = 0; s < n_pos; s++)
        for (int h = 0; h < n_head; h++)
            add_scaled(out + (size_t)h * dh, p[(size_t)h * n_pos + s],
                       v + s * stride + (size_t)(h / group) * dh, dh);
}

/* ---- the rest of a decode step: RMSNorm, rotation, router, expert grouping --------------- */

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
static void rmsnorm(const float *x, const float *w, int n, int d, float eps, float *out) {
    float (*dot8)(const float *, const float *, int) = dot8_for(d);
    for (int r = 0; r < n; r++) {
        const float *xr = x + (size_t)r * d;
        float *o = out + (size_t)r * d;
        const float rstd = 1.0f / sqrtf(dot8(xr, xr, d) / (float)d + eps);
        for (int i = 0; i < d; i++) o[i] = (xr[i] * rstd) * w[i];
    }
}

/* Adjacent pairs of each of n rows of `heads` heads of dh values turned by the row's angles:
 * (x0 c - x1 s, x0 s + x1 c), as rope_forward. */
static void rope(const float *x, const float *cos, const float *sin, int n, int heads, int dh,
                 float *out) {
    const int half = dh / 2;
    for (int r = 0; r < n; r++) {
        const float *c = cos + (size_t)r * half, *s = sin + (size_t)r * half;
        for (int h = 0; h < heads; h++) {
            const float *xh = x + ((size_t)r * heads + h) * dh;
            float *o = out + ((size_t)r * heads + h) * dh;
            for (int i = 0; i < half; i++) {
                const float x0 = xh[2 * i], x1 = xh[2 * i + 1];
                o[2 * i] = x0 * c[i] - x1 * s[i];
                o[2 * i + 1] = x0 * s[i] + x1 * c[i];
            }
        }
    }
}

/* out (n, f) = silu(g) * u of each row [g | u] of gu (n, 2f) (silu_mul). */
static void swiglu(const float *gu, int n, int f, float *out) {
    void (*silu_mul)(const float *, const float *, int, float *) = silu_mul_portable;
#if defined(FOUNDRY_X86)
    if (use_avx2) silu_mul = silu_mul_avx2;
#endif
    for (int r = 0; r < n; r++)
        silu_mul(gu + (size_t)r * 2 * f, gu + (size_t)r * 2 * f + f, f, out + (size_t)r * f);
}

#define MAX_EXPERTS 256

/* Each row's router: logits z_e = x . w_e, probabilities softmax(z) (the maximum taken off
 * before exp_f, each divided by their sum), the k largest (ties to the lower id, as a stable
 * sort), and their weights renormalised to sum 1 (layers.router_forward). */
static void route(const float *x, const float *w, int n, int d, int n_expert, int k,
                  float *weights, int64_t *top) {
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
static int64_t assign(const int64_t *top, int64_t m, int64_t first, int n_local, int64_t *order,
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
static void combine(const float *ys, const float *weights, const int64_t *slot, int n, int k,
                    int d, float *out) {
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

PyDoc_STRVAR(attend_doc,
             "attend(q, k, v, n_pos, n_head, n_kv, dh, out): one query row (n_head, dh) against "
             "positions 0 .. n_pos - 1 of a cache k, v (ctx, n_kv, dh); out (n_head, dh) written. "
             "All float32, C-contiguous.");

static PyObject *py_attend(PyObject *self, PyObject *args) {
    int n_pos, n_head, n_kv, dh;
    Py_buffer q, k, v, out;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*y*iiiiw*", &q, &k, &v, &n_pos, &n_head, &n_kv, &dh, &out))
        return NULL;
    PyObject *result = NULL;
    const Py_ssize_t row = (Py_ssize_t)n_head * dh * 4, pos = (Py_ssize_t)n_kv * dh * 4;
    if (n_pos < 1 || n_head < 1 || n_kv < 1 || dh < 1 || n_head % n_kv || q.len != row ||
        out.len != row || k.len != v.len || k.len % pos || k.len / pos < n_pos) {
        PyErr_Format(PyExc_ValueError,
                     "attend: q %zd and out %zd bytes for %d heads of %d, a cache of %zd and %zd "
                     "bytes for %d positions of %d kv heads",
                     q.len, out.len, n_head, dh, k.len, v.len, n_pos, n_kv);
        goto done;
    }
    float *p = malloc((size_t)n_pos * n_head * sizeof(float));
    if (p == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    attend(q.buf, k.buf, v.buf, n_pos, n_head, n_kv, dh, p, out.buf);
    Py_END_ALLOW_THREADS
    free(p);
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&q);
    PyBuffer_Release(&k);
    PyBuffer_Release(&v);
    PyBuffer_Release(&out);
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

/* A buffer of one call of the decode operations below: it must hold exactly `need` bytes. */
static int fits(const char *what, const Py_buffer *b, Py_ssize_t need) {
    if (need < 0 || b->len != need) {
        PyErr_Format(PyExc_ValueError, "%s holds %zd bytes, expected %zd", what, b->len, need);
        return 0;
    }
    return 1;
}

#define RELEASE_AND_RETURN(result, ...)                                                        \
    do {                                                                                       \
        Py_buffer *bufs_[] = {__VA_ARGS__};                                                    \
        for (size_t i_ = 0; i_ < sizeof bufs_ / sizeof bufs_[0]; i_++) PyBuffer_Release(bufs_[i_]); \
        return result;                                                                         \
    } while (0)

PyDoc_STRVAR(rmsnorm_doc, "rmsnorm(x, w, n, d, eps, out): out (n, d) = x / rms(x) * w, float32.");

static PyObject *py_rmsnorm(PyObject *self, PyObject *args) {
    int n, d;
    float eps;
    Py_buffer x, w, out;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*iifw*", &x, &w, &n, &d, &eps, &out)) return NULL;
    const Py_ssize_t rows = (Py_ssize_t)n * d * 4;
    if (n < 0 || d < 1 || !fits("x", &x, rows) || !fits("w", &w, (Py_ssize_t)d * 4) ||
        !fits("out", &out, rows))
        RELEASE_AND_RETURN(NULL, &x, &w, &out);
    Py_BEGIN_ALLOW_THREADS
    rmsnorm(x.buf, w.buf, n, d, eps, out.buf);
    Py_END_ALLOW_THREADS
    RELEASE_AND_RETURN(Py_NewRef(Py_None), &x, &w, &out);
}

PyDoc_STRVAR(rope_doc,
             "rope(x, cos, sin, n, heads, dh, out): x (n, heads, dh) turned by cos, sin "
             "(n, dh / 2); out (n, heads, dh).");

static PyObject *py_rope(PyObject *self, PyObject *args) {
    int n, heads, dh;
    Py_buffer x, cos, sin, out;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*y*iiiw*", &x, &cos, &sin, &n, &heads, &dh, &out))
        return NULL;
    if (n < 0 || heads < 1 || dh < 2 || dh % 2) {
        PyErr_Format(PyExc_ValueError, "rope: %d rows of %d heads of %d values", n, heads, dh);
        RELEASE_AND_RETURN(NULL, &x, &cos, &sin, &out);
    }
    const Py_ssize_t values = (Py_ssize_t)n * heads * dh * 4, angles = (Py_ssize_t)n * (dh / 2) * 4;
    if (!fits("x", &x, values) || !fits("cos", &cos, angles) || !fits("sin", &sin, angles) ||
        !fits("out", &out, values))
        RELEASE_AND_RETURN(NULL, &x, &cos, &sin, &out);
    Py_BEGIN_ALLOW_THREADS
    rope(x.buf, cos.buf, sin.buf, n, heads, dh, out.buf);
    Py_END_ALLOW_THREADS
    RELEASE_AND_RETURN(Py_NewRef(Py_None), &x, &cos, &sin, &out);
}

PyDoc_STRVAR(swiglu_doc, "swiglu(gu, n, f, out): out (n, f) = silu(g) * u of rows [g | u] of gu.");

static PyObject *py_swiglu(PyObject *self, PyObject *args) {
    int n, f;
    Py_buffer gu, out;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*iiw*", &gu, &n, &f, &out)) return NULL;
    if (n < 0 || f < 1 || !fits("gu", &gu, (Py_ssize_t)n * 2 * f * 4) ||
        !fits("out", &out, (Py_ssize_t)n * f * 4))
        RELEASE_AND_RETURN(NULL, &gu, &out);
    Py_BEGIN_ALLOW_THREADS
    swiglu(gu.buf, n, f, out.buf);
    Py_END_ALLOW_THREADS
    RELEASE_AND_RETURN(Py_NewRef(Py_None), &gu, &out);
}

PyDoc_STRVAR(route_doc,
             "route(x, w, n, d, n_expert, k, weights, top): each row's k experts (top, int64) "
             "and their renormalised probabilities (weights, float32), from x (n, d) and the "
             "router w (n_expert, d).");

static PyObject *py_route(PyObject *self, PyObject *args) {
    int n, d, n_expert, k;
    Py_buffer x, w, weights, top;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*iiiiw*w*", &x, &w, &n, &d, &n_expert, &k, &weights, &top))
        return NULL;
    if (n < 0 || d < 1 || n_expert < 1 || n_expert > MAX_EXPERTS || k < 1 || k > n_expert) {
        PyErr_Format(PyExc_ValueError, "route: %d of %d experts (at most %d)", k, n_expert,
                     MAX_EXPERTS);
        RELEASE_AND_RETURN(NULL, &x, &w, &weights, &top);
    }
    if (!fits("x", &x, (Py_ssize_t)n * d * 4) ||
        !fits("w", &w, (Py_ssize_t)n_expert * d * 4) ||
        !fits("weights", &weights, (Py_ssize_t)n * k * 4) ||
        !fits("top", &top, (Py_ssize_t)n * k * 8))
        RELEASE_AND_RETURN(NULL, &x, &w, &weights, &top);
    Py_BEGIN_ALLOW_THREADS
    route(x.buf, w.buf, n, d, n_expert, k, weights.buf, top.buf);
    Py_END_ALLOW_THREADS
    RELEASE_AND_RETURN(Py_NewRef(Py_None), &x, &w, &weights, &top);
}

PyDoc_STRVAR(assign_doc,
             "assign(top, first, n_local, order, bounds) -> M: the M assignments (flat indices "
             "of top, int64) to experts first .. first + n_local - 1 grouped by expert into "
             "order[:M], their bounds (n_local + 1, int64).");

static PyObject *py_assign(PyObject *self, PyObject *args) {
    long long first;
    int n_local;
    Py_buffer top, order, bounds;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*Liw*w*", &top, &first, &n_local, &order, &bounds)) return NULL;
    if (n_local < 0 || n_local > MAX_EXPERTS || top.len % 8) {
        PyErr_Format(PyExc_ValueError, "assign: %d local experts (at most %d), top %zd bytes",
                     n_local, MAX_EXPERTS, top.len);
        RELEASE_AND_RETURN(NULL, &top, &order, &bounds);
    }
    if (!fits("order", &order, top.len) ||
        !fits("bounds", &bounds, (Py_ssize_t)(n_local + 1) * 8))
        RELEASE_AND_RETURN(NULL, &top, &order, &bounds);
    int64_t m;
    Py_BEGIN_ALLOW_THREADS
    m = assign(top.buf, top.len / 8, first, n_local, order.buf, bounds.buf);
    Py_END_ALLOW_THREADS
    RELEASE_AND_RETURN(PyLong_FromLongLong(m), &top, &order, &bounds);
}

PyDoc_STRVAR(combine_doc,
             "combine(ys, weights, order, n, k, d, out): out (n, d) = each row's weighted sum of "
             "the expert outputs ys (M, d) of the assignments order (M, int64, distinct, < n k).");

static PyObject *py_combine(PyObject *self, PyObject *args) {
    int n, k, d;
    Py_buffer ys, weights, order, out;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*y*iiiw*", &ys, &weights, &order, &n, &k, &d, &out))
        return NULL;
    const int64_t m = order.len / 8, *o = order.buf;
    if (n < 0 || k < 1 || d < 1 || order.len % 8 || !fits("ys", &ys, (Py_ssize_t)m * d * 4) ||
        !fits("weights", &weights, (Py_ssize_t)n * k * 4) ||
        !fits("out", &out, (Py_ssize_t)n * d * 4))
        RELEASE_AND_RETURN(NULL, &ys, &weights, &order, &out);
    int64_t *slot = malloc(((size_t)n * k + 1) * sizeof(int64_t));
    if (slot == NULL) {
        PyErr_NoMemory();
        RELEASE_AND_RETURN(NULL, &ys, &weights, &order, &out);
    }
    for (int64_t a = 0; a < (int64_t)n * k; a++) slot[a] = -1;
    for (int64_t i = 0; i < m; i++) { /* the assignments' rows of ys, each assignment once */
        if (o[i] < 0 || o[i] >= (int64_t)n * k || slot[o[i]] >= 0) {
            free(slot);
            PyErr_Format(PyExc_ValueError, "combine: order[%lld] = %lld is not a distinct "
                         "assignment of %d rows of %d", (long long)i, (long long)o[i], n, k);
            RELEASE_AND_RETURN(NULL, &ys, &weights, &order, &out);
        }
        slot[o[i]] = i;
    }
    Py_BEGIN_ALLOW_THREADS
    combine(ys.buf, weights.buf, slot, n, k, d, out.buf);
    Py_END_ALLOW_THREADS
    free(slot);
    RELEASE_AND_RETURN(Py_NewRef(Py_None), &ys, &weights, &order, &out);
}

#if defined(FOUNDRY_X86)
static void detect_x86(int simd) {
    use_avx2 = simd && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
    use_vnni = use_avx2 && __builtin_cpu_supports("avx512vl") &&
               __builtin_cpu_supports("avx512vnni");
    use_512 = use_vnni && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
}
#endif

static PyObject *py_isa(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
#if defined(FOUNDRY_X86)
    return PyUnicode_FromString(use_512    ? "avx512-vnni"
                                : use_vnni ? "avx2+vnni"
                                : use_avx2 ? "avx2"
                                           : "portable");
#elif defined(__ARM_NEON) && defined(__ARM_FEATURE_DOTPROD)
    return PyUnicode_FromString("neon-dotprod");
#elif defined(__ARM_NEON)
    return PyUnicode_FromString("neon");
#else
    return PyUnicode_FromString("portable");
#endif
}

static PyObject *py_use(PyObject *self, PyObject *arg) {
    (void)self;
    const char *name = PyUnicode_AsUTF8(arg);
    if (name == NULL) return NULL;
#if defined(FOUNDRY_X86)
    if (strcmp(name, "portable") == 0) {
        detect_x86(0);
    } else if (strcmp(name, "avx2") == 0 || strcmp(name, "best") == 0) {
        detect_x86(1);
        if (!use_avx2) return PyErr_Format(PyExc_ValueError, "this CPU has no AVX2 and F16C");
        if (strcmp(name, "avx2") == 0) use_vnni = use_512 = 0;
    } else if (strcmp(name, "avx2+vnni") == 0) {
        detect_x86(1);
        if (!use_vnni) return PyErr_Format(PyExc_ValueError, "this CPU has no AVX-512 VNNI");
        use_512 = 0;
    } else {
        return PyErr_Format(PyExc_ValueError, "unknown kernel path %s", name);
    }
#else
    if (strcmp(name, "portable") != 0 && strcmp(name, "best") != 0)
        return PyErr_Format(PyExc_ValueError, "unknown kernel path %s", name);
#endif
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"matmul", py_matmul, METH_VARARGS, matmul_doc},
    {"dequantize", py_dequantize, METH_VARARGS, dequantize_doc},
    {"attend", py_attend, METH_VARARGS, attend_doc},
    {"rmsnorm", py_rmsnorm, METH_VARARGS, rmsnorm_doc},
    {"rope", py_rope, METH_VARARGS, rope_doc},
    {"swiglu", py_swiglu, METH_VARARGS, swiglu_doc},
    {"route", py_route, METH_VARARGS, route_doc},
    {"assign", py_assign, METH_VARARGS, assign_doc},
    {"combine", py_combine, METH_VARARGS, combine_doc},
    {"isa", py_isa, METH_NOARGS, "The instruction set the kernels use here."},
    {"use", py_use, METH_O,
     "use(path): 'best' (the default), 'avx2' (without VNNI) or 'portable' C (tests)."},
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
    detect_x86(1);
#endif
    return PyModule_Create(&module);
}
