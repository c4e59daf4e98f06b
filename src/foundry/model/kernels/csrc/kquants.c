/* The K-quants: Q4_K, Q5_K, Q6_K on super-blocks of 256 (theory in kernels.h). */

#include "kquants.h"

/* ---- the K-quants' integer dot product: exact per super-block ---------------------------- */

/* The inputs of a K-quant product: int8 values in blocks of 256 (one scale each, as ggml's
 * Q8_K), and their exact sums over each 32 values (``s32``). */
static void quantize_input_k(const float *x, int k, int8_t *q, float *d, int32_t *s32) {
    quantize_input(x, k, QK_K, q, d);
    for (int c = 0; c < k / QK; c++) {
        int32_t t = 0;
        for (int i = 0; i < QK; i++) t += q[c * QK + i];
        s32[c] = t;
    }
}

/* A super-block's scales as integers: sc[16] (for chunk c of 32 values, lanes 0-3 take
 * sc[2c] and lanes 4-7 sc[2c + 1]: the two sub-blocks of 16 of Q6_K, the same scale twice for
 * Q4_K and Q5_K) and m[8] (the minimum of each chunk; 0 for Q6_K). */
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

/* The one definition (kernels.h): super-block b's exact int32 L = the sum over its chunks of
 * sc x (the int8 products of each sub-block: Q4_K, Q5_K 32 values, Q6_K 16), and for Q4_K, Q5_K
 * M = the sum over chunks of m_c x (the chunk's input sum); then in float, b by b,
 * acc = acc + (d xd_b) L and acc_min = acc_min + (dmin xd_b) M; the result acc - acc_min.
 * Bounds (|x| <= 127): Q4_K |L| <= 256 x 15 x 63 x 127 < 2^25, Q5_K 256 x 31 x 63 x 127 < 2^26,
 * Q6_K 256 x 32 x 128 x 127 < 2^28, M <= 8 x 63 x 32 x 127 < 2^21: every int32 sum is exact, in
 * any order; (float)L may round (above 2^24), the same on every path. */
static float dot_k_portable(int type, const uint8_t *w, int bsize, const int8_t *xq,
                            const float *xd, const int32_t *s32, int nsb) {
    float acc = 0.0f, acc_min = 0.0f;
    int8_t q[QK];
    int32_t sc[16], m[8], s[8];
    for (int b = 0; b < nsb; b++) {
        const uint8_t *blk = w + (size_t)b * bsize;
        const float d = f16(blk + KQ_D(type)), dmin = type == T_Q6_K ? 0.0f : f16(blk + 2);
        kq_scales(type, blk, sc, m);
        int32_t L = 0, M = 0;
        for (int c = 0; c < 8; c++) {
            kq_chunk(type, blk, c, q);
            idot_lanes(q, xq + b * QK_K + c * QK, s);
            for (int l = 0; l < 8; l++) L += sc[2 * c + l / 4] * s[l];
            M += m[c] * s32[b * 8 + c];
        }
        acc = acc + (d * xd[b]) * (float)L;
        acc_min = acc_min + (dmin * xd[b]) * (float)M;
    }
    return acc - acc_min;
}

#if defined(FOUNDRY_X86)
#define KQ_AHEAD 4 /* super-blocks prefetched ahead */

/* The K-quants on x86: a tile of R rows (lane_bytes apart) against T inputs (R x T <= 4:
 * decode takes four rows of one input, a prefill block one row of four inputs, which then share
 * each chunk of weights as it is unpacked; on AVX-512 VNNI only what kquants_512.c's block
 * leaves: the last few inputs of a tile, and blocks of fewer than KQ_BLOCK_MIN), each exactly
 * dot_k_portable's operations. A chunk's 32 values unsigned (Q4_K 0..15, Q5_K 0..31, Q6_K its
 * stored 0..63), maddubs against the input's int8 values gives exact int16 pair sums (at most
 * 2 x 63 x 128); Q6_K takes off 32 x the input's pair sums (``x32p``, per input; still within
 * int16), which makes them the sums of (q - 32) x; madd by the chunk's scale as int16 (Q6_K:
 * lanes 0-3 sc[2c], 4-7 sc[2c + 1]) sums each two pairs times the scale, into eight exact int32
 * lanes that are added into the super-block's one L at its end. The minimums: M = the exact sum
 * of m_c x s32_c by one madd of the eight mins and the input's eight chunk sums as int16
 * (``s32h``, at most 32 x 128). */

#define KT 4 /* R x T, the outputs of one tile */

/* A tile's running sums: output i = r T + t in float i of acc (and of amin, the minimums'
 * part: Q4_K, Q5_K). The AVX2 and AVX-512 tiles share them and the float operations that end
 * a super-block, four outputs a register. */
typedef struct {
    __m128 acc, amin;
} kq_sums;

/* The exact sums of the eight int32 lanes of each of v[0 .. 3], as four int32. */
AVX2 INLINE __m128i kq_hsum4(const __m256i *v) {
    const __m256i h =
        _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

/* Super-block b of each of the R rows done: output i's exact int32 lanes L8[i] summed into its
 * L, times d x dx into acc, and for Q4_K and Q5_K the exact M = sum of m_c x s32_c (one madd of
 * the eight mins and the input's chunk sums) times dmin x dx into amin. */
AVX2 INLINE void kq_sums_block(kq_sums *s, const int type, const int R, const int T, const int b,
                               const uint8_t *w, size_t lane_bytes, int bsize, int nsb, int k,
                               const float *xd, const int16_t *s32h, const __m256i *L8,
                               const __m128i *mins) {
    float d[KT] = {0}, dmin[KT] = {0}, dx[KT] = {0};
    __m256i l8[KT], m8[KT];
    for (int i = 0; i < KT; i++) l8[i] = m8[i] = _mm256_setzero_si256();
    for (int r = 0; r < R; r++) {
        const uint8_t *blk = w + r * lane_bytes + (size_t)b * bsize;
        for (int t = 0; t < T; t++) {
            const int i = r * T + t;
            d[i] = f16c(blk + KQ_D(type));
            dx[i] = xd[(size_t)t * nsb + b];
            l8[i] = L8[i];
            if (type != T_Q6_K) {
                dmin[i] = f16c(blk + 2);
                m8[i] = _mm256_castsi128_si256(_mm_madd_epi16(
                    mins[r],
                    _mm_loadu_si128((const __m128i *)(s32h + (size_t)t * (k / QK) + 8 * b))));
            }
        }
    }
    const __m128 vdx = _mm_loadu_ps(dx);
    const __m128 f = _mm_mul_ps(_mm_loadu_ps(d), vdx);
    s->acc = _mm_add_ps(s->acc, _mm_mul_ps(f, _mm_cvtepi32_ps(kq_hsum4(l8))));
    if (type != T_Q6_K) {
        const __m128 fm = _mm_mul_ps(_mm_loadu_ps(dmin), vdx);
        s->amin = _mm_add_ps(s->amin, _mm_mul_ps(fm, _mm_cvtepi32_ps(kq_hsum4(m8))));
    }
}

AVX2 INLINE void kq_sums_store(const kq_sums *s, const int R, const int T, float *y, size_t y_row,
                               size_t y_in) {
    float out[KT];
    _mm_storeu_ps(out, _mm_sub_ps(s->acc, s->amin));
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) y[r * y_row + t * y_in] = out[r * T + t];
}

/* The weights KQ_AHEAD super-blocks past blk, into the cache before they are needed. */
AVX2 INLINE void kq_prefetch(const uint8_t *blk, const int bsize) {
    for (int o = 0; o < bsize; o += 64)
        _mm_prefetch((const char *)(blk + KQ_AHEAD * bsize + o), _MM_HINT_T0);
}

AVX2 INLINE void kq_tile_avx2_t(const int type, const int R, const int T, const uint8_t *w,
                                size_t lane_bytes, int bsize, int nsb, int k, const int8_t *xq,
                                const float *xd, const int16_t *s32h, const int16_t *x32p, float *y,
                                size_t y_row, size_t y_in) {
    kq_sums s = {_mm_setzero_ps(), _mm_setzero_ps()};
    for (int b = 0; b < nsb; b++) {
        __m256i scv[KT][8], L[KT];
        __m128i mins[KT];
        for (int r = 0; r < R; r++) {
            const uint8_t *blk = w + r * lane_bytes + (size_t)b * bsize;
            kq_prefetch(blk, bsize);
            kq_scales_avx2(type, blk, scv[r], &mins[r]);
        }
        for (int i = 0; i < R * T; i++) L[i] = _mm256_setzero_si256();
        for (int c = 0; c < 8; c++) {
            __m256i xv[KT], xp[KT];
            for (int t = 0; t < T; t++) {
                const size_t at = (size_t)t * k + (size_t)b * QK_K + (size_t)c * QK;
                xv[t] = _mm256_loadu_si256((const __m256i *)(xq + at));
                if (type == T_Q6_K) xp[t] = _mm256_loadu_si256((const __m256i *)(x32p + at / 2));
            }
            for (int r = 0; r < R; r++) {
                const uint8_t *blk = w + r * lane_bytes + (size_t)b * bsize;
                const __m256i qh5 = type == T_Q5_K ? _mm256_loadu_si256((const __m256i *)(blk + 16))
                                                   : _mm256_setzero_si256();
                const __m256i u8 = kq_chunk_avx2(type, blk, c, qh5);
                for (int t = 0; t < T; t++) {
                    __m256i p = _mm256_maddubs_epi16(u8, xv[t]);
                    if (type == T_Q6_K) p = _mm256_sub_epi16(p, xp[t]);
                    L[r * T + t] = _mm256_add_epi32(L[r * T + t], _mm256_madd_epi16(p, scv[r][c]));
                }
            }
        }
        kq_sums_block(&s, type, R, T, b, w, lane_bytes, bsize, nsb, k, xd, s32h, L, mins);
    }
    kq_sums_store(&s, R, T, y, y_row, y_in);
}

/* The same tiles on AVX-512 (BW): two chunks of a super-block per register, so each step is
 * one maddubs, one madd by the two chunks' scales and one addition for 64 values; the
 * super-block's sixteen int32 lanes (chunk 2j's eight, then 2j + 1's) are folded to eight by one
 * exact addition at its end, then kq_tile_avx2_t's sums. */
/* The scales of chunks 2j, 2j + 1 as int16 for madd: Q4_K, Q5_K sc[2j] x 16 | sc[2j + 1] x 16;
 * Q6_K per 8 int16 (4 int32 lanes) its sub-blocks' sc[4j], sc[4j + 1], sc[4j + 2], sc[4j + 3]. */
AVX512 INLINE void kq_scales_512(const int type, const uint8_t *blk, __m512i *scv, __m128i *mins) {
    __m512i sc16; /* the 8 (16 for Q6_K) scales as int16 in the low lanes */
    if (type == T_Q6_K) {
        sc16 = _mm512_castsi256_si512(
            _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192))));
        *mins = _mm_setzero_si128();
    } else {
        const __m128i both = kq_scales_mins_u8(blk);
        sc16 = _mm512_castsi128_si512(_mm_cvtepu8_epi16(both));
        *mins = _mm_cvtepu8_epi16(_mm_srli_si128(both, 8));
    }
    const __m512i lane =
        _mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14, 13,
                         12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const int q6 = type == T_Q6_K;
    const __m512i group = _mm512_srli_epi16(lane, q6 ? 3 : 4); /* 0..3 (Q6_K) or 0..1 */
    for (int j = 0; j < 4; j++)
        scv[j] = _mm512_permutexvar_epi16(
            _mm512_add_epi16(group, _mm512_set1_epi16((short)(q6 ? 4 * j : 2 * j))), sc16);
}

AVX512 INLINE void kq_tile_512_t(const int type, const int R, const int T, const uint8_t *w,
                                 size_t lane_bytes, int bsize, int nsb, int k, const int8_t *xq,
                                 const float *xd, const int16_t *s32h, const int16_t *x32p,
                                 float *y, size_t y_row, size_t y_in) {
    kq_sums s = {_mm_setzero_ps(), _mm_setzero_ps()};
    for (int b = 0; b < nsb; b++) {
        __m512i scv[KT][4], L[KT];
        __m128i mins[KT];
        for (int r = 0; r < R; r++) {
            const uint8_t *blk = w + r * lane_bytes + (size_t)b * bsize;
            kq_prefetch(blk, bsize);
            kq_scales_512(type, blk, scv[r], &mins[r]);
        }
        for (int i = 0; i < R * T; i++) L[i] = _mm512_setzero_si512();
        for (int j = 0; j < 4; j++) {
            __m512i xv[KT], xp[KT];
            for (int t = 0; t < T; t++) {
                const size_t at = (size_t)t * k + (size_t)b * QK_K + (size_t)j * 64;
                xv[t] = _mm512_loadu_si512((const void *)(xq + at));
                if (type == T_Q6_K) xp[t] = _mm512_loadu_si512((const void *)(x32p + at / 2));
            }
            for (int r = 0; r < R; r++) {
                const __m512i u8 = kq_pair_512(type, w + r * lane_bytes + (size_t)b * bsize, j);
                for (int t = 0; t < T; t++) {
                    __m512i p = _mm512_maddubs_epi16(u8, xv[t]);
                    if (type == T_Q6_K) p = _mm512_sub_epi16(p, xp[t]);
                    L[r * T + t] = _mm512_add_epi32(L[r * T + t], _mm512_madd_epi16(p, scv[r][j]));
                }
            }
        }
        __m256i L8[KT]; /* the sixteen lanes folded to eight: an exact addition */
        for (int i = 0; i < R * T; i++)
            L8[i] =
                _mm256_add_epi32(_mm512_castsi512_si256(L[i]), _mm512_extracti64x4_epi64(L[i], 1));
        kq_sums_block(&s, type, R, T, b, w, lane_bytes, bsize, nsb, k, xd, s32h, L8, mins);
    }
    kq_sums_store(&s, R, T, y, y_row, y_in);
}

/* One tile, specialised per type and shape: 4 x 1 (decode), 1 x T for T = 1 .. 4 (a prefill
 * block's inputs four at a time, and the rest). NAME (of the TARGET instruction set) calls
 * TILE_T, the tile of that width, with each as constants. */
#define KQ_CASE(TILE_T, TY, R_, T_)                                                                \
    if (type == TY && R == R_ && T == T_) {                                                        \
        TILE_T(TY, R_, T_, w, lane_bytes, bsize, nsb, k, xq, xd, s32h, x32p, y, y_row, y_in);      \
        return;                                                                                    \
    }
#define KQ_TYPE(TILE_T, TY)                                                                        \
    KQ_CASE(TILE_T, TY, 4, 1)                                                                      \
    KQ_CASE(TILE_T, TY, 1, 1)                                                                      \
    KQ_CASE(TILE_T, TY, 1, 2) KQ_CASE(TILE_T, TY, 1, 3) KQ_CASE(TILE_T, TY, 1, 4)
#define KQ_TILES(TARGET, NAME, TILE_T)                                                             \
    TARGET static void NAME(int type, int R, int T, const uint8_t *w, size_t lane_bytes,           \
                            int bsize, int nsb, int k, const int8_t *xq, const float *xd,          \
                            const int16_t *s32h, const int16_t *x32p, float *y, size_t y_row,      \
                            size_t y_in) {                                                         \
        KQ_TYPE(TILE_T, T_Q4_K)                                                                    \
        KQ_TYPE(TILE_T, T_Q5_K)                                                                    \
        KQ_TYPE(TILE_T, T_Q6_K)                                                                    \
    }
KQ_TILES(AVX512, kq_tile_512, kq_tile_512_t)
KQ_TILES(AVX2, kq_tile_avx2, kq_tile_avx2_t)
#undef KQ_TILES
#undef KQ_TYPE
#undef KQ_CASE
#endif

/* Inputs t0 .. t1 - 1 of a K-quant product: int8 blocks of 256 (ggml's Q8_K), the exact sums
 * of each 32 values (and as int16), and Q6_K's pair sums times 32. */
void fill_k(const mm_input *in, const float *x, int t0, int t1) {
    const int k = in->k, nsb = k / QK_K;
    for (int t = t0; t < t1; t++) {
        quantize_input_k(x + (size_t)t * k, k, in->xq + (size_t)t * k, in->xd + (size_t)t * nsb,
                         in->s32 + (size_t)t * (k / QK));
        for (size_t i = (size_t)t * (k / QK); i < (size_t)(t + 1) * (k / QK); i++)
            in->s32h[i] = (int16_t)in->s32[i];
        if (in->x32p != NULL)
            for (size_t i = (size_t)t * (k / 2); i < (size_t)(t + 1) * (k / 2); i++)
                in->x32p[i] = (int16_t)(32 * (in->xq[2 * i] + in->xq[2 * i + 1]));
    }
}

int matmul_k(int type, const uint8_t *w, size_t row_bytes, int n_out, int k, const mm_input *in,
             int n, float *y, size_t ldy) {
    const int bytes = type == T_Q4_K ? 144 : type == T_Q5_K ? 176 : 210;
    const int nsb = k / QK_K;
    const int8_t *xq = in->xq;
    const float *xd = in->xd;
    const int16_t *s32h = in->s32h, *x32p = in->x32p;
#if defined(FOUNDRY_X86)
    if (use_avx2) {
        void (*tile)(int, int, int, const uint8_t *, size_t, int, int, int, const int8_t *,
                     const float *, const int16_t *, const int16_t *, float *, size_t, size_t) =
            use_512 ? kq_tile_512 : kq_tile_avx2;
        void *room = NULL;
        if (use_512 && n >= KQ_BLOCK_MIN) {
            room = aligned_alloc(64, kq_block_room(k));
            if (room == NULL) return -1;
        }
        int r0 = 0;
        if (n == 1) { /* four rows a time, row j of each quarter: four sequential streams */
            const int quarter = n_out / 4;
            for (int j = 0; j < quarter; j++)
                tile(type, 4, 1, w + (size_t)j * row_bytes, (size_t)quarter * row_bytes, bytes, nsb,
                     k, xq, xd, s32h, x32p, y + j, (size_t)quarter, 0);
            r0 = 4 * quarter;
        }
        for (int t0 = 0; t0 < n; t0 += K_TILE) {
            const int tn = n - t0 < K_TILE ? n - t0 : K_TILE;
            /* the block's groups of KB_G inputs, the last a part one of KQ_BLOCK_MIN or more;
             * the inputs from t1 on by the tiles below */
            const int tb = tn % KB_G >= KQ_BLOCK_MIN ? tn : tn - tn % KB_G;
            int t1 = t0;
            if (room != NULL && tb > 0) {
                kq_block_512(type, w, row_bytes, r0, n_out, k, in, t0, tb, y, ldy, room);
                t1 = t0 + tb;
            }
            for (int r = r0; r < n_out; r++)
                for (int t = t1; t < t0 + tn; t += KT) {
                    const int nt = t0 + tn - t < KT ? t0 + tn - t : KT;
                    tile(type, 1, nt, w + (size_t)r * row_bytes, 0, bytes, nsb, k,
                         xq + (size_t)t * k, xd + (size_t)t * nsb, s32h + (size_t)t * (k / QK),
                         x32p != NULL ? x32p + (size_t)t * (k / 2) : NULL, y + (size_t)t * ldy + r,
                         0, ldy);
                }
        }
        free(room);
        return 0;
    }
#endif
    for (int t0 = 0; t0 < n; t0 += K_TILE)
        for (int r = 0; r < n_out; r++)
            for (int t = t0; t < n && t < t0 + K_TILE; t++)
                y[(size_t)t * ldy + r] =
                    dot_k_portable(type, w + (size_t)r * row_bytes, bytes, xq + (size_t)t * k,
                                   xd + (size_t)t * nsb, in->s32 + (size_t)t * (k / QK), nsb);
    return 0;
}
