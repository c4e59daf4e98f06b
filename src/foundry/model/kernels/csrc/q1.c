/* The 32-blocks with a minimum: Q4_1 and Q5_1 (theory in kernels.h). */

#include "q32.h"

/* y = sum over blocks of d_w (d_x q.x) + m_w (d_x S): the input quantized to int8 blocks of 32
 * as for Q8_0, S its exact sum per block; the weights' values unsigned (Q4_1 0..15, Q5_1
 * 0..31). A block's products give eight exact int32 lanes (idot_lanes), added as (d_w * d_x) *
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

int matmul_q1(int type, const uint8_t *w, size_t row_bytes, int n_out, int k, const mm_input *in,
              int n, float *y, size_t ldy) {
    const int bytes = type == T_Q4_1 ? 20 : 24, nb = k / QK;
    float (*dot)(int, const uint8_t *, int, const int8_t *, const float *, const float *, int) =
        dot_q1_portable;
#if defined(FOUNDRY_X86)
    if (use_avx2) dot = dot_q1_avx2;
#endif
    for (int t0 = 0; t0 < n; t0 += Q_TILE)
        for (int r = 0; r < n_out; r++)
            for (int t = t0; t < n && t < t0 + Q_TILE; t++)
                y[(size_t)t * ldy + r] =
                    dot(type, w + (size_t)r * row_bytes, bytes, in->xq + (size_t)t * k,
                        in->xd + (size_t)t * nb, in->sums + (size_t)t * nb, nb);
    return 0;
}
