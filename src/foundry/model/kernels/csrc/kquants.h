/* What the K-quant files share (kquants.c, kquants_512.c; theory in kernels.h): a super-block's
 * layout, its scales and chunks unpacked by AVX2, and the AVX-512 prefill block of
 * kquants_512.c that kquants.c's matmul_k calls. */

#ifndef FOUNDRY_KQUANTS_H
#define FOUNDRY_KQUANTS_H

#include "kernels.h"

/* The float16 d is at byte KQ_D of a super-block, dmin (Q4_K, Q5_K) at byte 2. */
#define KQ_D(type) ((type) == T_Q6_K ? 208 : 0)

/* Inputs per tile of a prefill block: their int8 values (and Q6_K's pair sums) stay in L2
 * while every row of the matrix passes over them, so each weight block is read once per tile. */
#define K_TILE 64

#if defined(FOUNDRY_X86)
/* Inputs of a group of the AVX-512 block (kquants_512.c): one int32 lane each of a register. */
#define KB_G 16
/* Inputs from which the block takes a part group of KB_G (zeros in the lanes past them):
 * fewer pay more for the lanes they leave idle than the tiles do. */
#define KQ_BLOCK_MIN 6

/* Bytes of room (64-aligned) that kq_block_512 takes for a product of k values a row. */
size_t kq_block_room(int k);
/* Rows r0 .. n_out - 1 by the tn inputs (at most K_TILE) from input t: y's rows t .. t + tn
 * - 1 (on AMX's tiles where use_amx). */
void kq_block_512(int type, const uint8_t *w, size_t row_bytes, int r0, int n_out, int k,
                  const mm_input *in, int t, int tn, float *y, size_t ldy, void *room);

/* A Q4_K or Q5_K super-block's twelve bytes of 6-bit scales and mins, as ggml unpacks them:
 * the eight scales in bytes 0-7, the eight mins in bytes 8-15. */
AVX2 INLINE __m128i kq_scales_mins_u8(const uint8_t *blk) {
    uint32_t u[4];
    memcpy(u, blk + 4, 12);
    u[3] = ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4);
    const uint32_t m03 = u[1] & 0x3f3f3f3fu;
    u[1] = (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4);
    u[2] = m03;
    u[0] &= 0x3f3f3f3fu;
    return _mm_loadu_si128((const __m128i *)u);
}

AVX2 INLINE void kq_scales_avx2(const int type, const uint8_t *blk, __m256i *scv, __m128i *mins) {
    if (type == T_Q6_K) {
        const int8_t *sc = (const int8_t *)(blk + 192);
        for (int c = 0; c < 8; c++)
            scv[c] = _mm256_blend_epi32(_mm256_set1_epi16(sc[2 * c]),
                                        _mm256_set1_epi16(sc[2 * c + 1]), 0xF0);
        *mins = _mm_setzero_si128();
        return;
    }
    const __m128i both = kq_scales_mins_u8(blk); /* scales 0-7, then mins 0-7 */
    const __m256i sc16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(both));
    for (int c = 0; c < 8; c++) /* int16 c of each half to all of it */
        scv[c] =
            _mm256_shuffle_epi8(sc16, _mm256_set1_epi16((short)(0x0100 * (2 * c + 1) + 2 * c)));
    *mins = _mm_cvtepu8_epi16(_mm_srli_si128(both, 8));
}

AVX2 INLINE __m256i kq_chunk_avx2(const int type, const uint8_t *blk, int c, __m256i qh5) {
    const __m256i m4 = _mm256_set1_epi8(0xF);
    if (type == T_Q6_K) {
        const int n = c / 4, cc = c % 4;
        const __m256i ql = _mm256_loadu_si256((const __m256i *)(blk + 64 * n + (cc & 1 ? 32 : 0)));
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * n));
        const __m256i lo =
            cc < 2 ? _mm256_and_si256(ql, m4) : _mm256_and_si256(_mm256_srli_epi16(ql, 4), m4);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * cc), _mm256_set1_epi8(3));
        return _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
    }
    const int five = type == T_Q5_K;
    const __m256i qs = _mm256_loadu_si256((const __m256i *)(blk + (five ? 48 : 16) + 32 * (c / 2)));
    __m256i v = c & 1 ? _mm256_and_si256(_mm256_srli_epi16(qs, 4), m4) : _mm256_and_si256(qs, m4);
    if (five) {
        const __m256i bit = _mm256_and_si256(_mm256_srli_epi16(qh5, c), _mm256_set1_epi8(1));
        v = _mm256_or_si256(v, _mm256_slli_epi16(bit, 4));
    }
    return v;
}

/* Chunks 2j and 2j + 1 of a super-block as kq_chunk_avx2 gives them, in the low and the high
 * half of one AVX-512 register. */
AVX512 INLINE __m512i kq_pair_512(const int type, const uint8_t *blk, int j) {
    const __m512i m4 = _mm512_set1_epi8(0xF);
    if (type == T_Q6_K) { /* chunks 2j, 2j + 1: n = j / 2, cc = 2 (j mod 2) and + 1 */
        const int n = j / 2, hi_nibble = j & 1;
        const __m512i ql = _mm512_loadu_si512((const void *)(blk + 64 * n));
        const __m512i lo = _mm512_and_si512(hi_nibble ? _mm512_srli_epi16(ql, 4) : ql, m4);
        const __m512i qh =
            _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * n)));
        const __m512i sh = _mm512_inserti64x4(_mm512_set1_epi16((short)(4 * hi_nibble)),
                                              _mm256_set1_epi16((short)(4 * hi_nibble + 2)), 1);
        const __m512i hi = _mm512_and_si512(_mm512_srlv_epi16(qh, sh), _mm512_set1_epi8(3));
        return _mm512_or_si512(lo, _mm512_slli_epi16(hi, 4));
    }
    const int five = type == T_Q5_K;
    const __m512i qs = _mm512_broadcast_i64x4(
        _mm256_loadu_si256((const __m256i *)(blk + (five ? 48 : 16) + 32 * j)));
    const __m512i sh = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
    __m512i v = _mm512_and_si512(_mm512_srlv_epi16(qs, sh), m4);
    if (five) {
        const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 16)));
        const __m512i hs = _mm512_inserti64x4(_mm512_set1_epi16((short)(2 * j)),
                                              _mm256_set1_epi16((short)(2 * j + 1)), 1);
        const __m512i bit = _mm512_and_si512(_mm512_srlv_epi16(qh, hs), _mm512_set1_epi8(1));
        v = _mm512_or_si512(v, _mm512_slli_epi16(bit, 4));
    }
    return v;
}
#endif

#endif
