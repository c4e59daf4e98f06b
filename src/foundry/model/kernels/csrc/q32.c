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
    return add_blocks(type, 0.0f, w, bsize, xq, xd, 0, nb);
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

/* One row, AVX2 (maddubs + madd) or AVX-512 VNNI on 256 bits (dpbusd): four blocks a step, each
 * block's eight exact int32 lanes (the same on both), the four blocks' sums by one tree
 * (hsum8x4_avx2), their four scale products d_w * d_x by one multiplication, then add_blocks'
 * float steps in block order (chain4_avx2); the last blocks by add_blocks. */
#define DOT_Q_X86(NAME, TARGET, LANES8)                                                            \
    TARGET static float NAME(int type, const uint8_t *w, int bsize, const int8_t *xq,              \
                             const float *xd, int nb) {                                            \
        float acc = 0.0f;                                                                          \
        int b = 0;                                                                                 \
        for (; b + 4 <= nb; b += 4) {                                                              \
            const uint8_t *p = w + (size_t)b * bsize;                                              \
            __m256i s[4];                                                                          \
            for (int m = 0; m < 4; m++) {                                                          \
                const __m256i wv = load_block_avx2(type, p + m * bsize);                           \
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + (b + m) * QK));       \
                s[m] = LANES8(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv));                 \
            }                                                                                      \
            const __m128i S = hsum8x4_avx2(s[0], s[1], s[2], s[3]);                                \
            const __m128 d = _mm_mul_ps(f16x4(p, p + bsize, p + 2 * bsize, p + 3 * bsize),         \
                                        _mm_loadu_ps(xd + b));                                     \
            acc = chain4_avx2(acc, _mm_mul_ps(d, _mm_cvtepi32_ps(S)));                             \
        }                                                                                          \
        return add_blocks(type, acc, w, bsize, xq, xd, b, nb);                                     \
    }

DOT_Q_X86(dot_q_avx2, AVX2, lanes8_avx2)

VNNI INLINE __m256i lanes8_vnni(__m256i u, __m256i v) {
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, v);
}
DOT_Q_X86(dot_q_vnni, VNNI, lanes8_vnni)

/* AVX2 without AVX-512 (most desktops and laptops: AMD before Zen 4, Intel's client cores): the
 * int8 types four rows at a time, the rows j of each quarter of the matrix (four sequential
 * streams, as rows_q_512_t), sharing the input's loads; a step is one block of the four rows:
 * their exact sums S_b by one tree (hsum8x4_avx2), the four scale products, and each row's
 * float step, four rows a register (the same operations as add_blocks, row by row). Each lane
 * prefetches its own rows PREFETCH2 ahead. */
#define ROWS2 4
#ifndef PREFETCH2
#define PREFETCH2 4 /* rows ahead */
#endif

AVX2 INLINE void rows_q_avx2_t(int type, const uint8_t *w, size_t row_bytes, size_t lane_bytes,
                               int bsize, const int8_t *xq, const float *xd, int nb, float *y) {
    __m128 acc = _mm_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + b * QK));
        const uint8_t *p = w + (size_t)b * bsize;
        __m256i s[ROWS2];
        for (int i = 0; i < ROWS2; i++) {
            const uint8_t *pi = p + i * lane_bytes;
            _mm_prefetch((const char *)(pi + PREFETCH2 * row_bytes), _MM_HINT_T0);
            const __m256i wv = load_block_avx2(type, pi);
            s[i] = lanes8_avx2(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv));
        }
        const __m128i S = hsum8x4_avx2(s[0], s[1], s[2], s[3]);
        const __m128 dw = f16x4(p, p + lane_bytes, p + 2 * lane_bytes, p + 3 * lane_bytes);
        const __m128 d = _mm_mul_ps(dw, _mm_set1_ps(xd[b]));
        acc = _mm_add_ps(acc, _mm_mul_ps(d, _mm_cvtepi32_ps(S)));
    }
    _mm_storeu_ps(y, acc);
}

AVX2 static void rows_q_avx2(int type, const uint8_t *w, size_t row_bytes, size_t lane_bytes,
                             int bsize, const int8_t *xq, const float *xd, int nb, float *y) {
    if (type == T_Q8_0)
        rows_q_avx2_t(T_Q8_0, w, row_bytes, lane_bytes, bsize, xq, xd, nb, y);
    else
        rows_q_avx2_t(T_Q5_0, w, row_bytes, lane_bytes, bsize, xq, xd, nb, y);
}

/* Q4_0, four rows and four blocks a step, each pair of blocks one register: the two blocks' low
 * nibbles (values 0-15, as unsigned bytes) against the input's values 0-15 of each, their high
 * nibbles (16-31) against values 16-31, the two maddubs' int16 pairs added (at most 4 x 15 x 127:
 * exact) and summed by madd into four int32 lanes per block, less 8 x the input's sums
 * (``corr4``, from q4_layout, whose ``x4`` order this reads: per four blocks their values 0-15,
 * then 16-31). The four rows' registers of a pair of blocks give, by one tree, each block's S_b
 * of the four rows; the scale products of each row's four blocks are turned to each block's
 * four rows (a 4 x 4 transposition), and the float steps go block by block, four rows a
 * register. */
AVX2 static void rows_q4_avx2(const uint8_t *w, size_t row_bytes, size_t lane_bytes,
                              const int8_t *xq, const int8_t *x4, const float *xd,
                              const int32_t *corr4, int nb, float *y) {
    const int bsize = 18;
    __m128 acc = _mm_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(0xF);
    const __m256i ones = _mm256_set1_epi16(1);
    const int quads = nb & ~3;
    for (int b = 0; b < quads; b += 4) {
        const int8_t *xg = x4 + (size_t)b * QK;
        const __m128 xd4 = _mm_loadu_ps(xd + b);
        const __m256i cv[2] = {_mm256_loadu_si256((const __m256i *)(corr4 + 4 * b)),
                               _mm256_loadu_si256((const __m256i *)(corr4 + 4 * b + 8))};
        __m128 d[4]; /* d[i]: row i's four blocks, then d[m]: block m's four rows */
        __m256i sv[2][ROWS2];
        for (int i = 0; i < ROWS2; i++) {
            const uint8_t *p = w + i * lane_bytes + (size_t)b * bsize;
            _mm_prefetch((const char *)(p + PREFETCH2 * row_bytes), _MM_HINT_T0);
            d[i] = _mm_mul_ps(f16x4(p, p + bsize, p + 2 * bsize, p + 3 * bsize), xd4);
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
                sv[half][i] = _mm256_sub_epi32(_mm256_madd_epi16(p16, ones), cv[half]);
            }
        }
        _MM_TRANSPOSE4_PS(d[0], d[1], d[2], d[3]);
        for (int half = 0; half < 2; half++) {
            /* half h of the result: block b + 2 half + h of the four rows */
            const __m256i S = hsum4_avx2(sv[half][0], sv[half][1], sv[half][2], sv[half][3]);
            const __m256 f = _mm256_cvtepi32_ps(S);
            acc = _mm_add_ps(acc, _mm_mul_ps(d[2 * half], _mm256_castps256_ps128(f)));
            acc = _mm_add_ps(acc, _mm_mul_ps(d[2 * half + 1], _mm256_extractf128_ps(f, 1)));
        }
    }
    float out[ROWS2];
    _mm_storeu_ps(out, acc);
    for (int i = 0; i < ROWS2; i++)
        y[i] = add_blocks(T_Q4_0, out[i], w + i * lane_bytes, bsize, xq, xd, quads, nb);
}

#endif

static float dot_q(int type, const uint8_t *w, int bsize, const int8_t *xq, const float *xd,
                   int nb) {
#if defined(FOUNDRY_X86)
    if (use_vnni) return dot_q_vnni(type, w, bsize, xq, xd, nb);
    if (use_avx2) return dot_q_avx2(type, w, bsize, xq, xd, nb);
#endif
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

int q32_input_type(int type, int n) {
    const int rest = use_512 ? n - qb_inputs(type, n) : n;     /* the inputs the block leaves */
    return type == T_Q5_0 && rest >= Q5_WIDEN ? T_Q8_0 : type; /* widened: as Q8_0 */
}

int matmul_q32(int type, const uint8_t *w, size_t row_bytes, int n_out, int k, const mm_input *in,
               int n, float *y, size_t ldy) {
#if defined(FOUNDRY_X86)
    if (use_512 && qb_inputs(type, n) > 0) {
        /* groups of QB_G inputs by the block, the last a part one of QB_PART_MIN or more
         * (q32_block.c: each row unpacked once per tile, whatever the type), the rest by the
         * paths below */
        const int blocked = qb_inputs(type, n);
        if (q32_block_512(type, w, row_bytes, n_out, k, in, blocked, y, ldy) < 0) return -1;
        if (blocked == n) return 0;
        const mm_input rest = mm_from(in, blocked);
        return matmul_q32(type, w, row_bytes, n_out, k, &rest, n - blocked,
                          y + (size_t)blocked * ldy, ldy);
    }
#endif
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
                y[(size_t)t * ldy + rr] = dot_q(type, w + rr * row_bytes, bytes, xq + (size_t)t * k,
                                                xd + (size_t)t * nb, nb);
    return 0;
}
