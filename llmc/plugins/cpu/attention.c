/* See kernels.h. Written for the compiler's vectorizer: the inner loops run over head_dim or a
 * block's keys with `omp simd` (built with -fopenmp-simd, no OpenMP runtime), and each function
 * is cloned for AVX-512, AVX2 and baseline x86-64 so one build runs on any x86 CPU. */
#include "kernels.h"
#include "simd.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* exp(x) for x <= 88: 2^n * e^y with |y| <= ln2/2 and a degree-7 Taylor polynomial (relative
 * error ~1e-8, under float rounding). Plain arithmetic, so loops calling it vectorize. */
static inline float exp_f(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    float n = nearbyintf(x * 1.44269504088896341f);
    float y = x - n * 0.693145751953125f - n * 1.42860682030941723e-6f;
    float p = 1.0f / 5040.0f;
    p = p * y + 1.0f / 720.0f;
    p = p * y + 1.0f / 120.0f;
    p = p * y + 1.0f / 24.0f;
    p = p * y + 1.0f / 6.0f;
    p = p * y + 0.5f;
    p = p * y + 1.0f;
    p = p * y + 1.0f;
    union { float f; int32_t i; } scale = {.i = ((int32_t)n + 127) << 23};
    return p * scale.f;
}

const char *llmc_attention_check(const llmc_attention *a) {
    for (int64_t b = 0; b < a->batch; b++) {
        int64_t past = a->past_lens[b], qlen = a->query_lens[b];
        if (past < 0 || qlen < 0 || qlen > a->seq)
            return "past_lens/query_lens out of range for the step";
        if (qlen == 0)
            continue;
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

/* dst = x rotated by the token's angles (or copied when there is no rotary embedding). */
static inline void rotate(const llmc_attention *a, const float *x, float *dst, int64_t b, int64_t j) {
    int64_t d = a->head_dim, rot = a->rotary_dim, half = rot / 2;
    memcpy(dst, x, (size_t)d * sizeof(float));
    if (rot == 0)
        return;
    const float *c = a->cos + b * a->cos_batch_stride + j * half;
    const float *s = a->sin + b * a->cos_batch_stride + j * half;
    if (a->interleaved) {
        for (int64_t i = 0; i < half; i++) {
            float x0 = x[2 * i], x1 = x[2 * i + 1];
            dst[2 * i] = x0 * c[i] - x1 * s[i];
            dst[2 * i + 1] = x1 * c[i] + x0 * s[i];
        }
    } else {
#pragma omp simd
        for (int64_t i = 0; i < half; i++) {
            dst[i] = x[i] * c[i] - x[i + half] * s[i];
            dst[i + half] = x[i + half] * c[i] + x[i] * s[i];
        }
    }
}

LLMC_CLONES
void llmc_attention_write(const llmc_attention *a) {
    int64_t d = a->head_dim, hkv = a->num_kv_heads, bs = a->block_size;
    int64_t plane = a->num_blocks * hkv * bs * d;
    float key[LLMC_MAX_HEAD_DIM];
    for (int64_t b = 0; b < a->batch; b++) {
        for (int64_t j = 0; j < a->query_lens[b]; j++) {
            int64_t p = a->past_lens[b] + j, tok = b * a->seq + j, slot = p % bs;
            int64_t blk = a->block_tables[b * a->max_blocks + p / bs];
            const float *k = a->k + tok * a->kv_stride, *v = a->v + tok * a->kv_stride;
            for (int64_t h = 0; h < hkv; h++) {
                float *tile = a->cache + (blk * hkv + h) * bs * d;
                rotate(a, k + h * d, key, b, j);
                for (int64_t i = 0; i < d; i++)  /* keys are stored transposed: [d, bs] */
                    tile[i * bs + slot] = key[i];
                memcpy(tile + plane + slot * d, v + h * d, (size_t)d * sizeof(float));
            }
        }
    }
}

/* Tasks enough to keep the threads busy, with dynamic scheduling evening out rows of unequal length. */
#define LLMC_MIN_TASKS 8

/* A task is (row b, query heads [h0, h0 + heads), query tile). A task takes all heads when that
 * leaves enough tasks: a block's KV heads lie side by side in the pool and a sequence's blocks
 * mostly follow each other, so the task reads one run of memory, not one head's tiles at a
 * stride (measured in docs/attention_cpu.md).
 * Otherwise heads that share a KV head go together, so each key and value is loaded once for
 * all of them; with fewer tasks still (batch-1 decode), each query head is a task of its own. */
static int64_t heads_per_task(const llmc_attention *a) {
    int64_t per_head = a->batch * ((a->seq + a->rows_per_task - 1) / a->rows_per_task);
    if (per_head >= LLMC_MIN_TASKS)
        return a->num_heads;
    return per_head * a->num_kv_heads >= LLMC_MIN_TASKS ? a->num_heads / a->num_kv_heads : 1;
}

int64_t llmc_attention_tasks(const llmc_attention *a) {
    int64_t tiles = (a->seq + a->rows_per_task - 1) / a->rows_per_task;
    return a->batch * (a->num_heads / heads_per_task(a)) * tiles;
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

/* A (block, KV head)'s key tile and value tile, one plane apart, fetched ahead of use: a row's
 * blocks lie anywhere in the pool, so no hardware prefetcher can guess the next one. */
static inline void prefetch_tiles(const float *key_tile, int64_t plane, int64_t floats) {
    for (int64_t i = 0; i < floats; i += 16) {
        PREFETCH(key_tile + i);
        PREFETCH(key_tile + plane + i);
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
    if (d % 16 == 0 && d <= 128) {  /* up to 4 rows of 64 or 2 of 128: <= 16 accumulator registers */
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

/* The body, inlined per (head_dim, block_size) so loops over them have constant trip counts. */
static inline __attribute__((always_inline)) void attend(const llmc_attention *a, int64_t task, const int64_t d,
                                                         const int64_t bs) {
    int64_t hkv = a->num_kv_heads, nh = heads_per_task(a);
    int64_t tiles = (a->seq + a->rows_per_task - 1) / a->rows_per_task;
    int64_t per_row = (a->num_heads / nh) * tiles;
    int64_t b = task / per_row, h0 = (task % per_row) / tiles * nh, tile = task % tiles;
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

    float *scratch = malloc((size_t)(rows * (2 * d + 2 + bs)) * sizeof(float));
    if (scratch == NULL) {  /* reported by the caller once every task has run */
        *a->out_of_memory = 1;
        return;
    }
    float *restrict q = scratch, *restrict acc = q + rows * d, *restrict m = acc + rows * d;
    float *restrict l = m + rows, *restrict s = l + rows;
    int64_t past = a->past_lens[b];
    for (int64_t r = 0; r < rows; r++) {
        int64_t j = j0 + r % nq;
        rotate(a, a->q + (b * a->seq + j) * a->q_stride + (h0 + r / nq) * d, q + r * d, b, j);
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
    int64_t plane = a->num_blocks * hkv * bs * d;
    const int32_t *table = a->block_tables + b * a->max_blocks;

    /* The next block's tiles stream in while this one is used. The fast paths fetch them a line
     * per line they read, spread over the block's arithmetic: fetching whole tiles at once fills
     * the core's miss buffers and stalls that arithmetic until they land (docs/attention_cpu.md).
     * Other shapes fetch at once. */
    int spread = bs == 16 && d % 16 == 0 && d <= 128;
    int64_t tile_floats = bs * d, run = kv_count * tile_floats;  /* the task's tiles of a block */
#define TILE(t) (a->cache + ((int64_t)table[(t) / bs] * hkv + kvh) * tile_floats)
    prefetch_tiles(TILE(first), plane, run);
    for (int64_t t0 = first - first % bs; t0 <= last; t0 += bs) {
        const float *kt = TILE(t0), *next = t0 + bs <= last ? TILE(t0 + bs) : kt;
        if (!spread && next != kt)
            prefetch_tiles(next, plane, run);
        int64_t n = last - t0 + 1 < bs ? last - t0 + 1 : bs;  /* keys any row of the tile sees */
        for (int64_t g = 0; g < kv_count; g++)
            score_rows(q + g * kv_rows * d, kt + g * tile_floats, s + g * kv_rows * bs, kv_rows, d, bs,
                       next + g * tile_floats);
        for (int64_t r = 0; r < rows; r++) {
            int64_t p = past + j0 + r % nq, t = p - t0;  /* the row's own position in the block */
            int64_t lo = a->sliding_window > 0 ? p - a->sliding_window + 1 - t0 : 0;
            int64_t k0 = lo > 0 ? lo : 0, k1 = t + 1 < n ? t + 1 : n;
            float *restrict sr = s + r * bs;
            if (k1 <= k0) {
                for (int64_t kk = 0; kk < n; kk++)
                    sr[kk] = 0.0f;
                continue;
            }
            float best = m[r];
            for (int64_t kk = k0; kk < k1; kk++) {
                if (a->softcap > 0.0f)
                    sr[kk] = a->softcap * tanhf(sr[kk] / a->softcap);
                best = sr[kk] > best ? sr[kk] : best;
            }
            float correction = exp_f(m[r] - best), sum = 0.0f;
            m[r] = best;
#pragma omp simd reduction(+ : sum)
            for (int64_t kk = 0; kk < n; kk++) {
                float w = (kk >= k0 && kk < k1) ? exp_f(sr[kk] - best) : 0.0f;
                sr[kk] = w;
                sum += w;
            }
            l[r] = l[r] * correction + sum;
            float *restrict ar = acc + r * d;
#pragma omp simd
            for (int64_t i = 0; i < d; i++)
                ar[i] *= correction;
        }
        for (int64_t g = 0; g < kv_count; g++)
            weigh_rows(acc + g * kv_rows * d, s + g * kv_rows * bs, kt + plane + g * tile_floats, kv_rows, n, d,
                       bs, next + plane + g * tile_floats);
    }
#undef TILE
    for (int64_t r = 0; r < rows; r++) {
        float *dst = a->out + (b * a->seq + j0 + r % nq) * out_stride + (h0 + r / nq) * d;
        float inv = 1.0f / l[r];
        for (int64_t i = 0; i < d; i++)
            dst[i] = acc[r * d + i] * inv;
    }
    free(scratch);
}

LLMC_CLONES
void llmc_attention_task(const llmc_attention *a, int64_t task) {
    /* The common shapes get loops the compiler fully unrolls and keeps in registers. */
    if (a->block_size == 16 && a->head_dim == 64)
        attend(a, task, 64, 16);
    else if (a->block_size == 16 && a->head_dim == 128)
        attend(a, task, 128, 16);
    else
        attend(a, task, a->head_dim, a->block_size);
}

LLMC_CLONES
void llmc_swiglu_rows(const float *x, float *out, int64_t width, int64_t row0, int64_t row1) {
    for (int64_t r = row0; r < row1; r++) {
        const float *gate = x + r * 2 * width, *up = gate + width;
        float *dst = out + r * width;
#pragma omp simd
        for (int64_t i = 0; i < width; i++)
            dst[i] = gate[i] / (1.0f + exp_f(-gate[i])) * up[i];
    }
}
