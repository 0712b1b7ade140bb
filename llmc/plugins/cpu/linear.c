/* See kernels.h. The tile is up to 12 rows x 32 columns: 24 accumulator registers (AVX-512),
 * each k step loading two weight vectors and feeding 24 FMAs with broadcast activations. Rows
 * beyond 12 take another pass over the panel, from cache; 12 rather than 8 per pass was measured
 * faster on 16-row decode steps (docs/attention_cpu.md). CPUs with AVX2 but not AVX-512 take a
 * tile of 3 rows x 32 columns instead, which fits their 16 ymm registers (panels_avx2 below). */
#include "kernels.h"
#include "simd.h"

#include <math.h>
#include <string.h>

/* How far ahead of its loads the tile prefetches the weights, in floats: 16 KB. The hardware
 * prefetchers stop at each 4 KB page, and the out-of-order window covers a few hundred bytes,
 * far less than DRAM latency; without it the FMAs and the weight stream took turns
 * (docs/attention_cpu.md has the measurements). */
#define PREFETCH_AHEAD 4096

/* A product of at most 12 rows reads each panel in one pass, so its weights are fetched with the
 * non-temporal hint (simd.h), which was measured faster (docs/attention_cpu.md). With more rows,
 * later passes reread the panel from cache, which that hint would evict. */
#define ONE_PASS_ROWS 12

/* Rows [0, R) of x times one panel into out (row stride out_stride). */
static inline __attribute__((always_inline)) void tile(const float *restrict x, const float *restrict panel,
                                                       float *restrict out, int64_t k, int64_t out_stride,
                                                       const int once, const int R) {
    v16 a[R][2];
    for (int r = 0; r < R; r++)
        a[r][0] = a[r][1] = (v16){0};
    for (int64_t i = 0; i < k; i++) {
        v16 w0 = VLOAD(panel + i * LLMC_PANEL), w1 = VLOAD(panel + i * LLMC_PANEL + 16);
        const float *ahead = panel + i * LLMC_PANEL + PREFETCH_AHEAD;  /* past the weight's end is fine: */
        if (once) {                                                    /* prefetches never fault */
            PREFETCH_ONCE(ahead);
            PREFETCH_ONCE(ahead + 16);
        } else {
            PREFETCH(ahead);
            PREFETCH(ahead + 16);
        }
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
static void panels_vec(const float *x, const float *w_packed, float *y, int64_t m, int64_t k, int64_t n, int64_t p0,
                       int64_t p1) {
    float tail[12 * LLMC_PANEL];
    const int once = m <= ONE_PASS_ROWS;
    for (int64_t p = p0; p < p1; p++) {
        const float *panel = w_packed + p * k * LLMC_PANEL;
        int64_t col = p * LLMC_PANEL, width = n - col < LLMC_PANEL ? n - col : LLMC_PANEL;
        for (int64_t r = 0; r < m;) {
            int64_t rows = m - r >= 12 ? 12 : m - r;
            /* A partial last panel is computed into a scratch tile, then its valid columns copied. */
            float *out = width == LLMC_PANEL ? y + r * n + col : tail;
            int64_t stride = width == LLMC_PANEL ? n : LLMC_PANEL;
            LLMC_ROWS_12(rows, tile, x + r * k, panel, out, k, stride, once);
            if (width != LLMC_PANEL)
                for (int64_t i = 0; i < rows; i++)
                    memcpy(y + (r + i) * n + col, tail + i * LLMC_PANEL, (size_t)width * sizeof(float));
            r += rows;
        }
    }
}

/* -- AVX2 without AVX-512: 16 ymm registers --------------------------------------------------------
 * The tile above needs 2R zmm accumulators; built for AVX2 (the x86-64-v3 clone) it needs 4R ymm
 * ones, 48 for 12 rows, and GCC keeps them on the stack. Here a tile is 3 rows x 32 columns: 12 ymm
 * accumulators, the 3 rows' broadcast activations and one weight vector fill the 16 registers, 7
 * loads per 12 FMAs. Each output is still one fused multiply-add per k step in k order, as in the
 * tile above, so the two paths give the same bits. Measured on an AVX2 EPYC (docs/attention_cpu.md):
 * 3 rows beat 2, 4 (16 accumulators: 4 spilled) and 6 x 16 half panels (one cache line per k step:
 * 1.6-2x slower at M <= 8), and software prefetch (PREFETCH_AHEAD, either hint) made it slower
 * (0.80-0.99x without it), so this tile leaves the weight stream to the hardware prefetchers. */

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#include <stdlib.h>
#define HAVE_AVX2_TILE 1
#define AVX2 __attribute__((target("avx2,fma")))
#define AVX2_ROWS 3

/* The AVX2 tile, where the CPU has no AVX-512 (whose clone of panels_vec is the better path). */
static int fp32_avx2(void) { return llmc_avx2() && !__builtin_cpu_supports("avx512f"); }

/* Rows [0, R) of x times one panel into out (row stride out_stride). */
static inline __attribute__((always_inline)) AVX2 void tile_avx2(const float *restrict x, const float *restrict panel,
                                                                 float *restrict out, int64_t k, int64_t out_stride,
                                                                 const int R) {
    __m256 a[AVX2_ROWS][4]; /* fixed sizes: GCC keeps variable-length arrays in memory */
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++)
            a[r][j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i++) {
        const float *w = panel + i * LLMC_PANEL;
        __m256 xb[AVX2_ROWS];
        for (int r = 0; r < R; r++)
            xb[r] = _mm256_broadcast_ss(x + r * k + i);
        for (int j = 0; j < 4; j++) {
            __m256 wj = _mm256_loadu_ps(w + 8 * j);
            for (int r = 0; r < R; r++)
                a[r][j] = _mm256_fmadd_ps(xb[r], wj, a[r][j]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++)
            _mm256_storeu_ps(out + r * out_stride + 8 * j, a[r][j]);
}

static AVX2 void panels_avx2(const float *x, const float *w_packed, float *y, int64_t m, int64_t k, int64_t n,
                             int64_t p0, int64_t p1) {
    float tail[AVX2_ROWS * LLMC_PANEL];
    for (int64_t p = p0; p < p1; p++) {
        const float *panel = w_packed + p * k * LLMC_PANEL;
        int64_t col = p * LLMC_PANEL, width = n - col < LLMC_PANEL ? n - col : LLMC_PANEL;
        for (int64_t r = 0; r < m;) {
            int64_t rows = m - r >= AVX2_ROWS ? AVX2_ROWS : m - r;
            float *out = width == LLMC_PANEL ? y + r * n + col : tail;
            int64_t stride = width == LLMC_PANEL ? n : LLMC_PANEL;
            if (rows == 3)
                tile_avx2(x + r * k, panel, out, k, stride, 3);
            else if (rows == 2)
                tile_avx2(x + r * k, panel, out, k, stride, 2);
            else
                tile_avx2(x + r * k, panel, out, k, stride, 1);
            if (width != LLMC_PANEL)
                for (int64_t i = 0; i < rows; i++)
                    memcpy(y + (r + i) * n + col, tail + i * LLMC_PANEL, (size_t)width * sizeof(float));
            r += rows;
        }
    }
}
#else
#define HAVE_AVX2_TILE 0
#endif

/* AVX2-only CPUs take the tile that fits their registers; the rest (AVX-512, or no AVX2) panels_vec,
 * whose clone the loader picked. */
void llmc_linear_panels(const float *x, const float *w_packed, float *y, int64_t m, int64_t k, int64_t n,
                        int64_t p0, int64_t p1) {
#if HAVE_AVX2_TILE
    if (fp32_avx2()) {
        panels_avx2(x, w_packed, y, m, k, n, p0, p1);
        return;
    }
#endif
    panels_vec(x, w_packed, y, m, k, n, p0, p1);
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

/* -- the lossless weight format (kernels.h) --------------------------------------------------- */

/* The lossless tile's prefetch distance, in bytes: 4 KB, not the fp32 tile's 16, which measured
 * slower at batch 1 to 4 (docs/attention_cpu.md); 2 KB and 8 KB did no better than 4. */
#define LOSSLESS_AHEAD 4096

#define PANEL_HEADER 64                      /* the code table: 16 uint32 */
#define GROUP_BYTES (4 * LLMC_PANEL * 3 + 64) /* 4 k steps: 16-bit, 8-bit and code planes: 448 */

static int64_t lossless_panel_bytes(int64_t k) { return PANEL_HEADER + k / 4 * GROUP_BYTES; }

int64_t llmc_lossless_bytes(int64_t k, int64_t n, int64_t exceptions) {
    int64_t panels = (n + LLMC_PANEL - 1) / LLMC_PANEL;
    return panels * lossless_panel_bytes(k) + 4 * (panels + 1) + 8 * exceptions;
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

/* GCC 12 turns the byte-to-lane widenings below into scalar code when written with the vector
 * extension, so this kernel is AVX-512 intrinsics, used only where the CPU has AVX-512. */
int llmc_lossless_supported(void) { return __builtin_cpu_supports("avx512f"); }

/* tile() over a lossless panel: rows [0, R) of x; exc..exc_end are the panel's exceptions. */
static inline __attribute__((always_inline, target("avx512f"))) void lossless_tile(
    const float *restrict x, const uint8_t *restrict panel, const int32_t *exc, const int32_t *exc_end,
    float *restrict out, int64_t k, int64_t out_stride, const int R) {
    __m512 a[R][2];
    for (int r = 0; r < R; r++)
        a[r][0] = a[r][1] = _mm512_setzero_ps();
    const __m512i table = _mm512_loadu_si512(panel);
    const uint8_t *group = panel + PANEL_HEADER;
    int64_t next = exc < exc_end ? exc[0] / LLMC_PANEL : -1; /* the k step of the next exception */
    for (int64_t g = 0; g < k / 4; g++, group += GROUP_BYTES) {
        for (int line = 0; line < GROUP_BYTES; line += 64)
            PREFETCH_ONCE(group + LOSSLESS_AHEAD + line);
        for (int s = 0; s < 4; s++) {
            const uint8_t *low = group + s * 64, *mid = group + 256 + s * 32, *codes = group + 384 + s * 16;
            /* lanes: low 16 bits | bits 16-23 << 16 | the code's table entry (vpermd reads the low
             * 4 bits of each lane, so the second half's codes need only the shift) */
            __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)codes));
            __m512i w0 = _mm512_ternarylogic_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)low)),
                _mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)mid)), 16),
                _mm512_permutexvar_epi32(c, table), 0xFE);
            __m512i w1 = _mm512_ternarylogic_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(low + 32))),
                _mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(mid + 16))), 16),
                _mm512_permutexvar_epi32(_mm512_srli_epi32(c, 4), table), 0xFE);
            __m512 v0 = _mm512_castsi512_ps(w0), v1 = _mm512_castsi512_ps(w1);
            int64_t i = g * 4 + s;
            if (__builtin_expect(i == next, 0)) {
                float w[LLMC_PANEL];
                _mm512_storeu_ps(w, v0);
                _mm512_storeu_ps(w + 16, v1);
                for (; exc < exc_end && exc[0] / LLMC_PANEL == i; exc += 2)
                    memcpy(&w[exc[0] % LLMC_PANEL], &exc[1], sizeof(float));
                next = exc < exc_end ? exc[0] / LLMC_PANEL : -1;
                v0 = _mm512_loadu_ps(w);
                v1 = _mm512_loadu_ps(w + 16);
            }
            for (int r = 0; r < R; r++) {
                __m512 xv = _mm512_set1_ps(x[r * k + i]);
                a[r][0] = _mm512_fmadd_ps(xv, v0, a[r][0]);
                a[r][1] = _mm512_fmadd_ps(xv, v1, a[r][1]);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        _mm512_storeu_ps(out + r * out_stride, a[r][0]);
        _mm512_storeu_ps(out + r * out_stride + 16, a[r][1]);
    }
}

__attribute__((target("avx512f")))
void llmc_linear_lossless(const float *x, const uint8_t *w, float *y, int64_t m, int64_t k, int64_t n, int64_t p0,
                          int64_t p1) {
    float tail[8 * LLMC_PANEL];
    int64_t panels = (n + LLMC_PANEL - 1) / LLMC_PANEL, panel_bytes = lossless_panel_bytes(k);
    const int32_t *offsets = (const int32_t *)(w + panels * panel_bytes), *exceptions = offsets + panels + 1;
    for (int64_t p = p0; p < p1; p++) {
        const uint8_t *panel = w + p * panel_bytes;
        const int32_t *exc = exceptions + 2 * (int64_t)offsets[p], *exc_end = exceptions + 2 * (int64_t)offsets[p + 1];
        int64_t col = p * LLMC_PANEL, width = n - col < LLMC_PANEL ? n - col : LLMC_PANEL;
        for (int64_t r = 0; r < m;) {
            int64_t rows = m - r >= 8 ? 8 : m - r;
            float *out = width == LLMC_PANEL ? y + r * n + col : tail;
            int64_t stride = width == LLMC_PANEL ? n : LLMC_PANEL;
            LLMC_ROWS_8(rows, lossless_tile, x + r * k, panel, exc, exc_end, out, k, stride);
            if (width != LLMC_PANEL)
                for (int64_t i = 0; i < rows; i++)
                    memcpy(y + (r + i) * n + col, tail + i * LLMC_PANEL, (size_t)width * sizeof(float));
            r += rows;
        }
    }
}
#else
int llmc_lossless_supported(void) { return 0; }
void llmc_linear_lossless(const float *x, const uint8_t *w, float *y, int64_t m, int64_t k, int64_t n, int64_t p0,
                          int64_t p1) {
    (void)x, (void)w, (void)y, (void)m, (void)k, (void)n, (void)p0, (void)p1;
}
#endif
