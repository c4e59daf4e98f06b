/* The 32-blocks' prefill block on AVX-512 VNNI (Q8_0, Q4_0, Q5_0; theory in kernels.h): the
 * K-quants' block of kquants_512.c for blocks of 32.
 *
 * A tile of inputs (Q_TILE) is laid out once for the block, in groups of QB_G = 16: for each
 * block of 32 values, 8 registers, register q holding values 4q .. 4q + 3 of each of the
 * group's inputs (input i in int32 lane i), with the group's scales d_x and minus the weights'
 * offset times each input's sum over the block (Q8_0 128, Q4_0 8, Q5_0 16). The last group of
 * a product may be a part one (q32.c gives the block a part group of QB_PART_MIN inputs or
 * more, Q4_0 QB_PART_MIN_Q4: qb_inputs): its lanes past the inputs are zeros (values, sums,
 * d_x), their outputs not stored, so a batch of 6 to 15 decode rows (Q4_0 9 to 15) takes the
 * block too. Each row of the matrix is unpacked once per tile into unsigned bytes (Q8_0 w + 128
 * by the sign bit, Q4_0 its stored nibbles 0..15, Q5_0 its five bits 0..31) and its float16
 * scales as floats. Then a tile of QB_R rows by one group keeps, per row, one register of the
 * block's sums (int32 lane i: input i), starting at the group's minus offset x sums, and one of
 * the float sums: per four values one vpdpbusd of the row's four bytes (broadcast) against the
 * group's register, 64 products, so the block's exact S_b of sixteen inputs is 8 vpdpbusd;
 * then per block one conversion, the scale products d_w * d_x of the sixteen inputs, one
 * multiplication and one addition: add_blocks' operations, sixteen outputs a register.
 *
 * With AMX (use_amx) rows go 16 at a time (QB_RA; the rest as above): the rows' unpacked values
 * of a block are the A tile (16 rows x 32 bytes, nb x 32 apart), the group's 8 registers of it
 * the B tile as they are laid out (8 rows x 64 bytes), and one tdpbusd gives the block's sums
 * of 16 rows by 16 inputs, exact, onto which the group's minus offset x sums come; then the same
 * float step. The tiles' state is each call's own (ldtilecfg at its start, tilerelease at its
 * end), so any thread of the pool runs it. */

#include "q32.h"

#if defined(FOUNDRY_X86)

#ifndef QB_R
#define QB_R 4 /* rows of a register tile (faster than 3, 5, 6 and 8 on the VM) */
#endif
#define QB_RA 16 /* rows of an AMX tile (and the most rows unpacked at once) */

/* The room of one block: its inputs laid out, QB_R rows unpacked. */
typedef struct {
    int8_t *xi;  /* group g, block b, register q: 64 bytes at ((g nb + b) 8 + q) 64 */
    int32_t *cx; /* group g, block b: the 16 inputs' - offset x sum at (g nb + b) 16 */
    float *dxv;  /* group g, block b: the 16 inputs' d_x at (g nb + b) 16 */
    uint8_t *u;  /* row r, block b: its 32 unsigned values at (r nb + b) 32 */
    float *dw;   /* row r, block b: d_w at r nb + b */
    int32_t *c;  /* AMX: two blocks' sums of 16 rows by 16 inputs (qb_amx_sums) */
} qb_room;

static size_t qb_room_parts(int k, char *base, qb_room *room) {
    const size_t nb = (size_t)(k / QK);
    const size_t sizes[6] = {(size_t)Q_TILE * k,          Q_TILE * nb * sizeof(int32_t),
                             Q_TILE * nb * sizeof(float), QB_RA * nb * QK,
                             QB_RA * nb * sizeof(float),  2 * 256 * sizeof(int32_t)};
    void *at[6];
    size_t off = 0;
    for (int i = 0; i < 6; i++) {
        at[i] = base + off;
        off += (sizes[i] + 63) / 64 * 64;
    }
    if (room != NULL) *room = (qb_room){at[0], at[1], at[2], at[3], at[4], at[5]};
    return off;
}

/* The inputs of group g of a tile of tn: QB_G, or fewer in a last part group. */
static inline int qb_live(int tn, int g) {
    return tn - QB_G * g < QB_G ? tn - QB_G * g : QB_G;
}

/* Inputs t .. t + tn - 1 of `in` into the room's layout: each register one gather of the
 * sixteen inputs' four values, their exact sums by vpdpbusd against ones; a last part group's
 * lanes past tn zeros (values, sums and d_x: their S_b and outputs 0, never stored). */
AVX512 static void qb_lay_inputs(int shift, const mm_input *in, int t, int tn, const qb_room *x) {
    const int k = in->k, nb = k / QK;
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i at_x = _mm512_mullo_epi32(lane, _mm512_set1_epi32(k));
    const __m512i at_d = _mm512_mullo_epi32(lane, _mm512_set1_epi32(nb));
    const __m512i ones = _mm512_set1_epi8(1);
    for (int g = 0; g < (tn + QB_G - 1) / QB_G; g++) {
        const int live = qb_live(tn, g);
        const __mmask16 m = (__mmask16)((1u << live) - 1); /* the lanes of live inputs */
        const int8_t *xg = in->xq + (size_t)(t + QB_G * g) * k;
        const float *dg = in->xd + (size_t)(t + QB_G * g) * nb;
        for (int b = 0; b < nb; b++) {
            const size_t gb = (size_t)g * nb + b;
            __m512i sum = _mm512_setzero_si512();
            for (int q = 0; q < QK / 4; q++) {
                const __m512i v = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m, at_x,
                                                              xg + b * QK + 4 * q, 1);
                _mm512_store_si512((void *)(x->xi + (gb * 8 + q) * 64), v);
                sum = _mm512_dpbusd_epi32(sum, ones, v);
            }
            _mm512_store_si512(
                (void *)(x->cx + gb * QB_G),
                _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(sum, (unsigned)shift)));
            _mm512_store_ps(x->dxv + gb * QB_G,
                            _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, at_d, dg + b, 4));
        }
    }
}

/* A row's blocks as unsigned bytes (u, 32 a block) and its scales as floats (dw). */
AVX512 static void qb_unpack_row(const int type, const uint8_t *row, int nb, uint8_t *u,
                                 float *dw) {
    const int bsize = type == T_Q8_0 ? 34 : type == T_Q5_0 ? 22 : 18;
    const __m128i m4 = _mm_set1_epi8(0xF);
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = row + (size_t)b * bsize;
        __m256i v;
        if (type == T_Q8_0) {
            v = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(blk + 2)),
                                 _mm256_set1_epi8((char)0x80));
        } else if (type == T_Q5_0) {
            v = q5_unsigned_avx2(blk);
        } else {
            const __m128i raw = _mm_loadu_si128((const __m128i *)(blk + 2));
            v = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), m4), _mm_and_si128(raw, m4));
        }
        _mm256_store_si256((__m256i *)(u + (size_t)b * QK), v);
        dw[b] = f16c(blk);
    }
}

/* R rows (u, dw: nb blocks each) by input group g, into y (its inputs 16 g .. 16 g + live - 1
 * of the tile, row 0's column): add_blocks' operations, sixteen outputs a register. */
AVX512 INLINE void qb_block_t(const int R, const uint8_t *u, const float *dw, int nb,
                              const qb_room *x, int g, int live, float *y, size_t ldy) {
    __m512 acc[QB_R];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const size_t gb = (size_t)g * nb + b;
        const int8_t *xb = x->xi + gb * 8 * 64;
        const __m512i s0 = _mm512_load_si512((const void *)(x->cx + gb * QB_G));
        __m512i S[QB_R];
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) S[r] = s0;
#pragma GCC unroll 8
        for (int q = 0; q < QK / 4; q++) {
            const __m512i xv = _mm512_load_si512((const void *)(xb + 64 * q));
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                int32_t w4;
                memcpy(&w4, u + ((size_t)r * nb + b) * QK + 4 * q, 4);
                S[r] = _mm512_dpbusd_epi32(S[r], _mm512_set1_epi32(w4), xv);
            }
        }
        const __m512 dv = _mm512_load_ps(x->dxv + gb * QB_G);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const __m512 d = _mm512_mul_ps(_mm512_set1_ps(dw[(size_t)r * nb + b]), dv);
            acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(d, _mm512_cvtepi32_ps(S[r])));
        }
    }
    for (int r = 0; r < R; r++) {
        float out[QB_G];
        _mm512_storeu_ps(out, acc[r]);
        for (int i = 0; i < live; i++) y[(size_t)(QB_G * g + i) * ldy + r] = out[i];
    }
}

/* The tiles' shapes (ldtilecfg's 64 bytes): 0 and 1 the sums (16 rows x 16 int32), 2 the rows'
 * values of a block (16 rows x 32 bytes), 3 the group's 8 registers of it (8 x 64 bytes). */
typedef struct {
    uint8_t palette, start, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} qb_tilecfg;

/* Block b's exact sums of QB_RA rows (their values at a, astride apart) by a group of inputs
 * (xb: its 8 registers of the block, the B layout of 8 rows a 64 bytes) plus the weights'
 * offset times each input's sum: one tdpbusd in tile CT from zero, stored at c (input i of row r
 * at 16 r + i). */
#define QA_SB(CT)                                                                                  \
    do {                                                                                           \
        _tile_zero(CT);                                                                            \
        _tile_loadd(2, a, astride);                                                                \
        _tile_loadd(3, xb, 64);                                                                    \
        _tile_dpbusd(CT, 2, 3);                                                                    \
        _tile_stored(CT, c, 64);                                                                   \
    } while (0)

AMX INLINE void qb_amx_sums(const uint8_t *a, size_t astride, const int8_t *xb, int32_t *c,
                            int odd) {
    if (odd)
        QA_SB(1);
    else
        QA_SB(0);
}
#undef QA_SB

/* QB_RA rows (u, dw) by input group g on AMX, into y as qb_block_t: a block's S_b of all the
 * rows by the group at once (the tile's sum plus the group's minus offset x sums, exact), then
 * per row qb_block_t's float step; the outputs transposed in registers (store_16x16_512). The
 * tile product of block b + 1 goes while b's sums are read (two buffers). */
AMX static void qb_block_amx_g(const uint8_t *u, const float *dw, int nb, const qb_room *x, int g,
                               int live, float *y, size_t ldy) {
    const size_t astride = (size_t)nb * QK;
    const int8_t *xg = x->xi + (size_t)g * nb * 8 * 64;
    __m512 acc[QB_RA];
    for (int r = 0; r < QB_RA; r++) acc[r] = _mm512_setzero_ps();
    qb_amx_sums(u, astride, xg, x->c, 0);
    for (int b = 0; b < nb; b++) {
        const size_t gb = (size_t)g * nb + b;
        const int32_t *c = x->c + (b & 1) * 256;
        if (b + 1 < nb)
            qb_amx_sums(u + (size_t)(b + 1) * QK, astride, xg + (size_t)(b + 1) * 8 * 64,
                        x->c + ((b + 1) & 1) * 256, (b + 1) & 1);
        const __m512i s0 = _mm512_load_si512((const void *)(x->cx + gb * QB_G));
        const __m512 dv = _mm512_load_ps(x->dxv + gb * QB_G);
        for (int r = 0; r < QB_RA; r++) {
            const __m512i S = _mm512_add_epi32(_mm512_load_si512((const void *)(c + 16 * r)), s0);
            const __m512 d = _mm512_mul_ps(_mm512_set1_ps(dw[(size_t)r * nb + b]), dv);
            acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(d, _mm512_cvtepi32_ps(S)));
        }
    }
    store_16x16_512(acc, live, y + (size_t)QB_G * g * ldy, ldy);
}

/* This thread's tiles in qb_tilecfg's shapes for one q32_block_512 call, given back at its
 * end: once a call, not once a tile of 16 rows (the pair cost about a microsecond, as much as
 * a tile's products; the device's figures in docs/benchmarks.md). */
AMX static void qb_amx_begin(void) {
    qb_tilecfg cfg = {.palette = 1};
    cfg.colsb[0] = cfg.colsb[1] = cfg.colsb[3] = 64;
    cfg.rows[0] = cfg.rows[1] = cfg.rows[2] = 16;
    cfg.colsb[2] = QK;
    cfg.rows[3] = QK / 4;
    _tile_loadconfig(&cfg);
}

AMX static void qb_amx_end(void) {
    _tile_release();
}

AMX static void qb_block_amx(const uint8_t *u, const float *dw, int nb, const qb_room *x, int tn,
                             float *y, size_t ldy) {
    for (int g = 0; g < (tn + QB_G - 1) / QB_G; g++)
        qb_block_amx_g(u, dw, nb, x, g, qb_live(tn, g), y, ldy);
}

AVX512 int q32_block_512(int type, const uint8_t *w, size_t row_bytes, int n_out, int k,
                         const mm_input *in, int n, float *y, size_t ldy) {
    const int nb = k / QK;
    const int shift = type == T_Q8_0 ? 7 : type == T_Q5_0 ? 4 : 3; /* offset 128, 16 or 8 */
    char *mem = aligned_alloc(64, qb_room_parts(k, NULL, NULL));
    if (mem == NULL) return -1;
    qb_room x;
    qb_room_parts(k, mem, &x);
    const int tiles = use_amx && n_out >= QB_RA; /* AMX takes the first rows' tiles */
    if (tiles) qb_amx_begin();
    for (int t0 = 0; t0 < n; t0 += Q_TILE) {
        const int tn = n - t0 < Q_TILE ? n - t0 : Q_TILE; /* the last group a part one or not */
        qb_lay_inputs(shift, in, t0, tn, &x);
        for (int r = 0; r < n_out;) {
            /* AMX: QB_RA rows a tile; the register tiles: QB_R rows, the last rows one at a time */
            const int amx = use_amx && n_out - r >= QB_RA;
            const int R = amx ? QB_RA : n_out - r < QB_R ? 1 : QB_R;
            for (int i = 0; i < R; i++)
                qb_unpack_row(type, w + (size_t)(r + i) * row_bytes, nb, x.u + (size_t)i * nb * QK,
                              x.dw + (size_t)i * nb);
            if (amx) {
                qb_block_amx(x.u, x.dw, nb, &x, tn, y + (size_t)t0 * ldy + r, ldy);
                r += R;
                continue;
            }
            for (int g = 0; g < (tn + QB_G - 1) / QB_G; g++) {
                const int live = qb_live(tn, g);
                float *yg = y + (size_t)t0 * ldy + r;
                if (R == QB_R)
                    qb_block_t(QB_R, x.u, x.dw, nb, &x, g, live, yg, ldy);
                else
                    qb_block_t(1, x.u, x.dw, nb, &x, g, live, yg, ldy);
            }
            r += R;
        }
    }
    if (tiles) qb_amx_end();
    free(mem);
    return 0;
}
#endif
