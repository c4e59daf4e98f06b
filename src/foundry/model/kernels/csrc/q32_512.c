/* The 32-blocks' AVX-512 kernels (Q8_0, Q4_0, Q5_0): four rows at a time, the small prefill
 * tiles and the input's preparation for them; the same operations as q32.c's portable
 * definition (theory in kernels.h). q32.c's dispatch calls them; q32_block.c holds the block of
 * 16 inputs a register. */

#include "q32.h"

#if defined(FOUNDRY_X86)

/* AVX-512: weights are unsigned for dpbusd (Q8_0: w + 128, an exclusive or of the sign bit;
 * Q4_0: its stored nibbles, 0..15, before the - 8; Q5_0 0..31), and 128, 8 or 16 times the
 * input's sums over each 4 values (``corr``, computed once per input row) come off again: exact
 * int32 lanes, whose sums are each block's S_b. */
/* q5_unsigned_avx2 with AVX-512 BW: qh is the mask of the bytes that take 16 (bit v, byte v). */
AVX512 INLINE __m256i q5_unsigned_bw(const uint8_t *blk) {
    uint32_t qh;
    memcpy(&qh, blk + 2, 4);
    const __m256i nib = q5_nibbles_avx2(blk);
    return _mm256_or_si256(nib, _mm256_maskz_mov_epi8((__mmask32)qh, _mm256_set1_epi8(0x10)));
}

AVX512 INLINE __m512i load_pair_512(int type, const uint8_t *p, int bsize) {
    if (type == T_Q8_0) {
        const __m512i v =
            _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(p + 2))),
                               _mm256_loadu_si256((const __m256i *)(p + bsize + 2)), 1);
        return _mm512_xor_si512(v, _mm512_set1_epi8((char)0x80));
    }
    /* Q5_0, both blocks at once: each block's 16 bytes of nibbles in two 128-bit lanes (low
     * nibbles: values 0-15, then high: 16-31), and the two qh as one 64-bit byte mask. */
    uint32_t qh0, qh1;
    memcpy(&qh0, p + 2, 4);
    memcpy(&qh1, p + bsize + 2, 4);
    const __m256i raw =
        _mm256_loadu2_m128i((const __m128i *)(p + bsize + 6), (const __m128i *)(p + 6));
    const __m512i dup = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 1, 0, 1, 2, 3, 2, 3),
                                                 _mm512_castsi256_si512(raw));
    const __m512i sh = _mm512_setr_epi64(0, 0, 0x0004000400040004LL, 0x0004000400040004LL, 0, 0,
                                         0x0004000400040004LL, 0x0004000400040004LL);
    const __m512i nib = _mm512_and_si512(_mm512_srlv_epi16(dup, sh), _mm512_set1_epi8(0xF));
    const __mmask64 high = (__mmask64)qh0 | ((__mmask64)qh1 << 32);
    return _mm512_or_si512(nib, _mm512_maskz_mov_epi8(high, _mm512_set1_epi8(0x10)));
}

/* For each 128-bit lane L of the result, int32 lane i = the sum of a_i's four lanes of L: one
 * tree of unpacks and additions (integers: exact in any order). */
AVX512 INLINE __m512i hsum4_512(__m512i a0, __m512i a1, __m512i a2, __m512i a3) {
    const __m512i u01 =
        _mm512_add_epi32(_mm512_unpacklo_epi32(a0, a1), _mm512_unpackhi_epi32(a0, a1));
    const __m512i u23 =
        _mm512_add_epi32(_mm512_unpacklo_epi32(a2, a3), _mm512_unpackhi_epi32(a2, a3));
    return _mm512_add_epi32(_mm512_unpacklo_epi64(u01, u23), _mm512_unpackhi_epi64(u01, u23));
}

/* Two blocks of eight lanes a register, after hsum4_512 (lanes 0, 1: the first block's halves,
 * 2, 3 the second's), of p0 then p1: the four blocks' sums in 128-bit lanes 0 .. 3. */
AVX512 INLINE __m512i halves_512(__m512i p0, __m512i p1) {
    return _mm512_add_epi32(_mm512_shuffle_i32x4(p0, p1, _MM_SHUFFLE(2, 0, 2, 0)),
                            _mm512_shuffle_i32x4(p0, p1, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* Four outputs' float chains over four blocks: acc + p's 128-bit lane 0, then 1, 2, 3. */
AVX512 INLINE __m128 chain4_512(__m128 acc, __m512 p) {
    acc = _mm_add_ps(acc, _mm512_castps512_ps128(p));
    acc = _mm_add_ps(acc, _mm512_extractf32x4_ps(p, 1));
    acc = _mm_add_ps(acc, _mm512_extractf32x4_ps(p, 2));
    return _mm_add_ps(acc, _mm512_extractf32x4_ps(p, 3));
}

/* Four rows at a time: the four rows are row j of each quarter of the matrix (lane_bytes apart),
 * so each of the four walks its own quarter from start to end: four long sequential streams,
 * which the L2 streamer prefetches (four adjacent rows, by contrast, share 4 KB pages at
 * different offsets and defeat it; docs/quantization.md has the figures). Each lane also
 * prefetches its own rows PREFETCH ahead in software. A step is four blocks of the four rows:
 * per row two dpbusd (two blocks each) sharing the input's loads, the sixteen block sums S_b by
 * one tree (hsum4_512, halves_512: block-major, four rows a 128-bit lane), their scale products
 * and conversions sixteen at once, then each row's float steps block by block, four rows a
 * register (chain4_512): add_blocks' operations, row by row. Per chunk of up to 16 blocks, each
 * row's float16 scales are converted by one vcvtph2ps and multiplied by the input's scales
 * (d_w * d_x, the same single rounding), and a step takes its sixteen by two permutations.
 * Specialized per type (rows_q_512 below), so the loop holds no test of the type. */
#define CHUNK 16 /* blocks whose scales are converted together */
#ifndef PREFETCH
#define PREFETCH ROWS /* rows ahead */
#endif

/* The scale products d_w * d_x of up to 16 blocks (``live``) of a row from p: each block's 4
 * first bytes gathered (its float16 scale in the low half), converted by one vcvtph2ps. */
AVX512 INLINE __m512 block_scales_512(const uint8_t *p, int bsize, __mmask16 live, __m512 xds) {
    const __m512i at =
        _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                           _mm512_set1_epi32(bsize));
    const __m512i g = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, at, p, 1);
    return _mm512_mul_ps(_mm512_cvtph_ps(_mm512_cvtepi32_epi16(g)), xds);
}

/* Blocks c .. c + 3 of the chunk's scale products (sp[i]: row i's), block-major: lane j is
 * row j mod 4's block c + j / 4. */
AVX512 INLINE __m512 rows_scales_512(const __m512 *sp, int c) {
    const __m512i idx =
        _mm512_add_epi32(_mm512_set_epi32(19, 3, 19, 3, 18, 2, 18, 2, 17, 1, 17, 1, 16, 0, 16, 0),
                         _mm512_set1_epi32(c));
    return _mm512_mask_blend_ps(0xCCCC, _mm512_permutex2var_ps(sp[0], idx, sp[1]),
                                _mm512_permutex2var_ps(sp[2], idx, sp[3]));
}

/* The four rows' outputs: their chains, the blocks from ``from`` on by add_blocks. */
AVX512 INLINE void finish_rows(int type, __m128 acc, const uint8_t *w, size_t lane_bytes, int bsize,
                               const int8_t *xq, const float *xd, int from, int nb, float *y) {
    float out[ROWS];
    _mm_storeu_ps(out, acc);
    for (int i = 0; i < ROWS; i++)
        y[i] = add_blocks(type, out[i], w + i * lane_bytes, bsize, xq, xd, from, nb);
}

AVX512 INLINE void rows_q_512_t(int type, const uint8_t *w, size_t row_bytes, size_t lane_bytes,
                                int bsize, const int8_t *xq, const float *xd, const int32_t *corr,
                                int nb, float *y) {
    __m128 acc = _mm_setzero_ps();
    const int quads = nb & ~3;
    for (int b = 0; b < quads; b += CHUNK) {
        const int n = quads - b < CHUNK ? quads - b : CHUNK; /* a multiple of 4 */
        const __mmask16 live = (__mmask16)((1u << n) - 1);
        const __m512 xds = _mm512_maskz_loadu_ps(live, xd + b);
        __m512 sp[ROWS];
        for (int i = 0; i < ROWS; i++)
            sp[i] = block_scales_512(w + i * lane_bytes + (size_t)b * bsize, bsize, live, xds);
        for (int c = 0; c < n; c += 4) {
            __m512i s[2][ROWS];
            for (int h = 0; h < 2; h++) {
                const int bb = b + c + 2 * h;
                const __m512i xv = _mm512_loadu_si512((const void *)(xq + bb * QK));
                /* dpbusd onto minus the correction: the same exact int32 lanes as subtracting it */
                const __m512i ncv = _mm512_sub_epi32(
                    _mm512_setzero_si512(), _mm512_loadu_si512((const void *)(corr + bb * 8)));
                for (int i = 0; i < ROWS; i++) {
                    const uint8_t *p = w + i * lane_bytes + (size_t)bb * bsize;
#if PREFETCH
                    _mm_prefetch((const char *)(p + PREFETCH * row_bytes), _MM_HINT_T0);
#endif
                    s[h][i] = _mm512_dpbusd_epi32(ncv, load_pair_512(type, p, bsize), xv);
                }
            }
            const __m512i S = halves_512(hsum4_512(s[0][0], s[0][1], s[0][2], s[0][3]),
                                         hsum4_512(s[1][0], s[1][1], s[1][2], s[1][3]));
            acc = chain4_512(acc, _mm512_mul_ps(rows_scales_512(sp, c), _mm512_cvtepi32_ps(S)));
        }
    }
    finish_rows(type, acc, w, lane_bytes, bsize, xq, xd, quads, nb, y);
}

AVX512 void rows_q_512(int type, const uint8_t *w, size_t row_bytes, size_t lane_bytes, int bsize,
                       const int8_t *xq, const float *xd, const int32_t *corr, int nb, float *y) {
    if (type == T_Q8_0)
        rows_q_512_t(T_Q8_0, w, row_bytes, lane_bytes, bsize, xq, xd, corr, nb, y);
    else
        rows_q_512_t(T_Q5_0, w, row_bytes, lane_bytes, bsize, xq, xd, corr, nb, y);
}

/* Q4_0 on AVX-512, four rows and four blocks per step: the blocks' 4 x 16 bytes one register
 * (block m in 128-bit lane m); its low nibbles (values 0-15) against the input's values 0-15
 * of each block, then its high nibbles (16-31) against values 16-31, both dpbusd into the same
 * int32 lanes onto minus 8 x the input's sums: 128-bit lane m holds block m's products in four
 * exact lanes, and one tree (hsum4_512) of the four rows gives the sixteen S_b block-major,
 * as rows_q_512_t's. The input comes in that order (``x4``: per four blocks their values 0-15,
 * then 16-31; ``corr4``: per block four sums of 8 values, times 8), from q4_layout. Scales and
 * float steps as in rows_q_512_t. */
AVX512 void rows_q4_512(const uint8_t *w, size_t row_bytes, size_t lane_bytes, const int8_t *xq,
                        const int8_t *x4, const float *xd, const int32_t *corr4, int nb, float *y) {
    const int bsize = 18;
    __m128 acc = _mm_setzero_ps();
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
            __m512i s[ROWS];
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
                s[i] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(ncv, lo, x1), hi, x2);
            }
            const __m512i S = hsum4_512(s[0], s[1], s[2], s[3]);
            acc = chain4_512(acc, _mm512_mul_ps(rows_scales_512(sp, c), _mm512_cvtepi32_ps(S)));
        }
    }
    finish_rows(T_Q4_0, acc, w, lane_bytes, bsize, xq, xd, quads, nb, y);
}

/* A small prefill block on AVX-512, Q8_0 (and Q5_0 widened to it), for the inputs that
 * q32_block.c's block leaves (fewer than QB_PART_MIN after its groups of 16; qb_inputs): R = 4
 * rows against T <= 4 inputs, each (row, input) add_blocks'
 * operations. The rows' weights are turned unsigned once per tile (``wu``: w + 128 by the sign
 * bit, 32 bytes a block) with their float16 scales as floats, each four times (``dw``: block b's
 * at 16 b, row i's in lanes 4i .. 4i + 3), and the inputs' scales block-major (``dx``: block
 * b's at 4 b, input t's in lane t), so a step of two blocks is, per row, one load shared by the
 * T inputs and one dpbusd per input onto minus the correction, then for the sixteen (row,
 * input) pairs at once the tree of sums, the scale products, the conversion, the
 * multiplication and the addition, block by block (lane 4i + t: row i, input t). */
AVX512 INLINE void tile_q8_512_t(const int T, const uint8_t *wu, const float *dw, const float *dx,
                                 int nb, int k, const int8_t *xq, const int32_t *corr,
                                 float *acc_out) {
    __m512 acc = _mm512_setzero_ps();
    const int pairs = nb & ~1;
    for (int b = 0; b < pairs; b += 2) {
        __m512i xv[4], ncv[4];
        for (int t = 0; t < T; t++) {
            xv[t] = _mm512_loadu_si512((const void *)(xq + (size_t)t * k + b * QK));
            ncv[t] = _mm512_sub_epi32(
                _mm512_setzero_si512(),
                _mm512_loadu_si512((const void *)(corr + (size_t)t * (k / 4) + b * 8)));
        }
        __m512i q[QT_ROWS]; /* row i: per 128-bit lane L, the T inputs' sums of lane L */
        for (int i = 0; i < QT_ROWS; i++) {
            const __m512i wv = _mm512_loadu_si512((const void *)(wu + ((size_t)i * nb + b) * QK));
            __m512i s[4];
            for (int t = 0; t < 4; t++)
                s[t] = t < T ? _mm512_dpbusd_epi32(ncv[t], wv, xv[t]) : _mm512_setzero_si512();
            q[i] = hsum4_512(s[0], s[1], s[2], s[3]);
        }
        const __m512i r01 = halves_512(q[0], q[1]), r23 = halves_512(q[2], q[3]);
        for (int h = 0; h < 2; h++) { /* block b + h of the sixteen pairs */
            const __m512i S = h ? _mm512_shuffle_i32x4(r01, r23, _MM_SHUFFLE(3, 1, 3, 1))
                                : _mm512_shuffle_i32x4(r01, r23, _MM_SHUFFLE(2, 0, 2, 0));
            const __m512 d =
                _mm512_mul_ps(_mm512_load_ps(dw + (size_t)(b + h) * 16),
                              _mm512_broadcast_f32x4(_mm_loadu_ps(dx + (size_t)(b + h) * 4)));
            acc = _mm512_add_ps(acc, _mm512_mul_ps(d, _mm512_cvtepi32_ps(S)));
        }
    }
    _mm512_storeu_ps(acc_out, acc);
}

AVX512 static void tile_q8_512(int T, const uint8_t *wu, const float *dw, const float *dx, int nb,
                               int k, const int8_t *xq, const int32_t *corr, float *acc_out) {
    switch (T) {
    case 1: tile_q8_512_t(1, wu, dw, dx, nb, k, xq, corr, acc_out); break;
    case 2: tile_q8_512_t(2, wu, dw, dx, nb, k, xq, corr, acc_out); break;
    case 3: tile_q8_512_t(3, wu, dw, dx, nb, k, xq, corr, acc_out); break;
    default: tile_q8_512_t(4, wu, dw, dx, nb, k, xq, corr, acc_out); break;
    }
}

/* y (n, n_out) for a block of inputs, Q8_0 rows r0 .. r0 + 4 * groups - 1, on tile_q8_512:
 * returns -1 when out of memory. */
AVX512 int block_q8_512(const uint8_t *w, size_t row_bytes, int groups, int k, const int8_t *xq,
                        const float *xd, const int32_t *corr, int n, size_t ldy, float *y) {
    const int nb = k / QK;
    uint8_t *wu = malloc((size_t)QT_ROWS * nb * QK);
    float *dw = aligned_alloc(64, (size_t)nb * 16 * sizeof(float));
    float *dx = malloc((size_t)nb * 4 * sizeof(float));
    if (wu == NULL || dw == NULL || dx == NULL) {
        free(wu);
        free(dw);
        free(dx);
        return -1;
    }
    for (int t0 = 0; t0 < n; t0 += Q_TILE)
        for (int g = 0; g < groups; g++) {
            for (int i = 0; i < QT_ROWS; i++) /* the group's rows, unsigned, scales as floats */
                for (int b = 0; b < nb; b++) {
                    const uint8_t *blk = w + (size_t)(QT_ROWS * g + i) * row_bytes + (size_t)b * 34;
                    _mm256_storeu_si256(
                        (__m256i *)(wu + ((size_t)i * nb + b) * QK),
                        _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(blk + 2)),
                                         _mm256_set1_epi8((char)0x80)));
                    _mm_storeu_ps(dw + (size_t)b * 16 + 4 * i, _mm_set1_ps(f16c(blk)));
                }
            for (int t = t0; t < n && t < t0 + Q_TILE; t += 4) {
                const int T = n - t < 4 ? n - t : (t0 + Q_TILE - t < 4 ? t0 + Q_TILE - t : 4);
                for (int b = 0; b < nb; b++)
                    for (int u = 0; u < 4; u++)
                        dx[(size_t)b * 4 + u] = u < T ? xd[(size_t)(t + u) * nb + b] : 0.0f;
                float lanes[QT_ROWS * 4];
                tile_q8_512(T, wu, dw, dx, nb, k, xq + (size_t)t * k, corr + (size_t)t * (k / 4),
                            lanes);
                for (int i = 0; i < QT_ROWS; i++)
                    for (int u = 0; u < T; u++) {
                        const int r = QT_ROWS * g + i;
                        y[(size_t)(t + u) * ldy + r] = add_blocks(
                            T_Q8_0, lanes[4 * i + u], w + (size_t)r * row_bytes, 34,
                            xq + (size_t)(t + u) * k, xd + (size_t)(t + u) * nb, nb & ~1, nb);
                    }
            }
        }
    free(wu);
    free(dw);
    free(dx);
    return 0;
}

/* A small prefill block of Q4_0 on AVX-512: rows_q4_512's operations for QT_ROWS rows against
 * two inputs a step. The rows are unpacked once per tile (``wq``: each four blocks' low
 * nibbles, then high nibbles, as rows_q4_512 makes them; ``dw``: their float16 scales as
 * floats, block-major: four blocks' four rows at 16 (b / 4), as rows_scales_512 orders them),
 * so per (row, input) and four blocks there remain the two dpbusd onto minus the input's sums,
 * and per input the tree of the four rows' sums, the scale products d_w * d_x, the
 * conversion, the multiplication and the float steps (chain4_512). */
AVX512 INLINE void tile_q4_512_t(const int T, const uint8_t *wq, const float *dw, int quads, int k,
                                 const int8_t *x4, const float *xd, const int32_t *corr4, int nb,
                                 float *acc_out) {
    __m128 acc[2];
    for (int t = 0; t < T; t++) acc[t] = _mm_setzero_ps();
    const __m512i idx = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    for (int b = 0; b < quads; b += 4) {
        __m512i x1[2], x2[2], ncv[2], s[2][QT_ROWS];
        __m512 dx[2];
        for (int t = 0; t < T; t++) {
            const int8_t *xg = x4 + (size_t)t * k + (size_t)b * QK;
            x1[t] = _mm512_loadu_si512((const void *)xg);
            x2[t] = _mm512_loadu_si512((const void *)(xg + 64));
            ncv[t] = _mm512_sub_epi32(
                _mm512_setzero_si512(),
                _mm512_loadu_si512((const void *)(corr4 + (size_t)t * (k / 8) + b * 4)));
            dx[t] = _mm512_permutexvar_ps(
                idx, _mm512_castps128_ps512(_mm_loadu_ps(xd + (size_t)t * nb + b)));
        }
        for (int i = 0; i < QT_ROWS; i++) {
            const size_t g = (size_t)i * (quads / 4) + b / 4;
            const __m512i lo = _mm512_load_si512((const void *)(wq + g * 128));
            const __m512i hi = _mm512_load_si512((const void *)(wq + g * 128 + 64));
            for (int t = 0; t < T; t++)
                s[t][i] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(ncv[t], lo, x1[t]), hi, x2[t]);
        }
        const __m512 dwv = _mm512_load_ps(dw + (size_t)b * 4);
        for (int t = 0; t < T; t++) {
            const __m512i S = hsum4_512(s[t][0], s[t][1], s[t][2], s[t][3]);
            acc[t] =
                chain4_512(acc[t], _mm512_mul_ps(_mm512_mul_ps(dwv, dx[t]), _mm512_cvtepi32_ps(S)));
        }
    }
    for (int t = 0; t < T; t++) _mm_storeu_ps(acc_out + 4 * t, acc[t]);
}

/* y (n, n_out) for a block of inputs, Q4_0 rows 0 .. 4 * groups - 1, on tile_q4_512_t, the
 * blocks past the last whole four by add_blocks: returns -1 when out of memory. */
AVX512 int block_q4_512(const uint8_t *w, size_t row_bytes, int groups, int k, const mm_input *in,
                        int n, size_t ldy, float *y) {
    const int nb = k / QK, quads = nb & ~3, bsize = 18;
    uint8_t *wq = aligned_alloc(64, (size_t)QT_ROWS * quads * QK + 64);
    float *dw = aligned_alloc(64, (size_t)QT_ROWS * quads * sizeof(float) + 64);
    if (wq == NULL || dw == NULL) {
        free(wq);
        free(dw);
        return -1;
    }
    const __m512i m4 = _mm512_set1_epi8(0xF);
    for (int t0 = 0; t0 < n; t0 += Q_TILE)
        for (int gr = 0; gr < groups; gr++) {
            for (int i = 0; i < QT_ROWS; i++) /* the group's rows unpacked */
                for (int b = 0; b < quads; b += 4) {
                    const uint8_t *p =
                        w + (size_t)(QT_ROWS * gr + i) * row_bytes + (size_t)b * bsize;
                    const size_t g = (size_t)i * (quads / 4) + b / 4;
                    __m512i q = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(p + 2)));
                    for (int m = 0; m < 4; m++) {
                        q = _mm512_mask_broadcast_i32x4(
                            q, (__mmask16)(0xF << (4 * m)),
                            _mm_loadu_si128((const __m128i *)(p + m * bsize + 2)));
                        dw[(size_t)b * 4 + 4 * m + i] = f16c(p + m * bsize);
                    }
                    _mm512_store_si512((void *)(wq + g * 128), _mm512_and_si512(q, m4));
                    _mm512_store_si512((void *)(wq + g * 128 + 64),
                                       _mm512_and_si512(_mm512_srli_epi16(q, 4), m4));
                }
            const int t_end = n - t0 < Q_TILE ? n : t0 + Q_TILE;
            for (int t = t0; t < t_end;) {
                const int T = t_end - t < 2 ? 1 : 2;
                float out[2 * QT_ROWS];
                if (T == 2)
                    tile_q4_512_t(2, wq, dw, quads, k, in->x4 + (size_t)t * k,
                                  in->xd + (size_t)t * nb, in->corr4 + (size_t)t * (k / 8), nb,
                                  out);
                else
                    tile_q4_512_t(1, wq, dw, quads, k, in->x4 + (size_t)t * k,
                                  in->xd + (size_t)t * nb, in->corr4 + (size_t)t * (k / 8), nb,
                                  out);
                for (int i = 0; i < QT_ROWS; i++)
                    for (int u = 0; u < T; u++) {
                        const int r = QT_ROWS * gr + i;
                        y[(size_t)(t + u) * ldy + r] = add_blocks(
                            T_Q4_0, out[4 * u + i], w + (size_t)r * row_bytes, bsize,
                            in->xq + (size_t)(t + u) * k, in->xd + (size_t)(t + u) * nb, quads, nb);
                    }
                t += T;
            }
        }
    free(wq);
    free(dw);
    return 0;
}

/* rows_q4_512's input order, from the int8 input (k values) and corr (8 x its sums of 4). */
void q4_layout(const int8_t *xq, const int32_t *corr, int k, int8_t *x4, int32_t *corr4) {
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
AVX512 void prepare_input_512(const float *x, int k, int shift, int8_t *q, float *d,
                              int32_t *corr) {
    for (int b = 0; b < k / QK; b++) {
        const __m512 x0 = _mm512_loadu_ps(x + b * QK), x1 = _mm512_loadu_ps(x + b * QK + 16);
        const __m512 m =
            _mm512_max_ps(_mm512_abs_ps(x1), _mm512_max_ps(_mm512_abs_ps(x0), _mm512_setzero_ps()));
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
