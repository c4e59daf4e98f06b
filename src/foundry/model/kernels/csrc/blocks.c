/* Block layouts, float16 and the dequantization of one row (ggml's formulas). */

#include "kernels.h"

float f16_table[65536];
int use_avx2 = 0, use_vnni = 0, use_512 = 0, use_amx = 0;

float f16_bits_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
    float f;
    if (exp == 0) {
        f = ldexpf((float)man, -24); /* zero or subnormal: exact */
        memcpy(&bits, &f, 4);
        bits |= sign;
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    }
    memcpy(&f, &bits, 4);
    return f;
}

void kernels_init(void) {
    for (uint32_t h = 0; h < 65536; h++) f16_table[h] = f16_bits_to_f32((uint16_t)h);
}

/* ---- block layouts (bytes per block; values per block) ------------------------------------ */

int type_block(int type, int *values, int *bytes) {
    switch (type) {
    case T_F32:
        *values = 1;
        *bytes = 4;
        return 1;
    case T_F16:
        *values = 1;
        *bytes = 2;
        return 1;
    case T_Q4_0:
        *values = QK;
        *bytes = 18;
        return 1;
    case T_Q4_1:
        *values = QK;
        *bytes = 20;
        return 1;
    case T_Q5_0:
        *values = QK;
        *bytes = 22;
        return 1;
    case T_Q5_1:
        *values = QK;
        *bytes = 24;
        return 1;
    case T_Q8_0:
        *values = QK;
        *bytes = 34;
        return 1;
    case T_Q4_K:
        *values = QK_K;
        *bytes = 144;
        return 1;
    case T_Q5_K:
        *values = QK_K;
        *bytes = 176;
        return 1;
    case T_Q6_K:
        *values = QK_K;
        *bytes = 210;
        return 1;
    default: return 0;
    }
}

/* ---- dequantization of one row (ggml's formulas) ------------------------------------------ */

void dequant_row(int type, const uint8_t *w, int k, float *y) {
    int nb;
    switch (type) {
    case T_F32: memcpy(y, w, (size_t)k * 4); return;
    case T_F16:
        for (int i = 0; i < k; i++) y[i] = f16(w + 2 * i);
        return;
    case T_Q8_0:
        nb = k / QK;
        for (int b = 0; b < nb; b++, w += 34, y += QK) {
            const float d = f16(w);
            for (int i = 0; i < QK; i++) y[i] = d * (float)(int8_t)w[2 + i];
        }
        return;
    case T_Q4_0:
        nb = k / QK;
        for (int b = 0; b < nb; b++, w += 18, y += QK) {
            const float d = f16(w);
            for (int i = 0; i < QK / 2; i++) {
                y[i] = d * (float)((w[2 + i] & 0xF) - 8);
                y[i + QK / 2] = d * (float)((w[2 + i] >> 4) - 8);
            }
        }
        return;
    case T_Q4_1:
        nb = k / QK;
        for (int b = 0; b < nb; b++, w += 20, y += QK) {
            const float d = f16(w), m = f16(w + 2);
            for (int i = 0; i < QK / 2; i++) {
                y[i] = (float)(w[4 + i] & 0xF) * d + m;
                y[i + QK / 2] = (float)(w[4 + i] >> 4) * d + m;
            }
        }
        return;
    case T_Q5_0:
    case T_Q5_1: {
        const int has_min = type == T_Q5_1, size = has_min ? 24 : 22;
        nb = k / QK;
        for (int b = 0; b < nb; b++, w += size, y += QK) {
            const float d = f16(w), m = has_min ? f16(w + 2) : 0.0f;
            uint32_t qh;
            memcpy(&qh, w + (has_min ? 4 : 2), 4);
            const uint8_t *qs = w + (has_min ? 8 : 6);
            for (int i = 0; i < QK / 2; i++) {
                const int h0 = (int)(((qh >> i) << 4) & 0x10);
                const int h1 = (int)((qh >> (i + 12)) & 0x10);
                const int x0 = (qs[i] & 0xF) | h0, x1 = (qs[i] >> 4) | h1;
                if (has_min) {
                    y[i] = (float)x0 * d + m;
                    y[i + QK / 2] = (float)x1 * d + m;
                } else {
                    y[i] = (float)(x0 - 16) * d;
                    y[i + QK / 2] = (float)(x1 - 16) * d;
                }
            }
        }
        return;
    }
    case T_Q4_K:
    case T_Q5_K: {
        const int five = type == T_Q5_K, size = five ? 176 : 144;
        nb = k / QK_K;
        for (int b = 0; b < nb; b++, w += size) {
            const float d = f16(w), dmin = f16(w + 2);
            const uint8_t *scales = w + 4, *qh = w + 16, *ql = w + (five ? 48 : 16);
            uint8_t u1 = 1, u2 = 2;
            for (int j = 0, is = 0; j < QK_K; j += 64, is += 2, ql += 32) {
                uint8_t sc, m;
                get_scale_min_k4(is, scales, &sc, &m);
                const float d1 = d * sc, m1 = dmin * m;
                get_scale_min_k4(is + 1, scales, &sc, &m);
                const float d2 = d * sc, m2 = dmin * m;
                for (int l = 0; l < 32; l++) {
                    const int hi = five && (qh[l] & u1) ? 16 : 0;
                    *y++ = d1 * (float)((ql[l] & 0xF) + hi) - m1;
                }
                for (int l = 0; l < 32; l++) {
                    const int hi = five && (qh[l] & u2) ? 16 : 0;
                    *y++ = d2 * (float)((ql[l] >> 4) + hi) - m2;
                }
                u1 <<= 2;
                u2 <<= 2;
            }
        }
        return;
    }
    case T_Q6_K:
        nb = k / QK_K;
        for (int b = 0; b < nb; b++, w += 210) {
            const uint8_t *ql = w, *qh = w + 128;
            const int8_t *sc = (const int8_t *)(w + 192);
            const float d = f16(w + 208);
            for (int n = 0; n < QK_K; n += 128, y += 128, ql += 64, qh += 32, sc += 8) {
                for (int l = 0; l < 32; l++) {
                    const int is = l / 16;
                    const int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
                    const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
                    const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                    const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                    y[l] = d * (float)sc[is + 0] * (float)q1;
                    y[l + 32] = d * (float)sc[is + 2] * (float)q2;
                    y[l + 64] = d * (float)sc[is + 4] * (float)q3;
                    y[l + 96] = d * (float)sc[is + 6] * (float)q4;
                }
            }
        }
        return;
    }
}
