/* The 32-blocks' AVX-512 kernels (Q8_0, Q4_0, Q5_0): a row's dot product, four rows at a time,
 * the prefill tiles and the input's preparation for them; the same operations as q32.c's
 * portable definition (theory in kernels.h). q32.c's dispatch calls them. */

#include "q32.h"

#if defined(FOUNDRY_X86)

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

AVX512 float dot_q_512(int type, const uint8_t *w, int bsize, const int8_t *xq, const float *xd,
                       const int32_t *corr, int nb) {
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

/* Four rows at a time, each exactly dot_q_512's operations: the input's loads (int8 values,
 * their sums, their scales) are shared by the four rows. The four rows are row j of each
 * quarter of the matrix (lane_bytes apart), so each of the four walks its own quarter from
 * start to end: four long sequential streams, which the L2 streamer prefetches (four adjacent
 * rows, by contrast, share 4 KB pages at different offsets and defeat it; docs/quantization.md
 * has the figures). Each lane also prefetches its own rows PREFETCH ahead in software. Per
 * chunk of up to 16 blocks, each row's float16 scales are converted by one vcvtph2ps and
 * multiplied by the input's scales (d_w * d_x, the same single rounding as dot_q_512), so the block
 * loop only broadcasts the two products of a step. Specialized per type (rows_q_512 below), so the
 * loop holds no test of the type. */
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

/* The four rows' outputs: their sixteen float lanes, the blocks from ``from`` on added one at a
 * time as dot_q_portable does, then halved. */
AVX512 static void finish_rows(int type, const __m512 *acc, const uint8_t *w, size_t lane_bytes,
                               int bsize, const int8_t *xq, const float *xd, int from, int nb,
                               float *y);

AVX512 INLINE void rows_q_512_t(int type, const uint8_t *w, size_t row_bytes, size_t lane_bytes,
                                int bsize, const int8_t *xq, const float *xd, const int32_t *corr,
                                int nb, float *y) {
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
            _mm512_storeu_ps(
                sp[i], block_scales_512(w + i * lane_bytes + (size_t)b * bsize, bsize, live, xds));
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
 * int32 lanes onto minus 8 x the input's sums: lane 4m + j is block m's lane j of add_block's
 * four, exactly, and the sixteen float lanes are its accumulators 4 (block mod 4) + j. The input
 * comes in that order (``x4``: per four blocks their values 0-15, then 16-31; ``corr4``: per
 * block four sums of 8 values, times 8), from q4_layout. Scales as in rows_q_512_t. */
AVX512 void rows_q4_512(const uint8_t *w, size_t row_bytes, size_t lane_bytes, const int8_t *xq,
                        const int8_t *x4, const float *xd, const int32_t *corr4, int nb, float *y) {
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
            const __m512i idx =
                _mm512_add_epi32(/* lanes 4m .. 4m + 3 take block c + m's */
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
AVX512 INLINE void tile_q8_512_t(const int T, const uint8_t *wu, const float *dw, int nb, int k,
                                 const int8_t *xq, const float *xd, const int32_t *corr,
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
            ncv[t] = _mm512_sub_epi32(
                _mm512_setzero_si512(),
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
AVX512 int block_q8_512(const uint8_t *w, size_t row_bytes, int groups, int k, const int8_t *xq,
                        const float *xd, const int32_t *corr, int n, size_t ldy, float *y) {
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
                    _mm256_storeu_si256(
                        (__m256i *)(wu + ((size_t)i * nb + b) * QK),
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

/* A prefill block of Q4_0 on AVX-512: rows_q4_512's operations for QT_ROWS rows against two
 * inputs a step. The rows are unpacked once per tile (``wq``: each four blocks' low nibbles,
 * then high nibbles, as rows_q4_512 makes them; ``dw``: their float16 scales as floats, lanes
 * 4m .. 4m + 3 block m's), so per (row, input) and four blocks there remain the scale products
 * d_w * d_x (one multiplication of the two vectors: block_scales_512's rounding), the two dpbusd
 * onto minus the input's sums, the conversion, the multiplication and the addition. */
AVX512 INLINE void tile_q4_512_t(const int T, const uint8_t *wq, const float *dw, int quads, int k,
                                 const int8_t *x4, const float *xd, const int32_t *corr4, int nb,
                                 float *acc_out) {
    __m512 acc[QT_ROWS][2];
    for (int i = 0; i < QT_ROWS; i++)
        for (int t = 0; t < T; t++) acc[i][t] = _mm512_setzero_ps();
    const __m512i idx = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    for (int b = 0; b < quads; b += 4) {
        __m512i x1[2], x2[2], ncv[2];
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
            const __m512 dwv = _mm512_load_ps(dw + g * 16);
            for (int t = 0; t < T; t++) {
                const __m512i sv =
                    _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(ncv[t], lo, x1[t]), hi, x2[t]);
                const __m512 dv = _mm512_mul_ps(dwv, dx[t]);
                acc[i][t] = _mm512_add_ps(acc[i][t], _mm512_mul_ps(dv, _mm512_cvtepi32_ps(sv)));
            }
        }
    }
    for (int i = 0; i < QT_ROWS; i++)
        for (int t = 0; t < T; t++) _mm512_storeu_ps(acc_out + (i * 2 + t) * LANES_Q, acc[i][t]);
}

/* y (n, n_out) for a block of inputs, Q4_0 rows 0 .. 4 * groups - 1, on tile_q4_512_t, the
 * blocks past the last whole four by add_blocks: returns -1 when out of memory. */
AVX512 int block_q4_512(const uint8_t *w, size_t row_bytes, int groups, int k, const mm_input *in,
                        int n, size_t ldy, float *y) {
    const int nb = k / QK, quads = nb & ~3, bsize = 18;
    uint8_t *wq = aligned_alloc(64, (size_t)QT_ROWS * quads * QK + 64);
    float *dw = aligned_alloc(64, (size_t)QT_ROWS * quads * 4 * sizeof(float) + 64);
    if (wq == NULL || dw == NULL) {
        free(wq);
        free(dw);
        return -1;
    }
    const __m512i m4 = _mm512_set1_epi8(0xF);
    const __m512i idx = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    for (int t0 = 0; t0 < n; t0 += Q_TILE)
        for (int gr = 0; gr < groups; gr++) {
            for (int i = 0; i < QT_ROWS; i++) /* the group's rows unpacked */
                for (int b = 0; b < quads; b += 4) {
                    const uint8_t *p =
                        w + (size_t)(QT_ROWS * gr + i) * row_bytes + (size_t)b * bsize;
                    const size_t g = (size_t)i * (quads / 4) + b / 4;
                    __m512i q = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(p + 2)));
                    float d[4];
                    for (int m = 0; m < 4; m++) {
                        q = _mm512_mask_broadcast_i32x4(
                            q, (__mmask16)(0xF << (4 * m)),
                            _mm_loadu_si128((const __m128i *)(p + m * bsize + 2)));
                        d[m] = f16c(p + m * bsize);
                    }
                    _mm512_store_si512((void *)(wq + g * 128), _mm512_and_si512(q, m4));
                    _mm512_store_si512((void *)(wq + g * 128 + 64),
                                       _mm512_and_si512(_mm512_srli_epi16(q, 4), m4));
                    _mm512_store_ps(dw + g * 16, _mm512_permutexvar_ps(
                                                     idx, _mm512_castps128_ps512(_mm_loadu_ps(d))));
                }
            const int t_end = n - t0 < Q_TILE ? n : t0 + Q_TILE;
            for (int t = t0; t < t_end;) {
                const int T = t_end - t < 2 ? 1 : 2;
                float lanes[QT_ROWS * 2 * LANES_Q];
                if (T == 2)
                    tile_q4_512_t(2, wq, dw, quads, k, in->x4 + (size_t)t * k,
                                  in->xd + (size_t)t * nb, in->corr4 + (size_t)t * (k / 8), nb,
                                  lanes);
                else
                    tile_q4_512_t(1, wq, dw, quads, k, in->x4 + (size_t)t * k,
                                  in->xd + (size_t)t * nb, in->corr4 + (size_t)t * (k / 8), nb,
                                  lanes);
                for (int i = 0; i < QT_ROWS; i++)
                    for (int u = 0; u < T; u++) {
                        const int r = QT_ROWS * gr + i;
                        y[(size_t)(t + u) * ldy + r] = add_blocks(
                            T_Q4_0, lanes + (i * 2 + u) * LANES_Q, w + (size_t)r * row_bytes, bsize,
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
