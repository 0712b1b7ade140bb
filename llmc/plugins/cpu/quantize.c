/* The build's symmetric blockwise quantizers (`search` and `rtn`) in C: the same arithmetic as
 * llmc/passes/quantizers.py, which is their reference and stays the path for asymmetric blocks and
 * installs without this library. The results are bit-identical to it (tests/test_quantization.py):
 * every float32 operation is the one numpy does, in the same order:
 * - no product is fused into an FMA (the pragma below; the rest of the library contracts them);
 * - a block's sums add its rows in row order, starting from the first row, as numpy's reduction
 *   along axis 0 does;
 * - a Python float meets float32 as numpy's weak scalars do: rounded to float32 first.
 * Numpy spends most of the search's time between its short operations; here each 64-column chunk
 * of a block (8 KB at 32 rows) stays in L1 through all of its candidate scales, and the caller
 * runs one thread per core without the GIL. */
#pragma GCC optimize("fp-contract=off")
#include "simd.h"

#include <math.h>
#include <stdint.h>

#define MAX_BLOCK 128    /* the largest block size the options allow */
#define SEARCH_STEPS 10  /* quantizers.SEARCH_STEPS */
/* The helpers are inlined into each clone of the entry point, so they vectorize for its ISA. */
#define INLINE static inline __attribute__((always_inline))

/* quantizers.SYMMETRIC_RANGE: int8 stays within +-127. */
INLINE float range_low(int bits) { return bits == 8 ? -127.0f : -(float)(1 << (bits - 1)); }
INLINE float range_high(int bits) { return (float)((1 << (bits - 1)) - 1); }

INLINE uint32_t bits_of(float x) {
    union { float f; uint32_t u; } v = {x};
    return v.u;
}

INLINE float float_of(uint32_t u) {
    union { uint32_t u; float f; } v = {u};
    return v.f;
}

#define F16_TINY 6.103515625e-05f /* float16's smallest normal, 2^-14 */

/* quantizers._f16: x rounded to float16 (nearest even), never closer to 0 than its smallest normal
 * (a value that rounds to a nonzero negative float16 gets its negative). In integer operations,
 * which vectorize in every clone (a _Float16 conversion is a library call without F16C). */
INLINE float to_f16(float x) {
    const uint32_t sign = bits_of(x) & 0x80000000u, magnitude = bits_of(x) ^ sign;
    uint32_t rounded;
    if (magnitude >= 0x477ff000u)  /* 65520 and up round to infinity */
        rounded = 0x7f800000u;
    else if (magnitude >= 0x38800000u)  /* a normal float16: 10 mantissa bits, ties to even */
        rounded = (magnitude + 0xfffu + ((magnitude >> 13) & 1u)) & ~0x1fffu;
    else  /* below 2^-14; it keeps its sign where it rounds to a nonzero float16 (above 2^-25) */
        return float_of(bits_of(F16_TINY) | (magnitude > 0x33000000u ? sign : 0));
    return float_of(rounded | sign);
}

/* np.nextafter in float16 of h (a float16 of at least its smallest normal magnitude, or an
 * infinity) toward +inf (up) or -inf; where the step lands below the smallest normal, to_f16
 * takes it back to it, as it does numpy's subnormal. */
INLINE float f16_next(float h, int up) {
    const float magnitude = fabsf(h);
    const float binade = float_of(bits_of(magnitude) & 0x7f800000u), ulp = binade * 0x1p-10f;
    float next;
    if ((h > 0) == (up != 0))  /* away from zero */
        next = magnitude + ulp;
    else if (magnitude > 65504.0f)  /* from infinity: the largest float16 */
        next = 65504.0f;
    else
        next = magnitude - (magnitude == binade ? ulp * 0.5f : ulp);
    return copysignf(next, h);
}

INLINE float clip(float v, float low, float high) {
    v = v > low ? v : low;  /* maxps, then minps */
    return v < high ? v : high;
}

/* The work goes G columns (one block each) at a time: every per-column value is a G-float array,
 * every loop over G a vector operation, and the group's accumulators stay in registers while the
 * block's rows stream from L1 for each candidate scale. Sums start at 0: 0 + a is a, and the sign
 * a zero sum might lose never reaches a result. */
#define G 32

/* Per column, the (weighted) squared error of x ~ scale * round(x / scale) over the block's rows
 * (quantizers._error of _round_to). */
INLINE void round_error(const float *x, int64_t ld, int rows, const float *scale, const float *weight, float low,
                        float high, float *err) {
    float sum[G] = {0};
    for (int r = 0; r < rows; r++) {
        const float *xr = x + r * ld;
        const float w = weight ? weight[r] : 1.0f;
        for (int c = 0; c < G; c++) {
            float q = clip(rintf(xr[c] / scale[c]), low, high);
            float d = xr[c] - scale[c] * q;
            sum[c] += weight ? w * (d * d) : d * d;
        }
    }
    for (int c = 0; c < G; c++)
        err[c] = sum[c];
}

/* quantizers._search_symmetric then _refit_f16: the scale of each column's block. */
INLINE void search_scales(const float *x, int64_t ld, int rows, int bits, const float *weight, float *scale) {
    const float low = range_low(bits), high = range_high(bits);
    const int edge = -low > high ? (int)low : (int)high;
    float most[G], least[G], safe[G], best_fit[G], inverse[G];
    for (int c = 0; c < G; c++)
        most[c] = least[c] = x[c];
    for (int r = 1; r < rows; r++)
        for (int c = 0; c < G; c++) {
            most[c] = x[r * ld + c] > most[c] ? x[r * ld + c] : most[c];
            least[c] = x[r * ld + c] < least[c] ? x[r * ld + c] : least[c];
        }
    for (int c = 0; c < G; c++) {  /* _extreme: the value of largest magnitude, its sign kept */
        float extreme = most[c] >= -least[c] ? most[c] : least[c];
        if (most[c] == -least[c] && most[c] != 0)  /* a tie of signs: the first row of that magnitude */
            for (int r = 0; r < rows; r++)
                if (fabsf(x[r * ld + c]) == most[c]) {
                    extreme = x[r * ld + c];
                    break;
                }
        safe[c] = extreme == 0 ? 1.0f : extreme;
        scale[c] = extreme / (float)edge;
        best_fit[c] = -INFINITY;
    }
    for (int step = -SEARCH_STEPS; step <= SEARCH_STEPS; step++) {
        const float factor = (float)((double)edge + 0.1 * (double)step);
        float sum_xq[G] = {0}, sum_qq[G] = {0};
        for (int c = 0; c < G; c++)
            inverse[c] = factor / safe[c];
        for (int r = 0; r < rows; r++) {
            const float *xr = x + r * ld;
            const float w = weight ? weight[r] : 1.0f;
            for (int c = 0; c < G; c++) {
                float q = clip(rintf(xr[c] * inverse[c]), low, high);
                float wq = weight ? w * q : q;
                sum_xq[c] += wq * xr[c];
                sum_qq[c] += wq * q;
            }
        }
        for (int c = 0; c < G; c++) {
            /* With q fixed the best scale is sum_xq / sum_qq and the error falls by sum_xq^2 / sum_qq. */
            int empty = !(sum_qq[c] > 0);
            float qq = empty ? 1.0f : sum_qq[c];
            float fit = empty ? -INFINITY : sum_xq[c] * sum_xq[c] / qq;
            if (fit > best_fit[c]) {
                best_fit[c] = fit;
                scale[c] = sum_xq[c] / qq;
            }
        }
    }
    /* The scale in float16 or a float16 neighbour: whichever errs least once rounded again. */
    float best_err[G], center[G], candidate[G], err[G];
    for (int c = 0; c < G; c++)
        scale[c] = center[c] = to_f16(scale[c]);
    round_error(x, ld, rows, scale, weight, low, high, best_err);
    for (int up = 1; up >= 0; up--) {
        for (int c = 0; c < G; c++)
            candidate[c] = to_f16(f16_next(center[c], up));
        round_error(x, ld, rows, candidate, weight, low, high, err);
        for (int c = 0; c < G; c++)
            if (err[c] < best_err[c]) {
                best_err[c] = err[c];
                scale[c] = candidate[c];
            }
    }
}

/* quantizers._rtn_symmetric: the block's largest magnitude onto the top of the range. */
INLINE void rtn_scales(const float *x, int64_t ld, int rows, int bits, float *scale) {
    float most[G];
    for (int c = 0; c < G; c++)
        most[c] = fabsf(x[c]);
    for (int r = 1; r < rows; r++)
        for (int c = 0; c < G; c++)
            most[c] = fabsf(x[r * ld + c]) > most[c] ? fabsf(x[r * ld + c]) : most[c];
    for (int c = 0; c < G; c++)
        scale[c] = to_f16(most[c] / range_high(bits));
}

/* The integers of a group and its error sums (quantizers.QuantizedWeight.errors, per block). */
INLINE void finish(const float *x, int64_t ld, int rows, int bits, const float *scale, int8_t *q, int64_t ldq,
                   float *err_sq, float *norm_sq) {
    const float low = range_low(bits), high = range_high(bits);
    float err[G] = {0}, norm[G] = {0};
    for (int r = 0; r < rows; r++) {
        const float *xr = x + r * ld;
        for (int c = 0; c < G; c++) {
            float v = clip(rintf(xr[c] / scale[c]), low, high);
            float d = xr[c] - v * scale[c];
            q[r * ldq + c] = (int8_t)v;
            err[c] += d * d;
            norm[c] += xr[c] * xr[c];
        }
    }
    for (int c = 0; c < G; c++) {
        err_sq[c] = err[c];
        norm_sq[c] = norm[c];
    }
}

/* One group of G columns of a block: x and the outputs point at its first column. */
INLINE void quantize_group(const float *x, int64_t ld, int rows, int bits, int search, const float *weight,
                           int8_t *q, int64_t ldq, float *scale, float *err_sq, float *norm_sq) {
    if (search)
        search_scales(x, ld, rows, bits, weight, scale);
    else
        rtn_scales(x, ld, rows, bits, scale);
    finish(x, ld, rows, bits, scale, q, ldq, err_sq, norm_sq);
}

/* w [k, n], element (r, c) at w[r * row_stride + c * col_stride], in blocks of `block` rows: of the
 * k / block rows of blocks, this call does first, first + stride, ... (one call per thread).
 * q [k, n] int8; scale [k / block, n]; errors [2, k / block, n]: each block's squared error and
 * squared norm. importance [k] or NULL weighs each row's error in the search. A weight read
 * transposed (a checkpoint's Linear is [n, k]: col_stride k) or the last few columns go through a
 * [block, G] copy, zero-padded. Returns 0, or -1 for arguments it does not take. */
LLMC_EXPORT LLMC_CLONES int llmc_quantize_symmetric(const float *w, int64_t k, int64_t n, int64_t row_stride,
                                               int64_t col_stride, int bits, int64_t block, int search,
                                               const float *importance, int8_t *q, float *scale, float *errors,
                                               int64_t first, int64_t stride) {
    if ((bits != 4 && bits != 6 && bits != 8) || block < 1 || block > MAX_BLOCK || k % block || stride < 1)
        return -1;
    const int64_t blocks = k / block;
    for (int64_t b = first; b < blocks; b += stride) {
        const float *x = w + b * block * row_stride;
        const float *weight = importance ? importance + b * block : 0;
        for (int64_t c0 = 0; c0 < n; c0 += G) {
            float *s = scale + b * n + c0, *e = errors + b * n + c0, *e2 = errors + (blocks + b) * n + c0;
            int8_t *qb = q + b * block * n + c0;
            if (col_stride == 1 && n - c0 >= G) {
                quantize_group(x + c0, row_stride, (int)block, bits, search, weight, qb, n, s, e, e2);
                continue;
            }
            const int cols = n - c0 < G ? (int)(n - c0) : G;
            float tile[MAX_BLOCK * G], tile_scale[G], tile_e[G], tile_e2[G];
            int8_t tile_q[MAX_BLOCK * G];
            if (cols < G)
                for (int i = 0; i < MAX_BLOCK * G; i++)
                    tile[i] = 0;
            if (col_stride < row_stride)
                for (int r = 0; r < block; r++)
                    for (int c = 0; c < cols; c++)
                        tile[r * G + c] = x[r * row_stride + (c0 + c) * col_stride];
            else
                for (int c = 0; c < cols; c++)
                    for (int r = 0; r < block; r++)
                        tile[r * G + c] = x[r * row_stride + (c0 + c) * col_stride];
            quantize_group(tile, G, (int)block, bits, search, weight, tile_q, G, tile_scale, tile_e, tile_e2);
            for (int c = 0; c < cols; c++) {
                s[c] = tile_scale[c];
                e[c] = tile_e[c];
                e2[c] = tile_e2[c];
            }
            for (int r = 0; r < block; r++)
                for (int c = 0; c < cols; c++)
                    qb[r * n + c] = tile_q[r * G + c];
        }
    }
    return 0;
}
