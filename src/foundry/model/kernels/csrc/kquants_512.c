/* The K-quants' prefill block on AVX-512 VNNI and AMX (theory in kernels.h, the tiles in
 * kquants.c).
 *
 * A tile of inputs (K_TILE) is laid out once for the block, in groups of KB_G = 16: for each
 * super-block, 64 registers, register q holding values 4q .. 4q + 3 of each of the group's
 * inputs (input i in int32 lane i), with the group's scales dx. Each row of the matrix is
 * unpacked once per tile into unsigned bytes (Q4_K 0..15, Q5_K 0..31, Q6_K its stored 0..63),
 * its sub-block scales as int32 and d as a float (an L1-resident kq_sb per super-block), and its
 * minimums' part of every input of the tile computed at once (kq_unpack_row). Then a tile of
 * KB_R rows by one group keeps, per row, one register of a sub-block's sums (int32 lane i:
 * input i), one of the super-block's and one of the float sums: per four values one vpdpbusd of
 * the row's four bytes (broadcast) against the group's register, 64 products; a sub-block's
 * exact sums times its scale (vpmulld) into the super-block's exact L; then per super-block
 * the float operations of dot_k_portable for sixteen outputs a register.
 *
 * Q6_K's weights are its stored 0..63 (q + 32): a sub-block's sums start at -32 x the input's
 * sum over its 16 values (laid out with the inputs), so that each ends at exactly the sum of
 * (q - 32) x.
 *
 * With AMX (use_amx) rows go 16 at a time (KB_RA; the rest as above): each row's values times
 * their sub-block's scale, v = sc w (Q6_K sc (w - 32)), as two byte planes (kq_amx_weights),
 * the rows' planes are A tiles (16 rows x 64 values), a group's registers of a super-block the
 * B tiles as they are laid out (16 rows x 64 bytes: values 4q .. 4q + 3 of 16 inputs), and
 * the super-block's L of 16 rows x 16 inputs is tdpbusd (low planes) + 256 tdpbssd (high
 * planes), exact; then the same float step. The tiles' state is each call's own (ldtilecfg,
 * tilerelease), so any thread of the pool runs it. */

#include "kquants.h"

#if defined(FOUNDRY_X86)

#ifndef KB_R
#define KB_R 6 /* rows of a register tile */
#endif
#define KB_RA 16 /* rows of an AMX tile (and the most rows unpacked at once) */

/* One super-block of a row, unpacked (384 bytes). */
typedef struct {
    uint8_t w[QK_K]; /* unsigned: Q4_K 0..15, Q5_K 0..31, Q6_K 0..63 */
    int32_t sc[16];  /* sub-block s's scale (Q4_K, Q5_K: 8 of 32 values; Q6_K: 16 of 16) */
    float d, pad[15];
} kq_sb;

/* The room of one block: its inputs laid out, KB_RA rows unpacked, and AMX's sums. */
typedef struct {
    int8_t *xi;   /* group g, super-block b, register q: 64 bytes at ((g nsb + b) 64 + q) 64 */
    float *dxv;   /* group g, super-block b: the 16 inputs' dx at (g nsb + b) 16 */
    int32_t *x32; /* Q6_K: group g, super-block b, sub-block s: at ((g nsb + b) 16 + s) 16 */
    int16_t *s32; /* super-block b, chunks 2j and 2j + 1 of input t at ((b 4 + j) K_TILE + t) 2 */
    float *dxt;   /* super-block b, input t at b K_TILE + t */
    kq_sb *u;     /* row r's super-blocks at r nsb */
    float *amin;  /* row r, input t at r K_TILE + t: the minimums' part of the sum */
    uint8_t *av;  /* AMX: row r, super-block b: its planes at (r nsb + b) 512 (kq_amx_weights) */
    int32_t *c;   /* AMX: two super-blocks' sums (kq_amx_sums) */
} kq_room;

static size_t kq_room_parts(int k, char *base, kq_room *room) {
    const size_t nsb = (size_t)(k / QK_K);
    const size_t sizes[9] = {(size_t)K_TILE * k,
                             K_TILE * nsb * sizeof(float),
                             K_TILE * nsb * 16 * sizeof(int32_t),
                             nsb * 4 * K_TILE * 2 * sizeof(int16_t),
                             nsb * K_TILE * sizeof(float),
                             KB_RA * nsb * sizeof(kq_sb),
                             KB_RA * K_TILE * sizeof(float),
                             KB_RA * nsb * 512,
                             2 * 512 * sizeof(int32_t)};
    void *at[9];
    size_t off = 0;
    for (int i = 0; i < 9; i++) {
        at[i] = base + off;
        off += (sizes[i] + 63) / 64 * 64;
    }
    if (room != NULL)
        *room = (kq_room){at[0], at[1], at[2], at[3], at[4], at[5], at[6], at[7], at[8]};
    return off;
}

size_t kq_block_room(int k) {
    return kq_room_parts(k, NULL, NULL);
}

/* Inputs 0 .. tn - 1 of `in` from t on, into the room's layout; the last group's lanes past tn
 * zeros. */
static void kq_lay_inputs(const int q6, const mm_input *in, int t, int tn, const kq_room *x) {
    const int k = in->k, nsb = k / QK_K;
    for (int g = 0; g < (tn + KB_G - 1) / KB_G; g++)
        for (int b = 0; b < nsb; b++) {
            const size_t gb = (size_t)g * nsb + b;
            for (int i = 0; i < KB_G; i++) {
                const int ti = KB_G * g + i, live = ti < tn;
                const int8_t *src = in->xq + (size_t)(t + ti) * k + (size_t)b * QK_K;
                for (int q = 0; q < QK_K / 4; q++) {
                    int32_t v = 0;
                    if (live) memcpy(&v, src + 4 * q, 4);
                    memcpy(x->xi + (gb * 64 + q) * 64 + 4 * i, &v, 4);
                }
                x->dxv[gb * KB_G + i] = live ? in->xd[(size_t)(t + ti) * nsb + b] : 0.0f;
                if (!q6) continue;
                for (int sb = 0; sb < 16; sb++) {
                    int32_t sum = 0;
                    for (int j = 0; live && j < 16; j++) sum += src[16 * sb + j];
                    x->x32[(gb * 16 + sb) * KB_G + i] = -32 * sum;
                }
            }
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
        if (ahead != NULL) /* the row unpacked a tile of rows later */
            for (int o = 0; o < bytes; o += 64)
                _mm_prefetch((const char *)(ahead + (size_t)b * bytes + o), _MM_HINT_T0);
        __m128i mins = _mm_setzero_si128();
        if (q6) {
            const __m128i s8 = _mm_loadu_si128((const __m128i *)(blk + 192));
            _mm512_store_si512((void *)u[b].sc, _mm512_cvtepi8_epi32(s8));
        } else {
            const __m128i both = kq_scales_mins_u8(blk); /* scales 0-7, then mins 0-7 */
            _mm256_store_si256((__m256i *)u[b].sc, _mm256_cvtepu8_epi32(both));
            mins = _mm_cvtepu8_epi16(_mm_srli_si128(both, 8));
        }
        for (int j = 0; j < 4; j++)
            _mm512_store_si512((void *)(u[b].w + 64 * j), kq_pair_512(type, blk, j));
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

/* A super-block's float step of dot_k_portable for sixteen inputs: acc + (d dx) (float)L. */
AVX512 INLINE __m512 kq_float_step(__m512 acc, float d, __m512 dv, __m512i L) {
    const __m512 f = _mm512_mul_ps(_mm512_set1_ps(d), dv);
    return _mm512_add_ps(acc, _mm512_mul_ps(f, _mm512_cvtepi32_ps(L)));
}

/* A row's sums of group g less its minimums' part (amin: the row's), into its column of y. */
AVX512 INLINE void kq_store_out(__m512 acc, const float *amin, int g, int live, float *y,
                                size_t ldy) {
    float out[KB_G];
    _mm512_storeu_ps(out, _mm512_sub_ps(acc, _mm512_loadu_ps(amin + KB_G * g)));
    for (int i = 0; i < live; i++) y[(size_t)(KB_G * g + i) * ldy] = out[i];
}

/* The outputs of sixteen rows (acc[r]: row r's sixteen inputs of group g, less amin's row r)
 * into y (row 0's column) by store_16x16_512 (kq_store_out's values). */
AVX512 INLINE void kq_store_16x16(const __m512 *acc, const float *amin, int g, int live, float *y,
                                  size_t ldy) {
    __m512 a[16];
    for (int r = 0; r < 16; r++)
        a[r] = _mm512_sub_ps(acc[r], _mm512_loadu_ps(amin + r * K_TILE + KB_G * g));
    store_16x16_512(a, live, y + (size_t)KB_G * g * ldy, ldy);
}

/* R rows (u, nsb super-blocks each) by input group g, into y (its inputs 16 g .. 16 g + live
 * - 1 of the tile): dot_k_portable's float operations, sixteen outputs a register, less the
 * rows' minimums' part. */
AVX512 INLINE void kq_block_t(const int q6, const int R, const kq_sb *u, int nsb, const kq_room *x,
                              int g, int live, const float *amin, float *y, size_t ldy) {
    const int ns = q6 ? 16 : 8, nq = q6 ? 4 : 8; /* sub-blocks, registers per sub-block */
    __m512 acc[KB_R];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int b = 0; b < nsb; b++) {
        const size_t gb = (size_t)g * nsb + b;
        const int8_t *xb = x->xi + gb * 64 * 64;
        const kq_sb *ub = u + b;
        __m512i L[KB_R];
        for (int s = 0; s < ns; s++) {
            __m512i S[KB_R];
            const __m512i s0 = q6 ? _mm512_load_si512((const void *)(x->x32 + (gb * 16 + s) * KB_G))
                                  : _mm512_setzero_si512();
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) S[r] = s0;
#pragma GCC unroll 8
            for (int q = s * nq; q < (s + 1) * nq; q++) {
                const __m512i xv = _mm512_load_si512((const void *)(xb + 64 * q));
#pragma GCC unroll 8
                for (int r = 0; r < R; r++) {
                    int32_t w4;
                    memcpy(&w4, ub[(size_t)r * nsb].w + 4 * q, 4);
                    S[r] = _mm512_dpbusd_epi32(S[r], _mm512_set1_epi32(w4), xv);
                }
            }
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                const __m512i p =
                    _mm512_mullo_epi32(S[r], _mm512_set1_epi32(ub[(size_t)r * nsb].sc[s]));
                L[r] = s == 0 ? p : _mm512_add_epi32(L[r], p);
            }
        }
        const __m512 dv = _mm512_load_ps(x->dxv + gb * KB_G);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) acc[r] = kq_float_step(acc[r], ub[(size_t)r * nsb].d, dv, L[r]);
    }
    for (int r = 0; r < R; r++) kq_store_out(acc[r], amin + r * K_TILE, g, live, y + r, ldy);
}

AVX512 static void kq_block_rows(const int type, const int R, const kq_sb *u, int nsb,
                                 const kq_room *x, int tn, const float *amin, float *y,
                                 size_t ldy) {
    const int q6 = type == T_Q6_K;
    for (int g = 0; g < (tn + KB_G - 1) / KB_G; g++) {
        const int live = tn - KB_G * g < KB_G ? tn - KB_G * g : KB_G;
#define KB_CASE(Q6, R_)                                                                            \
    if (q6 == Q6 && R == R_) kq_block_t(Q6, R_, u, nsb, x, g, live, amin, y, ldy);
        KB_CASE(0, KB_R)
        KB_CASE(1, KB_R)
        KB_CASE(0, 1)
        KB_CASE(1, 1)
#undef KB_CASE
    }
}

/* Row r's AMX weights (av, KB_RA rows): each super-block's values times their sub-block's
 * scale, v = sc w (Q6_K: sc (w - 32); |v| <= 4096, int16), as two planes of 256 bytes: its low
 * bytes (unsigned), then v >> 8 (signed, -16 .. 16), so v = lo + 256 hi exactly. */
AVX512 static void kq_amx_weights(const int q6, const kq_sb *u, int nsb, uint8_t *av) {
    for (int b = 0; b < nsb; b++, av += 512)
        for (int j = 0; j < 8; j++) { /* values 32 j .. 32 j + 31: sub-block j (Q6_K 2j, 2j+1) */
            const int32_t *sc = u[b].sc;
            const __m512i scv = q6 ? _mm512_inserti64x4(_mm512_set1_epi16((short)sc[2 * j]),
                                                        _mm256_set1_epi16((short)sc[2 * j + 1]), 1)
                                   : _mm512_set1_epi16((short)sc[j]);
            __m512i w = _mm512_cvtepu8_epi16(_mm256_load_si256((const __m256i *)(u[b].w + 32 * j)));
            if (q6) w = _mm512_sub_epi16(w, _mm512_set1_epi16(32));
            const __m512i v = _mm512_mullo_epi16(w, scv);
            _mm256_store_si256((__m256i *)(av + 32 * j), _mm512_cvtepi16_epi8(v));
            _mm256_store_si256((__m256i *)(av + 256 + 32 * j),
                               _mm512_cvtepi16_epi8(_mm512_srai_epi16(v, 8)));
        }
}

/* The tiles' shapes (ldtilecfg's 64 bytes): all eight 16 rows x 64 bytes. */
typedef struct {
    uint8_t palette, start, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} kq_tilecfg;

/* A super-block's exact sums of KB_RA rows (their planes at a, astride apart) by a group of
 * inputs (xb: its 64 registers, the B layout of 16 rows a 64 values), in tiles CL (the low
 * planes, tdpbusd) and CH (the high ones, tdpbssd) from zero, stored at c: input i of row r at
 * 16 r + i, the high sums 256 on. */
#define KA_SB(CL, CH)                                                                              \
    do {                                                                                           \
        _tile_zero(CL);                                                                            \
        _tile_zero(CH);                                                                            \
        for (int kc = 0; kc < 4; kc++) {                                                           \
            _tile_loadd(4, a + 64 * kc, astride);                                                  \
            _tile_loadd(5, a + 256 + 64 * kc, astride);                                            \
            _tile_loadd(6, xb + 1024 * kc, 64);                                                    \
            _tile_dpbusd(CL, 4, 6);                                                                \
            _tile_dpbssd(CH, 5, 6);                                                                \
        }                                                                                          \
        _tile_stored(CL, c, 64);                                                                   \
        _tile_stored(CH, c + 256, 64);                                                             \
    } while (0)

AMX INLINE void kq_amx_sums(const uint8_t *a, size_t astride, const int8_t *xb, int32_t *c,
                            int odd) {
    if (odd)
        KA_SB(2, 3);
    else
        KA_SB(0, 1);
}
#undef KA_SB

/* KB_RA rows (u, and their planes av; nsb super-blocks each) by input group g on AMX, into y
 * as kq_block_t: a super-block's L of all the rows by the group at once (row r's, input i: low
 * sum + 256 x high sum, exact), then per row kq_block_t's float step. The tiles of super-block
 * b + 1 go while b's sums are read (two buffers). */
AMX static void kq_block_amx_g(const kq_sb *u, const uint8_t *av, int nsb, const kq_room *x, int g,
                               int live, const float *amin, float *y, size_t ldy) {
    const size_t astride = (size_t)nsb * 512;
    const int8_t *xg = x->xi + (size_t)g * nsb * 64 * 64;
    __m512 acc[KB_RA];
    for (int r = 0; r < KB_RA; r++) acc[r] = _mm512_setzero_ps();
    kq_amx_sums(av, astride, xg, x->c, 0);
    for (int b = 0; b < nsb; b++) {
        const size_t gb = (size_t)g * nsb + b;
        const int32_t *c = x->c + (b & 1) * 512;
        if (b + 1 < nsb)
            kq_amx_sums(av + (size_t)(b + 1) * 512, astride, xg + (size_t)(b + 1) * 64 * 64,
                        x->c + ((b + 1) & 1) * 512, (b + 1) & 1);
        const __m512 dv = _mm512_load_ps(x->dxv + gb * KB_G);
        for (int r = 0; r < KB_RA; r++) {
            const __m512i lo = _mm512_load_si512((const void *)(c + 16 * r));
            const __m512i hi = _mm512_load_si512((const void *)(c + 256 + 16 * r));
            const __m512i L = _mm512_add_epi32(lo, _mm512_slli_epi32(hi, 8));
            acc[r] = kq_float_step(acc[r], u[(size_t)r * nsb + b].d, dv, L);
        }
    }
    kq_store_16x16(acc, amin, g, live, y, ldy);
}

/* This thread's tiles in kq_tilecfg's shapes, for one kq_block_512 call (once a call, not
 * once a tile of rows), and given back at its end. */
AMX static void kq_amx_begin(void) {
    kq_tilecfg cfg = {.palette = 1};
    for (int i = 0; i < 8; i++) {
        cfg.colsb[i] = 64;
        cfg.rows[i] = 16;
    }
    _tile_loadconfig(&cfg);
}

AMX static void kq_amx_end(void) {
    _tile_release();
}

AMX static void kq_block_amx(const kq_sb *u, const uint8_t *av, int nsb, const kq_room *x, int tn,
                             const float *amin, float *y, size_t ldy) {
    for (int g = 0; g < (tn + KB_G - 1) / KB_G; g++) {
        const int live = tn - KB_G * g < KB_G ? tn - KB_G * g : KB_G;
        kq_block_amx_g(u, av, nsb, x, g, live, amin, y, ldy);
    }
}

void kq_block_512(int type, const uint8_t *w, size_t row_bytes, int r0, int n_out, int k,
                  const mm_input *in, int t, int tn, float *y, size_t ldy, void *mem) {
    const int bytes = type == T_Q4_K ? 144 : type == T_Q5_K ? 176 : 210;
    const int nsb = k / QK_K, q6 = type == T_Q6_K;
    kq_room x;
    kq_room_parts(k, mem, &x);
    kq_lay_inputs(q6, in, t, tn, &x);
    const int tiles = use_amx && n_out - r0 >= KB_RA;
    if (tiles) kq_amx_begin();
    for (int r = r0; r < n_out;) {
        /* AMX: KB_RA rows a tile; the register tiles: KB_R rows, the last rows one at a time */
        const int amx = use_amx && n_out - r >= KB_RA;
        const int R = amx ? KB_RA : n_out - r < KB_R ? 1 : KB_R;
        for (int i = 0; i < R; i++)
            kq_unpack_row(type, w + (size_t)(r + i) * row_bytes,
                          r + i + R < n_out ? w + (size_t)(r + i + R) * row_bytes : NULL, bytes,
                          nsb, &x, x.u + (size_t)i * nsb, x.amin + (size_t)i * K_TILE);
        if (amx) {
            for (int i = 0; i < R; i++)
                kq_amx_weights(q6, x.u + (size_t)i * nsb, nsb, x.av + (size_t)i * nsb * 512);
            kq_block_amx(x.u, x.av, nsb, &x, tn, x.amin, y + (size_t)t * ldy + r, ldy);
        } else {
            kq_block_rows(type, R, x.u, nsb, &x, tn, x.amin, y + (size_t)t * ldy + r, ldy);
        }
        r += R;
    }
    if (tiles) kq_amx_end();
}
#endif
