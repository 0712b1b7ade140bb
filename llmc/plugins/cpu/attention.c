#define _GNU_SOURCE /* sysconf(_SC_NPROCESSORS_ONLN) under -std=c11 */
/* See kernels.h. Written for the compiler's vectorizer: the inner loops run over head_dim or a
 * block's keys with `omp simd` (built with -fopenmp-simd, no OpenMP runtime), and each function
 * is cloned for AVX-512, AVX2 and baseline x86-64 so one build runs on any x86 CPU. */
#include "kernels.h"
#include "simd.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define LLMC_X86 1
#endif

/* -- 16-bit and int8 pools (kernels.h, kv_type) ------------------------------------------------
 * The conversions are integer arithmetic, bit for bit numpy's astype(float16) and ml_dtypes'
 * bfloat16 (round to nearest even), whatever the CPU. */
static inline uint32_t float_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float bits_float(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t half_of(float x) {
    uint32_t u = float_bits(x), sign = (u >> 16) & 0x8000, a = u & 0x7fffffff;
    if (a > 0x7f800000)
        return (uint16_t)(sign | 0x7e00);  /* NaN */
    if (a >= 0x477ff000)
        return (uint16_t)(sign | 0x7c00);  /* 65520 and above round to infinity */
    if (a >= 0x38800000) {                 /* a normal half, 2^-14 and above: rebias, round */
        uint32_t r = a - 0x38000000;
        return (uint16_t)(sign | ((r + 0xfff + ((r >> 13) & 1)) >> 13));
    }
    if (a <= 0x33000000)  /* 2^-25 and below round to zero (2^-25 itself ties to the even 0) */
        return (uint16_t)sign;
    uint32_t shift = 126 - (a >> 23), m = (a & 0x7fffff) | 0x800000;  /* a subnormal half: m >> shift */
    uint32_t q = m >> shift, rest = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    q += rest > half || (rest == half && (q & 1));
    return (uint16_t)(sign | q);
}

static inline float float_of_half(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, em = h & 0x7fff;
    if (em >= 0x7c00)  /* infinity, NaN */
        return bits_float(sign | 0x7f800000 | (em & 0x3ff) << 13);
    if (em >= 0x400)
        return bits_float(sign | ((em << 13) + 0x38000000));
    float f = (float)em * 0x1p-24f;  /* subnormal (or zero): exact */
    return sign ? -f : f;
}

static inline uint16_t bf16_of(float x) {
    uint32_t u = float_bits(x);
    if ((u & 0x7fffffff) > 0x7f800000)
        return (uint16_t)((u >> 16) | 0x40);  /* NaN stays NaN */
    return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

int64_t llmc_attention_tile_bytes(const llmc_attention *a) {
    int64_t n = a->block_size * a->head_dim;
    switch (a->kv_type) {
    case LLMC_KV_FP16:
    case LLMC_KV_BF16:
        return 2 * n;
    case LLMC_KV_INT8:
        return n + (int64_t)sizeof(float) * a->block_size;
    default:
        return (int64_t)sizeof(float) * n;
    }
}

#ifdef LLMC_X86
/* half_of over 8 values at a time: F16C's conversion rounds to nearest even as half_of does. It
 * runs on every step's serial path (each new token's K and V). */
__attribute__((target("avx,f16c"))) static void halves_f16c(const float *restrict x, uint16_t *restrict h,
                                                            int64_t d) {
    int64_t i = 0;
    for (; i + 8 <= d; i += 8)
        _mm_storeu_si128((__m128i *)(h + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < d; i++)
        h[i] = half_of(x[i]);
}
#endif

/* Stores a token's d values x into its tile, at element i * stride + offset for value i, as the
 * pool's type holds them (an int8 tile's scale goes to scales[slot]). */
static void store_token(int type, const float *restrict x, char *tile, int64_t d, int64_t stride, int64_t offset,
                        int64_t bs, int64_t slot) {
    if (type == LLMC_KV_FP16 || type == LLMC_KV_BF16) {
        uint16_t *t = (uint16_t *)tile + offset;
#ifdef LLMC_X86
        if (type == LLMC_KV_FP16 && llmc_avx2()) {
            uint16_t h[LLMC_MAX_HEAD_DIM];
            halves_f16c(x, h, d);
            for (int64_t i = 0; i < d; i++)
                t[i * stride] = h[i];
            return;
        }
#endif
        for (int64_t i = 0; i < d; i++)
            t[i * stride] = type == LLMC_KV_FP16 ? half_of(x[i]) : bf16_of(x[i]);
        return;
    }
    float amax = 0.0f;
    for (int64_t i = 0; i < d; i++)
        amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    float scale = amax / 127.0f;
    int8_t *t = (int8_t *)tile + offset;
    for (int64_t i = 0; i < d; i++) {
        float r = scale > 0.0f ? nearbyintf(x[i] / scale) : 0.0f;  /* round half to even */
        t[i * stride] = (int8_t)(r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r));
    }
    memcpy(tile + bs * d + slot * (int64_t)sizeof(float), &scale, sizeof scale);
}

/* dst[0, n) = a tile's first n elements as floats (int8: the integers; their scales are applied
 * by the caller). Each 64 bytes read prefetches the same line of the tile `next` (next_bytes
 * long: the rest of it at the end), as the fp32 path's loads do. */
static void widen_generic(int type, const void *src, float *restrict dst, int64_t n, const char *next,
                          int64_t next_bytes) {
    for (int64_t i = 0; i < next_bytes; i += 64)
        PREFETCH(next + i);
    if (type == LLMC_KV_INT8) {
        const int8_t *q = src;
        for (int64_t i = 0; i < n; i++)
            dst[i] = (float)q[i];
    } else if (type == LLMC_KV_FP16) {
        const uint16_t *h = src;
        for (int64_t i = 0; i < n; i++)
            dst[i] = float_of_half(h[i]);
    } else {
        const uint16_t *h = src;
        for (int64_t i = 0; i < n; i++)
            dst[i] = bits_float((uint32_t)h[i] << 16);
    }
}

#ifdef LLMC_X86
/* The same with AVX2 and F16C: 8 elements a conversion instruction. */
__attribute__((target("avx2,f16c"))) static void widen_avx2(int type, const void *src, float *restrict dst,
                                                            int64_t n, const char *next, int64_t next_bytes) {
    int64_t fetched = 0;
    if (type == LLMC_KV_INT8) {
        const int8_t *q = src;
        int64_t whole = n / 64 * 64;
        for (int64_t i = 0; i < whole; i += 64, fetched += 64) {
            PREFETCH(next + fetched);
            for (int c = 0; c < 64; c += 8)
                _mm256_storeu_ps(dst + i + c, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                                  _mm_loadl_epi64((const __m128i *)(q + i + c)))));
        }
        for (int64_t i = whole; i < n; i++)
            dst[i] = (float)q[i];
    } else {
        const uint16_t *h = src;
        int64_t whole = n / 32 * 32;
        for (int64_t i = 0; i < whole; i += 32, fetched += 64) {
            PREFETCH(next + fetched);
            for (int c = 0; c < 32; c += 8) {
                __m128i x = _mm_loadu_si128((const __m128i *)(h + i + c));
                _mm256_storeu_ps(dst + i + c, type == LLMC_KV_FP16 ? _mm256_cvtph_ps(x)
                                                                   : _mm256_castsi256_ps(_mm256_slli_epi32(
                                                                         _mm256_cvtepu16_epi32(x), 16)));
            }
        }
        for (int64_t i = whole; i < n; i++)
            dst[i] = type == LLMC_KV_FP16 ? float_of_half(h[i]) : bits_float((uint32_t)h[i] << 16);
    }
    for (; fetched < next_bytes; fetched += 64)
        PREFETCH(next + fetched);
}

static int widen_fast; /* the CPU has AVX2 and F16C */
__attribute__((constructor)) static void detect_widen(void) {
    __builtin_cpu_init();
    widen_fast = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
}
#endif

static inline void widen(int type, const void *src, float *restrict dst, int64_t n, const char *next,
                         int64_t next_bytes) {
#ifdef LLMC_X86
    if (widen_fast) {
        widen_avx2(type, src, dst, n, next, next_bytes);
        return;
    }
#endif
    widen_generic(type, src, dst, n, next, next_bytes);
}

const char *llmc_attention_check(const llmc_attention *a) {
    for (int64_t b = 0; b < a->batch; b++) {
        int64_t past = a->past_lens[b], qlen = a->query_lens[b];
        if (past < 0 || qlen < 0 || qlen > a->seq)
            return "past_lens/query_lens out of range for the step";
        if (qlen == 0)
            continue;
        if (a->positions != NULL)
            for (int64_t j = 0; j < qlen; j++)
                if (a->positions[b * a->seq + j] < 0 || a->positions[b * a->seq + j] >= a->rotary_rows)
                    return "position_ids outside the rotary tables (the engine's max context)";
        int64_t last = past + qlen - 1;
        if (last / a->block_size >= a->max_blocks)
            return "block_tables has fewer columns than a row's tokens need";
        for (int64_t t = 0; t <= last / a->block_size; t++) {
            int32_t blk = a->block_tables[b * a->max_blocks + t];
            if (blk < 0 || blk >= a->num_blocks)
                return "block_tables names a block outside the KV pool";
        }
    }
    return NULL;
}

/* dst = x, RMS-normalized with `norm` when it is set (QK-norm), rotated by the token's angles. */
static inline void rotate(const llmc_attention *a, const float *x, const float *norm, float *dst, int64_t b,
                          int64_t j) {
    int64_t d = a->head_dim, rot = a->rotary_dim, half = rot / 2;
    if (norm != NULL) {
        float squares = 0.0f;
        for (int64_t i = 0; i < d; i++)
            squares += x[i] * x[i];
        float rms = sqrtf(squares / (float)d + a->norm_eps);
        for (int64_t i = 0; i < d; i++)
            dst[i] = x[i] / rms * norm[i];
    } else {
        memcpy(dst, x, (size_t)d * sizeof(float));
    }
    if (rot == 0)
        return;
    int64_t at = a->positions ? a->positions[b * a->seq + j] * half : b * a->cos_batch_stride + j * half;
    const float *c = a->cos + at, *s = a->sin + at;
    if (a->interleaved) {
        for (int64_t i = 0; i < half; i++) {
            float x0 = dst[2 * i], x1 = dst[2 * i + 1];
            dst[2 * i] = x0 * c[i] - x1 * s[i];
            dst[2 * i + 1] = x1 * c[i] + x0 * s[i];
        }
    } else {
#pragma omp simd
        for (int64_t i = 0; i < half; i++) {
            float x0 = dst[i], x1 = dst[i + half];
            dst[i] = x0 * c[i] - x1 * s[i];
            dst[i + half] = x1 * c[i] + x0 * s[i];
        }
    }
}

/* llmc_attention_write for a 16-bit or int8 pool. */
LLMC_CLONES
static void write_converted(const llmc_attention *a) {
    int64_t d = a->head_dim, hkv = a->num_kv_heads, bs = a->block_size;
    int64_t tile_bytes = llmc_attention_tile_bytes(a), plane = a->num_blocks * hkv * tile_bytes;
    float key[LLMC_MAX_HEAD_DIM];
    for (int64_t b = 0; b < a->batch; b++) {
        for (int64_t j = 0; j < a->query_lens[b]; j++) {
            int64_t p = a->past_lens[b] + j, tok = b * a->seq + j, slot = p % bs;
            int64_t blk = a->block_tables[b * a->max_blocks + p / bs];
            const float *k = a->k + tok * a->kv_stride, *v = a->v + tok * a->kv_stride;
            for (int64_t h = 0; h < hkv; h++) {
                char *tile = (char *)a->cache + (blk * hkv + h) * tile_bytes;
                rotate(a, k + h * d, a->k_norm, key, b, j);
                store_token(a->kv_type, key, tile, d, bs, slot, bs, slot);           /* keys: [d, bs] */
                store_token(a->kv_type, v + h * d, tile + plane, d, 1, slot * d, bs, slot); /* values: [bs, d] */
            }
        }
    }
}

LLMC_CLONES
void llmc_attention_write(const llmc_attention *a) {
    if (a->kv_type != LLMC_KV_FP32) {
        write_converted(a);
        return;
    }
    int64_t d = a->head_dim, hkv = a->num_kv_heads, bs = a->block_size;
    int64_t plane = a->num_blocks * hkv * bs * d;
    float key[LLMC_MAX_HEAD_DIM];
    for (int64_t b = 0; b < a->batch; b++) {
        for (int64_t j = 0; j < a->query_lens[b]; j++) {
            int64_t p = a->past_lens[b] + j, tok = b * a->seq + j, slot = p % bs;
            int64_t blk = a->block_tables[b * a->max_blocks + p / bs];
            const float *k = a->k + tok * a->kv_stride, *v = a->v + tok * a->kv_stride;
            for (int64_t h = 0; h < hkv; h++) {
                float *tile = (float *)a->cache + (blk * hkv + h) * bs * d;
                rotate(a, k + h * d, a->k_norm, key, b, j);
                for (int64_t i = 0; i < d; i++)  /* keys are stored transposed: [d, bs] */
                    tile[i * bs + slot] = key[i];
                memcpy(tile + plane + slot * d, v + h * d, (size_t)d * sizeof(float));
            }
        }
    }
}

/* Tasks enough to keep the threads busy, with dynamic scheduling evening out rows of unequal length. */
#define LLMC_MIN_TASKS 8
/* Decode with few (row, KV head) pairs splits each row's keys into chunks of at least
 * LLMC_MIN_SPLIT_BLOCKS blocks, up to split_tasks() tasks in all (see llmc_attention_splits). */
#define LLMC_MIN_SPLIT_BLOCKS 2
#define LLMC_MAX_SPLITS 64
/* A task fetches its first blocks, up to this many bytes, as it starts, then a block ahead. */
#define LLMC_TASK_AHEAD_BYTES 65536

int64_t llmc_cpus(void) {
    static int64_t cpus = 0;
    if (cpus == 0) {
        long online = sysconf(_SC_NPROCESSORS_ONLN);
        cpus = online > 1 ? online : 1;
    }
    return cpus;
}

/* Three tasks per CPU: enough for dynamic scheduling to even them out, few enough that each is a
 * run of blocks long enough to stream (docs/attention_cpu.md, "Split decode"). */
static int64_t split_tasks(void) { return 3 * (llmc_cpus() > 1 ? llmc_cpus() : 2); }

/* A task is (row b, query heads [h0, h0 + heads), query tile, key chunk). A task takes all heads
 * when that leaves enough tasks: a block's KV heads lie side by side in the pool and a sequence's
 * blocks mostly follow each other, so the task reads one run of memory, not one head's tiles at a
 * stride (measured in docs/attention_cpu.md).
 * Otherwise heads that share a KV head go together, so each key and value is loaded (and a
 * converted pool widened) once for all of them; decode with fewer pairs still also splits keys. */
static int64_t heads_per_task(const llmc_attention *a) {
    int64_t per_head = a->batch * ((a->seq + a->rows_per_task - 1) / a->rows_per_task);
    if (per_head >= LLMC_MIN_TASKS)
        return a->num_heads;
    return per_head * a->num_kv_heads >= LLMC_MIN_TASKS || a->seq == 1 ? a->num_heads / a->num_kv_heads : 1;
}

/* The number of key chunks per row (flash-decoding's split-K): batch-1 decode has as few tasks
 * as KV heads, each a chain of dependent block reads from scattered blocks, so the threads sit
 * waiting on memory one block at a time. Chunks give the threads independent chains; each chunk
 * leaves its (max, sum, unnormalized output) in `partial`, and llmc_attention_combine merges them. */
int64_t llmc_attention_splits(const llmc_attention *a) {
    int64_t pairs = a->batch * a->num_kv_heads;
    if (a->seq != 1 || pairs >= split_tasks())
        return 1;
    int64_t longest = 0;  /* blocks, in the longest row's range of keys */
    for (int64_t b = 0; b < a->batch; b++) {
        if (a->query_lens[b] == 0)
            continue;
        int64_t last = a->past_lens[b], first = 0;
        if (a->sliding_window > 0 && last - a->sliding_window + 1 > 0)
            first = last - a->sliding_window + 1;
        int64_t blocks = last / a->block_size - first / a->block_size + 1;
        longest = blocks > longest ? blocks : longest;
    }
    int64_t splits = (split_tasks() + pairs - 1) / pairs, by_length = longest / LLMC_MIN_SPLIT_BLOCKS;
    splits = splits < by_length ? splits : by_length;
    splits = splits < LLMC_MAX_SPLITS ? splits : LLMC_MAX_SPLITS;
    return splits > 1 ? splits : 1;
}

int64_t llmc_attention_partial_floats(const llmc_attention *a) {
    return a->splits > 1 ? a->batch * a->num_heads * a->splits * (a->head_dim + 2) : 0;
}

int64_t llmc_attention_tasks(const llmc_attention *a) {
    int64_t tiles = (a->seq + a->rows_per_task - 1) / a->rows_per_task;
    return a->batch * (a->num_heads / heads_per_task(a)) * tiles * a->splits;
}

/* exp(sink - top) for a head's sink (-inf: none, weight 0) and the max `top` it is measured from. */
static inline float sink_weight(float sink, float top) { return sink == -INFINITY ? 0.0f : exp_f(sink - top); }

/* A (row, head)'s chunks, each [max, sum, output[d]] over its keys: the softmax over all of them
 * (and the head's sink). */
LLMC_CLONES
void llmc_attention_combine(const llmc_attention *a) {
    int64_t d = a->head_dim, S = a->splits, stride = d + 2;
    for (int64_t b = 0; b < a->batch; b++) {
        if (a->query_lens[b] == 0)  /* a padding row: its tasks wrote zeros */
            continue;
        for (int64_t h = 0; h < a->num_heads; h++) {
            const float *part = a->partial + (b * a->num_heads + h) * S * stride;
            float best = -INFINITY, total = 0.0f, weight[LLMC_MAX_SPLITS];
            for (int64_t c = 0; c < S; c++)
                best = part[c * stride] > best ? part[c * stride] : best;
            if (a->sinks != NULL && a->sinks[h] > best)
                best = a->sinks[h];
            for (int64_t c = 0; c < S; c++) {  /* a chunk that saw no key has max -inf: weight 0 */
                weight[c] = part[c * stride + 1] > 0.0f ? exp_f(part[c * stride] - best) : 0.0f;
                total += weight[c] * part[c * stride + 1];
            }
            if (a->sinks != NULL)
                total += sink_weight(a->sinks[h], best);
            float *restrict dst = a->out + b * a->num_heads * d + h * d;
            for (int64_t i = 0; i < d; i++)
                dst[i] = 0.0f;
            for (int64_t c = 0; c < S; c++) {
                const float *restrict acc = part + c * stride + 2;
                float w = weight[c] / total;
#pragma omp simd
                for (int64_t i = 0; i < d; i++)
                    dst[i] += w * acc[i];
            }
        }
    }
}

/* Scores of R rows against a 16-key tile kt [d, 16] (keys transposed): one key-vector load
 * feeds R FMA chains; with few rows each chain is split in P over head_dim so that enough
 * independent FMAs are in flight to hide their latency. Each load of kt prefetches the same line
 * of the tile `next`. */
static inline __attribute__((always_inline)) void scores16(const float *restrict q, const float *restrict kt,
                                                           float *restrict s, const int64_t d, const int R,
                                                           const int P, const float *next) {
    v16 acc[R][P];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < P; c++)
            acc[r][c] = (v16){0};
    for (int64_t i = 0; i < d; i += P)
        for (int c = 0; c < P; c++) {
            v16 k = VLOAD(kt + (i + c) * 16);
            PREFETCH(next + (i + c) * 16);
            for (int r = 0; r < R; r++)
                acc[r][c] += q[r * d + i + c] * k;
        }
    for (int r = 0; r < R; r++) {
        v16 sum = acc[r][0];
        for (int c = 1; c < P; c++)
            sum += acc[r][c];
        VSTORE(s + r * 16, sum);
    }
}

/* acc[R, d] += w[R, n] @ V[n, d] with the R accumulator rows held in registers over all n keys;
 * each value row read prefetches the same row of the tile `next`. */
static inline __attribute__((always_inline)) void weigh_values(float *restrict acc, const float *restrict w,
                                                               int64_t w_stride, const float *restrict vb,
                                                               int64_t row, int64_t n, const int64_t d, const int R,
                                                               const float *next) {
    const int64_t V = d / 16;
    v16 a[R][V];
    for (int r = 0; r < R; r++)
        for (int64_t v = 0; v < V; v++)
            a[r][v] = VLOAD(acc + r * d + v * 16);
    for (int64_t kk = 0; kk < n; kk++) {
        const float *val = vb + kk * row;
        for (int64_t v = 0; v < V; v++)
            PREFETCH(next + kk * row + v * 16);
        for (int r = 0; r < R; r++) {
            float wr = w[r * w_stride + kk];
            for (int64_t v = 0; v < V; v++)
                a[r][v] += wr * VLOAD(val + v * 16);
        }
    }
    for (int r = 0; r < R; r++)
        for (int64_t v = 0; v < V; v++)
            VSTORE(acc + r * d + v * 16, a[r][v]);
}

/* -- AVX2 without AVX-512: 16 ymm registers ---------------------------------------------------
 * scores16 and weigh_values hold their accumulators in v16 (one zmm each); built for AVX2 (the
 * x86-64-v3 clone) GCC lowers each v16 through the stack, a store and reload per FMA. task_avx2
 * runs the same loops over 8-float vectors with at most 12 accumulators, so they stay in the 16
 * ymm registers (docs/attention_cpu.md), and reads every pool type's tiles in place: each key or
 * value vector converted in registers as it is loaded (F16C for fp16, a shift for bf16, a sign
 * extension for int8), where widening a tile into a float copy first stored and reloaded every
 * element. Same products in the same order as the widened path, so the same results. Built for
 * AVX2 and not inlined into attend, whose other instances are built without it. The `next` tile
 * is prefetched a line per line read. */
typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4), may_alias));
#define V8LOAD(p) (*(const v8u *)(p))
#define V8STORE(p, v) (*(v8u *)(p) = (v))

#ifdef LLMC_X86
#define AVX2_TARGET __attribute__((target("avx2,fma,f16c")))

static inline __attribute__((always_inline)) int64_t element_bytes(const int type) {
    return type == LLMC_KV_FP32 ? 4 : type == LLMC_KV_INT8 ? 1 : 2;
}

/* 8 elements from element i of a tile of `type`, as floats (int8: the integers). */
static inline __attribute__((always_inline)) AVX2_TARGET v8 lanes8(const char *tile, int64_t i, const int type) {
    if (type == LLMC_KV_FP32)
        return V8LOAD((const float *)tile + i);
    if (type == LLMC_KV_INT8)
        return (v8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(tile + i))));
    __m128i h = _mm_loadu_si128((const __m128i *)(tile + 2 * i));
    if (type == LLMC_KV_FP16)
        return (v8)_mm256_cvtph_ps(h);
    return (v8)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline __attribute__((always_inline)) AVX2_TARGET void scores16_in_place(const float *restrict q,
                                                                               const char *restrict kt,
                                                                               float *restrict s, const int64_t d,
                                                                               const int R, const int P,
                                                                               const int type, const char *next) {
    const int64_t row_bytes = 16 * element_bytes(type);  /* a 16-key row of the tile */
    v8 acc[6][4][2];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < P; c++)
            acc[r][c][0] = acc[r][c][1] = (v8){0};
    for (int64_t i = 0; i < d; i += P)
        for (int c = 0; c < P; c++) {
            v8 k0 = lanes8(kt, (i + c) * 16, type), k1 = lanes8(kt, (i + c) * 16 + 8, type);
            if ((i + c) * row_bytes % 64 == 0)
                PREFETCH(next + (i + c) * row_bytes);
            for (int r = 0; r < R; r++) {
                float qv = q[r * d + i + c];
                acc[r][c][0] += qv * k0;
                acc[r][c][1] += qv * k1;
            }
        }
    for (int r = 0; r < R; r++) {
        v8 s0 = acc[r][0][0], s1 = acc[r][0][1];
        for (int c = 1; c < P; c++)
            s0 += acc[r][c][0], s1 += acc[r][c][1];
        V8STORE(s + r * 16, s0);
        V8STORE(s + r * 16 + 8, s1);
    }
}

static inline __attribute__((always_inline)) AVX2_TARGET void weigh_values_in_place(
    float *restrict acc, const float *restrict w, int64_t w_stride, const char *restrict vb, int64_t n,
    const int64_t d, const int R, const int C, const int type, const char *next) {
    const int64_t size = element_bytes(type);
    for (int64_t col = 0; col < d; col += 8 * C) {
        v8 a[3][8];
        for (int r = 0; r < R; r++)
            for (int v = 0; v < C; v++)
                a[r][v] = V8LOAD(acc + r * d + col + v * 8);
        for (int64_t kk = 0; kk < n; kk++) {
            for (int v = 0; v < C; v++)
                if ((col + v * 8) * size % 64 == 0)
                    PREFETCH(next + (kk * d + col + v * 8) * size);
            float wr[3];
            for (int r = 0; r < R; r++)
                wr[r] = w[r * w_stride + kk];
            for (int v = 0; v < C; v++) {
                v8 x = lanes8(vb, kk * d + col + v * 8, type);
                for (int r = 0; r < R; r++)
                    a[r][v] += wr[r] * x;
            }
        }
        for (int r = 0; r < R; r++)
            for (int v = 0; v < C; v++)
                V8STORE(acc + r * d + col + v * 8, a[r][v]);
    }
}

/* Rows in groups that fill the registers, for 16-key tiles and d a multiple of 16 up to 256. */
static inline __attribute__((always_inline)) AVX2_TARGET void score_rows_in_place(
    const float *restrict q, const char *restrict kt, float *restrict s, int64_t rows, const int64_t d,
    const int type, const char *next) {
    if (type == LLMC_KV_INT8)  /* the tile's scales, after its 16 * d values */
        PREFETCH(next + 16 * d);
    int64_t r = 0;
    for (; r + 6 <= rows; r += 6)
        scores16_in_place(q + r * d, kt, s + r * 16, d, 6, 1, type, next);
    if (rows - r >= 3)
        scores16_in_place(q + r * d, kt, s + r * 16, d, 3, 2, type, next), r += 3;
    if (rows - r == 2)
        scores16_in_place(q + r * d, kt, s + r * 16, d, 2, 2, type, next);
    else if (rows - r == 1)
        scores16_in_place(q + r * d, kt, s + r * 16, d, 1, 4, type, next);
}

static inline __attribute__((always_inline)) AVX2_TARGET void weigh_rows_in_place(
    float *restrict acc, const float *restrict w, const char *restrict vb, int64_t rows, int64_t n,
    const int64_t d, const int type, const char *next) {
    if (type == LLMC_KV_INT8)
        PREFETCH(next + 16 * d);
    int64_t r = 0;
    if (d % 32 == 0) {  /* 3 rows x 32 columns a pass */
        for (; r + 3 <= rows; r += 3)
            weigh_values_in_place(acc + r * d, w + r * 16, 16, vb, n, d, 3, 4, type, next);
        if (rows - r == 2)
            weigh_values_in_place(acc + r * d, w + r * 16, 16, vb, n, d, 2, 4, type, next);
        else if (rows - r == 1)
            weigh_values_in_place(acc + r * d, w + r * 16, 16, vb, n, d, 1, d % 64 == 0 ? 8 : 4, type, next);
    } else {            /* 3 rows x 16 columns */
        for (; r + 3 <= rows; r += 3)
            weigh_values_in_place(acc + r * d, w + r * 16, 16, vb, n, d, 3, 2, type, next);
        if (rows - r == 2)
            weigh_values_in_place(acc + r * d, w + r * 16, 16, vb, n, d, 2, 2, type, next);
        else if (rows - r == 1)
            weigh_values_in_place(acc + r * d, w + r * 16, 16, vb, n, d, 1, 2, type, next);
    }
}

/* The two per pool type, at a constant head_dim where it is a common one (the loops unroll). */
#define IN_PLACE_SHAPES(call, type)  \
    do {                             \
        if (d == 64)                 \
            call(64, type);          \
        else if (d == 128)           \
            call(128, type);         \
        else if (d == 256)           \
            call(256, type);         \
        else                         \
            call(d, type);           \
    } while (0)
#define IN_PLACE_TYPES(call)                                                                    \
    do {                                                                                        \
        if (type == LLMC_KV_FP32)                                                               \
            IN_PLACE_SHAPES(call, LLMC_KV_FP32);                                                \
        else if (type == LLMC_KV_FP16)                                                          \
            IN_PLACE_SHAPES(call, LLMC_KV_FP16);                                                \
        else if (type == LLMC_KV_BF16)                                                          \
            IN_PLACE_SHAPES(call, LLMC_KV_BF16);                                                \
        else                                                                                    \
            IN_PLACE_SHAPES(call, LLMC_KV_INT8);                                                \
    } while (0)

static inline AVX2_TARGET void score_in_place(int type, const float *q, const char *kt, float *s, int64_t rows, int64_t d,
                                       const char *next) {
#define SCORE(D, T) score_rows_in_place(q, kt, s, rows, D, T, next)
    IN_PLACE_TYPES(SCORE);
#undef SCORE
}

static inline AVX2_TARGET void weigh_in_place(int type, float *acc, const float *w, const char *vb, int64_t rows, int64_t n,
                                       int64_t d, const char *next) {
#define WEIGH(D, T) weigh_rows_in_place(acc, w, vb, rows, n, D, T, next)
    IN_PLACE_TYPES(WEIGH);
#undef WEIGH
}
#endif

/* A (block, KV head)'s key tile and value tile, one plane apart, fetched ahead of use: a row's
 * blocks lie anywhere in the pool, so no hardware prefetcher can guess the next one. */
static inline void prefetch_tiles(const void *key_tile, int64_t plane_bytes, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) {
        PREFETCH((const char *)key_tile + i);
        PREFETCH((const char *)key_tile + plane_bytes + i);
    }
}

/* Scores s[rows, bs] of the rows q[rows, d] against one key tile kt (transposed, [d, bs]); the
 * 16-key fast path prefetches the tile `next` a line per line it reads. */
static inline __attribute__((always_inline)) void score_rows(const float *restrict q, const float *restrict kt,
                                                             float *restrict s, int64_t rows, const int64_t d,
                                                             const int64_t bs, const float *next) {
    int64_t r = 0;
    if (bs == 16 && d % 4 == 0) {
        for (; r + 8 <= rows; r += 8)
            scores16(q + r * d, kt, s + r * bs, d, 8, 1, next);
        if (rows - r >= 4)
            scores16(q + r * d, kt, s + r * bs, d, 4, 2, next), r += 4;
        if (rows - r == 3)  /* a decode task's GQA group of 3 heads */
            scores16(q + r * d, kt, s + r * bs, d, 3, 4, next), r += 3;
        for (; r < rows; r++)
            scores16(q + r * d, kt, s + r * bs, d, 1, 4, next);
    }
    for (; r < rows; r++) {
        const float *restrict qr = q + r * d;
        float *restrict sr = s + r * bs;
        for (int64_t kk = 0; kk < bs; kk++)
            sr[kk] = 0.0f;
        for (int64_t i = 0; i < d; i++) {
            float qi = qr[i];
#pragma omp simd
            for (int64_t kk = 0; kk < bs; kk++)
                sr[kk] += qi * kt[i * bs + kk];
        }
    }
}

/* acc[rows, d] += w[rows, :n] @ vb[n, d] for one value tile vb; the fast path prefetches `next`. */
static inline __attribute__((always_inline)) void weigh_rows(float *restrict acc, const float *restrict w,
                                                             const float *restrict vb, int64_t rows, int64_t n,
                                                             const int64_t d, const int64_t bs, const float *next) {
    int64_t r = 0;
    if (d == 256) {  /* a row of 256 is 16 accumulator registers: one row a pass */
        for (; r < rows; r++)
            weigh_values(acc + r * d, w + r * bs, bs, vb, d, n, d, 1, next);
    } else if (d % 16 == 0 && d <= 128) {  /* up to 4 rows of 64 or 2 of 128: <= 16 accumulator registers */
        for (; r + (d <= 64 ? 4 : 2) <= rows; r += d <= 64 ? 4 : 2)
            weigh_values(acc + r * d, w + r * bs, bs, vb, d, n, d, d <= 64 ? 4 : 2, next);
        if (rows - r == 3)  /* a decode task's GQA group of 3 heads */
            weigh_values(acc + r * d, w + r * bs, bs, vb, d, n, d, 3, next), r += 3;
        else if (rows - r == 2)
            weigh_values(acc + r * d, w + r * bs, bs, vb, d, n, d, 2, next), r += 2;
        for (; r < rows; r++)
            weigh_values(acc + r * d, w + r * bs, bs, vb, d, n, d, 1, next);
    }
    for (; r < rows; r++) {
        float *restrict ar = acc + r * d;
        for (int64_t kk = 0; kk < n; kk++) {
            const float *restrict val = vb + kk * d;
            float wk = w[r * bs + kk];
#pragma omp simd
            for (int64_t i = 0; i < d; i++)
                ar[i] += wk * val[i];
        }
    }
}

/* The max and the sum of a 16-key row s[0, 16), in registers: a reduction the compiler vectorizes
 * goes through a stack copy reloaded a float at a time (a store-forwarding stall per row and
 * block). Pointers in, not vectors: a vector argument's ABI differs between the clones. */
typedef int32_t v8i __attribute__((vector_size(32)));
#define MAX8(x, y) ((v8)(((v8i)(x) & ((x) > (y))) | ((v8i)(y) & ~((x) > (y)))))
#define SWAP8(x, a, b, c, d, e, f, g, h) __builtin_shufflevector(x, x, a, b, c, d, e, f, g, h)

static inline __attribute__((always_inline)) float max16(const float *s) {
    v8 x = V8LOAD(s), y = V8LOAD(s + 8);
    x = MAX8(x, y);
    y = SWAP8(x, 4, 5, 6, 7, 0, 1, 2, 3);
    x = MAX8(x, y);
    y = SWAP8(x, 2, 3, 0, 1, 6, 7, 4, 5);
    x = MAX8(x, y);
    y = SWAP8(x, 1, 0, 3, 2, 5, 4, 7, 6);
    x = MAX8(x, y);
    return x[0];
}

static inline __attribute__((always_inline)) float sum16(const float *s) {
    v8 x = V8LOAD(s) + V8LOAD(s + 8);
    x += SWAP8(x, 4, 5, 6, 7, 0, 1, 2, 3);
    x += SWAP8(x, 2, 3, 0, 1, 6, 7, 4, 5);
    x += SWAP8(x, 1, 0, 3, 2, 5, 4, 7, 6);
    return x[0];
}

/* The online softmax over one block for every row: s[r, :n] (the block's scores) become the
 * row's weights, and its running max m, sum l and accumulator acc are rescaled to match. */
static inline __attribute__((always_inline)) void softmax_block(const llmc_attention *a, float *restrict s,
                                                                float *restrict m, float *restrict l,
                                                                float *restrict acc, int64_t rows, int64_t nq,
                                                                int64_t first_pos, int64_t t0, int64_t n,
                                                                const int64_t d, const int64_t bs) {
    for (int64_t r = 0; r < rows; r++) {
        int64_t p = first_pos + r % nq, t = p - t0;  /* the row's own position in the block */
        int64_t lo = a->sliding_window > 0 ? p - a->sliding_window + 1 - t0 : 0;
        int64_t k0 = lo > 0 ? lo : 0, k1 = t + 1 < n ? t + 1 : n;
        float *restrict sr = s + r * bs;
        if (k1 <= k0) {
            for (int64_t kk = 0; kk < n; kk++)
                sr[kk] = 0.0f;
            continue;
        }
        /* A whole block without softcap: its max and sum in two vectors (max16, sum16). */
        const int whole = bs == 16 && k0 == 0 && k1 == 16 && a->softcap <= 0.0f;
        float best = m[r];
        if (whole) {
            float top = max16(sr);
            best = top > best ? top : best;
        } else {
            for (int64_t kk = k0; kk < k1; kk++) {
                if (a->softcap > 0.0f)
                    sr[kk] = a->softcap * tanhf(sr[kk] / a->softcap);
                best = sr[kk] > best ? sr[kk] : best;
            }
        }
        float correction = exp_f(m[r] - best), sum = 0.0f;
        m[r] = best;
        if (whole) {
#pragma omp simd
            for (int64_t kk = 0; kk < 16; kk++)
                sr[kk] = exp_f(sr[kk] - best);
            sum = sum16(sr);
        } else {
#pragma omp simd reduction(+ : sum)
            for (int64_t kk = 0; kk < n; kk++) {
                float w = (kk >= k0 && kk < k1) ? exp_f(sr[kk] - best) : 0.0f;
                sr[kk] = w;
                sum += w;
            }
        }
        l[r] = l[r] * correction + sum;
        float *restrict ar = acc + r * d;
#pragma omp simd
        for (int64_t i = 0; i < d; i++)
            ar[i] *= correction;
    }
}

/* s[r, kk] *= scale[kk] for rows [0, rows): an int8 tile's per-token scales (unaligned in the
 * pool for some shapes, so copied first) applied to its key scores or folded into the weights
 * of its values. */
static inline __attribute__((always_inline)) void scale_columns(float *restrict s, int64_t rows, const int64_t bs,
                                                                const char *scales, float *restrict buf) {
    memcpy(buf, scales, (size_t)bs * sizeof(float));
    for (int64_t r = 0; r < rows; r++)
#pragma omp simd
        for (int64_t kk = 0; kk < bs; kk++)
            s[r * bs + kk] *= buf[kk];
}

/* The body, inlined per (head_dim, block_size) so loops over them have constant trip counts;
 * `converted`: the pool is 16-bit or int8 (a->kv_type), each tile read is widened first. */
static inline __attribute__((always_inline)) void attend(const llmc_attention *a, int64_t task, const int64_t d,
                                                         const int64_t bs, const int converted, const int avx2) {
    int64_t hkv = a->num_kv_heads, nh = heads_per_task(a), S = a->splits;
    int64_t tiles = (a->seq + a->rows_per_task - 1) / a->rows_per_task;
    int64_t per_row = (a->num_heads / nh) * tiles * S;
    int64_t b = task / per_row, chunk = task % S, rest = task % per_row / S;
    int64_t h0 = rest / tiles * nh, tile = rest % tiles;
    int64_t group = a->num_heads / hkv, kvh = h0 / group;  /* the task's first KV head */
    int64_t kv_count = nh >= group ? nh / group : 1;        /* and how many it reads */
    int64_t j0 = tile * a->rows_per_task, j1 = j0 + a->rows_per_task;
    int64_t out_stride = a->num_heads * d;
    if (j1 > a->seq)
        j1 = a->seq;
    int64_t valid_end = a->query_lens[b] < j1 ? a->query_lens[b] : j1;
    for (int64_t j = (valid_end > j0 ? valid_end : j0); j < j1; j++)  /* padding rows: zeros */
        memset(a->out + (b * a->seq + j) * out_stride + h0 * d, 0, (size_t)(nh * d) * sizeof(float));
    int64_t nq = valid_end - j0, rows = nh * nq;  /* row r = (head h0 + r / nq, query j0 + r % nq) */
    int64_t kv_rows = rows / kv_count;  /* rows [g * kv_rows, (g + 1) * kv_rows) read KV head kvh + g */
    if (nq <= 0)
        return;
    /* task_avx2 reads 16-key tiles in place (score_in_place, weigh_in_place); the rest the
     * portable loops, a converted pool's tiles widened first. */
#ifdef LLMC_X86
    const int in_place = avx2 && bs == 16 && d % 16 == 0 && d <= 256;
#else
    const int in_place = 0;
#endif

    /* A converted pool's tasks also need a float tile (64-byte aligned) and a tile's scales.
     * Decode's few rows fit on the stack: no allocator call per task. */
    int64_t extra = converted ? bs * d + bs + 16 : 0;
    size_t bytes = (size_t)(rows * (2 * d + 2 + bs) + extra) * sizeof(float);
    _Alignas(64) float local[4096];
    float *scratch = bytes <= sizeof local ? local : malloc(bytes);
    if (scratch == NULL) {  /* reported by the caller once every task has run */
        *a->out_of_memory = 1;
        return;
    }
    float *restrict q = scratch, *restrict acc = q + rows * d, *restrict m = acc + rows * d;
    float *restrict l = m + rows, *restrict s = l + rows;
    int64_t past = a->past_lens[b];
    for (int64_t r = 0; r < rows; r++) {
        int64_t j = j0 + r % nq;
        rotate(a, a->q + (b * a->seq + j) * a->q_stride + (h0 + r / nq) * d, a->q_norm, q + r * d, b, j);
        for (int64_t i = 0; i < d; i++) {
            q[r * d + i] *= a->scale;
            acc[r * d + i] = 0.0f;
        }
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    int64_t first = 0, last = past + valid_end - 1;
    if (a->sliding_window > 0 && past + j0 - a->sliding_window + 1 > 0)
        first = past + j0 - a->sliding_window + 1;
    if (S > 1) {  /* this chunk's share of the row's blocks; the first keeps `first`'s offset */
        int64_t b0 = first / bs, blocks = last / bs - b0 + 1;
        int64_t c0 = b0 + chunk * blocks / S, c1 = b0 + (chunk + 1) * blocks / S;
        first = c0 == b0 ? first : c0 * bs;
        last = c1 * bs - 1 < last ? c1 * bs - 1 : last;
    }
    const int32_t *table = a->block_tables + b * a->max_blocks;

    if (!converted) {
        int64_t plane = a->num_blocks * hkv * bs * d;
        /* The next block's tiles stream in while this one is used. The fast paths fetch them a
         * line per line they read, spread over the block's arithmetic: fetching whole tiles at
         * once fills the core's miss buffers and stalls that arithmetic until they land
         * (docs/attention_cpu.md). Other shapes fetch at once. */
        int spread = bs == 16 && d % 16 == 0 && d <= 256;
        int64_t tile_floats = bs * d, run = kv_count * tile_floats;  /* the task's tiles of a block */
#define TILE(t) ((const float *)a->cache + ((int64_t)table[(t) / bs] * hkv + kvh) * tile_floats)
        int64_t run_bytes = run * (int64_t)sizeof(float), plane_bytes = plane * (int64_t)sizeof(float);
        int64_t start = first - first % bs, ahead = LLMC_TASK_AHEAD_BYTES / (2 * run_bytes);
        for (int64_t t = start; t <= last && t <= start + ahead * bs; t += bs)  /* as the converted path */
            prefetch_tiles(TILE(t), plane_bytes, run_bytes);
        for (int64_t t0 = start; t0 <= last; t0 += bs) {
            const float *kt = TILE(t0), *next = t0 + bs <= last ? TILE(t0 + bs) : kt;
            if (!spread && next != kt)
                prefetch_tiles(next, plane_bytes, run_bytes);
            int64_t n = last - t0 + 1 < bs ? last - t0 + 1 : bs;  /* keys any row of the tile sees */
            for (int64_t g = 0; g < kv_count; g++) {
#ifdef LLMC_X86
                if (in_place)
                    score_in_place(LLMC_KV_FP32, q + g * kv_rows * d, (const char *)(kt + g * tile_floats),
                                   s + g * kv_rows * bs, kv_rows, d, (const char *)(next + g * tile_floats));
                else
#endif
                    score_rows(q + g * kv_rows * d, kt + g * tile_floats, s + g * kv_rows * bs, kv_rows, d, bs,
                               next + g * tile_floats);
            }
            softmax_block(a, s, m, l, acc, rows, nq, past + j0, t0, n, d, bs);
            for (int64_t g = 0; g < kv_count; g++) {
#ifdef LLMC_X86
                if (in_place)
                    weigh_in_place(LLMC_KV_FP32, acc + g * kv_rows * d, s + g * kv_rows * bs,
                                   (const char *)(kt + plane + g * tile_floats), kv_rows, n, d,
                                   (const char *)(next + plane + g * tile_floats));
                else
#endif
                    weigh_rows(acc + g * kv_rows * d, s + g * kv_rows * bs, kt + plane + g * tile_floats, kv_rows,
                               n, d, bs, next + plane + g * tile_floats);
            }
        }
#undef TILE
    } else {
        /* Where the tiles are not read in place, each is widened into `wide` just before use (an
         * L1-resident copy), its next block's counterpart prefetched a line per line widened. */
        float *restrict wide = (float *)(((uintptr_t)(s + rows * bs) + 63) & ~(uintptr_t)63);
        float *restrict scales = wide + bs * d;
        int type = a->kv_type, int8 = type == LLMC_KV_INT8;
        int64_t tile_bytes = llmc_attention_tile_bytes(a), plane = a->num_blocks * hkv * tile_bytes;
        int64_t values = bs * d;  /* a tile's elements; int8 scales follow them */
#define TILE(t) ((const char *)a->cache + ((int64_t)table[(t) / bs] * hkv + kvh) * tile_bytes)
        /* The task's first blocks at once (a decode chunk: all of it), then the next block's
         * lines as each is read. A decode task has little arithmetic to hide one block's
         * latency behind, so it fetches wide first (docs/attention_cpu.md, "Split decode"). */
        int64_t start = first - first % bs, ahead = LLMC_TASK_AHEAD_BYTES / (2 * kv_count * tile_bytes);
        for (int64_t t = start; t <= last && t <= start + ahead * bs; t += bs)
            prefetch_tiles(TILE(t), plane, kv_count * tile_bytes);
        for (int64_t t0 = start; t0 <= last; t0 += bs) {
            const char *kt = TILE(t0), *next = t0 + bs <= last ? TILE(t0 + bs) : kt;
            int64_t n = last - t0 + 1 < bs ? last - t0 + 1 : bs;
            for (int64_t g = 0; g < kv_count; g++) {
                const char *keys = kt + g * tile_bytes;
                float *sg = s + g * kv_rows * bs;
#ifdef LLMC_X86
                if (in_place)
                    score_in_place(type, q + g * kv_rows * d, keys, sg, kv_rows, d, next + g * tile_bytes);
                else
#endif
                {
                    widen(type, keys, wide, values, next + g * tile_bytes, tile_bytes);
                    score_rows(q + g * kv_rows * d, wide, sg, kv_rows, d, bs, wide);
                }
                if (int8)  /* q . k = (q . k_int) * k_scale, per key column */
                    scale_columns(sg, kv_rows, bs, keys + values, scales);
            }
            softmax_block(a, s, m, l, acc, rows, nq, past + j0, t0, n, d, bs);
            for (int64_t g = 0; g < kv_count; g++) {
                const char *vals = kt + plane + g * tile_bytes;
                float *sg = s + g * kv_rows * bs;
                if (int8)  /* w . v = (w * v_scale) . v_int, per token */
                    scale_columns(sg, kv_rows, bs, vals + values, scales);
#ifdef LLMC_X86
                if (in_place)
                    weigh_in_place(type, acc + g * kv_rows * d, sg, vals, kv_rows, n, d,
                                   next + plane + g * tile_bytes);
                else
#endif
                {
                    widen(type, vals, wide, n * d, next + plane + g * tile_bytes, tile_bytes);
                    weigh_rows(acc + g * kv_rows * d, sg, wide, kv_rows, n, d, bs, wide);
                }
            }
        }
#undef TILE
    }
    for (int64_t r = 0; r < rows; r++) {
        if (S > 1) {  /* decode (nq = 1): row r is head h0 + r's share, combined later */
            float *part = a->partial + ((b * a->num_heads + h0 + r) * S + chunk) * (d + 2);
            part[0] = m[r];
            part[1] = l[r];
            memcpy(part + 2, acc + r * d, (size_t)d * sizeof(float));
            continue;
        }
        float *dst = a->out + (b * a->seq + j0 + r % nq) * out_stride + (h0 + r / nq) * d;
        float inv = 1.0f / l[r];
        if (a->sinks != NULL) {  /* the sink's exp(s - m) joins the sum; where it is above the max, all rescale */
            float sink = a->sinks[h0 + r / nq], top = sink > m[r] ? sink : m[r], kept = exp_f(m[r] - top);
            inv = kept / (l[r] * kept + sink_weight(sink, top));
        }
        for (int64_t i = 0; i < d; i++)
            dst[i] = acc[r * d + i] * inv;
    }
    if (scratch != local)
        free(scratch);
}

/* llmc_attention_task for a 16-bit or int8 pool. */
LLMC_CLONES
static void task_converted(const llmc_attention *a, int64_t task) {
    if (a->block_size == 16 && a->head_dim == 64)
        attend(a, task, 64, 16, 1, 0);
    else if (a->block_size == 16 && a->head_dim == 128)
        attend(a, task, 128, 16, 1, 0);
    else if (a->block_size == 16 && a->head_dim == 256)
        attend(a, task, 256, 16, 1, 0);
    else
        attend(a, task, a->head_dim, a->block_size, 1, 0);
}

LLMC_CLONES
static void task_vec(const llmc_attention *a, int64_t task) {
    if (a->kv_type != LLMC_KV_FP32) {
        task_converted(a, task);
        return;
    }
    /* The common shapes get loops the compiler fully unrolls and keeps in registers. */
    if (a->block_size == 16 && a->head_dim == 64)
        attend(a, task, 64, 16, 0, 0);
    else if (a->block_size == 16 && a->head_dim == 128)
        attend(a, task, 128, 16, 0, 0);
    else if (a->block_size == 16 && a->head_dim == 256)
        attend(a, task, 256, 16, 0, 0);
    else
        attend(a, task, a->head_dim, a->block_size, 0, 0);
}

#ifdef LLMC_X86
/* The AVX2 loops where the CPU has no AVX-512, and for a 16-bit or int8 pool everywhere: on an
 * AVX-512 host the avx512f clone of task_vec widens each converted tile into a copy first, slower
 * than converting in registers (docs/attention_cpu.md, "On an AVX-512 host"); for an fp32 pool
 * the two are even there, and the v16 loops stay. */
static int attention_avx2(const llmc_attention *a) {
    return llmc_avx2() && (a->kv_type != LLMC_KV_FP32 || !__builtin_cpu_supports("avx512f"));
}

/* task_vec with the in-place AVX2 loops where the shape has them, for every pool type. */
__attribute__((target("avx2,fma,f16c"))) static void task_avx2(const llmc_attention *a, int64_t task) {
    int converted = a->kv_type != LLMC_KV_FP32;
    if (a->block_size == 16 && a->head_dim == 64) {
        if (converted)
            attend(a, task, 64, 16, 1, 1);
        else
            attend(a, task, 64, 16, 0, 1);
    } else if (a->block_size == 16 && a->head_dim == 128) {
        if (converted)
            attend(a, task, 128, 16, 1, 1);
        else
            attend(a, task, 128, 16, 0, 1);
    } else if (a->block_size == 16 && a->head_dim == 256) {
        if (converted)
            attend(a, task, 256, 16, 1, 1);
        else
            attend(a, task, 256, 16, 0, 1);
    } else if (converted) {
        attend(a, task, a->head_dim, a->block_size, 1, 1);
    } else {
        attend(a, task, a->head_dim, a->block_size, 0, 1);
    }
}
#endif

void llmc_attention_task(const llmc_attention *a, int64_t task) {
#ifdef LLMC_X86
    if (attention_avx2(a)) {
        task_avx2(a, task);
        return;
    }
#endif
    task_vec(a, task);
}

LLMC_CLONES
void llmc_swiglu_rows(const float *x, float *out, int64_t width, int64_t row0, int64_t row1, int activation) {
    for (int64_t r = row0; r < row1; r++) {
        const float *gate = x + r * 2 * width, *up = gate + width;
        float *dst = out + r * width;
        if (activation == LLMC_ACT_GELU_TANH) {
            /* 0.5 g (1 + tanh(y)) = g sigmoid(2 y), y = sqrt(2 / pi) (g + 0.044715 g^3) */
#pragma omp simd
            for (int64_t i = 0; i < width; i++) {
                float g = gate[i], y2 = 1.5957691216057308f * (g + 0.044715f * g * g * g);
                dst[i] = g / (1.0f + exp_f(-y2)) * up[i];
            }
        } else {
#pragma omp simd
            for (int64_t i = 0; i < width; i++)
                dst[i] = gate[i] / (1.0f + exp_f(-gate[i])) * up[i];
        }
    }
}
