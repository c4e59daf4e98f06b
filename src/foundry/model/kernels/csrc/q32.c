/* The 32-blocks with an integer kernel: Q8_0, Q4_0, Q5_0 (theory in kernels.h). */

#include "kernels.h"

/* Inputs per tile of a prefill block (with their sums, 4 bytes a value): every row group of the
 * matrix passes over a tile while it stays in L2, so each weight block is read once per tile. */
#define Q_TILE 64

/* The inputs' int8 blocks are ggml's, as llama.cpp's CPU build on x86-64 makes them (its
 * quantize_row_q8_0 / q8_1 for AVX2 and quantize_row_q8_K), one definition on every path:
 *
 * - blocks of 32 (Q8_0, Q8_1): amax = max |x|, q = round(x * (127 / amax)) to nearest, ties to
 *   even, and the scale d = amax / 127 kept as float16 (round_f16): the products' d_x. (ggml's
 *   scalar reference multiplies by 1 / d and rounds ties away from zero: a value one ulp apart
 *   now and then; llama.cpp on this machine type runs the AVX2 code.)
 * - blocks of 256 (Q8_K): m = the value of largest magnitude (the first, with its sign),
 *   s = -127 / m, q = min(127, round(s * x)) to nearest, ties to even, and d = 1 / s in
 *   float32 (negative where m is positive: q and d change sign together).
 *
 * round_even(v): to nearest, ties to even, for |v| < 2^22, as ggml's nearest_int (a float
 * addition of 1.5 x 2^23 leaves the integer in the low fraction bits). */
static inline int32_t round_even(float v) {
    const float t = v + 12582912.0f;
    int32_t i;
    memcpy(&i, &t, 4);
    return (i & 0x007fffff) - 0x00400000;
}

static void quantize_block32(const float *x, int8_t *q, float *d) {
    float amax = 0.0f;
    for (int i = 0; i < QK; i++) amax = fmaxf(amax, fabsf(x[i]));
    const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
    *d = round_f16(amax / 127.0f);
    for (int i = 0; i < QK; i++) q[i] = (int8_t)round_even(x[i] * id);
}

static void quantize_block256(const float *x, int8_t *q, float *d) {
    float amax = 0.0f, m = 0.0f;
    for (int i = 0; i < QK_K; i++)
        if (fabsf(x[i]) > amax) {
            amax = fabsf(x[i]);
            m = x[i];
        }
    if (amax == 0.0f) {
        memset(q, 0, QK_K);
        *d = 0.0f;
        return;
    }
    const float s = -127.0f / m;
    for (int i = 0; i < QK_K; i++) {
        const int32_t v = round_even(s * x[i]);
        q[i] = (int8_t)(v < 127 ? v : 127);
    }
    *d = 1.0f / s;
}

#if defined(FOUNDRY_X86)
/* quantize_block32's operations 8 values at a time: the same maximum (exact; NaNs ignored as
 * fmaxf does: max_ps keeps its second operand when the first is NaN), the same scalar scales,
 * the same product x * id, rounded to nearest even by round_ps (round_even's result). */
AVX2 static void quantize_input_avx2(const float *x, int k, int8_t *q, float *d) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int b = 0; b < k / QK; b++) {
        const float *xb = x + (size_t)b * QK;
        __m256 m = _mm256_setzero_ps();
        for (int i = 0; i < QK; i += 8)
            m = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(xb + i), absmask), m);
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
        const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
        d[b] = round_f16(amax / 127.0f);
        const __m256 idv = _mm256_set1_ps(id);
        __m256i v32[4];
        for (int j = 0; j < 4; j++) {
            const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(xb + 8 * j), idv);
            v32[j] = _mm256_cvtps_epi32(
                _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        }
        const __m256i p16 = _mm256_packs_epi16(_mm256_packs_epi32(v32[0], v32[1]),
                                               _mm256_packs_epi32(v32[2], v32[3]));
        _mm256_storeu_si256((__m256i *)(q + (size_t)b * QK), _mm256_permutevar8x32_epi32(p16, order));
    }
}
#endif

/* Inputs as int8 blocks of bs values (32: ggml's Q8_0, d as float16; 256: its Q8_K, d float32):
 * q (k values), d (k / bs scales). */
void quantize_input(const float *x, int k, int bs, int8_t *q, float *d) {
    if (bs == QK_K) {
        for (int b = 0; b < k / QK_K; b++) quantize_block256(x + b * QK_K, q + b * QK_K, d + b);
        return;
    }
#if defined(FOUNDRY_X86)
    if (use_avx2) {
        quantize_input_avx2(x, k, q, d);
        return;
    }
#endif
    for (int b = 0; b < k / QK; b++) quantize_block32(x + b * QK, q + b * QK, d + b);
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

#if defined(FOUNDRY_X86)

/* Q5_0's low four bits of one block's 32 values as bytes: values 0-15 the low nibbles of its
 * 16 bytes of quants, 16-31 the high ones. */
AVX2 INLINE __m256i q5_nibbles_avx2(const uint8_t *blk) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)(blk + 6));
    const __m128i m4 = _mm_set1_epi8(0xF);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), m4), _mm_and_si128(raw, m4));
}

/* Q5_0's 32 values of one block as unsigned bytes 0..31: the nibbles and, as 16, bit v of the
 * block's 32-bit qh for value v. */
AVX2 INLINE __m256i q5_unsigned_avx2(const uint8_t *blk) {
    uint32_t qh;
    memcpy(&qh, blk + 2, 4);
    const __m256i nib = q5_nibbles_avx2(blk);
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
/* q5_unsigned_avx2 with AVX-512 BW: qh is the mask of the bytes that take 16 (bit v, byte v). */
AVX512 INLINE __m256i q5_unsigned_bw(const uint8_t *blk) {
    uint32_t qh;
    memcpy(&qh, blk + 2, 4);
    const __m256i nib = q5_nibbles_avx2(blk);
    return _mm256_or_si256(nib, _mm256_maskz_mov_epi8((__mmask32)qh, _mm256_set1_epi8(0x10)));
}

AVX512 INLINE __m512i load_pair_512(int type, const uint8_t *p, int bsize) {
    if (type == T_Q8_0) {
        const __m512i v = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(p + 2))),
            _mm256_loadu_si256((const __m256i *)(p + bsize + 2)), 1);
        return _mm512_xor_si512(v, _mm512_set1_epi8((char)0x80));
    }
    /* Q5_0, both blocks at once: each block's 16 bytes of nibbles in two 128-bit lanes (low
     * nibbles: values 0-15, then high: 16-31), and the two qh as one 64-bit byte mask. */
    uint32_t qh0, qh1;
    memcpy(&qh0, p + 2, 4);
    memcpy(&qh1, p + bsize + 2, 4);
    const __m256i raw = _mm256_loadu2_m128i((const __m128i *)(p + bsize + 6),
                                            (const __m128i *)(p + 6));
    const __m512i dup = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 1, 0, 1, 2, 3, 2, 3),
                                                 _mm512_castsi256_si512(raw));
    const __m512i sh = _mm512_setr_epi64(0, 0, 0x0004000400040004LL, 0x0004000400040004LL, 0, 0,
                                         0x0004000400040004LL, 0x0004000400040004LL);
    const __m512i nib = _mm512_and_si512(_mm512_srlv_epi16(dup, sh), _mm512_set1_epi8(0xF));
    const __mmask64 high = (__mmask64)qh0 | ((__mmask64)qh1 << 32);
    return _mm512_or_si512(nib, _mm512_maskz_mov_epi8(high, _mm512_set1_epi8(0x10)));
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

/* A prefill block on AVX-512, Q8_0 (and Q5_0 unpacked to it): R = 4 rows against T inputs, each
 * (row, input) exactly rows_q_512_t's operations. The rows' weights are turned unsigned once per
 * tile (``wu``: w + 128 by the sign bit, 32 bytes a block) with their float16 scales as floats
 * (``dw``), so a step of two blocks is, per row, one load shared by the T inputs, and per (row,
 * input) the scale product d_w * d_x (one multiplication of the two pairs' vectors: the same
 * rounding), dpbusd onto minus the correction, the conversion, the multiplication and the
 * addition. */
#define QT_ROWS 4
AVX512 INLINE void tile_q8_512_t(const int T, const uint8_t *wu, const float *dw, int nb,
                                 int k, const int8_t *xq, const float *xd, const int32_t *corr,
                                 float *acc_out) {
    __m512 acc[QT_ROWS][4];
    for (int i = 0; i < QT_ROWS; i++)
        for (int t = 0; t < T; t++) acc[i][t] = _mm512_setzero_ps();
    const int pairs = nb & ~1;
    for (int b = 0; b < pairs; b += 2) {
        __m512i xv[4], ncv[4];
        __m512 dx[4];
        for (int t = 0; t < T; t++) {
            xv[t] = _mm512_loadu_si512((const void *)(xq + (size_t)t * k + b * QK));
            ncv[t] = _mm512_sub_epi32(_mm512_setzero_si512(),
                                      _mm512_loadu_si512((const void *)(corr + (size_t)t * (k / 4) + b * 8)));
            dx[t] = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(xd[(size_t)t * nb + b]),
                                         _mm512_set1_ps(xd[(size_t)t * nb + b + 1]));
        }
        for (int i = 0; i < QT_ROWS; i++) {
            const __m512i wv = _mm512_loadu_si512((const void *)(wu + ((size_t)i * nb + b) * QK));
            const __m512 dwv = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(dw[(size_t)i * nb + b]),
                                                    _mm512_set1_ps(dw[(size_t)i * nb + b + 1]));
            for (int t = 0; t < T; t++) {
                const __m512i sv = _mm512_dpbusd_epi32(ncv[t], wv, xv[t]);
                const __m512 dv = _mm512_mul_ps(dwv, dx[t]);
                acc[i][t] = _mm512_add_ps(acc[i][t], _mm512_mul_ps(dv, _mm512_cvtepi32_ps(sv)));
            }
        }
    }
    for (int i = 0; i < QT_ROWS; i++)
        for (int t = 0; t < T; t++) _mm512_storeu_ps(acc_out + (i * 4 + t) * LANES_Q, acc[i][t]);
}

AVX512 static void tile_q8_512(int T, const uint8_t *wu, const float *dw, int nb, int k,
                               const int8_t *xq, const float *xd, const int32_t *corr,
                               float *acc_out) {
    switch (T) {
    case 1: tile_q8_512_t(1, wu, dw, nb, k, xq, xd, corr, acc_out); break;
    case 2: tile_q8_512_t(2, wu, dw, nb, k, xq, xd, corr, acc_out); break;
    case 3: tile_q8_512_t(3, wu, dw, nb, k, xq, xd, corr, acc_out); break;
    default: tile_q8_512_t(4, wu, dw, nb, k, xq, xd, corr, acc_out); break;
    }
}

/* y (n, n_out) for a block of inputs, Q8_0 rows r0 .. r0 + 4 * groups - 1, on tile_q8_512:
 * returns -1 when out of memory. */
AVX512 static int block_q8_512(const uint8_t *w, size_t row_bytes, int groups, int k,
                               const int8_t *xq, const float *xd, const int32_t *corr, int n,
                               size_t ldy, float *y) {
    const int nb = k / QK;
    uint8_t *wu = malloc((size_t)QT_ROWS * nb * QK);
    float *dw = malloc((size_t)QT_ROWS * nb * sizeof(float));
    if (wu == NULL || dw == NULL) {
        free(wu);
        free(dw);
        return -1;
    }
    for (int t0 = 0; t0 < n; t0 += Q_TILE)
        for (int g = 0; g < groups; g++) {
            for (int i = 0; i < QT_ROWS; i++) /* the group's rows, unsigned, scales as floats */
                for (int b = 0; b < nb; b++) {
                    const uint8_t *blk = w + (size_t)(QT_ROWS * g + i) * row_bytes + (size_t)b * 34;
                    _mm256_storeu_si256((__m256i *)(wu + ((size_t)i * nb + b) * QK),
                                        _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(blk + 2)),
                                                         _mm256_set1_epi8((char)0x80)));
                    dw[(size_t)i * nb + b] = f16c(blk);
                }
            for (int t = t0; t < n && t < t0 + Q_TILE; t += 4) {
                const int T = n - t < 4 ? n - t : (t0 + Q_TILE - t < 4 ? t0 + Q_TILE - t : 4);
                float lanes[QT_ROWS * 4 * LANES_Q];
                tile_q8_512(T, wu, dw, nb, k, xq + (size_t)t * k, xd + (size_t)t * nb,
                            corr + (size_t)t * (k / 4), lanes);
                for (int i = 0; i < QT_ROWS; i++)
                    for (int u = 0; u < T; u++) {
                        const int r = QT_ROWS * g + i;
                        y[(size_t)(t + u) * ldy + r] = add_blocks(
                            T_Q8_0, lanes + (i * 4 + u) * LANES_Q, w + (size_t)r * row_bytes, 34,
                            xq + (size_t)(t + u) * k, xd + (size_t)(t + u) * nb, nb & ~1, nb);
                    }
            }
        }
    free(wu);
    free(dw);
    return 0;
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
 * 16 values at a time: quantize_block32's maximum (exact, NaNs ignored as fmaxf does), scalar
 * scales and product x * id, rounded to nearest even by roundscale (round_even's result). */
AVX512 static void prepare_input_512(const float *x, int k, int shift, int8_t *q, float *d,
                                     int32_t *corr) {
    for (int b = 0; b < k / QK; b++) {
        const __m512 x0 = _mm512_loadu_ps(x + b * QK), x1 = _mm512_loadu_ps(x + b * QK + 16);
        const __m512 m = _mm512_max_ps(_mm512_abs_ps(x1),
                                       _mm512_max_ps(_mm512_abs_ps(x0), _mm512_setzero_ps()));
        const float amax = _mm512_reduce_max_ps(m);
        const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
        d[b] = round_f16(amax / 127.0f); /* quantize_block32's */
        const __m512 idv = _mm512_set1_ps(id);
        for (int h = 0; h < 2; h++) {
            const __m512 v = _mm512_mul_ps(h ? x1 : x0, idv);
            const __m512 t = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
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


#if defined(FOUNDRY_X86)
AVX2 static void widen_q5_avx2(const uint8_t *blk, uint8_t *out) {
    _mm256_storeu_si256((__m256i *)out, load_block_avx2(T_Q5_0, blk));
}
#endif

/* A Q5_0 block's 32 values as int8 (v - 16), as unpack_block gives them. */
static void widen_q5(const uint8_t *blk, uint8_t *out) {
#if defined(FOUNDRY_X86)
    if (use_avx2) {
        widen_q5_avx2(blk, out);
        return;
    }
#endif
    unpack_block(T_Q5_0, blk, (int8_t *)out);
}

/* Inputs t0 .. t1 - 1 of a Q8_0, Q4_0 or Q5_0 product as ``in`` holds them (mm_alloc): the
 * int8 blocks, their scales, the sums of each 4 values times 2^shift, and Q4_0's order for
 * AVX2 (x4, corr4). */
void fill_q32(const mm_input *in, const float *x, int t0, int t1) {
    const int k = in->k, nb = k / QK, type = in->type;
    const int shift = type == T_Q8_0 ? 7 : type == T_Q5_0 ? 4 : 3; /* 128, 16 or 8 */
    for (int t = t0; t < t1; t++) {
        int8_t *q = in->xq + (size_t)t * k;
        int32_t *corr = in->corr + (size_t)t * (k / 4);
#if defined(FOUNDRY_X86)
        if (use_512) {
            prepare_input_512(x + (size_t)t * k, k, shift, q, in->xd + (size_t)t * nb, corr);
        } else
#endif
        {
            quantize_input(x + (size_t)t * k, k, QK, q, in->xd + (size_t)t * nb);
            for (int g = 0; g < k / 4; g++)
                corr[g] = (q[4 * g] + q[4 * g + 1] + q[4 * g + 2] + q[4 * g + 3]) * (1 << shift);
        }
        if (in->x4 != NULL)
            q4_layout(q, corr, k, in->x4 + (size_t)t * k, in->corr4 + (size_t)t * (k / 8));
    }
}

int matmul_q32(int type, const uint8_t *w, size_t row_bytes, int n_out, int k,
               const mm_input *in, int n, float *y, size_t ldy) {
    if (type == T_Q5_0 && in->type == T_Q8_0) {
        /* A block of inputs (mm_alloc: Q5_WIDEN or more): the Q5_0 weights unpacked once into
         * Q8_0 blocks (the same scale, the values v - 16 as int8) and multiplied as Q8_0, whose
         * operations are Q5_0's on the same int8 values (the same lanes, the same float
         * steps): the same bits, without unpacking each block again for every input. */
        const int nb = k / QK;
        uint8_t *w8 = malloc((size_t)n_out * nb * 34);
        if (w8 == NULL) return -1;
        for (int r = 0; r < n_out; r++)
            for (int b = 0; b < nb; b++) {
                const uint8_t *blk = w + (size_t)r * row_bytes + (size_t)b * 22;
                uint8_t *out = w8 + ((size_t)r * nb + b) * 34;
                memcpy(out, blk, 2);
                widen_q5(blk, out + 2);
            }
        const int rc = matmul_q32(T_Q8_0, w8, (size_t)nb * 34, n_out, k, in, n, y, ldy);
        free(w8);
        return rc;
    }
    const int bytes = type == T_Q8_0 ? 34 : type == T_Q5_0 ? 22 : 18;
    const int nb = k / QK;
    const int8_t *xq = in->xq;
    const float *xd = in->xd;
    const int32_t *corr = in->corr;
    int r = 0;
#if defined(FOUNDRY_X86)
    if (use_512 && type == T_Q8_0 && n > 1) { /* a block of inputs: tiles of rows x inputs */
        if (block_q8_512(w, row_bytes, n_out / QT_ROWS, k, xq, xd, corr, n, ldy, y) < 0)
            return -1;
        r = QT_ROWS * (n_out / QT_ROWS);
    } else if (use_avx2) { /* groups of four rows, kept in cache while the inputs pass over them */
        const int8_t *x4 = in->x4;
        const int32_t *corr4 = in->corr4;
        const int per = use_512 ? ROWS : ROWS2, quarter = n_out / per;
        for (int t0 = 0; t0 < n; t0 += Q_TILE) /* a tile of inputs stays in L2 */
        for (int j = 0; j < quarter; j++)
            for (int t = t0; t < n && t < t0 + Q_TILE; t++) {
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
                for (int i = 0; i < per; i++) y[(size_t)t * ldy + j + i * quarter] = out[i];
            }
        r = per * quarter;
    }
#endif
    for (int t0 = 0; t0 < n; t0 += Q_TILE)
        for (int rr = r; rr < n_out; rr++)
            for (int t = t0; t < n && t < t0 + Q_TILE; t++)
                y[(size_t)t * ldy + rr] =
                    dot_q(type, w + rr * row_bytes, bytes, xq + (size_t)t * k,
                          xd + (size_t)t * nb, corr + (size_t)t * (k / 4), nb);
    return 0;
}

/* ---- Q4_1 and Q5_1: the 32-blocks with a minimum ------------------------------------------- */

/* y = sum over blocks of d_w (d_x q.x) + m_w (d_x S): the input quantized to int8 blocks of 32
 * as for Q8_0, S its exact sum per block; the weights' values unsigned (Q4_1 0..15, Q5_1
 * 0..31). A block's products give add_block's eight exact int32 lanes, added as (d_w * d_x) *
 * lane_j into accumulator 8 (block mod 2) + j; the minimums add (m_w * d_x) * S into one more
 * float, which comes onto the halved lanes at the end: finish(acc) + acc_min. */
static inline void unpack_block_min(int type, const uint8_t *blk, int8_t *q) {
    if (type == T_Q4_1) {
        for (int i = 0; i < QK / 2; i++) {
            q[i] = (int8_t)(blk[4 + i] & 0xF);
            q[i + QK / 2] = (int8_t)(blk[4 + i] >> 4);
        }
        return;
    }
    uint32_t qh; /* Q5_1: value v's fifth bit is bit v of qh */
    memcpy(&qh, blk + 4, 4);
    for (int i = 0; i < QK / 2; i++) {
        q[i] = (int8_t)((blk[8 + i] & 0xF) | (((qh >> i) & 1) << 4));
        q[i + QK / 2] = (int8_t)((blk[8 + i] >> 4) | (((qh >> (i + 16)) & 1) << 4));
    }
}

static float dot_q1_portable(int type, const uint8_t *w, int bsize, const int8_t *xq,
                             const float *xd, const float *sums, int nb) {
    float acc[LANES_Q] = {0}, acc_min = 0.0f;
    int8_t q[QK];
    int32_t s[8];
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = w + (size_t)b * bsize;
        unpack_block_min(type, blk, q);
        idot_lanes(q, xq + b * QK, s);
        float *a = acc + 8 * (b & 1);
        const float f = f16(blk) * xd[b];
        for (int j = 0; j < 8; j++) a[j] = a[j] + f * (float)s[j];
        acc_min = acc_min + f16(blk + 2) * sums[b];
    }
    return finish(acc, LANES_Q) + acc_min;
}

#if defined(FOUNDRY_X86)
/* dot_q1_portable's operations, two blocks a step: maddubs of the unsigned values (at most 31)
 * and the input's int8 values is exact, madd by ones sums each two pairs: the eight lanes. */
AVX2 INLINE float dot_q1_avx2_t(const int type, const uint8_t *w, int bsize, const int8_t *xq,
                                const float *xd, const float *sums, int nb) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
    float acc_min = 0.0f;
    const __m128i m4 = _mm_set1_epi8(0xF);
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = w + (size_t)b * bsize;
        __m256i u;
        if (type == T_Q4_1) {
            const __m128i raw = _mm_loadu_si128((const __m128i *)(blk + 4));
            u = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), m4), _mm_and_si128(raw, m4));
        } else {
            u = q5_unsigned_avx2(blk + 2); /* qh at 4, values at 8: Q5_0's layout 2 bytes on */
        }
        const __m256i s = lanes8_avx2(u, _mm256_loadu_si256((const __m256i *)(xq + b * QK)));
        const float dx = xd[b];
        const __m256 v = _mm256_mul_ps(_mm256_set1_ps(f16c(blk) * dx), _mm256_cvtepi32_ps(s));
        if (b & 1)
            acc1 = _mm256_add_ps(acc1, v);
        else
            acc0 = _mm256_add_ps(acc0, v);
        acc_min = acc_min + f16c(blk + 2) * sums[b];
    }
    return finish16_avx2(acc0, acc1) + acc_min;
}

AVX2 static float dot_q1_avx2(int type, const uint8_t *w, int bsize, const int8_t *xq,
                              const float *xd, const float *sums, int nb) {
    return type == T_Q4_1 ? dot_q1_avx2_t(T_Q4_1, w, bsize, xq, xd, sums, nb)
                          : dot_q1_avx2_t(T_Q5_1, w, bsize, xq, xd, sums, nb);
}
#endif

/* Inputs t0 .. t1 - 1 of a Q4_1 or Q5_1 product: int8 blocks as Q8_0's and ggml's Q8_1 sums. */
void fill_q1(const mm_input *in, const float *x, int t0, int t1) {
    const int k = in->k, nb = k / QK;
    for (int t = t0; t < t1; t++) {
        const int8_t *q = in->xq + (size_t)t * k;
        const float *xt = x + (size_t)t * k;
        quantize_input(xt, k, QK, in->xq + (size_t)t * k, in->xd + (size_t)t * nb);
        for (int b = 0; b < nb; b++) { /* as ggml's Q8_1: s = fp16(sum * d), d float32 */
            int32_t s = 0;
            for (int i = 0; i < QK; i++) s += q[b * QK + i];
            float amax = 0.0f; /* a loop of its own: aarch64 gcc 12's vectorizer fails on both */
            for (int i = 0; i < QK; i++) amax = fmaxf(amax, fabsf(xt[b * QK + i]));
            in->sums[(size_t)t * nb + b] = round_f16((float)s * (amax / 127.0f));
        }
    }
}

int matmul_q1(int type, const uint8_t *w, size_t row_bytes, int n_out, int k,
              const mm_input *in, int n, float *y, size_t ldy) {
    const int bytes = type == T_Q4_1 ? 20 : 24, nb = k / QK;
    float (*dot)(int, const uint8_t *, int, const int8_t *, const float *, const float *, int) =
        dot_q1_portable;
#if defined(FOUNDRY_X86)
    if (use_avx2) dot = dot_q1_avx2;
#endif
    for (int t0 = 0; t0 < n; t0 += Q_TILE)
        for (int r = 0; r < n_out; r++)
            for (int t = t0; t < n && t < t0 + Q_TILE; t++)
                y[(size_t)t * ldy + r] = dot(type, w + (size_t)r * row_bytes, bytes,
                                             in->xq + (size_t)t * k, in->xd + (size_t)t * nb,
                                             in->sums + (size_t)t * nb, nb);
    return 0;
}
