/* F16 and the types without an integer kernel: the row as float32 (exact for F16; ggml's
 * dequantization for blocks) times x in 32 float lanes, halved at the end. */

#include "kernels.h"

static float dot_f32_portable(const float *w, const float *x, int k) {
    float acc[LANES_F] = {0};
    int i = 0;
    for (; i + LANES_F <= k; i += LANES_F)
        for (int j = 0; j < LANES_F; j++) acc[j] = acc[j] + w[i + j] * x[i + j];
    for (; i < k; i++) acc[i % LANES_F] = acc[i % LANES_F] + w[i] * x[i];
    return finish(acc, LANES_F);
}

#if defined(FOUNDRY_X86)
AVX2 static float dot_f32_avx2(const float *w, const float *x, int k) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int i = 0;
    for (; i + LANES_F <= k; i += LANES_F) {
        a0 = _mm256_add_ps(a0, _mm256_mul_ps(_mm256_loadu_ps(w + i), _mm256_loadu_ps(x + i)));
        a1 = _mm256_add_ps(a1,
                           _mm256_mul_ps(_mm256_loadu_ps(w + i + 8), _mm256_loadu_ps(x + i + 8)));
        a2 = _mm256_add_ps(a2,
                           _mm256_mul_ps(_mm256_loadu_ps(w + i + 16), _mm256_loadu_ps(x + i + 16)));
        a3 = _mm256_add_ps(a3,
                           _mm256_mul_ps(_mm256_loadu_ps(w + i + 24), _mm256_loadu_ps(x + i + 24)));
    }
    float acc[LANES_F];
    _mm256_storeu_ps(acc, a0);
    _mm256_storeu_ps(acc + 8, a1);
    _mm256_storeu_ps(acc + 16, a2);
    _mm256_storeu_ps(acc + 24, a3);
    for (; i < k; i++) acc[i % LANES_F] = acc[i % LANES_F] + w[i] * x[i];
    return finish(acc, LANES_F);
}

/* F16 rows straight from their bytes: four rows at a time share each load of x. */
AVX2 static void rows_f16_avx2(const uint8_t *w, size_t row_bytes, int rows, int k, const float *x,
                               float *y, int y_stride) {
    int r = 0;
    for (; r + 4 <= rows && k % LANES_F == 0; r += 4) {
        __m256 acc[4][4];
        for (int a = 0; a < 4; a++)
            for (int c = 0; c < 4; c++) acc[a][c] = _mm256_setzero_ps();
        for (int i = 0; i < k; i += LANES_F) {
            __m256 xv[4];
            for (int c = 0; c < 4; c++) xv[c] = _mm256_loadu_ps(x + i + 8 * c);
            for (int a = 0; a < 4; a++) {
                const uint8_t *wr = w + (size_t)(r + a) * row_bytes + 2 * (size_t)i;
                for (int c = 0; c < 4; c++) {
                    const __m256 wv =
                        _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wr + 16 * c)));
                    acc[a][c] = _mm256_add_ps(acc[a][c], _mm256_mul_ps(wv, xv[c]));
                }
            }
        }
        for (int a = 0; a < 4; a++) {
            float lanes[LANES_F];
            for (int c = 0; c < 4; c++) _mm256_storeu_ps(lanes + 8 * c, acc[a][c]);
            y[(size_t)(r + a) * y_stride] = finish(lanes, LANES_F);
        }
    }
    float *row = malloc((size_t)k * sizeof(float));
    if (row == NULL) abort();
    for (; r < rows; r++) {
        dequant_row(T_F16, w + (size_t)r * row_bytes, k, row);
        y[(size_t)r * y_stride] = dot_f32_avx2(row, x, k);
    }
    free(row);
}

/* F16 rows on every x86 machine with AVX2 and F16C (AVX-512 ones too: an AVX-512 version of this,
 * four rows of two 512-bit accumulators, streamed 2-6 % slower inside the engine on the 16-core
 * Xeon, bench/performance/kernel_builds.py): ROWS_F16 rows at a time share each load of x, the
 * rows j of each of ROWS_F16 parts of the matrix (sequential streams, as rows_q_512_t), each
 * prefetching its next row; lanes 0-31 of the 32 float accumulators are four registers per row. */
#ifndef ROWS_F16
#define ROWS_F16 4
#endif
AVX2 static void rows_f16_avx2_streams(const uint8_t *w, size_t row_bytes, int rows, int k,
                                       const float *x, float *y) {
    const int part = k % LANES_F == 0 ? rows / ROWS_F16 : 0;
    for (int j = 0; j < part; j++) {
        __m256 acc[ROWS_F16][4];
        const uint8_t *wr0[ROWS_F16];
        for (int a = 0; a < ROWS_F16; a++) {
            wr0[a] = w + (size_t)(a * part + j) * row_bytes;
            for (int c = 0; c < 4; c++) acc[a][c] = _mm256_setzero_ps();
        }
        for (int i = 0; i < k; i += LANES_F) {
            for (int a = 0; a < ROWS_F16; a++)
                _mm_prefetch((const char *)(wr0[a] + 2 * (size_t)i + row_bytes), _MM_HINT_T0);
            for (int c = 0; c < 4; c++) {
                const __m256 xv = _mm256_loadu_ps(x + i + 8 * c);
                for (int a = 0; a < ROWS_F16; a++) {
                    const __m256 wv = _mm256_cvtph_ps(
                        _mm_loadu_si128((const __m128i *)(wr0[a] + 2 * (size_t)(i + 8 * c))));
                    acc[a][c] = _mm256_add_ps(acc[a][c], _mm256_mul_ps(wv, xv));
                }
            }
        }
        for (int a = 0; a < ROWS_F16; a++) /* finish(acc, 32): lane j + lane j + 16 first */
            y[a * part + j] = finish16_avx2(_mm256_add_ps(acc[a][0], acc[a][2]),
                                            _mm256_add_ps(acc[a][1], acc[a][3]));
    }
    const int r = ROWS_F16 * part;
    if (r < rows) rows_f16_avx2(w + (size_t)r * row_bytes, row_bytes, rows - r, k, x, y + r, 1);
}
#endif

static float dot_f32(const float *w, const float *x, int k) {
#if defined(FOUNDRY_X86)
    if (use_avx2) return dot_f32_avx2(w, x, k);
#endif
    return dot_f32_portable(w, x, k);
}

int matmul_float(int type, const uint8_t *w, size_t row_bytes, int n_out, int k, const float *x,
                 int n, float *y, size_t ldy) {
#if defined(FOUNDRY_X86)
    if (type == T_F16 && use_avx2) {
        if (n == 1) {
            rows_f16_avx2_streams(w, row_bytes, n_out, k, x, y);
            return 0;
        }
        /* several inputs: each group of rows stays in cache while the inputs pass over it */
        for (int r = 0; r < n_out; r += ROWS_F16) {
            const int rows = n_out - r < ROWS_F16 ? n_out - r : ROWS_F16;
            for (int t = 0; t < n; t++)
                rows_f16_avx2_streams(w + (size_t)r * row_bytes, row_bytes, rows, k,
                                      x + (size_t)t * k, y + t * ldy + r);
        }
        return 0;
    }
#endif
    float *row = malloc((size_t)k * sizeof(float));
    if (row == NULL) return -1;
    for (int r = 0; r < n_out; r++) {
        dequant_row(type, w + r * row_bytes, k, row);
        for (int t = 0; t < n; t++) y[(size_t)t * ldy + r] = dot_f32(row, x + (size_t)t * k, k);
    }
    free(row);
    return 0;
}
