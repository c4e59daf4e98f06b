/* The K-quants' prefill block on AVX-512 VNNI (theory in kernels.h, the tiles in kquants.c).
 *
 * A tile of inputs (K_TILE) is laid out once for the block: inputs in pairs, chunk c of a
 * super-block of input 2p in the low 32 bytes of a register and of input 2p + 1 in the high
 * ones, with the pair's scales dx (eight of each). Each row of the matrix is unpacked once per
 * tile into int8 values, int16 scales and float d (an L1-resident kq_sb per super-block), and
 * its minimums' part of every input of the tile computed at once (kq_unpack_row). Then a tile of
 * KB_R rows by KB_P pairs keeps its int32 lanes in registers: per chunk one maddubs of the
 * unpacked weights (broadcast to both halves) and the pair's values, and one vpdpwssd by the
 * chunk's scales, which gives each output the eight exact lanes L of dot_k_portable, already
 * apart (no folding); the super-block's float operations follow for two outputs a register.
 *
 * Q6_K's weights are kept signed (q - 32) and the inputs unsigned (x + 128, the bits of x
 * xor 0x80), so maddubs gives the pair sums of (x + 128)(q - 32) (at most 2 x 255 x 32); the
 * lanes start at -128 x sum_c sc_c x (the lane's four weights), a row's constant, so that each
 * ends at exactly dot_k_portable's L. */

#include "kquants.h"

#if defined(FOUNDRY_X86)

#ifndef KB_R
#define KB_R 4 /* rows of a register tile */
#endif
#ifndef KB_P
#define KB_P 3 /* pairs of inputs of a register tile */
#endif

/* A chunk's 32 values (and an input's) in the block's order: their eight groups of four (the
 * lanes of dot_k_portable) as 0, 4, 1, 5, 2, 6, 3, 7, so that Q6_K's two sub-blocks alternate
 * and a chunk's scales are one 64-bit pattern; the float sums keep that order until
 * kq_block_t's end, which puts them back (KB_BACK) before the halving. */
#define KB_ORDER _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)
#define KB_BACK  _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7)

/* One super-block of a row, unpacked (384 bytes). */
typedef struct {
    int8_t w[QK_K];   /* chunk c at 32c: Q4_K, Q5_K as unsigned 0..15, 0..31; Q6_K q - 32 */
    int64_t sc[8];    /* chunk c's scales as int16 for vpdpwssd, lanes 0 and 1 of KB_ORDER */
    int32_t start[8]; /* the lanes' start: 0, or Q6_K's -128 sum_c sc_c (the four weights) */
    float d, pad[7];
} kq_sb;

/* The room of one block: its inputs laid out, and KB_R rows unpacked. */
typedef struct {
    int8_t *xi;   /* pair p, super-block b, chunk c: 64 bytes at ((p nsb + b) 8 + c) 64 */
    float *dxv;   /* pair p, super-block b: dx of 2p eight times, then of 2p + 1 */
    int16_t *s32; /* super-block b, chunks 2j and 2j + 1 of input t at ((b 4 + j) K_TILE + t) 2 */
    float *dxt;   /* super-block b, input t at b K_TILE + t */
    kq_sb *u;     /* row r's super-blocks at r nsb */
    float *amin;  /* row r, input t at r K_TILE + t: the minimums' part of the sum */
} kq_room;

static size_t kq_room_parts(int k, char *base, kq_room *room) {
    const size_t nsb = (size_t)(k / QK_K);
    const size_t sizes[6] = {(size_t)K_TILE * k,
                             (K_TILE / 2) * nsb * 16 * sizeof(float),
                             nsb * 4 * K_TILE * 2 * sizeof(int16_t),
                             nsb * K_TILE * sizeof(float),
                             KB_R * nsb * sizeof(kq_sb),
                             KB_R * K_TILE * sizeof(float)};
    void *at[6];
    size_t off = 0;
    for (int i = 0; i < 6; i++) {
        at[i] = base + off;
        off += (sizes[i] + 63) / 64 * 64;
    }
    if (room != NULL) *room = (kq_room){at[0], at[1], at[2], at[3], at[4], at[5]};
    return off;
}

size_t kq_block_room(int k) {
    return kq_room_parts(k, NULL, NULL);
}

/* Inputs 0 .. tn - 1 (tn even) of `in` from t on, into the room's layout. */
AVX512 static void kq_lay_inputs(const int q6, const mm_input *in, int t, int tn,
                                 const kq_room *x) {
    const int k = in->k, nsb = k / QK_K;
    const __m256i flip = _mm256_set1_epi8(q6 ? (char)0x80 : 0);
    for (int p = 0; p < tn / 2; p++)
        for (int b = 0; b < nsb; b++) {
            for (int h = 0; h < 2; h++) {
                const int8_t *src = in->xq + (size_t)(t + 2 * p + h) * k + (size_t)b * QK_K;
                int8_t *dst = x->xi + ((size_t)p * nsb + b) * 8 * 64 + 32 * h;
                for (int c = 0; c < 8; c++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(src + 32 * c));
                    _mm256_storeu_si256(
                        (__m256i *)(dst + 64 * c),
                        _mm256_permutevar8x32_epi32(_mm256_xor_si256(v, flip), KB_ORDER));
                }
            }
            float *dv = x->dxv + ((size_t)p * nsb + b) * 16;
            for (int i = 0; i < 16; i++) dv[i] = in->xd[(size_t)(t + 2 * p + i / 8) * nsb + b];
        }
    if (q6) return;
    for (int b = 0; b < nsb; b++)
        for (int i = 0; i < K_TILE; i++) {
            const int live = i < tn;
            x->dxt[(size_t)b * K_TILE + i] = live ? in->xd[(size_t)(t + i) * nsb + b] : 0.0f;
            for (int c = 0; c < 8; c++)
                x->s32[(((size_t)b * 4 + c / 2) * K_TILE + i) * 2 + c % 2] =
                    live ? in->s32h[(size_t)(t + i) * (k / QK) + 8 * b + c] : 0;
        }
}

/* Row `row` unpacked into u (nsb super-blocks), and for Q4_K, Q5_K the minimums' part of each
 * input of the tile: amin_t = amin_t + (dmin dx_t) M_t super-block by super-block, M_t the exact
 * sum of m_c s32_c (four vpdpwssd of the minimums' pairs against sixteen inputs' pairs of chunk
 * sums), as kq_sums_block's amin. The row `ahead` (or NULL) is prefetched as it goes: the
 * matrix's one pass from memory is here. */
AVX512 static void kq_unpack_row(const int type, const uint8_t *row, const uint8_t *ahead,
                                 int bytes, int nsb, const kq_room *x, kq_sb *u, float *amin) {
    const int q6 = type == T_Q6_K;
    __m512 am[K_TILE / 16];
    for (int q = 0; q < K_TILE / 16; q++) am[q] = _mm512_setzero_ps();
    for (int b = 0; b < nsb; b++) {
        const uint8_t *blk = row + (size_t)b * bytes;
        if (ahead != NULL) /* the row unpacked KB_R rows later */
            for (int o = 0; o < bytes; o += 64)
                _mm_prefetch((const char *)(ahead + (size_t)b * bytes + o), _MM_HINT_T0);
        __m128i mins = _mm_setzero_si128();
        __m128i sc[4]; /* chunks 2i, 2i + 1: sc[2c] twice, sc[2c + 1] twice, as int16 */
        if (q6) {
            for (int h = 0; h < 2; h++) {
                const __m128i s16 =
                    _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(blk + 192 + 8 * h)));
                sc[2 * h] = _mm_unpacklo_epi16(s16, s16);
                sc[2 * h + 1] = _mm_unpackhi_epi16(s16, s16);
            }
        } else {
            const __m128i both = kq_scales_mins_u8(blk); /* scales 0-7, then mins 0-7 */
            const __m128i s16 = _mm_cvtepu8_epi16(both);
            const __m128i lo = _mm_unpacklo_epi16(s16, s16), hi = _mm_unpackhi_epi16(s16, s16);
            sc[0] = _mm_unpacklo_epi32(lo, lo);
            sc[1] = _mm_unpackhi_epi32(lo, lo);
            sc[2] = _mm_unpacklo_epi32(hi, hi);
            sc[3] = _mm_unpackhi_epi32(hi, hi);
            mins = _mm_cvtepu8_epi16(_mm_srli_si128(both, 8));
        }
        for (int i = 0; i < 4; i++) _mm_store_si128((__m128i *)(u[b].sc + 2 * i), sc[i]);
        __m512i start = _mm512_setzero_si512();
        for (int j = 0; j < 4; j++) {
            __m512i v = kq_pair_512(type, blk, j);
            v = _mm512_permutexvar_epi32(
                _mm512_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15), v);
            if (q6) {
                v = _mm512_sub_epi8(v, _mm512_set1_epi8(32));
                const __m512i sv = _mm512_inserti64x4(_mm512_set1_epi64(u[b].sc[2 * j]),
                                                      _mm256_set1_epi64x(u[b].sc[2 * j + 1]), 1);
                const __m512i pairs = _mm512_maddubs_epi16(_mm512_set1_epi8(1), v);
                start = _mm512_add_epi32(start, _mm512_madd_epi16(pairs, sv));
            }
            _mm512_store_si512((void *)(u[b].w + 64 * j), v);
        }
        const __m256i s8 =
            _mm256_add_epi32(_mm512_castsi512_si256(start), _mm512_extracti64x4_epi64(start, 1));
        _mm256_store_si256((__m256i *)u[b].start,
                           _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(s8, 7)));
        u[b].d = f16c(blk + KQ_D(type));
        if (q6) continue;
        const float dmin = f16c(blk + 2);
        __m512i mp[4]; /* the minimums m_2j, m_2j+1 as one int32 */
        mp[0] = _mm512_set1_epi32(_mm_extract_epi32(mins, 0));
        mp[1] = _mm512_set1_epi32(_mm_extract_epi32(mins, 1));
        mp[2] = _mm512_set1_epi32(_mm_extract_epi32(mins, 2));
        mp[3] = _mm512_set1_epi32(_mm_extract_epi32(mins, 3));
        for (int q = 0; q < K_TILE / 16; q++) { /* past tn: zeros */
            __m512i m = _mm512_setzero_si512();
            for (int j = 0; j < 4; j++)
                m = _mm512_dpwssd_epi32(
                    m, mp[j],
                    _mm512_load_si512(
                        (const void *)(x->s32 + (((size_t)b * 4 + j) * K_TILE + 16 * q) * 2)));
            const __m512 dm = _mm512_mul_ps(_mm512_set1_ps(dmin),
                                            _mm512_load_ps(x->dxt + (size_t)b * K_TILE + 16 * q));
            am[q] = _mm512_add_ps(am[q], _mm512_mul_ps(dm, _mm512_cvtepi32_ps(m)));
        }
    }
    for (int q = 0; q < K_TILE / 16; q++) _mm512_storeu_ps(amin + 16 * q, am[q]);
}

/* Super-block b of R rows (u, nsb super-blocks each) by P pairs of inputs from pair p, added
 * into the float sums a (those of b's parity). */
AVX512 INLINE void kq_block_sb(const int q6, const int R, const int P, const kq_sb *u, int nsb,
                               const kq_room *x, int p, int b, __m512 *a) {
    __m512i L[KB_R * KB_P];
    for (int r = 0; r < R; r++) {
        const __m512i s = _mm512_broadcast_i64x4(
            _mm256_load_si256((const __m256i *)u[(size_t)r * nsb + b].start));
        for (int j = 0; j < P; j++) L[r * P + j] = s;
    }
    const int8_t *xb = x->xi + ((size_t)p * nsb + b) * 8 * 64;
    for (int c = 0; c < 8; c++) {
        __m512i xv[KB_P];
        for (int j = 0; j < P; j++)
            xv[j] = _mm512_load_si512((const void *)(xb + (size_t)j * nsb * 8 * 64 + 64 * c));
        for (int r = 0; r < R; r++) {
            const kq_sb *s = u + (size_t)r * nsb + b;
            const __m512i wv =
                _mm512_broadcast_i64x4(_mm256_load_si256((const __m256i *)(s->w + 32 * c)));
            const __m512i sv = _mm512_set1_epi64(s->sc[c]);
            for (int j = 0; j < P; j++) {
                const __m512i pr =
                    q6 ? _mm512_maddubs_epi16(xv[j], wv) : _mm512_maddubs_epi16(wv, xv[j]);
                L[r * P + j] = _mm512_dpwssd_epi32(L[r * P + j], pr, sv);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        const __m512 d = _mm512_set1_ps(u[(size_t)r * nsb + b].d);
        for (int j = 0; j < P; j++) {
            const __m512 f =
                _mm512_mul_ps(d, _mm512_load_ps(x->dxv + ((size_t)(p + j) * nsb + b) * 16));
            const __m512 v = _mm512_mul_ps(f, _mm512_cvtepi32_ps(L[r * P + j]));
            a[r * P + j] = _mm512_add_ps(a[r * P + j], v);
        }
    }
}

/* The high eight floats of a register (AVX-512F alone: extractf32x8 is AVX-512DQ's). */
AVX512 INLINE __m256 kq_high(__m512 v) {
    return _mm256_castsi256_ps(_mm512_extracti64x4_epi64(_mm512_castps_si512(v), 1));
}

/* R rows by P pairs of inputs from pair p, into y: the outputs' sums (a0 and a1 as the
 * super-blocks alternate) finished as kq_sums_store, less the row's minimums' part. */
AVX512 INLINE void kq_block_t(const int q6, const int R, const int P, const kq_sb *u, int nsb,
                              const kq_room *x, int p, const float *amin, float *y, size_t ldy) {
    __m512 a0[KB_R * KB_P], a1[KB_R * KB_P];
    for (int i = 0; i < R * P; i++) a0[i] = a1[i] = _mm512_setzero_ps();
    for (int b = 0; b < nsb; b += 2) {
        kq_block_sb(q6, R, P, u, nsb, x, p, b, a0);
        if (b + 1 < nsb) kq_block_sb(q6, R, P, u, nsb, x, p, b + 1, a1);
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < P; j++) {
            const int i = r * P + j, t = 2 * (p + j);
            const __m256 lo = _mm256_add_ps(_mm512_castps512_ps256(a0[i]),
                                            _mm512_castps512_ps256(a1[i])); /* finish16_avx2 */
            const __m256 hi = _mm256_add_ps(kq_high(a0[i]), kq_high(a1[i]));
            y[(size_t)t * ldy + r] =
                finish8_avx2(_mm256_permutevar8x32_ps(lo, KB_BACK)) - amin[r * K_TILE + t];
            y[(size_t)(t + 1) * ldy + r] =
                finish8_avx2(_mm256_permutevar8x32_ps(hi, KB_BACK)) - amin[r * K_TILE + t + 1];
        }
}

AVX512 static void kq_block_rows(const int type, const int R, const kq_sb *u, int nsb,
                                 const kq_room *x, int pairs, const float *amin, float *y,
                                 size_t ldy) {
    const int q6 = type == T_Q6_K;
    int p = 0;
#define KB_CASE(Q6, R_, P_)                                                                        \
    if (q6 == Q6 && R == R_)                                                                       \
        for (; p + P_ <= pairs; p += P_) kq_block_t(Q6, R_, P_, u, nsb, x, p, amin, y, ldy);
    KB_CASE(0, KB_R, KB_P)
    KB_CASE(1, KB_R, KB_P)
    KB_CASE(0, 1, KB_P)
    KB_CASE(1, 1, KB_P)
    KB_CASE(0, KB_R, 1)
    KB_CASE(1, KB_R, 1)
    KB_CASE(0, 1, 1)
    KB_CASE(1, 1, 1)
#undef KB_CASE
}

void kq_block_512(int type, const uint8_t *w, size_t row_bytes, int r0, int n_out, int k,
                  const mm_input *in, int t, int tn, float *y, size_t ldy, void *mem) {
    const int bytes = type == T_Q4_K ? 144 : type == T_Q5_K ? 176 : 210;
    const int nsb = k / QK_K, q6 = type == T_Q6_K;
    kq_room x;
    kq_room_parts(k, mem, &x);
    kq_lay_inputs(q6, in, t, tn, &x);
    for (int r = r0; r < n_out;) {
        const int R = n_out - r < KB_R ? 1 : KB_R; /* the last rows one at a time */
        for (int i = 0; i < R; i++)
            kq_unpack_row(type, w + (size_t)(r + i) * row_bytes,
                          r + i + KB_R < n_out ? w + (size_t)(r + i + KB_R) * row_bytes : NULL,
                          bytes, nsb, &x, x.u + (size_t)i * nsb, x.amin + (size_t)i * K_TILE);
        kq_block_rows(type, R, x.u, nsb, &x, tn / 2, x.amin, y + (size_t)t * ldy + r, ldy);
        r += R;
    }
}
#endif
