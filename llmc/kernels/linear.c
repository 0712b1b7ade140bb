/* See kernels.h. The tile is up to 12 rows x 32 columns: 24 accumulator registers (AVX-512),
 * each k step loading two weight vectors and feeding 24 FMAs with broadcast activations. Rows
 * beyond 12 take another pass over the panel, from cache; 12 rather than 8 per pass took a
 * 16-row decode step's projections from 17.1-17.9 to 16.1-16.3 ms (docs/attention_cpu.md). */
#include "kernels.h"
#include "simd.h"

#include <math.h>
#include <string.h>

/* How far ahead of its loads the tile prefetches the weights, in floats: 16 KB. The hardware
 * prefetchers stop at each 4 KB page, and the out-of-order window covers a few hundred bytes,
 * far less than DRAM latency; without it the FMAs and the weight stream took turns. On a chain
 * of smollm2's 121 projections (a C harness), 16 rows went from 15.6-21 ms to 12.1-13.8 (about
 * the time the weights take to read), 8 rows and 1 row gained 5-10% and 2-5%. */
#define PREFETCH_AHEAD 4096

/* Rows [0, R) of x times one panel into out (row stride out_stride). */
static inline __attribute__((always_inline)) void tile(const float *restrict x, const float *restrict panel,
                                                       float *restrict out, int64_t k, int64_t out_stride,
                                                       const int R) {
    v16 a[R][2];
    for (int r = 0; r < R; r++)
        a[r][0] = a[r][1] = (v16){0};
    for (int64_t i = 0; i < k; i++) {
        v16 w0 = VLOAD(panel + i * LLMC_PANEL), w1 = VLOAD(panel + i * LLMC_PANEL + 16);
        PREFETCH(panel + i * LLMC_PANEL + PREFETCH_AHEAD);  /* may run past the weight: prefetches never fault */
        PREFETCH(panel + i * LLMC_PANEL + PREFETCH_AHEAD + 16);
        for (int r = 0; r < R; r++) {
            float xv = x[r * k + i];
            a[r][0] += xv * w0;
            a[r][1] += xv * w1;
        }
    }
    for (int r = 0; r < R; r++) {
        VSTORE(out + r * out_stride, a[r][0]);
        VSTORE(out + r * out_stride + 16, a[r][1]);
    }
}

LLMC_CLONES
void llmc_linear_panels(const float *x, const float *w_packed, float *y, int64_t m, int64_t k, int64_t n,
                        int64_t p0, int64_t p1) {
    float tail[12 * LLMC_PANEL];
    for (int64_t p = p0; p < p1; p++) {
        const float *panel = w_packed + p * k * LLMC_PANEL;
        int64_t col = p * LLMC_PANEL, width = n - col < LLMC_PANEL ? n - col : LLMC_PANEL;
        for (int64_t r = 0; r < m;) {
            int64_t rows = m - r >= 12 ? 12 : m - r >= 8 ? 8 : (m - r >= 4 ? 4 : 1);
            /* A partial last panel is computed into a scratch tile, then its valid columns copied. */
            float *out = width == LLMC_PANEL ? y + r * n + col : tail;
            int64_t stride = width == LLMC_PANEL ? n : LLMC_PANEL;
            if (rows == 12)
                tile(x + r * k, panel, out, k, stride, 12);
            else if (rows == 8)
                tile(x + r * k, panel, out, k, stride, 8);
            else if (rows == 4)
                tile(x + r * k, panel, out, k, stride, 4);
            else
                tile(x + r * k, panel, out, k, stride, 1);
            if (width != LLMC_PANEL)
                for (int64_t i = 0; i < rows; i++)
                    memcpy(y + (r + i) * n + col, tail + i * LLMC_PANEL, (size_t)width * sizeof(float));
            r += rows;
        }
    }
}

LLMC_CLONES
void llmc_skip_rmsnorm_rows(const float *x, const float *skip, const float *gamma, float *sum, float *normed,
                            int64_t k, float epsilon, int64_t row0, int64_t row1) {
    for (int64_t r = row0; r < row1; r++) {
        const float *xr = x + r * k, *sr = skip + r * k;
        float *dst = sum + r * k, *out = normed + r * k, squares = 0.0f;
#pragma omp simd reduction(+ : squares)
        for (int64_t i = 0; i < k; i++) {
            dst[i] = xr[i] + sr[i];
            squares += dst[i] * dst[i];
        }
        float inv = 1.0f / sqrtf(squares / (float)k + epsilon);
#pragma omp simd
        for (int64_t i = 0; i < k; i++)
            out[i] = dst[i] * inv * gamma[i];
    }
}
