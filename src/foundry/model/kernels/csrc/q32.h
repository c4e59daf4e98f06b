/* What the 32-block files share (q32.c, q32_512.c, q1.c; theory in kernels.h): the tile of a
 * prefill block, a block's portable unpacking and lanes, the AVX2 helpers, and the AVX-512
 * kernels of q32_512.c that q32.c's dispatch calls. */

#ifndef FOUNDRY_Q32_H
#define FOUNDRY_Q32_H

#include "kernels.h"

/* Inputs per tile of a prefill block (with their sums, 4 bytes a value): every row group of the
 * matrix passes over a tile while it stays in L2, so each weight block is read once per tile. */
#define Q_TILE 64

/* Rows of the matrix per AVX-512 step (rows_q_512) and per prefill tile (block_q8_512,
 * block_q4_512). */
#ifndef ROWS
#define ROWS 4
#endif
#define QT_ROWS 4
/* Inputs from which Q4_0 on AVX-512 unpacks a tile's rows once (block_q4_512) */
#define Q4_BLOCK_MIN 4

/* The AVX-512 block of q32_block.c takes of n inputs its groups of QB_G (one int32 lane each of
 * a register), the last a part one of QB_PART_MIN inputs or more (Q4_0 QB_PART_MIN_Q4):
 * qb_inputs; fewer are faster by the small tiles of q32_512.c (measured on the VM:
 * docs/quantization.md). */
#define QB_G 16
#ifndef QB_PART_MIN
#define QB_PART_MIN 6
#endif
#ifndef QB_PART_MIN_Q4
#define QB_PART_MIN_Q4 9 /* Q4_0's small tiles unpack each row once too (block_q4_512) */
#endif
static inline int qb_inputs(int type, int n) {
    return n % QB_G >= (type == T_Q4_0 ? QB_PART_MIN_Q4 : QB_PART_MIN) ? n : n - n % QB_G;
}

/* Inputs from which a block of Q5_0 products unpacks its weights once (fewer pay more to unpack
 * than they save): of those that the AVX-512 block leaves */
#define Q5_WIDEN 8

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

/* The one definition (kernels.h): blocks from .. nb - 1 of a row, each block's exact int32 sum
 * S_b = sum of w_i x_i, then acc = acc + (d_w * d_x) * (float)S_b block after block; the
 * whole dot product from 0 (acc 0), the SIMD paths' last blocks from where they stop. Always
 * inlined, so in a SIMD path it is compiled with that path's (VEX) encoding: called as a
 * function of plain SSE with the 512-bit registers' upper halves dirty (gcc 13 left out the
 * vzeroupper), every row paid Intel's transition penalty (AVX-512 Q8_0 at 4 GB/s, not 13). */
INLINE float add_blocks(int type, float acc, const uint8_t *w, int bsize, const int8_t *xq,
                        const float *xd, int from, int nb) {
    int8_t q[QK];
    for (int b = from; b < nb; b++) {
        const float dw = unpack_block(type, w + (size_t)b * bsize, q);
        acc = acc + (dw * xd[b]) * (float)idot_sum(q, xq + b * QK);
    }
    return acc;
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

AVX2 INLINE __m256i lanes8_avx2(__m256i u, __m256i v) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, v), _mm256_set1_epi16(1));
}

/* The block sums of the x86 paths. Integer additions are exact in any order, so the lanes of
 * several blocks (or rows, or inputs) are summed by one tree of unpacks and additions, and the
 * sums land in the order that the float step reads them. hsum4_avx2: for each 128-bit half h,
 * lane i of the result = the sum of a_i's four int32 lanes of half h. */
AVX2 INLINE __m256i hsum4_avx2(__m256i a0, __m256i a1, __m256i a2, __m256i a3) {
    /* per half: a0 (0 + 2), a1 (0 + 2), a0 (1 + 3), a1 (1 + 3) */
    const __m256i u01 =
        _mm256_add_epi32(_mm256_unpacklo_epi32(a0, a1), _mm256_unpackhi_epi32(a0, a1));
    const __m256i u23 =
        _mm256_add_epi32(_mm256_unpacklo_epi32(a2, a3), _mm256_unpackhi_epi32(a2, a3));
    return _mm256_add_epi32(_mm256_unpacklo_epi64(u01, u23), _mm256_unpackhi_epi64(u01, u23));
}

/* The sums of four registers of eight int32 lanes each (four blocks, or four rows' block). */
AVX2 INLINE __m128i hsum8x4_avx2(__m256i a0, __m256i a1, __m256i a2, __m256i a3) {
    const __m256i h = hsum4_avx2(a0, a1, a2, a3);
    return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

/* acc + p0 + p1 + p2 + p3, in that order: four blocks of one output's float chain. */
AVX2 INLINE float chain4_avx2(float acc, __m128 p) {
    acc = acc + _mm_cvtss_f32(p);
    acc = acc + _mm_cvtss_f32(_mm_movehdup_ps(p));
    acc = acc + _mm_cvtss_f32(_mm_movehl_ps(p, p));
    return acc + _mm_cvtss_f32(_mm_shuffle_ps(p, p, 3));
}

/* The float16 scales at p0 .. p3 as four floats (F16C: exact). */
AVX2 INLINE __m128 f16x4(const uint8_t *p0, const uint8_t *p1, const uint8_t *p2,
                         const uint8_t *p3) {
    __m128i h = _mm_cvtsi32_si128(rd16(p0));
    h = _mm_insert_epi16(h, rd16(p1), 1);
    h = _mm_insert_epi16(h, rd16(p2), 2);
    h = _mm_insert_epi16(h, rd16(p3), 3);
    return _mm_cvtph_ps(h);
}

AVX512 void rows_q_512(int type, const uint8_t *w, size_t row_bytes, size_t lane_bytes, int bsize,
                       const int8_t *xq, const float *xd, const int32_t *corr, int nb, float *y);
AVX512 void rows_q4_512(const uint8_t *w, size_t row_bytes, size_t lane_bytes, const int8_t *xq,
                        const int8_t *x4, const float *xd, const int32_t *corr4, int nb, float *y);
AVX512 int block_q4_512(const uint8_t *w, size_t row_bytes, int groups, int k, const mm_input *in,
                        int n, size_t ldy, float *y);
AVX512 int block_q8_512(const uint8_t *w, size_t row_bytes, int groups, int k, const int8_t *xq,
                        const float *xd, const int32_t *corr, int n, size_t ldy, float *y);
/* Rows 0 .. n_out - 1 by inputs 0 .. n - 1 in groups of QB_G inputs a register, the last
 * group a part one where QB_G does not divide n (q32_block.c): 0, or -1 when out of memory. */
AVX512 int q32_block_512(int type, const uint8_t *w, size_t row_bytes, int n_out, int k,
                         const mm_input *in, int n, float *y, size_t ldy);
void q4_layout(const int8_t *xq, const int32_t *corr, int k, int8_t *x4, int32_t *corr4);
AVX512 void prepare_input_512(const float *x, int k, int shift, int8_t *q, float *d, int32_t *corr);
#endif

#endif
