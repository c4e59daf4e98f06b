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
 *   32 as llama.cpp's x86 build does (q = round(x * (127 / max|x|)) to nearest even, d =
 *   max|x| / 127 kept as float16: q32.c's quantize_block32). A block's products (weights as
 *   int8: Q8_0 its values, Q4_0 the nibble - 8, Q5_0 the five bits - 16) are summed exactly into
 *   ONE int32 S_b (|S_b| <= 32 x 128 x 127 < 2^24, so (float)S_b is exact too); then, block
 *   after block, acc = acc + (d_w * d_x) * (float)S_b, the result acc (q32.h's add_blocks):
 *   ggml's scalar reference for Q8_0 and Q5_0 (sumf += sumi * (d_w * d_y)) where its compiler
 *   does not fuse the multiply-add; for Q4_0 ggml multiplies sumi * d_w first, then * d_y,
 *   which rounds differently (docs/quantization.md). The integer sums are exact in any order, so
 *   each path sums the lanes of its instructions (AVX2's maddubs + madd, VNNI's dpbusd, NEON's
 *   sdot) by a tree as suits it, several blocks, rows or inputs at once, and then runs each
 *   output's float steps in block order, several outputs a register.
 * - Q4_K, Q5_K and Q6_K: x is quantized once per call to int8 blocks of 256 (one float32 scale
 *   per super-block, as ggml's Q8_K: quantize_block256). A super-block's products (weights as
 *   int8: Q4_K 0..15, Q5_K 0..31, Q6_K q - 32), each sub-block's (Q4_K, Q5_K 32 values, Q6_K 16)
 *   times its integer scale, are summed exactly into ONE int32 L (|L| < 2^25 for Q4_K, 2^26 Q5_K,
 *   2^28 Q6_K), and the minimums' M = the exact sum of each sub-block's minimum times its input
 *   sum; then, super-block after super-block, acc = acc + (d * d_x) * (float)L and acc_min =
 *   acc_min + (dmin * d_x) * (float)M, the result acc - acc_min (dot_k_portable). The integer
 *   sums are exact in any order, so each path sums them as suits it (the prompt's block 16
 *   inputs a register, one vpdpbusd per 64 products); (float)L may round, the same on all.
 * - Q4_1 and Q5_1 (a minimum per block): x as ggml's Q8_1: as for Q8_0, with s_b = S_b * d (S_b
 *   the exact sum of the block's int8 values, d its float32 scale) kept as float16; a block's
 *   products (unsigned values 0..15, 0..31) summed exactly in eight int32 lanes, lane j holding
 *   values 4j .. 4j + 3 (idot_lanes), added as (d_w * d_x) * lane_j into float accumulator
 *   8 (block mod 2) + j of sixteen, finished by halving like the float path, and m_w * s_b
 *   into one more float, added after the halving (dot_q1_portable).
 * - F16: the weight row is turned into float32 (exact), then multiplied with x in float32:
 *   element i adds w * x into lane (i mod 32) of 32 accumulators, finished by halving
 *   (lane j += lane j + 16, then + 8, + 4, + 2, + 1).
 *
 * Multiplications and additions are never fused (built with -ffp-contract=off; the SIMD paths
 * use separate multiply and add instructions) since a fused multiply-add rounds once instead of
 * twice and would make the paths differ.
 *
 * A block of inputs (prefill) is matrix-matrix over the stored blocks: the inputs in tiles that
 * stay in L2 while every row of the matrix passes over them (each weight block read once per
 * tile), the rows' unpacked chunks shared by several inputs in registers (the K-quants: four
 * on AVX2; on AVX-512 VNNI each row unpacked once per tile, 6 rows by 16 inputs a register
 * tile; with AMX 16 rows by 16 inputs a tile product, each super-block's scaled values as two
 * byte planes, v = lo + 256 hi, so its L is eight tile products, exact: kquants_512.c; Q8_0,
 * Q4_0 and Q5_0 on AVX-512 VNNI: groups of 16 inputs, the last a part one where it holds
 * QB_PART_MIN inputs or more (zeros in its other lanes; fewer go to small tiles), each row
 * unpacked once per tile, 4 rows by 16 inputs a register tile, a block's S_b of 16 inputs 8
 * vpdpbusd; with AMX 16 rows by 16 inputs, a block's S_b one tdpbusd: q32_block.c).
 * Each (row, input) output is still the one definition above, so a row of a block has the bits
 * of that row decoded alone, on every path and machine.
 *
 * The files: blocks.c (layouts, float16, dequantization), float.c (F16 and the float path), q32.c
 * (Q8_0, Q4_0, Q5_0: the input's quantization, the portable and AVX2 products, the dispatch),
 * q32_512.c (their AVX-512 kernels), q32_block.c (their AVX-512 and AMX prefill block of 16 inputs
 * a register), q1.c (Q4_1, Q5_1), q32.h (what those four share), kquants.c (Q4_K, Q5_K, Q6_K),
 * kquants_512.c (their AVX-512 and AMX prefill block), kquants.h (what those two share),
 * attention.c (one row's attention), attention_pool.c (rows and heads of it on the pool), decode.c
 * (the decode step's other operations), step.c (the one-token step), pool.c (the threads),
 * sample.c (the next token from rows of logits), and the Python interface: module.c (the module,
 * the instruction set, the threads), py_ops.c (the products and the decode operations), py_step.c
 * (the one-token step), py_sample.c (sampling), py_kernels.h (what they share). This header holds
 * what they all share: the SIMD helpers and the dispatch (use_avx2 ..., matmul).
 */

#ifndef FOUNDRY_KERNELS_H
#define FOUNDRY_KERNELS_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "step_exchange.h"

/* Always inlined: a helper is compiled in its caller's encoding (a SIMD path's VEX), never
 * called as a function of another one (add_blocks' comment says what that cost). */
#define INLINE static inline __attribute__((always_inline))

/* FOUNDRY_PORTABLE: the portable C alone on an x86-64 host, as an ARM build compiles it
 * (tests/test_portable_build.py links it, so an x86-only call in portable code fails there). */
#if defined(__x86_64__) && !defined(FOUNDRY_PORTABLE)
#include <immintrin.h>
#define FOUNDRY_X86 1
#endif
#if defined(__ARM_NEON)
#include <arm_neon.h>
#endif

/* ggml_type codes (gguf.GGMLQuantizationType). */
enum {
    T_F32 = 0,
    T_F16 = 1,
    T_Q4_0 = 2,
    T_Q4_1 = 3,
    T_Q5_0 = 6,
    T_Q5_1 = 7,
    T_Q8_0 = 8,
    T_Q4_K = 12,
    T_Q5_K = 13,
    T_Q6_K = 14,
};

#define QK      32  /* values per block of the 32-blocks */
#define QK_K    256 /* values per super-block of the K-quants */
#define LANES_F 32
#define LANES_Q 16 /* Q4_1, Q5_1: 2 block parities x 8 int32 lanes */

/* Functions shared between the files stay inside the module (not exported by its .so). */
#pragma GCC visibility push(hidden)

/* ---- float16 ------------------------------------------------------------------------------ */

extern float f16_table[65536]; /* filled by kernels_init */
float f16_bits_to_f32(uint16_t h);
void kernels_init(void);

static inline uint16_t rd16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

static inline float f16(const uint8_t *p) {
    return f16_table[rd16(p)];
}

/* x rounded to the nearest float16 value (ties to even; subnormals kept, 65520 and above to
 * infinity), as float32: what ggml's FP32_TO_FP16 then FP16_TO_FP32 give (F16C's vcvtps2ph
 * with round-to-nearest), in integer and float steps that are the same on every machine. */
static inline float round_f16(float x) {
    uint32_t u, sign;
    memcpy(&u, &x, 4);
    sign = u & 0x80000000u;
    u ^= sign;
    float a;
    memcpy(&a, &u, 4);
    if (a != a) return x; /* NaN */
    if (a >= 65520.0f) {
        a = INFINITY;
    } else if (a < 6.103515625e-05f) { /* below float16's normals: multiples of 2^-24 */
        volatile float big = a + 0.5f; /* float32's step at 0.5 is 2^-24: the one rounding */
        a = big - 0.5f;
    } else { /* drop 13 of the 23 fraction bits, to nearest, ties to even */
        u = (u + 0x0FFFu + ((u >> 13) & 1u)) & ~0x1FFFu;
        memcpy(&a, &u, 4);
    }
    memcpy(&u, &a, 4);
    u |= sign;
    memcpy(&x, &u, 4);
    return x;
}

/* The bits of the float16 nearest x (round_f16's value, exactly a float16). */
static inline uint16_t f16_bits(float x) {
    const float r = round_f16(x);
    uint32_t u;
    memcpy(&u, &r, 4);
    const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    u &= 0x7FFFFFFFu;
    if (u > 0x7F800000u) return sign | 0x7E00u; /* NaN */
    if (u == 0x7F800000u) return sign | 0x7C00u;
    float a;
    memcpy(&a, &u, 4);
    if (a < 6.103515625e-05f) return sign | (uint16_t)(a * 16777216.0f); /* k x 2^-24, exact */
    return sign | (uint16_t)((((u >> 23) - 112u) << 10) | ((u >> 13) & 0x3FFu));
}

/* float32 to the float16 bits numpy's astype(float16) gives: round to nearest even (f16_bits),
 * and a NaN as numpy keeps it (its payload's top ten bits, at least 1, the sign). */
static inline uint16_t half_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) {
        const uint32_t payload = (u & 0x7FFFFFu) >> 13;
        return (uint16_t)(((u >> 16) & 0x8000u) | 0x7C00u | (payload ? payload : 1u));
    }
    return f16_bits(x);
}

int type_block(int type, int *values, int *bytes);
void dequant_row(int type, const uint8_t *w, int k, float *y);

static inline void get_scale_min_k4(int j, const uint8_t *q, uint8_t *d, uint8_t *m) {
    if (j < 4) {
        *d = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *d = (uint8_t)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
        *m = (uint8_t)((q[j + 4] >> 4) | ((q[j - 0] >> 6) << 4));
    }
}

/* ---- the arithmetic every family shares ----------------------------------------------------- */

/* Lanes halved: lane j += lane j + lanes / 2, then + lanes / 4, ... (the float paths' end). */
static inline float finish(float *acc, int lanes) {
    for (int width = lanes / 2; width >= 1; width /= 2)
        for (int j = 0; j < width; j++) acc[j] = acc[j] + acc[j + width];
    return acc[0];
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

/* The exact sum of one block's 32 products, |S| <= 32 x 128 x 127 < 2^24 (so (float)S is
 * exact too): the eight lanes above added as integers, exact in any order, so NEON's lanes
 * give the same S as every other path by construction. */
static inline int32_t idot_sum(const int8_t *a, const int8_t *b) {
    int32_t s[8];
    idot_lanes(a, b, s);
    return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

/* ---- the SIMD paths and their dispatch --------------------------------------------------- */

extern int use_avx2, use_vnni, use_512; /* the x86 paths chosen at import (module.c) */
extern int use_amx; /* the K-quants' prefill block on AMX tiles (kquants_512.c), with use_512 */

#if defined(FOUNDRY_X86)
#define AVX2 __attribute__((target("avx2,f16c")))

/* float16 to float32 by the F16C instruction: the table's value (both are exact), without a
 * load from a 256 KB table that the streamed weights keep evicting from the caches. */
AVX2 INLINE float f16c(const uint8_t *p) {
    return _cvtsh_ss(rd16(p));
}

#define VNNI   __attribute__((target("avx2,f16c,avx512f,avx512vl,avx512vnni")))
#define AVX512 __attribute__((target("avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))
/* AVX512 with AMX's tiles and int8 products: only where use_amx (module.c asked the kernel for
 * the tiles' state), so the module still loads on CPUs without AMX. */
#define AMX                                                                                        \
    __attribute__((target("avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni,amx-tile,amx-int8")))

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

/* Sixteen rows' outputs of sixteen inputs (a[r]: row r's, input i in lane i; a is overwritten)
 * into y transposed in registers, so that each input's sixteen rows are one store: input i's at
 * y + i ldy, for the first `live` inputs (the prefill blocks' AMX tiles). */
AVX512 INLINE void store_16x16_512(__m512 *a, int live, float *y, size_t ldy) {
    __m512 t[16], v[16];
    for (int j = 0; j < 8; j++) { /* lane-wise: [a0 b0 a1 b1], [a2 b2 a3 b3] */
        t[2 * j] = _mm512_unpacklo_ps(a[2 * j], a[2 * j + 1]);
        t[2 * j + 1] = _mm512_unpackhi_ps(a[2 * j], a[2 * j + 1]);
    }
    for (int q = 0; q < 4;
         q++) /* a[4q + j]: rows 4q .. 4q + 3 of columns j, j + 4, j + 8, j + 12 */
        for (int h = 0; h < 2; h++) {
            const __m512d lo = _mm512_castps_pd(t[4 * q + h]),
                          hi = _mm512_castps_pd(t[4 * q + h + 2]);
            a[4 * q + 2 * h] = _mm512_castpd_ps(_mm512_unpacklo_pd(lo, hi));
            a[4 * q + 2 * h + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(lo, hi));
        }
    for (int h = 0; h < 2; h++) /* v[8h + j]: columns j, j + 8; v[8h + 4 + j]: j + 4, j + 12 */
        for (int j = 0; j < 4; j++) {
            v[8 * h + j] = _mm512_shuffle_f32x4(a[8 * h + j], a[8 * h + 4 + j], 0x88);
            v[8 * h + 4 + j] = _mm512_shuffle_f32x4(a[8 * h + j], a[8 * h + 4 + j], 0xdd);
        }
    for (int m = 0; m < 8; m++) { /* column m and m + 8: input m's rows 0 .. 15 */
        t[m] = _mm512_shuffle_f32x4(v[m], v[8 + m], 0x88);
        t[m + 8] = _mm512_shuffle_f32x4(v[m], v[8 + m], 0xdd);
    }
    for (int i = 0; i < live; i++) _mm512_storeu_ps(y + (size_t)i * ldy, t[i]);
}
#endif

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
#define EXP_LOOPS(SUFFIX, ATTR)                                                                    \
    ATTR static inline void exp_shifted##SUFFIX(float *p, int n, float m) {                        \
        for (int i = 0; i < n; i++) p[i] = exp_f(p[i] - m);                                        \
    }                                                                                              \
    ATTR static inline void silu_mul##SUFFIX(const float *g, const float *u, int f, float *o) {    \
        for (int i = 0; i < f; i++) o[i] = g[i] * (1.0f / (1.0f + exp_f(-g[i]))) * u[i];           \
    }

/* ---- the families (one file each) ---------------------------------------------------------- */

void quantize_input(const float *x, int k, int bs, int8_t *q, float *d);
/* The inputs of a product prepared once, for every row (and every thread) to read: what the
 * type's dot products take (the int8 blocks and their scales and sums), per input t at
 * t x (the field's values per input); fields a type does not use are NULL (F16, F32: none). */
typedef struct {
    int type, k, n;       /* prepared for `type`: Q5_0 widened for a block as Q8_0 */
    int8_t *xq;           /* n x k int8 values */
    float *xd;            /* n x k / 32 (32-blocks) or k / 256 (K-quants) scales */
    int32_t *corr;        /* 32-blocks: n x k / 4, sums of 4 values x 2^shift */
    int8_t *x4;           /* Q4_0 on AVX2: n x k values in rows_q4's order */
    int32_t *corr4;       /* Q4_0 on AVX2: n x k / 8 */
    float *sums;          /* Q4_1, Q5_1: n x k / 32, ggml's Q8_1 sums */
    int32_t *s32;         /* K-quants: n x k / 32 exact sums of 32 values */
    int16_t *s32h, *x32p; /* K-quants: the same as int16; Q6_K: n x k / 2 pair sums x 32 */
} mm_input;

int mm_alloc(int type, int k, int n, mm_input *in);               /* 0, or -1 when out of memory */
void mm_fill(const mm_input *in, const float *x, int t0, int t1); /* inputs t0 .. t1 - 1 */
mm_input mm_from(const mm_input *in, int t0);                     /* the inputs from t0 on */
void mm_free(mm_input *in);
void fill_q32(const mm_input *in, const float *x, int t0, int t1); /* q32.c */
void fill_q1(const mm_input *in, const float *x, int t0, int t1);  /* q1.c */
void fill_k(const mm_input *in, const float *x, int t0, int t1);   /* kquants.c */
int q32_input_type(int type, int n); /* q32.c: mm_input.type (Q5_0 widened for a block) */

/* y (n, ldy): columns 0 .. n_out - 1 of each of its n rows written (the caller's rows of a wider
 * product start at y + their first row; ldy is the whole product's row length), from the
 * prepared inputs (the float family reads x itself). */
int matmul_q32(int type, const uint8_t *w, size_t row_bytes, int n_out, int k, const mm_input *in,
               int n, float *y, size_t ldy); /* q32.c */
int matmul_q1(int type, const uint8_t *w, size_t row_bytes, int n_out, int k, const mm_input *in,
              int n, float *y, size_t ldy); /* q1.c: Q4_1, Q5_1 */
int matmul_k(int type, const uint8_t *w, size_t row_bytes, int n_out, int k, const mm_input *in,
             int n, float *y, size_t ldy); /* kquants.c */
int matmul_float(int type, const uint8_t *w, size_t row_bytes, int n_out, int k, const float *x,
                 int n, float *y, size_t ldy); /* float.c */

/* The product of rows of W by one thread from prepared inputs: y (n, ldy) = x (n, k) . W^T. */
static inline int matmul_part(int type, const uint8_t *w, size_t row_bytes, int n_out, int k,
                              const float *x, const mm_input *in, int n, float *y, size_t ldy) {
    switch (type) {
    case T_Q8_0:
    case T_Q4_0:
    case T_Q5_0: return matmul_q32(type, w, row_bytes, n_out, k, in, n, y, ldy);
    case T_Q4_1:
    case T_Q5_1: return matmul_q1(type, w, row_bytes, n_out, k, in, n, y, ldy);
    case T_Q4_K:
    case T_Q5_K:
    case T_Q6_K: return matmul_k(type, w, row_bytes, n_out, k, in, n, y, ldy);
    default: return matmul_float(type, w, row_bytes, n_out, k, x, n, y, ldy);
    }
}

/* ---- the thread pool (pool.c) -------------------------------------------------------------- */

/* Work of one pool call: task(ctx, i) for i in 0 .. n_tasks - 1, each task run by exactly one
 * thread (which one does not matter: a task writes outputs no other task writes, computed the
 * same way whoever runs it). Returns 0, or -1 when a task did (out of memory). */
typedef int (*pool_task)(void *ctx, int i);
int pool_run(pool_task task, void *ctx, int n_tasks);
int pool_threads(void);            /* the threads a call runs on, the caller included */
int pool_set_threads(int n);       /* 0, or -1 when a thread could not be started */
void pool_split_below(long bytes); /* products of less work run on the caller alone */
long pool_split_work(void);        /* that bound (64 KiB unless changed) */

/* y (n, n_out) = x (n, k) . W (n_out, k)^T on the pool, split by whole rows (and by inputs when
 * the rows are few): each output element is one thread's matmul_rows, so the bits do not
 * depend on the thread count. Returns 0, or -1 when out of memory. */
int matmul(int type, const uint8_t *w, size_t row_bytes, int n_out, int k, const float *x, int n,
           float *y);

/* Several one-input products in one pool call (a token's chosen experts): item i is
 * y_i (n_out_i) = W_i . x_i, each row task the one-thread code, as matmul. */
typedef struct {
    int type, n_out, k;
    size_t row_bytes;
    const uint8_t *w;
    const float *x;
    float *y;
} mm_item;
int matmul_many(const mm_item *items, int count);

/* A block of inputs x (n, k) in groups of consecutive rows t0 .. t1 - 1, each group times its
 * own matrix of n_out rows (a prompt's experts: the rows of each expert's assignments), into
 * the same rows of y (n, n_out): every group's inputs prepared in one pool call, every group's
 * row tasks in another (each task the one-thread code, as matmul: the bits of one matmul per
 * group). Groups hold at least one row. Returns 0, or -1 when out of memory. */
typedef struct {
    int type, t0, t1;
    size_t row_bytes;
    const uint8_t *w;
} mm_group;
int matmul_groups(const mm_group *groups, int count, int n_out, int k, const float *x, float *y);

/* Where a decoded token's time goes (bench/performance/engine.py --profile): off unless
 * prof_on; counted by the thread that calls the pool (one Python thread at a time). */
enum {
    PROF_LAYER, /* step_whole: a layer of the one-token step */
    PROF_QKV,   /* its Q, K and V products */
    PROF_ATTN,  /* its rows (norms, rotation, the cache) and the attention */
    PROF_OUT,   /* its output products */
    PROF_FFN,   /* its FFN: routing, experts or the dense GLU, and their sum */
    PROF_POOL,  /* a pool call, from start to join */
    PROF_JOIN,  /* a pool call's wait for its workers after the caller ran out of tasks */
    PROF_ALONE, /* a product run on the caller alone (less work than split_below per thread) */
    PROF_N
};
extern int prof_on;
extern uint64_t prof_ns[PROF_N], prof_calls[PROF_N];
uint64_t prof_clock(void);
#define PROF_START(t) const uint64_t t = prof_on ? prof_clock() : 0
#define PROF_STOP(t, phase)                                                                        \
    do {                                                                                           \
        if (prof_on) {                                                                             \
            prof_ns[phase] += prof_clock() - (t);                                                  \
            prof_calls[phase]++;                                                                   \
        }                                                                                          \
    } while (0)

/* attention.c */
float score_portable(const float *q, const float *k, int dh);
void add_scaled_portable(float *o, float c, const float *v, int dh); /* o += c v */
void f16_row_portable(const uint16_t *h, int n, float *out);         /* float16 -> float32 */
#if defined(FOUNDRY_X86)
float score_avx2(const float *q, const float *k, int dh);
void add_scaled_avx2(float *o, float c, const float *v, int dh);
void f16_row_avx2(const uint16_t *h, int n, float *out);
#endif
void attend(const float *q, const void *k, const void *v, int half, int n_pos, int n_head, int n_kv,
            int dh, float *p, float *out);
/* attend for heads of a cache whose positions are `stride` values apart (a block of the kv
 * heads: k and v at its first head, q and out at its first query head). */
void attend_strided(const float *q, const void *k, const void *v, int half, int n_pos, int n_head,
                    int n_kv, int dh, size_t stride, float *p, float *out);
/* Floats of room attend needs. */
size_t attend_room(int n_pos, int n_head, int n_kv, int dh);

/* attention_pool.c */
/* One query row's attention for several blocks of heads in one pool call (the parts of a
 * layer's split): item i is attend over n_pos positions of its cache (k, v at its first
 * position; n_kv heads of dh values a position), its q and out (n_head x dh). A task per kv
 * head and its query heads while the kv heads are as many as the threads, else per fewer
 * query heads; over a window of SPLIT_POSITIONS or more with fewer heads in all than threads,
 * each item split by positions and by value columns instead (attend_split). Each head's
 * operations are attend's for that head alone, so the bits do not depend on the split. */
typedef struct {
    const float *q;
    const void *k, *v;
    int n_head, n_kv;
    float *out;
} attend_item;
int attend_many(const attend_item *items, int count, int half, int n_pos, int dh);
/* Rows of one sequence at positions pos, pos + 1, ...: row t against positions 0 .. pos + t
 * of the cache (the last `window` of them where window > 0), each (row, kv head) a task; one
 * row as attend_many. */
int attend_rows(const float *q, const void *k, const void *v, int half, int pos, int window,
                int rows, int n_head, int n_kv, int dh, float *out);
/* A batch's rows of several sequences, each with its own caches (ctx, n_kv, dh, float16 where
 * half) at its position; its rows are row .. row + rows - 1 of the batch. */
typedef struct {
    void *k, *v;
    int pos, row, rows;
} attend_seq;
/* For one layer's heads: each sequence's K and V rows (n_kv x dh values of the batch's rows, k_ld
 * and v_ld floats apart) stored at its positions as store_rows stores them, then each row's
 * attention as attend_rows computes it for its sequence; a task per (row, kv head, block of its
 * query heads) over every sequence, in one pool call. 0, or -1 out of memory. */
int store_attend(const float *q, const float *kx, size_t k_ld, const float *vx, size_t v_ld,
                 const attend_seq *seqs, int count, int half, int window, int n_head, int n_kv,
                 int dh, float *out);

/* decode.c */
#define MAX_EXPERTS 256
void rmsnorm(const float *x, const float *w, int n, int d, float eps, float *out);
void rope(const float *x, const float *cos, const float *sin, int n, int heads, int dh, int neox,
          float *out);
void swiglu(const float *gu, int n, int f, float *out);
void geglu(const float *gu, const float *table, int n, int f, float *out);
void route(const float *x, const float *w, int n, int d, int n_expert, int k, float *weights,
           int64_t *top);
int64_t assign(const int64_t *top, int64_t m, int64_t first, int n_local, int64_t *order,
               int64_t *bounds);
void combine(const float *ys, const float *weights, const int64_t *slot, int n, int k, int d,
             float *out);
void add_rows(const float *a, const float *b, int n, int d, float *out); /* out may be a */
void store_rows(const float *x, size_t ld, int n, int d, int half, void *out);
void take_rows(const float *x, const int64_t *idx, int m, int d, float *out);

/* step.c: one token through a layer (inference.Engine's one-row step), described once */
typedef struct { /* a matrix of stored blocks: rows of k values of ggml type `type` */
    int type, rows, k;
    size_t row_bytes;
    const uint8_t *w;
} step_mat;

enum { STEP_QK_NONE = 0, STEP_QK_HEAD = 1, STEP_QK_FULL = 2 };

typedef struct { /* one routed expert: gate and up (stacked, or one matrix each), down */
    step_mat gate_up[2], down;
    int n_gate_up;
} step_expert;

typedef struct { /* what one part holds of a layer (infer.step_plan.PartLayer) */
    step_mat qkv[3], out, gate_up[2], down;
    int n_qkv, n_gate_up, has_ffn; /* has_ffn: a dense FFN, or routed experts (below) */
    int n_exp, first_exp;          /* routed: experts first_exp .. first_exp + n_exp - 1 */
    step_expert *experts;          /* n_exp of them (freed with the plan) */
    int n_q, n_k, n_v, n_kv, n_ff; /* rows computed; kv heads cached; FFN intermediate rows */
    int q_keep[2], k_keep[2];      /* the kept heads of the computed Q and K rows */
    int skip_kv;                   /* K and V are the part before's (a shared cache row) */
    const float *bias[3], *q_norm, *k_norm;
} step_part;

/* The most parts one layer's plan holds: a rank holds one; one process standing for a world of
 * N ranks holds N (model.shard.MAX_WORLD). */
#define STEP_MAX_PARTS 16

typedef struct {
    int d, dh, half, neox, qk_norm, window, gelu, n_parts;
    int gelu16; /* the GELU table's float16 copy is in use (step_gelu16) */
    float eps;
    const float *attn_norm, *ffn_norm, *post_attn, *post_ffn, *gelu_table;
    const float *router;  /* routed experts: (n_expert, d) float32, else NULL */
    int n_expert, n_used; /* each token's n_used of n_expert, weights renormalised */
    step_part parts[STEP_MAX_PARTS];
} step_layer;

size_t step_room(const step_layer *l, int n_pos);
int step_gelu16(const float *table);
/* 1 where geglu's rows may look ``table`` up in its float16 copy (step_gelu16, the same bits) */
int gelu16_for(const float *table);
#if defined(FOUNDRY_X86)
void geglu16_avx2(const float *gu, int f, float *out); /* one row, the float16 copy (AVX2) */
#endif
int step_attn(const step_layer *l, int j, const float *h, int pos, void *kc, void *vc,
              const float *cos, const float *sin, float *out, float *room);
int step_ffn(const step_layer *l, int j, const float *h, float *out,
             float *room); /* dense or routed */
/* x += the layer for the token at pos; with xch (a rank of a world) each gate's partial is
 * exchanged through it (step_exchange.h) */
int step_whole(const step_layer *l, float *x, int pos, void *const *kc, void *const *vc,
               const float *cos, const float *sin, float *room, const step_exchange *xch);

/* sample.c: the next token of rows of logits (sampling.py's definition) */
typedef struct {
    double temperature, top_p, u; /* u: the draw's uniform in [0, 1), unused when greedy */
    int64_t top_k;                /* 0: no limit */
} sample_args;

enum { SAMPLE_BROKEN = -1, SAMPLE_ALL_MASKED = -2, SAMPLE_NO_MEMORY = -3 };

int64_t sample_row(const float *z, int64_t v, const sample_args *a); /* a token, or SAMPLE_* */
void sample_rows(const float *const *z, int rows, int64_t v, const sample_args *args, int64_t *out);

/* The same draw with the row cut into vocabulary blocks held by different ranks (sample.c,
 * "A row in blocks"): what each block's rank computes, a row a task on the pool. Each row's
 * parameters are PART_ARGS float64 (part_arg), its results PART_OUTS float64 (part_out). */
enum {
    PART_SKIP = -1,
    PART_PASS = 0,
    PART_TAIL = 1,
    PART_WALK = 2,
    PART_LAST = 3,
    PART_TOP_K = 4,
    PART_FINISH = 5
};
enum { ARG_MODE, ARG_TOP, ARG_INV, ARG_ACC, ARG_U, ARG_TARGET, ARG_TOP_K, ARG_NONZERO, PART_ARGS };
enum { OUT_NONZERO, OUT_LAST, OUT_MASS, OUT_KIND, OUT_INDEX, OUT_TARGET, OUT_N, PART_OUTS };
enum { KIND_NONE = 0, KIND_TOKEN = 1, KIND_LEADER_WALK = 2, KIND_LEADER_LAST = 3, KIND_TOP_K = 4 };
void sample_parts(const float *z, int rows, int64_t v, float *e, double *bsum, const double *args,
                  double *out, int64_t k, float *cand_e, int64_t *cand_id);

#pragma GCC visibility pop
#endif
