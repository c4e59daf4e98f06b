/* The 32-blocks with an integer kernel: Q8_0, Q4_0, Q5_0 (theory in kernels.h): the input's
 * quantization, the portable and AVX2 dot products and the dispatch; the AVX-512 kernels are
 * q32_512.c's, Q4_1 and Q5_1 q1.c's. */

#include "q32.h"

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
        _mm256_storeu_si256((__m256i *)(q + (size_t)b * QK),
                            _mm256_permutevar8x32_epi32(p16, order));
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

static float dot_q_portable(int type, const uint8_t *w, int bsize, const int8_t *xq,
                            const float *xd, int nb) {
    float acc[LANES_Q] = {0};
    return add_blocks(type, acc, w, bsize, xq, xd, 0, nb);
}

#if defined(FOUNDRY_X86)

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
    TARGET static float NAME(int type, const uint8_t *w, int bsize, const int8_t *xq,              \
                             const float *xd, int nb) {                                            \
        __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;                                            \
        int b = 0;                                                                                 \
        for (; b + 2 <= nb; b += 2) {                                                              \
            const uint8_t *p = w + (size_t)b * bsize;                                              \
            const __m256i w0 = LOAD(type, p), w1 = LOAD(type, p + bsize);                          \
            const __m256i x0 = _mm256_loadu_si256((const __m256i *)(xq + b * QK));                 \
            const __m256i x1 = _mm256_loadu_si256((const __m256i *)(xq + (b + 1) * QK));           \
            const __m256i s0 = LANES8(_mm256_sign_epi8(w0, w0), _mm256_sign_epi8(x0, w0));         \
            const __m256i s1 = LANES8(_mm256_sign_epi8(w1, w1), _mm256_sign_epi8(x1, w1));         \
            const __m256 d0 = _mm256_set1_ps(f16c(p) * xd[b]);                                     \
            const __m256 d1 = _mm256_set1_ps(f16c(p + bsize) * xd[b + 1]);                         \
            acc0 = _mm256_add_ps(acc0, _mm256_mul_ps(d0, _mm256_cvtepi32_ps(s0)));                 \
            acc1 = _mm256_add_ps(acc1, _mm256_mul_ps(d1, _mm256_cvtepi32_ps(s1)));                 \
        }                                                                                          \
        float acc[LANES_Q];                                                                        \
        _mm256_storeu_ps(acc, acc0);                                                               \
        _mm256_storeu_ps(acc + 8, acc1);                                                           \
        return add_blocks(type, acc, w, bsize, xq, xd, b, nb);                                     \
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
    TARGET static float NAME(const uint8_t *w, int bsize, const int8_t *xq, const float *xd,       \
                             int nb) {                                                             \
        __m128 acc[4];                                                                             \
        for (int m = 0; m < 4; m++) acc[m] = _mm_setzero_ps();                                     \
        int b = 0;                                                                                 \
        for (; b + 4 <= nb; b += 4)                                                                \
            for (int m = 0; m < 4; m++) {                                                          \
                const uint8_t *p = w + (size_t)(b + m) * bsize;                                    \
                const __m256i wv = load_block_avx2(T_Q4_0, p);                                     \
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + (b + m) * QK));       \
                const __m256i s8 = LANES8(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv));     \
                const __m128i s4 =                                                                 \
                    _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));    \
                acc[m] = _mm_add_ps(                                                               \
                    acc[m], _mm_mul_ps(_mm_set1_ps(f16c(p) * xd[b + m]), _mm_cvtepi32_ps(s4)));    \
            }                                                                                      \
        float lanes[LANES_Q];                                                                      \
        for (int m = 0; m < 4; m++) _mm_storeu_ps(lanes + 4 * m, acc[m]);                          \
        return add_blocks(T_Q4_0, lanes, w, bsize, xq, xd, b, nb);                                 \
    }
DOT_Q4_X86(dot_q4_avx2, AVX2, lanes8_avx2)
DOT_Q4_X86(dot_q4_vnni, VNNI, lanes8_vnni)

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
AVX2 INLINE void finish_rows_avx2(int type, const __m256 *a0, const __m256 *a1, const uint8_t *w,
                                  size_t lane_bytes, int bsize, const int8_t *xq, const float *xd,
                                  int from, int nb, float *y) {
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

AVX2 INLINE void rows_q_avx2_t(int type, const uint8_t *w, size_t row_bytes, size_t lane_bytes,
                               int bsize, const int8_t *xq, const float *xd, int nb, float *y) {
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
            const __m256 d4 =
                _mm256_castps128_ps256(_mm_mul_ps(_mm_cvtph_ps(h), _mm_loadu_ps(xd + b)));
            for (int half = 0; half < 2; half++) {
                const uint8_t *ph = p + 2 * half * bsize;
                const __m256i q = _mm256_loadu2_m128i((const __m128i *)(ph + bsize + 2),
                                                      (const __m128i *)(ph + 2));
                const __m256i xlo = _mm256_loadu_si256((const __m256i *)(xg + 32 * half));
                const __m256i xhi = _mm256_loadu_si256((const __m256i *)(xg + 64 + 32 * half));
                const __m256i lo = _mm256_and_si256(q, m4);
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
                const __m256i p16 =
                    _mm256_add_epi16(_mm256_maddubs_epi16(lo, xlo), _mm256_maddubs_epi16(hi, xhi));
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
#if defined(FOUNDRY_X86)
        if (in->x4 != NULL)
            q4_layout(q, corr, k, in->x4 + (size_t)t * k, in->corr4 + (size_t)t * (k / 8));
#endif
    }
}

int matmul_q32(int type, const uint8_t *w, size_t row_bytes, int n_out, int k, const mm_input *in,
               int n, float *y, size_t ldy) {
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
        if (block_q8_512(w, row_bytes, n_out / QT_ROWS, k, xq, xd, corr, n, ldy, y) < 0) return -1;
        r = QT_ROWS * (n_out / QT_ROWS);
    } else if (use_512 && type == T_Q4_0 && n >= Q4_BLOCK_MIN) { /* the same, rows unpacked */
        if (block_q4_512(w, row_bytes, n_out / QT_ROWS, k, in, n, ldy, y) < 0) return -1;
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
                    dot_q(type, w + rr * row_bytes, bytes, xq + (size_t)t * k, xd + (size_t)t * nb,
                          corr + (size_t)t * (k / 4), nb);
    return 0;
}
