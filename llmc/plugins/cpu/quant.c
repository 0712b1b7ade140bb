/* See kernels.h: the quantized (int8/int6/int4 blockwise, mxfp4) and 16-bit (bf16/fp16) weight formats
 * of the packed GEMM. Each has an AVX2 path (intrinsics, target avx2+fma+f16c, chosen at run time) and a
 * plain C one for other CPUs, which computes the same integer dot products.
 *
 * The quantized tile is rows [0, R) x one 32-column panel. Per group of 4 k steps, a 32-byte
 * vector holds 8 columns x 4 k bytes, so vpmaddubsw against the row's 4 activation bytes
 * (broadcast) gives each column two pair sums, and vpmaddwd with ones their sum: 4 k steps of
 * 8 columns per instruction pair, no horizontal sums.
 * - int4: the weight is the unsigned operand (nibbles 0..15, the symmetric ones stored + 8) and
 *   the activation the signed one; 15 * 127 * 2 = 3810 per pair, so the 16-bit sums of a 32-k
 *   sub-block (8 groups, < 30480) are added as they are and widened once per sub-block.
 * - int8: maddubs(|w|, sign(x, w)) (x in [-127, 127], so its negation never wraps; |-128| reads
 *   as the unsigned 128): at most 128 * 127 * 2 = 32512 per pair, widened at once.
 * - int6: int4's nibbles OR'd with the high 2 bits of a third vector (shifted into bits 4-5),
 *   unsigned 0..63 (the symmetric ones stored + 32): 63 * 127 * 2 = 16002 per pair, widened at
 *   once as int8's.
 * - mxfp4: int4's nibbles, each E2M1 code looked up (vpshufb) in a 16-byte table of 2 * its value
 *   + MX_BIAS: the weight operand must be unsigned, and the bias is taken off as int4's + 8 is.
 *   0..24: 24 * 127 * 2 = 6096 per pair, so eight groups would overflow 16 bits: widened at once
 *   as int6's. (Signs moved onto x, as int8's, keep 16-bit sums but measured slower.) The block's
 *   factor 2^(e - 128) is made from the E8M0 bytes' bits (mx_scale).
 * The zero point (the stored offsets of int4/int6/mxfp4 included) is applied at the end of a sub-block as
 * dot - zp * sum(xq), exact in float32 (every term an integer below 2^24), then the sub-block adds
 * scale[c] * sx[r] * that to the row's float accumulator.
 * Two rows per tile: 8 integer accumulators, 4 weight vectors and the constants fill the 16 ymm
 * registers (the float accumulators are touched once per sub-block). */
#define _POSIX_C_SOURCE 199309L /* clock_gettime, for the probe */
#include "kernels.h"
#include "simd.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define QUANT_HEADER 64     /* a block's 32 scales, float16 */
#define MX_HEADER 32        /* mxfp4's: 32 E8M0 bytes */
#define QUANT_ZP 32         /* a block's 32 zero points, int8 (asymmetric only) */
#define SUB 32              /* k steps per activation sum, and int4's 16-bit sub-block */
#ifndef QUANT_AHEAD
#define QUANT_AHEAD 4096 /* prefetch distance in bytes, as the lossless tile's */
#endif
#ifndef ONE_ROW_AHEAD
/* The VNNI tile's one-row loop's, to L1 (docs/quantization.md, "The integer and 16-bit GEMMs"). */
#define ONE_ROW_AHEAD 8192
#endif
#define HALF_AHEAD 8192     /* the 16-bit tile's: half the fp32 tile's 16 KB, the same k steps ahead */
#define ONE_PASS_ROWS 2     /* rows per tile: more rows take another pass over the panel, from cache */
/* The VNNI tile's rows a pass. Up to FEW_ROWS rows (decode batches, a speculative step's k + 1)
 * the weights stream from memory, and a pass of 8 rows serves twice the rows of a pass of 4 per
 * load; from 24 rows on (prefill) the 8-row tile, whose 32 accumulators do not fit the registers
 * beside the weights, ran slower than two passes of 4 (docs/quantization.md). */
#define VNNI_ROWS 4
#define VNNI_FEW_ROWS 8
#define FEW_ROWS 16

/* The functions below take a quantized format (LLMC_FORMAT_INT8, INT6, INT4, MXFP4), in the tiles a
 * compile-time constant: mxfp4 is int4's nibbles with another decode and header. */
static int64_t group_bytes(int format) {
    const int bits = llmc_format_bits(format);
    return (bits == 8 ? 4 : bits == 6 ? 3 : 2) * LLMC_PANEL;
}
/* A quantized format's row in the tables of tiles and decode choices: int4, int6, int8, mxfp4; -1
 * for the others. */
#define QUANT_FORMAT_COUNT 4
static int format_index(int format) {
    return format == LLMC_FORMAT_INT4    ? 0
           : format == LLMC_FORMAT_INT6  ? 1
           : format == LLMC_FORMAT_INT8  ? 2
           : format == LLMC_FORMAT_MXFP4 ? 3
                                         : -1;
}
static int64_t header_bytes(int format, int zp) {
    return (format == LLMC_FORMAT_MXFP4 ? MX_HEADER : QUANT_HEADER) + (zp ? QUANT_ZP : 0);
}

/* mxfp4's codes as the tiles read them: 2 * the E2M1 value (0, 0.5, 1, 1.5, 2, 3, 4, 6, then
 * their negatives), an integer, + MX_BIAS. */
#define MX_BIAS 12
static const uint8_t MX_CODES[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};

/* What a symmetric format stores each q plus (mxfp4: its table's), so the kernel's weight operand is
 * unsigned. */
static float stored_offset(int format) {
    return format == LLMC_FORMAT_INT8 ? 0.0f : format == LLMC_FORMAT_INT6 ? 32.0f
                                             : format == LLMC_FORMAT_MXFP4 ? (float)MX_BIAS : 8.0f;
}

/* An E8M0 byte's block factor float32(2^(e - 127)) / 2 (kernels.h): 2^(e - 127) is the float whose
 * bits are e << 23 (255: +inf), but for e = 0, the subnormal 2^-127 (bits 1 << 22). Halved, as the
 * codes read as twice their value. The tiles make it the same way, 8 or 16 at a time. */
static float mx_scale(uint8_t e) {
    uint32_t bits = e ? (uint32_t)e << 23 : 1u << 22;
    float f;
    memcpy(&f, &bits, sizeof f);
    return 0.5f * f;
}

int64_t llmc_quant_block_bytes(int format, int64_t block, int zero_points) {
    return header_bytes(format, zero_points) + block / 4 * group_bytes(format);
}

int64_t llmc_quant_bytes(int64_t k, int64_t n, int format, int64_t block, int zero_points) {
    return (n + LLMC_PANEL - 1) / LLMC_PANEL * (k / block) * llmc_quant_block_bytes(format, block, zero_points);
}

/* -- activations ---------------------------------------------------------------------------- */

static int64_t round_up(int64_t v) { return (v + 63) / 64 * 64; }

int64_t llmc_qact_bytes(int64_t m, int64_t k, int64_t block) {
    return round_up(m * k) + round_up(4 * m * (k / block)) + round_up(4 * m * (k / SUB));
}

void llmc_qact_init(llmc_qact *a, void *scratch, int64_t m, int64_t k, int64_t block) {
    uint8_t *p = scratch;
    a->q = (int8_t *)p;
    a->scale = (float *)(p + round_up(m * k));
    a->sum = (float *)(p + round_up(m * k) + round_up(4 * m * (k / block)));
    a->m = m;
    a->k = k;
    a->block = block;
}

LLMC_CLONES
static void quantize_rows_plain(const llmc_qact *a, const float *x, int64_t row0, int64_t row1) {
    const int64_t k = a->k, B = a->block;
    for (int64_t r = row0; r < row1; r++)
        for (int64_t b = 0; b < k / B; b++) {
            const float *xb = x + r * k + b * B;
            int8_t *q = a->q + r * k + b * B;
            /* A compare, not fmaxf: GCC calls libm's fmaxf per element (NaN rules) and this loop is
             * on every op's serial path. A NaN is skipped either way. */
            float amax = 0.0f;
#pragma omp simd reduction(max : amax)
            for (int64_t i = 0; i < B; i++) {
                float v = fabsf(xb[i]);
                amax = v > amax ? v : amax;
            }
            float sx = amax / 127.0f;
            if (!(sx > 0.0f) || !isfinite(sx)) { /* a zero (or non-finite) block contributes 0 */
                sx = 0.0f;
                memset(q, 0, (size_t)B);
            } else {
                const float inv = 1.0f / sx;
#pragma omp simd
                for (int64_t i = 0; i < B; i++) {
                    float v = nearbyintf(xb[i] * inv); /* half to even, as the reference's np.rint */
                    v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);
                    q[i] = (int8_t)v;
                }
            }
            a->scale[r * (k / B) + b] = sx;
            for (int64_t s = 0; s < B / SUB; s++) {
                int32_t total = 0;
#pragma omp simd reduction(+ : total)
                for (int64_t i = 0; i < SUB; i++)
                    total += q[s * SUB + i];
                a->sum[r * (k / SUB) + b * (B / SUB) + s] = (float)total;
            }
        }
}

/* -- plain C: any CPU ------------------------------------------------------------------------- */

static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0x1F)
        bits = sign | 0x7F800000u | (man << 13);
    else if (exp != 0)
        bits = sign | ((exp + 112) << 23) | (man << 13);
    else if (man == 0)
        bits = sign;
    else { /* subnormal: normalize */
        int e = -1;
        do {
            e++;
            man <<= 1;
        } while (!(man & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3FF) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* The stored weight of (column c, k step kk of group g) in a block's weights. */
static int stored_weight(const uint8_t *wq, int format, int64_t g, int c, int kk) {
    if (format == LLMC_FORMAT_INT8)
        return ((const int8_t *)wq)[g * 128 + c * 4 + kk];
    const uint8_t *group = wq + g * group_bytes(format);
    int half = c / 16, high = (c % 16) / 8;
    uint8_t byte = group[half * 32 + (c % 8) * 4 + kk];
    int low = high ? byte >> 4 : byte & 15;
    if (format != LLMC_FORMAT_INT6)
        return format == LLMC_FORMAT_MXFP4 ? MX_CODES[low] : low;
    return low | ((group[64 + (c % 8) * 4 + kk] >> (2 * (c / 8))) & 3) << 4;
}

static void quant_panel_plain(const llmc_qact *a, const uint8_t *panel, float *out, int64_t out_stride,
                              int64_t row0, int64_t rows, int format, int zp) {
    const int64_t k = a->k, B = a->block, nb = k / B, bb = llmc_quant_block_bytes(format, B, zp);
    for (int64_t r = 0; r < rows; r++) {
        float acc[LLMC_PANEL] = {0};
        const int8_t *xq = a->q + (row0 + r) * k;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = panel + b * bb, *wq = blk + header_bytes(format, zp);
            float sx = a->scale[(row0 + r) * nb + b];
            /* as the AVX2 tile: int4 per 32 k, the others per block */
            int64_t span = format == LLMC_FORMAT_INT4 ? SUB : B;
            for (int64_t s0 = 0; s0 < B; s0 += span) {
                float xs = 0.0f;
                for (int64_t s = s0 / SUB; s < (s0 + span) / SUB; s++)
                    xs += a->sum[(row0 + r) * (k / SUB) + b * (B / SUB) + s];
                for (int c = 0; c < LLMC_PANEL; c++) {
                    int32_t dot = 0;
                    for (int64_t i = s0; i < s0 + span; i++)
                        dot += xq[b * B + i] * stored_weight(wq, format, i / 4, c, (int)(i % 4));
                    float offset = zp ? (float)((const int8_t *)(blk + QUANT_HEADER))[c] : stored_offset(format);
                    float scale;
                    if (format == LLMC_FORMAT_MXFP4)
                        scale = mx_scale(blk[c]);
                    else {
                        uint16_t h;
                        memcpy(&h, blk + 2 * c, sizeof h);
                        scale = half_to_float(h);
                    }
                    acc[c] += ((float)dot - offset * xs) * (scale * sx);
                }
            }
        }
        memcpy(out + r * out_stride, acc, sizeof acc);
    }
}

static void half_panel_plain(const float *x, const uint16_t *panel, float *out, int64_t out_stride, int64_t k,
                             int64_t rows, int bf16) {
    for (int64_t r = 0; r < rows; r++) {
        float acc[LLMC_PANEL] = {0};
        for (int64_t i = 0; i < k; i++) {
            float xv = x[r * k + i];
            for (int c = 0; c < LLMC_PANEL; c++) {
                uint16_t h = panel[i * LLMC_PANEL + c];
                acc[c] += xv * (bf16 ? bf16_to_float(h) : half_to_float(h));
            }
        }
        memcpy(out + r * out_stride, acc, sizeof acc);
    }
}

/* -- AVX2 ------------------------------------------------------------------------------------ */

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_AVX2_PATH 1
#define AVX2 __attribute__((target("avx2,fma,f16c")))

/* mx_scale of the 8 E8M0 bytes at e. */
static inline __attribute__((always_inline)) AVX2 __m256 mx_scales(const uint8_t *e) {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)e));
    const __m256i zero = _mm256_and_si256(_mm256_cmpeq_epi32(v, _mm256_setzero_si256()), _mm256_set1_epi32(1 << 22));
    const __m256 power = _mm256_castsi256_ps(_mm256_or_si256(_mm256_slli_epi32(v, 23), zero));
    return _mm256_mul_ps(power, _mm256_set1_ps(0.5f));
}

/* Rows [0, R) of the quantized activations from row0, times one quantized panel, into out. */
static inline __attribute__((always_inline)) AVX2 void quant_tile(const llmc_qact *a, int64_t row0,
                                                                  const uint8_t *panel, float *out,
                                                                  int64_t out_stride, const int format, const int zp,
                                                                  const int once, const int R) {
    const int bits = llmc_format_bits(format), mx = format == LLMC_FORMAT_MXFP4;
    const int narrow = format == LLMC_FORMAT_INT4; /* 16-bit sums over a 32-k sub-block */
    const int64_t k = a->k, B = a->block, nb = k / B, gb = group_bytes(format);
    const int64_t bb = llmc_quant_block_bytes(format, B, zp), span = narrow ? SUB : B;
    const int8_t *xq[R];
    for (int r = 0; r < R; r++)
        xq[r] = a->q + (row0 + r) * k;
    __m256 acc[R][4];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++)
            acc[r][j] = _mm256_setzero_ps();
    const __m256i ones = _mm256_set1_epi16(1), nibble = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30);
    const __m256i codes = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)MX_CODES));
    const uint8_t *blk = panel;
    for (int64_t b = 0; b < nb; b++, blk += bb) {
        const uint8_t *wq = blk + header_bytes(format, zp);
        PREFETCH_FOR(once, blk + QUANT_AHEAD);
        PREFETCH_FOR(once, blk + QUANT_AHEAD + 64);
        for (int64_t s0 = 0; s0 < B; s0 += span) {
            __m256i dot[R][4];
            for (int r = 0; r < R; r++)
                for (int j = 0; j < 4; j++)
                    dot[r][j] = _mm256_setzero_si256();
            for (int64_t g = s0 / 4; g < (s0 + span) / 4; g++) {
                const uint8_t *gp = wq + g * gb;
                PREFETCH_FOR(once, gp + QUANT_AHEAD);
                if (bits != 8) {
                    __m256i v0 = _mm256_loadu_si256((const __m256i *)gp);
                    __m256i v1 = _mm256_loadu_si256((const __m256i *)(gp + 32));
                    __m256i w[4] = {_mm256_and_si256(v0, nibble), _mm256_and_si256(_mm256_srli_epi16(v0, 4), nibble),
                                    _mm256_and_si256(v1, nibble), _mm256_and_si256(_mm256_srli_epi16(v1, 4), nibble)};
                    if (bits == 6) {
                        PREFETCH_FOR(once, gp + QUANT_AHEAD + 64);
                        /* Column group j's high 2 bits sit at bits 2j: shifted to bits 4-5 (a 16-bit
                         * shift carries bits across bytes, but the mask keeps only the byte's own). */
                        __m256i h = _mm256_loadu_si256((const __m256i *)(gp + 64));
                        w[0] = _mm256_or_si256(w[0], _mm256_and_si256(_mm256_slli_epi16(h, 4), top));
                        w[1] = _mm256_or_si256(w[1], _mm256_and_si256(_mm256_slli_epi16(h, 2), top));
                        w[2] = _mm256_or_si256(w[2], _mm256_and_si256(h, top));
                        w[3] = _mm256_or_si256(w[3], _mm256_and_si256(_mm256_srli_epi16(h, 2), top));
                    }
                    if (mx)
                        for (int j = 0; j < 4; j++)
                            w[j] = _mm256_shuffle_epi8(codes, w[j]);
                    for (int r = 0; r < R; r++) {
                        int32_t four;
                        memcpy(&four, xq[r] + b * B + g * 4, sizeof four);
                        __m256i xb = _mm256_set1_epi32(four);
                        for (int j = 0; j < 4; j++) {
                            __m256i pairs = _mm256_maddubs_epi16(w[j], xb);
                            dot[r][j] = narrow ? _mm256_add_epi16(dot[r][j], pairs)
                                               : _mm256_add_epi32(dot[r][j], _mm256_madd_epi16(pairs, ones));
                        }
                    }
                } else {
                    PREFETCH_FOR(once, gp + QUANT_AHEAD + 64);
                    __m256i w[4], aw[4];
                    for (int j = 0; j < 4; j++) {
                        w[j] = _mm256_loadu_si256((const __m256i *)(gp + 32 * j));
                        aw[j] = _mm256_abs_epi8(w[j]);
                    }
                    for (int r = 0; r < R; r++) {
                        int32_t four;
                        memcpy(&four, xq[r] + b * B + g * 4, sizeof four);
                        __m256i xb = _mm256_set1_epi32(four);
                        for (int j = 0; j < 4; j++)
                            dot[r][j] = _mm256_add_epi32(
                                dot[r][j], _mm256_madd_epi16(_mm256_maddubs_epi16(aw[j], _mm256_sign_epi8(xb, w[j])),
                                                             ones));
                    }
                }
            }
            /* The sub-block's scales and offsets, then each row's share. */
            __m256 scale[4], offset[4];
            for (int j = 0; j < 4; j++) {
                scale[j] = mx ? mx_scales(blk + 8 * j)
                              : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16 * j)));
                if (zp)
                    offset[j] = _mm256_cvtepi32_ps(
                        _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(blk + QUANT_HEADER + 8 * j))));
                else
                    offset[j] = _mm256_set1_ps(stored_offset(format)); /* int8 symmetric has none */
            }
            for (int r = 0; r < R; r++) {
                const float *sums = a->sum + (row0 + r) * (k / SUB) + b * (B / SUB) + s0 / SUB;
                float xs = 0.0f;
                for (int64_t s = 0; s < span / SUB; s++)
                    xs += sums[s];
                __m256 sx = _mm256_set1_ps(a->scale[(row0 + r) * nb + b]), xsv = _mm256_set1_ps(xs);
                for (int j = 0; j < 4; j++) {
                    __m256 d = _mm256_cvtepi32_ps(narrow ? _mm256_madd_epi16(dot[r][j], ones) : dot[r][j]);
                    if (zp || bits != 8)
                        d = _mm256_fnmadd_ps(offset[j], xsv, d);
                    acc[r][j] = _mm256_fmadd_ps(d, _mm256_mul_ps(scale[j], sx), acc[r][j]);
                }
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++)
            _mm256_storeu_ps(out + r * out_stride + 8 * j, acc[r][j]);
}

/* quantize_rows_plain's arithmetic, in registers: every op's serial path runs it before the GEMM,
 * and compiled from C its per-32 sums went through the stack (a store-forwarding stall each).
 * Same results: max skips a NaN (maxps returns its second operand), roundps rounds half to even as
 * nearbyintf, and each sum adds the clamped integers exactly in float. */
static AVX2 void quantize_rows_avx2(const llmc_qact *a, const float *x, int64_t row0, int64_t row1) {
    const int64_t k = a->k, B = a->block;
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256 hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7); /* undoes packs' lane interleave */
    for (int64_t r = row0; r < row1; r++)
        for (int64_t b = 0; b < k / B; b++) {
            const float *xb = x + r * k + b * B;
            int8_t *q = a->q + r * k + b * B;
            float *sums = a->sum + r * (k / SUB) + b * (B / SUB);
            __m256 peak = _mm256_setzero_ps();
            for (int64_t i = 0; i < B; i += 8)
                peak = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(xb + i), magnitude), peak);
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(peak), _mm256_extractf128_ps(peak, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            float sx = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4))) / 127.0f;
            if (!(sx > 0.0f) || !isfinite(sx)) { /* a zero (or non-finite) block contributes 0 */
                a->scale[r * (k / B) + b] = 0.0f;
                memset(q, 0, (size_t)B);
                for (int64_t s = 0; s < B / SUB; s++)
                    sums[s] = 0.0f;
                continue;
            }
            a->scale[r * (k / B) + b] = sx;
            const __m256 inv = _mm256_set1_ps(1.0f / sx);
            for (int64_t s = 0; s < B; s += SUB) {
                __m256 v[4];
                for (int j = 0; j < 4; j++)
                    v[j] = _mm256_max_ps(_mm256_min_ps(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + s + 8 * j), inv),
                                                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                                                       hi),
                                         lo);
                __m256 t = _mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3]));
                __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
                t4 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
                sums[s / SUB] = _mm_cvtss_f32(_mm_add_ss(t4, _mm_movehdup_ps(t4)));
                __m256i w01 = _mm256_packs_epi32(_mm256_cvtps_epi32(v[0]), _mm256_cvtps_epi32(v[1]));
                __m256i w23 = _mm256_packs_epi32(_mm256_cvtps_epi32(v[2]), _mm256_cvtps_epi32(v[3]));
                __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w01, w23), order);
                _mm256_storeu_si256((__m256i *)(q + s), bytes);
            }
        }
}

/* One format's panels [p0, p1): the tile specialized per (rows, format) at compile time, at most
 * MAXR (2 or 4: a literal, LLMC_ROWS_<MAXR> dispatches) rows a pass. */
#define QUANT_PANELS(NAME, TILE, TARGET, FORMAT, ZP, MAXR)                                                \
    static TARGET void NAME(const llmc_qact *a, const uint8_t *w, float *y, int64_t n, int64_t p0, int64_t p1) { \
        float tail[MAXR * LLMC_PANEL];                                                                    \
        const int64_t bytes = (a->k / a->block) * llmc_quant_block_bytes(FORMAT, a->block, ZP);           \
        const int once = a->m <= MAXR;                                                                    \
        for (int64_t p = p0; p < p1; p++) {                                                               \
            const uint8_t *panel = w + p * bytes;                                                         \
            int64_t col = p * LLMC_PANEL, width = n - col < LLMC_PANEL ? n - col : LLMC_PANEL;            \
            for (int64_t r = 0; r < a->m;) {                                                              \
                int64_t rows = a->m - r >= MAXR ? MAXR : a->m - r;                                        \
                float *out = width == LLMC_PANEL ? y + r * n + col : tail;                                \
                int64_t stride = width == LLMC_PANEL ? n : LLMC_PANEL;                                    \
                LLMC_ROWS_##MAXR(rows, TILE, a, r, panel, out, stride, FORMAT, ZP, once);                 \
                if (width != LLMC_PANEL)                                                                  \
                    for (int64_t i = 0; i < rows; i++)                                                    \
                        memcpy(y + (r + i) * n + col, tail + i * LLMC_PANEL, (size_t)width * sizeof(float)); \
                r += rows;                                                                                \
            }                                                                                             \
        }                                                                                                 \
    }
/* Every format's panels for one tile: int4/int6/int8, symmetric and asymmetric, and mxfp4. */
#define QUANT_FORMATS(SUFFIX, TILE, TARGET, MAXR)                                                         \
    QUANT_PANELS(int4_sym##SUFFIX, TILE, TARGET, LLMC_FORMAT_INT4, 0, MAXR)                               \
    QUANT_PANELS(int4_asym##SUFFIX, TILE, TARGET, LLMC_FORMAT_INT4, 1, MAXR)                              \
    QUANT_PANELS(int6_sym##SUFFIX, TILE, TARGET, LLMC_FORMAT_INT6, 0, MAXR)                               \
    QUANT_PANELS(int6_asym##SUFFIX, TILE, TARGET, LLMC_FORMAT_INT6, 1, MAXR)                              \
    QUANT_PANELS(int8_sym##SUFFIX, TILE, TARGET, LLMC_FORMAT_INT8, 0, MAXR)                               \
    QUANT_PANELS(int8_asym##SUFFIX, TILE, TARGET, LLMC_FORMAT_INT8, 1, MAXR)                              \
    QUANT_PANELS(mxfp4##SUFFIX, TILE, TARGET, LLMC_FORMAT_MXFP4, 0, MAXR)
QUANT_FORMATS(, quant_tile, AVX2, ONE_PASS_ROWS)

/* -- AVX-512 VNNI ------------------------------------------------------------------------------ */

/* The same panels with vpdpbusd: u8 x s8 products of 4 k steps summed into int32 in one
 * instruction, 16 columns a zmm, so a 4-k group of 32 columns is two instructions a row.
 * - int4/int6: one 64-byte load holds the group; its low nibbles are columns 0-7 and 16-23 (the
 *   two 32-byte halves), its high nibbles 8-15 and 24-31. The accumulators keep that order and
 *   the scales and offsets are loaded in it.
 * - int8: each weight byte XOR 0x80 is w + 128 as an unsigned byte, so the offset is the zero
 *   point plus 128 (at most 255 * 127 * 128 < 2^24 a block: exact in float, as above).
 * - mxfp4: int4's group, both nibbles shifted down to look their codes up (vpshufb indexes with
 *   the low 4 bits but zeroes a byte whose bit 7 is set), no 16x trick.
 * int32 sums cannot overflow within a block, so every format takes a whole block before its
 * offset and scale are applied. */
#define VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

/* The CPU has AVX-512 VNNI and LLMC_CPU_NO_VNNI=1 (which the tests also run) does not ask for the
 * AVX2 tile instead. */
static int llmc_vnni(void) {
    static int cached = -1;
    if (cached < 0)
        cached = llmc_avx2() && !llmc_env_on("LLMC_CPU_NO_VNNI") && __builtin_cpu_supports("avx512f") &&
                 __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                 __builtin_cpu_supports("avx512vnni");
    return cached;
}

/* 16 float16 values from two 8-value runs at a and b, widened. */
static inline __attribute__((always_inline)) VNNI __m512 halves_at(const uint8_t *a, const uint8_t *b) {
    __m256i h = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)a)),
                                        _mm_loadu_si128((const __m128i *)b), 1);
    return _mm512_cvtph_ps(h);
}

/* mx_scale of 16 E8M0 bytes from two 8-byte runs at a and b. */
static inline __attribute__((always_inline)) VNNI __m512 mx_scales_at(const uint8_t *a, const uint8_t *b) {
    __m128i v = _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)a), _mm_loadl_epi64((const __m128i *)b));
    __m512i e = _mm512_cvtepu8_epi32(v);
    __m512i power = _mm512_mask_mov_epi32(_mm512_slli_epi32(e, 23), _mm512_cmpeq_epi32_mask(e, _mm512_setzero_si512()),
                                          _mm512_set1_epi32(1 << 22));
    return _mm512_mul_ps(_mm512_castsi512_ps(power), _mm512_set1_ps(0.5f));
}

/* 16 int8 values from two 8-value runs at a and b, as floats. */
static inline __attribute__((always_inline)) VNNI __m512 bytes_at(const uint8_t *a, const uint8_t *b) {
    __m128i v = _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)a), _mm_loadl_epi64((const __m128i *)b));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v));
}

static inline __attribute__((always_inline)) VNNI __m256 upper_half(__m512 v) {
    return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
}

/* A 4-k group of 32 columns as vpdpbusd's unsigned operands, in accumulator order. int4's high
 * nibbles are masked in place, 16x their value (a 128-block's sums stay below 2^22, so the float
 * product by 1/16 afterwards is exact): one instruction fewer than shifting them down. */
static inline __attribute__((always_inline)) VNNI void vnni_group(const uint8_t *gp, const int format, __m512i w[2]) {
    if (format == LLMC_FORMAT_INT8) {
        const __m512i flip = _mm512_set1_epi8((char)0x80);
        w[0] = _mm512_xor_si512(_mm512_loadu_si512(gp), flip);
        w[1] = _mm512_xor_si512(_mm512_loadu_si512(gp + 64), flip);
        return;
    }
    const __m512i nibble = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(0x30);
    __m512i v = _mm512_loadu_si512(gp);
    w[0] = _mm512_and_si512(v, nibble);
    if (format == LLMC_FORMAT_INT4) {
        w[1] = _mm512_and_si512(v, _mm512_set1_epi8((char)0xF0));
        return;
    }
    if (format == LLMC_FORMAT_MXFP4) {
        const __m512i codes = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)MX_CODES));
        w[0] = _mm512_shuffle_epi8(codes, w[0]);
        w[1] = _mm512_shuffle_epi8(codes, _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble));
        return;
    }
    w[1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
    /* int6: the high 2 bits of column run j sit at bits 2j of the third vector: runs 0 and 2 go
     * with w[0]'s halves, 1 and 3 with w[1]'s, each shifted to bits 4-5. */
    __m256i h = _mm256_loadu_si256((const __m256i *)(gp + 64));
    __m512i h0 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_slli_epi16(h, 4)), h, 1);
    __m512i h1 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_slli_epi16(h, 2)), _mm256_srli_epi16(h, 2), 1);
    w[0] = _mm512_or_si512(w[0], _mm512_and_si512(h0, top));
    w[1] = _mm512_or_si512(w[1], _mm512_and_si512(h1, top));
}

static inline __attribute__((always_inline)) VNNI void vnni_tile(const llmc_qact *a, int64_t row0,
                                                                 const uint8_t *panel, float *out,
                                                                 int64_t out_stride, const int format, const int zp,
                                                                 const int once, const int R) {
    const int bits = llmc_format_bits(format);
    const int64_t k = a->k, B = a->block, nb = k / B, gb = group_bytes(format);
    const int64_t bb = llmc_quant_block_bytes(format, B, zp);
    const int8_t *xq[R];
    for (int r = 0; r < R; r++)
        xq[r] = a->q + (row0 + r) * k;
    __m512 acc[R][2];
    for (int r = 0; r < R; r++)
        acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    /* Column runs of 8 in accumulator order: which 8-column runs the two zmm hold. */
    const int lo0 = 0, lo1 = bits == 8 ? 8 : 16, hi0 = bits == 8 ? 16 : 8, hi1 = 24;
    const uint8_t *blk = panel;
    for (int64_t b = 0; b < nb; b++, blk += bb) {
        const uint8_t *wq = blk + header_bytes(format, zp);
        __m512i dot[R][2];
        for (int r = 0; r < R; r++)
            dot[r][0] = dot[r][1] = _mm512_setzero_si512();
        if (R == 1) {
            /* One row: each line prefetched ONE_ROW_AHEAD bytes ahead into L1 (more lines in
             * flight than the loop's own loads keep), and the odd groups in accumulators of their
             * own, two chains of dependent vpdpbusd. */
            __m512i odd[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
            for (int64_t g = 0; g < B / 4; g += 2) {
                __m512i w[2][2];
                for (int64_t line = 0; line < 2 * gb; line += 64)
                    _mm_prefetch((const char *)(wq + g * gb + ONE_ROW_AHEAD + line), _MM_HINT_T0);
                vnni_group(wq + g * gb, format, w[0]);
                vnni_group(wq + (g + 1) * gb, format, w[1]);
                int32_t four[2];
                memcpy(four, xq[0] + b * B + g * 4, sizeof four);
                __m512i x0 = _mm512_set1_epi32(four[0]), x1 = _mm512_set1_epi32(four[1]);
                for (int j = 0; j < 2; j++) {
                    dot[0][j] = _mm512_dpbusd_epi32(dot[0][j], w[0][j], x0);
                    odd[j] = _mm512_dpbusd_epi32(odd[j], w[1][j], x1);
                }
            }
            for (int j = 0; j < 2; j++)
                dot[0][j] = _mm512_add_epi32(dot[0][j], odd[j]);
        } else {
            PREFETCH_FOR(once, blk + QUANT_AHEAD);
            PREFETCH_FOR(once, blk + QUANT_AHEAD + 64);
            for (int64_t g = 0; g < B / 4; g++) {
                const uint8_t *gp = wq + g * gb;
                PREFETCH_FOR(once, gp + QUANT_AHEAD);
                if (bits == 8)
                    PREFETCH_FOR(once, gp + QUANT_AHEAD + 64);
                __m512i w[2];
                vnni_group(gp, format, w);
                for (int r = 0; r < R; r++) {
                    int32_t four;
                    memcpy(&four, xq[r] + b * B + g * 4, sizeof four);
                    __m512i xb = _mm512_set1_epi32(four);
                    for (int j = 0; j < 2; j++)
                        dot[r][j] = _mm512_dpbusd_epi32(dot[r][j], w[j], xb);
                }
            }
        }
        /* The block's scales and offsets in accumulator order, then each row's share. */
        __m512 scale[2];
        if (format == LLMC_FORMAT_MXFP4) {
            scale[0] = mx_scales_at(blk + lo0, blk + lo1);
            scale[1] = mx_scales_at(blk + hi0, blk + hi1);
        } else {
            scale[0] = halves_at(blk + 2 * lo0, blk + 2 * lo1);
            scale[1] = halves_at(blk + 2 * hi0, blk + 2 * hi1);
        }
        __m512 offset[2];
        const float base = bits == 8 ? 128.0f : 0.0f;
        if (zp) {
            const uint8_t *z = blk + QUANT_HEADER;
            offset[0] = _mm512_add_ps(bytes_at(z + lo0, z + lo1), _mm512_set1_ps(base));
            offset[1] = _mm512_add_ps(bytes_at(z + hi0, z + hi1), _mm512_set1_ps(base));
        } else
            offset[0] = offset[1] = _mm512_set1_ps(base + stored_offset(format));
        for (int r = 0; r < R; r++) {
            const float *sums = a->sum + (row0 + r) * (k / SUB) + b * (B / SUB);
            float xs = 0.0f;
            for (int64_t s = 0; s < B / SUB; s++)
                xs += sums[s];
            __m512 sx = _mm512_set1_ps(a->scale[(row0 + r) * nb + b]), xsv = _mm512_set1_ps(xs);
            for (int j = 0; j < 2; j++) {
                __m512 sum = _mm512_cvtepi32_ps(dot[r][j]);
                if (format == LLMC_FORMAT_INT4 && j == 1)
                    sum = _mm512_mul_ps(sum, _mm512_set1_ps(1.0f / 16));
                __m512 d = _mm512_fnmadd_ps(offset[j], xsv, sum);
                acc[r][j] = _mm512_fmadd_ps(d, _mm512_mul_ps(scale[j], sx), acc[r][j]);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        float *o = out + r * out_stride;
        _mm256_storeu_ps(o + lo0, _mm512_castps512_ps256(acc[r][0]));
        _mm256_storeu_ps(o + lo1, upper_half(acc[r][0]));
        _mm256_storeu_ps(o + hi0, _mm512_castps512_ps256(acc[r][1]));
        _mm256_storeu_ps(o + hi1, upper_half(acc[r][1]));
    }
}

QUANT_FORMATS(_vnni, vnni_tile, VNNI, VNNI_ROWS)
/* In a section of their own: compiled in among the others, the few-rows tiles moved the 4-row
 * tile's loops to other offsets within their cache lines, and that alone made int4 products of
 * prefill's size 5-7% slower (docs/quantization.md). */
#ifdef __ELF__
#define VNNI_FEW VNNI __attribute__((section(".text.llmc_few_rows")))
#else
#define VNNI_FEW VNNI
#endif
QUANT_FORMATS(_vnni_few, vnni_tile, VNNI_FEW, VNNI_FEW_ROWS)

/* Each format's panels by [tile][format_index][symmetric, asymmetric] (mxfp4 has no zero points:
 * the ops refuse them, and both entries are its one tile). */
enum { TILE_AVX2, TILE_VNNI, TILE_VNNI_FEW /* at most FEW_ROWS rows */ };
typedef void (*quant_panels_fn)(const llmc_qact *, const uint8_t *, float *, int64_t, int64_t, int64_t);
static const quant_panels_fn QUANT_PANELS_BY[3][QUANT_FORMAT_COUNT][2] = {
    {{int4_sym, int4_asym}, {int6_sym, int6_asym}, {int8_sym, int8_asym}, {mxfp4, mxfp4}},
    {{int4_sym_vnni, int4_asym_vnni}, {int6_sym_vnni, int6_asym_vnni}, {int8_sym_vnni, int8_asym_vnni},
     {mxfp4_vnni, mxfp4_vnni}},
    {{int4_sym_vnni_few, int4_asym_vnni_few}, {int6_sym_vnni_few, int6_asym_vnni_few},
     {int8_sym_vnni_few, int8_asym_vnni_few}, {mxfp4_vnni_few, mxfp4_vnni_few}},
};

/* Rows [0, R) of x times one 16-bit panel: the fp32 tile with a conversion after each load. */
static inline __attribute__((always_inline)) AVX2 void half_tile(const float *restrict x,
                                                                 const uint16_t *restrict panel, float *restrict out,
                                                                 int64_t k, int64_t out_stride, const int R,
                                                                 const int bf16, const int once) {
    __m256 acc[R][4];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++)
            acc[r][j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i++) {
        const uint16_t *row = panel + i * LLMC_PANEL;
        PREFETCH_FOR(once, (const uint8_t *)row + HALF_AHEAD);
        __m256 xb[R];
        for (int r = 0; r < R; r++)
            xb[r] = _mm256_broadcast_ss(x + r * k + i);
        for (int j = 0; j < 4; j++) {
            __m128i h = _mm_loadu_si128((const __m128i *)(row + 8 * j));
            __m256 w = bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)) : _mm256_cvtph_ps(h);
            for (int r = 0; r < R; r++)
                acc[r][j] = _mm256_fmadd_ps(xb[r], w, acc[r][j]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++)
            _mm256_storeu_ps(out + r * out_stride + 8 * j, acc[r][j]);
}

/* The 16-bit panels [p0, p1): up to MAX_ROWS rows a pass through TILE (ROWS: the LLMC_ROWS_*
 * switch of that many), the rows of a partial last panel through a scratch tile. */
#define HALF_TILE_ROWS(TILE, BF16, once, x, panel, out, k, stride, R) TILE(x, panel, out, k, stride, R, BF16, once)
#define HALF_PANELS(NAME, BF16, TILE, TARGET, MAX_ROWS, ROWS)                                              \
    static TARGET void NAME(const float *x, const uint16_t *w, float *y, int64_t m, int64_t k, int64_t n, \
                            int64_t p0, int64_t p1) {                                                     \
        float tail[MAX_ROWS * LLMC_PANEL];                                                                \
        const int once = m <= MAX_ROWS;                                                                   \
        for (int64_t p = p0; p < p1; p++) {                                                               \
            const uint16_t *panel = w + p * k * LLMC_PANEL;                                               \
            int64_t col = p * LLMC_PANEL, width = n - col < LLMC_PANEL ? n - col : LLMC_PANEL;            \
            for (int64_t r = 0; r < m;) {                                                                 \
                const int64_t rows = m - r >= MAX_ROWS ? MAX_ROWS : m - r;                                \
                float *out = width == LLMC_PANEL ? y + r * n + col : tail;                                \
                const int64_t stride = width == LLMC_PANEL ? n : LLMC_PANEL;                              \
                ROWS(rows, HALF_TILE_ROWS, TILE, BF16, once, x + r * k, panel, out, k, stride)            \
                if (width != LLMC_PANEL)                                                                  \
                    for (int64_t i = 0; i < rows; i++)                                                    \
                        memcpy(y + (r + i) * n + col, tail + i * LLMC_PANEL, (size_t)width * sizeof(float)); \
                r += rows;                                                                                \
            }                                                                                             \
        }                                                                                                 \
    }
HALF_PANELS(bf16_panels, 1, half_tile, AVX2, 3, LLMC_ROWS_3)
HALF_PANELS(fp16_panels, 0, half_tile, AVX2, 3, LLMC_ROWS_3)

/* The same tile 16 columns a register: per column the same products added in the same order, so
 * the same sums to the bit, in half the instructions a weight byte (what a host whose decode is
 * bound by instructions rather than memory needs; the probe decides), and 8 rows a pass. */
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
static inline __attribute__((always_inline)) AVX512 void half_tile512(const float *restrict x,
                                                                      const uint16_t *restrict panel,
                                                                      float *restrict out, int64_t k,
                                                                      int64_t out_stride, const int R,
                                                                      const int bf16, const int once) {
    __m512 acc[R][2];
    for (int r = 0; r < R; r++)
        acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i++) {
        const uint16_t *row = panel + i * LLMC_PANEL;
        PREFETCH_FOR(once, (const uint8_t *)row + HALF_AHEAD);
        __m512 w[2];
        for (int j = 0; j < 2; j++) {
            __m256i h = _mm256_loadu_si256((const __m256i *)(row + 16 * j));
            w[j] = bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)) : _mm512_cvtph_ps(h);
        }
        for (int r = 0; r < R; r++) {
            const __m512 xb = _mm512_set1_ps(x[r * k + i]);
            acc[r][0] = _mm512_fmadd_ps(xb, w[0], acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(xb, w[1], acc[r][1]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 2; j++)
            _mm512_storeu_ps(out + r * out_stride + 16 * j, acc[r][j]);
}

/* 8 rows a pass: 16 accumulators of the 32 registers */
HALF_PANELS(bf16_panels512, 1, half_tile512, AVX512, 8, LLMC_ROWS_8)
HALF_PANELS(fp16_panels512, 0, half_tile512, AVX512, 8, LLMC_ROWS_8)

static int llmc_avx512(void) {
    static int cached = -1;
    if (cached < 0)
        cached = llmc_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                 __builtin_cpu_supports("avx512vl");
    return cached;
}
#else
#define HAVE_AVX2_PATH 0
static int llmc_avx2(void) { return 0; }
#endif

/* -- entry points ------------------------------------------------------------------------------ */

void llmc_quantize_rows(const llmc_qact *a, const float *x, int64_t row0, int64_t row1) {
#if HAVE_AVX2_PATH
    if (llmc_avx2()) {
        quantize_rows_avx2(a, x, row0, row1);
        return;
    }
#endif
    quantize_rows_plain(a, x, row0, row1);
}

/* Which tile a decode step's product (at most ONE_PASS_ROWS rows) takes per quantized format
 * (format_index): 1 VNNI, 0 AVX2, as measured on this host (llmc_probe_quant, plugins/cpu/host.py)
 * and set before a session runs; -1 until then: VNNI but for int8, the rule of the first VNNI host
 * measured (docs/quantization.md), which the Intel host contradicts. */
static int decode_vnni[QUANT_FORMAT_COUNT] = {-1, -1, -1, -1};

/* format: LLMC_FORMAT_INT8, INT6, INT4 or MXFP4. */
LLMC_EXPORT int llmc_set_decode_tile(int format, int vnni) {
    if (format_index(format) < 0 || vnni < -1 || vnni > 1)
        return -1;
    decode_vnni[format_index(format)] = vnni;
    return 0;
}

#if HAVE_AVX2_PATH
static int takes_vnni(int format, int64_t m) {
    if (!llmc_vnni())
        return 0;
    if (m > ONE_PASS_ROWS)
        return 1;
    const int chosen = decode_vnni[format_index(format)];
    return chosen < 0 ? format != LLMC_FORMAT_INT8 : chosen;
}
#endif

/* Which tile each 16-bit format (fp16, bf16) takes: 1 the AVX-512 one, 0 AVX2, as measured on this
 * host (llmc_probe_16bit) and set before a session runs; -1 until then: AVX2. */
static int wide_16bit[2] = {-1, -1};

LLMC_EXPORT int llmc_set_16bit_tile(int bf16, int avx512) {
    if (avx512 < -1 || avx512 > 1)
        return -1;
    wide_16bit[bf16 != 0] = avx512;
    return 0;
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* How long m rows times a [k, n] symmetric block-32 weight of `format` take through each tile, on
 * this thread: seconds[0] the AVX2 tile's, seconds[1] the VNNI one's (-1 where the CPU lacks it),
 * the fastest of `reps` calls each, the tiles taking turns. The weight (random integers, fixed
 * scales) should exceed the last-level cache, so it streams from memory as a model's does.
 * Returns 0, or -1 where no tile runs (no AVX2, bad arguments, no memory). */
LLMC_EXPORT int llmc_probe_quant(int format, int64_t m, int64_t k, int64_t n, int reps, double seconds[2]) {
    seconds[0] = seconds[1] = -1;
#if HAVE_AVX2_PATH
    if (format_index(format) < 0 || m < 1 || m > FEW_ROWS || k % 32 || n < 1 || reps < 1 || !llmc_avx2())
        return -1;
    const int64_t block = 32, panels = (n + LLMC_PANEL - 1) / LLMC_PANEL;
    const int64_t bytes = llmc_quant_bytes(k, n, format, block, 0),
                  block_bytes = llmc_quant_block_bytes(format, block, 0);
    uint64_t *w = malloc((size_t)(bytes + 7) / 8 * 8);
    float *x = malloc((size_t)(m * k) * sizeof(float)), *y = malloc((size_t)(m * n) * sizeof(float));
    void *scratch = malloc((size_t)llmc_qact_bytes(m, k, block));
    int status = -1;
    if (w && x && y && scratch) {
        uint64_t state = 0x9E3779B97F4A7C15ull;
        for (int64_t i = 0; i < (bytes + 7) / 8; i++) {
            state ^= state << 13, state ^= state >> 7, state ^= state << 17;
            w[i] = state;
        }
        uint8_t *blob = (uint8_t *)w;
        for (int64_t b = 0; b < bytes / block_bytes; b++)  /* each block's 32 scales: 1/256 */
            for (int c = 0; c < LLMC_PANEL; c++)
                if (format == LLMC_FORMAT_MXFP4)
                    blob[b * block_bytes + c] = 127 - 8;
                else
                    memcpy(blob + b * block_bytes + 2 * c, &(uint16_t){0x1c00}, 2);
        for (int64_t i = 0; i < m * k; i++)
            x[i] = (float)((i * 7919) % 255) / 127.0f - 1.0f;
        llmc_qact a;
        llmc_qact_init(&a, scratch, m, k, block);
        llmc_quantize_rows(&a, x, 0, m);
        for (int r = 0; r < reps; r++)
            for (int vnni = 0; vnni <= llmc_vnni(); vnni++) {
                const double t0 = now();
                QUANT_PANELS_BY[vnni ? TILE_VNNI_FEW : TILE_AVX2][format_index(format)][0](&a, blob, y, n, 0, panels);
                const double took = now() - t0;
                seconds[vnni] = seconds[vnni] < 0 || took < seconds[vnni] ? took : seconds[vnni];
            }
        status = 0;
    }
    free(w), free(x), free(y), free(scratch);
    return status;
#else
    (void)format, (void)m, (void)k, (void)n, (void)reps;
    return -1;
#endif
}

/* llmc_probe_quant for the 16-bit formats (bf16 or fp16): seconds[0] the AVX2 tile's, seconds[1]
 * the AVX-512 one's (-1 where the CPU lacks it). The weight's values are normal numbers (no
 * subnormal, which some CPUs take slow paths for). */
LLMC_EXPORT int llmc_probe_16bit(int bf16, int64_t m, int64_t k, int64_t n, int reps, double seconds[2]) {
    seconds[0] = seconds[1] = -1;
#if HAVE_AVX2_PATH
    if (m < 1 || k < 1 || n < 1 || reps < 1 || !llmc_avx2())
        return -1;
    const int64_t panels = (n + LLMC_PANEL - 1) / LLMC_PANEL, count = panels * k * LLMC_PANEL;
    uint16_t *w = malloc((size_t)count * sizeof(uint16_t));
    float *x = malloc((size_t)(m * k) * sizeof(float)), *y = malloc((size_t)(m * n) * sizeof(float));
    int status = -1;
    if (w && x && y) {
        uint32_t state = 2463534242u;
        /* sign and mantissa random, the exponent 2^-7 */
        const uint16_t keep = bf16 ? 0x807f : 0x83ff, exponent = bf16 ? 0x78 << 7 : 0x08 << 10;
        for (int64_t i = 0; i < count; i++) {
            state ^= state << 13, state ^= state >> 17, state ^= state << 5;
            w[i] = (uint16_t)((state & keep) | exponent);
        }
        for (int64_t i = 0; i < m * k; i++)
            x[i] = (float)((i * 7919) % 255) / 127.0f - 1.0f;
        for (int r = 0; r < reps; r++)
            for (int wide = 0; wide <= llmc_avx512(); wide++) {
                const double t0 = now();
                if (wide)
                    (bf16 ? bf16_panels512 : fp16_panels512)(x, w, y, m, k, n, 0, panels);
                else
                    (bf16 ? bf16_panels : fp16_panels)(x, w, y, m, k, n, 0, panels);
                const double took = now() - t0;
                seconds[wide] = seconds[wide] < 0 || took < seconds[wide] ? took : seconds[wide];
            }
        status = 0;
    }
    free(w), free(x), free(y);
    return status;
#else
    (void)bf16, (void)m, (void)k, (void)n, (void)reps;
    return -1;
#endif
}

void llmc_linear_quant(const llmc_qact *a, const uint8_t *w, float *y, int64_t n, int format, int zero_points,
                       int64_t p0, int64_t p1) {
#if HAVE_AVX2_PATH
    const int vnni = takes_vnni(format, a->m);
    if (vnni || llmc_avx2()) {
        const int tile = !vnni ? TILE_AVX2 : a->m <= FEW_ROWS ? TILE_VNNI_FEW : TILE_VNNI;
        QUANT_PANELS_BY[tile][format_index(format)][zero_points != 0](a, w, y, n, p0, p1);
        return;
    }
#endif
    float tail[LLMC_PANEL];
    const int64_t bytes = (a->k / a->block) * llmc_quant_block_bytes(format, a->block, zero_points);
    for (int64_t p = p0; p < p1; p++) {
        int64_t col = p * LLMC_PANEL, width = n - col < LLMC_PANEL ? n - col : LLMC_PANEL;
        for (int64_t r = 0; r < a->m; r++) {
            quant_panel_plain(a, w + p * bytes, tail, LLMC_PANEL, r, 1, format, zero_points);
            memcpy(y + r * n + col, tail, (size_t)width * sizeof(float));
        }
    }
}

void llmc_linear_16bit(const float *x, const uint16_t *w, float *y, int64_t m, int64_t k, int64_t n, int bf16,
                       int64_t p0, int64_t p1) {
#if HAVE_AVX2_PATH
    if (llmc_avx2()) {
        if (wide_16bit[bf16 != 0] == 1 && llmc_avx512())
            (bf16 ? bf16_panels512 : fp16_panels512)(x, w, y, m, k, n, p0, p1);
        else
            (bf16 ? bf16_panels : fp16_panels)(x, w, y, m, k, n, p0, p1);
        return;
    }
#endif
    float tail[LLMC_PANEL];
    for (int64_t p = p0; p < p1; p++) {
        int64_t col = p * LLMC_PANEL, width = n - col < LLMC_PANEL ? n - col : LLMC_PANEL;
        for (int64_t r = 0; r < m; r++) {
            half_panel_plain(x + r * k, w + p * k * LLMC_PANEL, tail, LLMC_PANEL, k, 1, bf16);
            memcpy(y + r * n + col, tail, (size_t)width * sizeof(float));
        }
    }
}

int llmc_quant_fast_path(void) { return llmc_avx2(); }
