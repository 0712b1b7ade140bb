// llmc's paged attention on CUDA (sm_80 and later): the op of llmc/plugins/paged_attention.py.
//
// One call = kv_write (the step's new K/V into the paged cache, in place) followed by one
// attention kernel and, when the context is split, a reduce kernel. Both attention kernels give a
// CTA one KV head of one sequence and every query head that reads it (GQA), so each K/V tile is
// loaded once for the whole group, and split the context into partitions (flash-decoding) when
// there are too few CTAs to fill the GPU; paged_attention_split_reduce then merges the
// per-partition (max, sum, output) triples.
//   decode  (up to 16 query rows): bound by the K/V bytes it streams, so each of the four warps
//           runs its own cp.async ring over its own 16-token tiles and keeps S, P and O in
//           mma.sync fragments; the warps merge once at the end (decode(), below).
//   prefill (64 query rows per CTA): S > 1 new tokens x the group's heads, attending to the paged
//           prefix and causally to themselves; one tiled online-softmax body (attend()) whose
//           products run through WMMA, K/V tiles shared by the CTA in a two-stage cp.async ring.
// A query "row" is one (new token, query head of the group) pair, flattened token-major, so a
// tile holds whole GQA groups and any group size works (a tile may end mid-group). Products
// accumulate in fp32 on tensor cores; the softmax and all bookkeeping are fp32.
//
// Rotary embedding (rotary_dim > 0) is fused, each kernel instantiated with and without it (the
// kRope template flag) so that the plain path keeps its code: kv_write rotates each K chunk in
// registers between its load and its store to the cache (so the cache holds rotated keys); the
// prefill kernel rotates its query tile in shared memory once its cp.async lands, while the first
// K/V tile is still in flight, and the decode kernel rotates the query as it loads its fragments.
// All compute in fp32 without FMA contraction and round once, exactly like numpy's fp32
// x1*cos - x2*sin, x2*cos + x1*sin.

#include "llmc_attention.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "llmc's attention kernels need sm_80 or newer (cp.async, bf16 tensor cores)"
#endif

#include <atomic>
#include <cmath>
#include <cstdint>

namespace llmc {

namespace wmma = nvcuda::wmma;

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
// Build-time knobs (-DLLMC_...=N), so that benchmarks/cuda_attention_variants.py can time
// alternatives; the defaults are what it measured best (docs/tensorrt.md).
#ifndef LLMC_KV_TILE
#define LLMC_KV_TILE 32
#endif
#ifndef LLMC_DECODE_STAGES
#define LLMC_DECODE_STAGES 3
#endif
#ifndef LLMC_DECODE_TARGET_CTAS
#define LLMC_DECODE_TARGET_CTAS 256
#endif
constexpr int kKvTile = LLMC_KV_TILE;  // tokens per prefill K/V tile: a multiple of 32 (lanes in the softmax)
constexpr int kLaneTokens = kKvTile / 32;
static_assert(kKvTile % 32 == 0, "the softmax gives each lane whole tokens");
constexpr int kPad = 8;              // 16 bytes per 16-bit row: rows start 4 banks apart
constexpr int kFloatPad = 4;         // WMMA wants float strides in multiples of 4
constexpr int kDecodeRows = 16;
constexpr int kPrefillRows = 64;
// cp.async stages: of each decode warp's own ring, of the prefill CTA's shared one.
constexpr int kDecodeStages = LLMC_DECODE_STAGES;
constexpr int kPrefillStages = 2;
// Splits are sized so that a launch has about this many CTAs: for decode one wave (two CTAs an SM
// on 132 SMs), for prefill a few. Fixed numbers, not the device's SM count, so the workspace size
// depends on the shapes alone.
constexpr int kDecodeTargetCtas = LLMC_DECODE_TARGET_CTAS;
constexpr int kPrefillTargetCtas = 512;
constexpr int kMinPartition = 256;   // tokens: below this a split's fixed cost outweighs its work
constexpr float kLog2e = 1.4426950408889634f;

struct Params {
    const void* query;
    const void* key;
    const void* value;
    void* cache;
    void* output;
    const int32_t* past_lens;
    const int32_t* query_lens;
    const int32_t* block_tables;
    float* partial_o;                // [B, Hq, rows_seq, splits, D], unnormalized
    float2* partial_ml;              // [B, Hq, rows_seq, splits] (max in log2 units, sum)
    int64_t cache_half;              // elements of the K half of the cache
    int batch, seq, rows_seq, num_heads, num_kv_heads, group, head_dim;
    int num_blocks, block_size, max_blocks;
    int window;
    float scale, softcap;
    int num_splits, partition;       // partition: tokens per split, a multiple of kKvTile
    const void* rope_cos;            // [B, seq, rotary_dim / 2], the query's dtype; null: no RoPE
    const void* rope_sin;
    int rotary_dim, rotary_interleaved;
};

template <typename T> struct Num;
template <> struct Num<__half> {
    static __device__ __forceinline__ __half from_float(float x) { return __float2half_rn(x); }
    static __device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
    static __device__ __forceinline__ unsigned short bits(__half x) { return __half_as_ushort(x); }
};
template <> struct Num<__nv_bfloat16> {
    static __device__ __forceinline__ __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
    static __device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
    static __device__ __forceinline__ unsigned short bits(__nv_bfloat16 x) { return __bfloat16_as_ushort(x); }
};

template <typename T> struct alignas(16) Pack8 { T v[8]; };

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

// 16-byte async copy; with fill == false it writes zeros instead, so masked or missing tokens
// never bring stale (possibly NaN) pool bytes into a product where 0 * NaN would poison a row.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool fill) {
    const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    const int bytes = fill ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(bytes)
                 : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// One rotated element: x1*cos - x2*sin for the first of a pair (x = x1, partner = x2), x2*cos +
// x1*sin for the second (x = x2, partner = x1). Explicit roundings: no FMA contraction, so the
// result is numpy's fp32 one bit for bit and the key written to the cache is reproducible.
__device__ __forceinline__ float rope_rotate(float x, float partner, float c, float s, bool second) {
    const float ps = __fmul_rn(partner, s);
    return __fadd_rn(__fmul_rn(x, c), second ? ps : -ps);
}

// The cos (or sin) row of token j of row b: [B, seq, rotary_dim / 2].
template <typename T>
__device__ __forceinline__ const T* rope_row(const void* table, const Params& p, int b, int j) {
    return static_cast<const T*>(table) + (static_cast<int64_t>(b) * p.seq + j) * (p.rotary_dim / 2);
}

// Element d (< rotary_dim) of token j's head row, x = row[d], rotated. `neighbour` is row[d ^ 1],
// its interleaved partner, which the caller already holds; a rotate-halves partner rotary_dim / 2
// away is loaded from row (an L1 hit: the neighbouring threads load it too).
template <typename T>
__device__ __forceinline__ T rotated_element(const Params& p, const T* row, int b, int j, int d, T x, T neighbour) {
    const int half = p.rotary_dim / 2;
    const bool second = p.rotary_interleaved ? (d & 1) != 0 : d >= half;
    const int i = p.rotary_interleaved ? d >> 1 : (second ? d - half : d);
    const T partner = p.rotary_interleaved ? neighbour : row[second ? d - half : d + half];
    return Num<T>::from_float(rope_rotate(Num<T>::to_float(x), Num<T>::to_float(partner),
                                          Num<T>::to_float(rope_row<T>(p.rope_cos, p, b, j)[i]),
                                          Num<T>::to_float(rope_row<T>(p.rope_sin, p, b, j)[i]), second));
}

// Where chunk dc of token t's head row kvh starts in the K half of the cache ([blocks,
// block_size, Hkv, D]; V is cache_half further). ok = false where t lies outside [t_lo, t_end) or
// has no valid block: the caller loads zeros there, so that masked or missing tokens never bring
// stale (possibly NaN) pool bytes into a product.
template <int D>
__device__ __forceinline__ int64_t kv_offset(const Params& p, const int32_t* table, int t, int t_lo, int t_end,
                                             int kvh, int dc, bool& ok) {
    const int col = t / p.block_size;
    int blk = -1;
    if (t >= t_lo && t < t_end && col < p.max_blocks) blk = table[col];
    ok = blk >= 0 && blk < p.num_blocks;
    int64_t off = 0;
    if (ok) off = ((static_cast<int64_t>(blk) * p.block_size + t % p.block_size) * p.num_kv_heads + kvh) * D + dc * 8;
    return off;
}

// The K/V tiles [first, last) of kTile tokens a CTA attends over, and the tokens [t_lo, t_end)
// they hold: from the window start of its first row to its last row's own token, cut to its
// split's partition. Its rows are tokens j_first..j_last of the step (none where j_first >
// j_last). False for a split CTA with nothing to do: the reduce reads a row's split only if it
// overlaps the row's range, so such a CTA writes nothing.
template <int kTile>
__device__ __forceinline__ bool kv_range(const Params& p, int past, int j_first, int j_last, int split, int& t_lo,
                                         int& t_end, int& first, int& last) {
    const bool any_row = j_first <= j_last;
    t_end = any_row ? past + j_last + 1 : 0;
    t_lo = (any_row && p.window > 0) ? max(0, past + j_first - p.window + 1) : 0;
    first = t_lo / kTile;
    last = (t_end + kTile - 1) / kTile;
    if (p.num_splits > 1) {
        const int per = p.partition / kTile;
        first = max(first, split * per);
        last = min(last, (split + 1) * per);
        if (!any_row || first >= last) return false;
    }
    return true;
}

// Query head h's row for token j in the query and the output ([B, Hq, seq, D]), in units of D.
__device__ __forceinline__ int64_t head_row(const Params& p, int b, int h, int j) {
    return (static_cast<int64_t>(b) * p.num_heads + h) * p.seq + j;
}

// The same row's slot for split `split` in the partials ([B, Hq, rows_seq, splits]).
__device__ __forceinline__ int64_t partial_row(const Params& p, int b, int h, int j, int split) {
    return ((static_cast<int64_t>(b) * p.num_heads + h) * p.rows_seq + j) * p.num_splits + split;
}

__host__ __device__ constexpr size_t round128(size_t x) { return (x + 127) / 128 * 128; }
__host__ __device__ constexpr size_t max_size(size_t a, size_t b) { return a > b ? a : b; }

// Shared memory of one prefill CTA (attend()). The fp32 output staging of the epilogue reuses
// the K/V buffers, which are dead by then.
template <int D> struct PrefillSmem {
    static constexpr int M = kPrefillRows;
    static constexpr int kStages = kPrefillStages;
    static constexpr int kLd = D + kPad;              // Q, K, V rows (16-bit elements)
    static constexpr int kSld = kKvTile + kFloatPad;  // scores (floats)
    static constexpr int kPld = kKvTile + kPad;       // probabilities (16-bit)
    static constexpr int kOld = D + kFloatPad;        // output staging (floats)
    static constexpr size_t kQ = size_t(M) * kLd * 2;
    static constexpr size_t kKvStage = size_t(kKvTile) * kLd * 2;
    static constexpr size_t kKvo = max_size(2 * kStages * kKvStage, size_t(M) * kOld * 4);  // K, V x stages
    static constexpr size_t kS = size_t(M) * kSld * 4;
    static constexpr size_t kP = size_t(M) * kPld * 2;
    static constexpr size_t kStats = size_t(3) * M * 4;
    static constexpr size_t q_off = 0;
    static constexpr size_t kvo_off = q_off + round128(kQ);
    static constexpr size_t s_off = kvo_off + round128(kKvo);
    static constexpr size_t p_off = s_off + round128(kS);
    static constexpr size_t stat_off = p_off + round128(kP);
    static constexpr size_t bytes = stat_off + round128(kStats);
};

template <typename T, int D, bool kRope>
__device__ __forceinline__ void attend(const Params& p) {
    using L = PrefillSmem<D>;
    constexpr int M = L::M, kStages = L::kStages;
    constexpr int kChunks = D / 8;           // 16-byte chunks per head row
    constexpr int kRowBlocks = M / 16;
    constexpr int kColBlocks = D / 16;
    constexpr int kFragsPerWarp = kRowBlocks * kColBlocks / kWarps;
    static_assert(kRowBlocks * kColBlocks % kWarps == 0, "output fragments must spread evenly over warps");
    static_assert(M >= 16 && M % 16 == 0, "row tile must be whole WMMA tiles");

    extern __shared__ __align__(128) unsigned char smem[];
    T* q_s = reinterpret_cast<T*>(smem + L::q_off);
    T* k_s = reinterpret_cast<T*>(smem + L::kvo_off);
    T* v_s = k_s + kStages * kKvTile * L::kLd;
    float* o_s = reinterpret_cast<float*>(smem + L::kvo_off);
    float* s_s = reinterpret_cast<float*>(smem + L::s_off);
    T* p_s = reinterpret_cast<T*>(smem + L::p_off);
    float* m_s = reinterpret_cast<float*>(smem + L::stat_off);
    float* l_s = m_s + M;
    float* a_s = l_s + M;

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int row_tiles = gridDim.x / p.num_splits;
    const int split = blockIdx.x % p.num_splits;
    // Later tokens see longer contexts: starting the heaviest row tiles first shortens the tail.
    const int tile = row_tiles - 1 - static_cast<int>(blockIdx.x) / p.num_splits;
    const int kvh = blockIdx.y, b = blockIdx.z;
    const int G = p.group;
    const int row0 = tile * M;
    const int rows_total = p.rows_seq * G;
    const int past = p.past_lens[b];
    const int qlen = past < 0 ? 0 : min(p.query_lens[b], p.rows_seq);

    // The token range the tile's rows attend to, in K/V tiles; positions grow with the row index.
    int t_lo, t_end, tile_first, tile_last;
    if (!kv_range<kKvTile>(p, past, row0 / G, min((row0 + M - 1) / G, qlen - 1), split, t_lo, t_end, tile_first,
                           tile_last))
        return;
    const int n_tiles = max(0, tile_last - tile_first);

    const T* query = static_cast<const T*>(p.query);
    const T* k_cache = static_cast<const T*>(p.cache);
    const T* v_cache = k_cache + p.cache_half;
    const int32_t* table = p.block_tables + static_cast<int64_t>(b) * p.max_blocks;

    for (int c = tid; c < M * kChunks; c += kThreads) {
        const int r = c / kChunks, dc = c % kChunks;
        const int rg = row0 + r, j = rg / G, g = rg % G;
        const bool ok = rg < rows_total && j < qlen;
        const T* src = query;
        if (ok) src += head_row(p, b, kvh * G + g, j) * D + dc * 8;
        cp_async16(q_s + r * L::kLd + dc * 8, src, ok);
    }
    // With RoPE the query tile is a commit group of its own, so it can be waited for (and rotated)
    // alone while the first K/V tile is still loading; without, it rides with that tile.
    if constexpr (kRope) cp_async_commit();

    auto load_tile = [&](int kv_tile, int stage) {
        const int t0 = kv_tile * kKvTile;
        for (int c = tid; c < kKvTile * kChunks; c += kThreads) {
            const int i = c / kChunks, dc = c % kChunks;
            bool ok;
            const int64_t off = kv_offset<D>(p, table, t0 + i, t_lo, t_end, kvh, dc, ok);
            const int dst = (stage * kKvTile + i) * L::kLd + dc * 8;
            cp_async16(k_s + dst, k_cache + off, ok);
            cp_async16(v_s + dst, v_cache + off, ok);
        }
    };
    // The first kStages - 1 tiles, a commit group each (possibly empty), so that in iteration n
    // "all but the newest kStages - 1 groups" is always tile n.
    auto load_prologue = [&]() {
#pragma unroll
        for (int s = 0; s < kStages - 1; ++s) {
            if (s < n_tiles) load_tile(tile_first + s, s);
            cp_async_commit();
        }
    };

    if constexpr (kRope) {
        // Start the first K/V tiles, then rotate the query tile in place while they load: a warp
        // per row, a lane per pair, fp32, one rounding. Done before the accumulators come alive
        // (and the loops kept rolled) so that it adds no register pressure to the main loop. The
        // __syncthreads below orders these writes before the first Q.K^T product.
        load_prologue();
        cp_async_wait<kStages - 1>();   // the query group has landed; the K/V tiles may be in flight
        __syncthreads();
        const int half = p.rotary_dim / 2;
        const bool inter = p.rotary_interleaved != 0;
#pragma unroll 1
        for (int r = warp; r < M; r += kWarps) {
            const int rg = row0 + r, j = rg / G;
            if (rg >= rows_total || j >= qlen) continue;   // zero rows stay zero
            const T* cos_row = rope_row<T>(p.rope_cos, p, b, j);
            const T* sin_row = rope_row<T>(p.rope_sin, p, b, j);
            T* row = q_s + r * L::kLd;
#pragma unroll 1
            for (int i = lane; i < half; i += 32) {
                const float co = Num<T>::to_float(cos_row[i]), si = Num<T>::to_float(sin_row[i]);
                const int d1 = inter ? 2 * i : i, d2 = inter ? 2 * i + 1 : i + half;
                const float x1 = Num<T>::to_float(row[d1]), x2 = Num<T>::to_float(row[d2]);
                row[d1] = Num<T>::from_float(rope_rotate(x1, x2, co, si, false));
                row[d2] = Num<T>::from_float(rope_rotate(x2, x1, co, si, true));
            }
        }
    }

    // WMMA does not document which (row, col) each accumulator element holds; loading a tile of
    // row numbers into an accumulator fragment reveals it, so O can be rescaled per row in place.
    for (int i = tid; i < 16 * 16; i += kThreads) s_s[(i / 16) * L::kSld + i % 16] = static_cast<float>(i / 16);
    for (int r = tid; r < M; r += kThreads) {
        m_s[r] = -INFINITY;
        l_s[r] = 0.f;
        a_s[r] = 1.f;
    }
    __syncthreads();
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> row_of;
    wmma::load_matrix_sync(row_of, s_s, L::kSld, wmma::mem_row_major);
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[kFragsPerWarp];
#pragma unroll
    for (int i = 0; i < kFragsPerWarp; ++i) wmma::fill_fragment(acc[i], 0.f);

    if constexpr (!kRope) load_prologue();

    for (int n = 0; n < n_tiles; ++n) {
        const int stage = n % kStages;
        const int ahead = n + kStages - 1;   // its stage is the one iteration n - 1 finished with
        if (ahead < n_tiles) load_tile(tile_first + ahead, ahead % kStages);
        cp_async_commit();
        cp_async_wait<kStages - 1>();
        __syncthreads();

        const T* k_tile = k_s + stage * kKvTile * L::kLd;
        const T* v_tile = v_s + stage * kKvTile * L::kLd;
        for (int f = warp; f < kRowBlocks * (kKvTile / 16); f += kWarps) {
            const int rb = f / (kKvTile / 16), cb = f % (kKvTile / 16);
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> sc;
            wmma::fill_fragment(sc, 0.f);
#pragma unroll
            for (int k = 0; k < D / 16; ++k) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> qa;
                wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> kb;
                wmma::load_matrix_sync(qa, q_s + rb * 16 * L::kLd + k * 16, L::kLd);
                wmma::load_matrix_sync(kb, k_tile + cb * 16 * L::kLd + k * 16, L::kLd);
                wmma::mma_sync(sc, qa, kb, sc);
            }
            wmma::store_matrix_sync(s_s + rb * 16 * L::kSld + cb * 16, sc, L::kSld, wmma::mem_row_major);
        }
        __syncthreads();

        // Online softmax in log2 units: one warp per row, lane l holding tokens l, l + 32, ...
        const int t0 = (tile_first + n) * kKvTile + lane;
        for (int r = warp; r < M; r += kWarps) {
            const int rg = row0 + r, j = rg / G;
            if (rg >= rows_total || j >= qlen) continue;   // uniform per warp; P is never read for it
            const int pos = past + j;
            float s[kLaneTokens];
            float m_tile = -INFINITY;
#pragma unroll
            for (int e = 0; e < kLaneTokens; ++e) {
                const int t = t0 + 32 * e;
                s[e] = -INFINITY;
                if (t <= pos && (p.window <= 0 || t > pos - p.window)) {
                    float x = s_s[r * L::kSld + lane + 32 * e] * p.scale;
                    if (p.softcap > 0.f) x = p.softcap * tanhf(x / p.softcap);
                    s[e] = x * kLog2e;
                }
                m_tile = fmaxf(m_tile, s[e]);
            }
            const float m_old = m_s[r];
            const float m_new = fmaxf(m_old, warp_max(m_tile));
            float lane_sum = 0.f, alpha = 1.f;
            // m_new == -inf: nothing allowed yet, so O and l stay zero.
            if (m_new != -INFINITY) alpha = exp2f(m_old - m_new);
#pragma unroll
            for (int e = 0; e < kLaneTokens; ++e) {
                const float prob = s[e] != -INFINITY ? exp2f(s[e] - m_new) : 0.f;
                lane_sum += prob;
                p_s[r * L::kPld + lane + 32 * e] = Num<T>::from_float(prob);
            }
            const float sum = warp_sum(lane_sum);
            __syncwarp();
            if (lane == 0) {
                m_s[r] = m_new;
                l_s[r] = l_s[r] * alpha + sum;
                a_s[r] = alpha;
            }
        }
        __syncthreads();

#pragma unroll
        for (int i = 0; i < kFragsPerWarp; ++i) {
            const int f = warp + i * kWarps;
            const int rb = f / kColBlocks, cb = f % kColBlocks;
#pragma unroll
            for (int e = 0; e < acc[i].num_elements; ++e) acc[i].x[e] *= a_s[rb * 16 + static_cast<int>(row_of.x[e])];
#pragma unroll
            for (int k = 0; k < kKvTile / 16; ++k) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> pa;
                wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> vb;
                wmma::load_matrix_sync(pa, p_s + rb * 16 * L::kPld + k * 16, L::kPld);
                wmma::load_matrix_sync(vb, v_tile + k * 16 * L::kLd + cb * 16, L::kLd);
                wmma::mma_sync(acc[i], pa, vb, acc[i]);
            }
        }
        __syncthreads();   // the next iteration's prefetch overwrites this stage
    }
    cp_async_wait<0>();
    __syncthreads();

#pragma unroll
    for (int i = 0; i < kFragsPerWarp; ++i) {
        const int f = warp + i * kWarps;
        const int rb = f / kColBlocks, cb = f % kColBlocks;
        wmma::store_matrix_sync(o_s + rb * 16 * L::kOld + cb * 16, acc[i], L::kOld, wmma::mem_row_major);
    }
    __syncthreads();

    if (p.num_splits == 1) {
        T* out = static_cast<T*>(p.output);
        for (int c = tid; c < M * kChunks; c += kThreads) {
            const int r = c / kChunks, dc = c % kChunks;
            const int rg = row0 + r;
            if (rg >= rows_total) continue;
            const int j = rg / G, g = rg % G;
            const float l = l_s[r];
            const bool valid = j < qlen && l > 0.f;
            const float inv = valid ? 1.f / l : 0.f;
            Pack8<T> pack;
#pragma unroll
            for (int e = 0; e < 8; ++e) pack.v[e] = Num<T>::from_float(valid ? o_s[r * L::kOld + dc * 8 + e] * inv : 0.f);
            const int64_t dst = head_row(p, b, kvh * G + g, j) * D + dc * 8;
            *reinterpret_cast<Pack8<T>*>(out + dst) = pack;
        }
    } else {
        for (int c = tid; c < M * (D / 4); c += kThreads) {
            const int r = c / (D / 4), dc = c % (D / 4);
            const int rg = row0 + r, j = rg / G, g = rg % G;
            if (rg >= rows_total || j >= qlen) continue;
            const int64_t prow = partial_row(p, b, kvh * G + g, j, split);
            const float* src = o_s + r * L::kOld + dc * 4;
            *reinterpret_cast<float4*>(p.partial_o + prow * D + dc * 4) = make_float4(src[0], src[1], src[2], src[3]);
        }
        for (int r = tid; r < M; r += kThreads) {
            const int rg = row0 + r, j = rg / G, g = rg % G;
            if (rg >= rows_total || j >= qlen) continue;
            const int64_t prow = partial_row(p, b, kvh * G + g, j, split);
            p.partial_ml[prow] = make_float2(m_s[r], l_s[r]);
        }
    }
}

// --- decode: warps that stream their own K/V tiles ------------------------------------------------
//
// A decode CTA (one KV head of one sequence, up to 16 query rows: the GQA group, times the few
// tokens of a speculative step) reads far more K/V than it computes on, so what bounds it is how
// many bytes stay in flight. Each warp therefore owns a private cp.async ring over its own
// 16-token tiles (tiles w, w + 4, ... of the CTA's range), keeps S, P and O in mma.sync fragments
// (the fragment layout is documented, so the softmax runs in registers: no shared-memory round
// trip, no CTA barrier per tile), and the four warps merge their (max, sum, O) once at the end.

constexpr int kWarpTile = 16;   // tokens per warp step: one k16 of P.V
static_assert(kKvTile % kWarpTile == 0, "split partitions must be whole warp tiles");

template <int D> struct DecodeSmem {
    static constexpr int kStages = kDecodeStages;
    static constexpr int kLd = D + kPad;                              // K, V rows (16-bit elements)
    static constexpr size_t kTile = size_t(kWarpTile) * kLd * 2;      // one K or V tile, bytes
    static constexpr size_t kRing = kStages * 2 * kTile;              // a warp's K and V stages
    static constexpr int kOld = D + kFloatPad;                        // merge: O rows (floats)
    static constexpr size_t kMergeO = size_t(kWarps) * kDecodeRows * kOld * 4;
    static constexpr size_t kMerge = kMergeO + size_t(2) * kWarps * kDecodeRows * 4;
    static constexpr size_t bytes = max_size(kWarps * kRing, kMerge);
};

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem) {
    const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem) {
    const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a) : "memory");
}

// c += a (16x16, row-major) . b (16x8, column-major), fp32 accumulators.
template <typename T>
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
template <>
__device__ __forceinline__ void mma16816<__half>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma16816<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                                        uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two 16-bit values in one register, the first in the low half (the lower column of a fragment).
template <typename T> __device__ __forceinline__ uint32_t pack2(T lo, T hi) {
    return static_cast<uint32_t>(Num<T>::bits(lo)) | static_cast<uint32_t>(Num<T>::bits(hi)) << 16;
}

template <typename T, int D, bool kRope>
__device__ __forceinline__ void decode(const Params& p) {
    using L = DecodeSmem<D>;
    constexpr int kChunks = D / 8;          // 16-byte chunks per head row
    constexpr int kSteps = D / 16;          // k16 steps of Q.K^T
    constexpr int kNTiles = D / 8;          // n8 tiles of O

    extern __shared__ __align__(128) unsigned char smem[];
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int quad = lane / 4, tq = lane % 4;   // fragment row and column pair
    const int split = blockIdx.x;
    const int kvh = blockIdx.y, b = blockIdx.z;
    const int G = p.group;
    const int rows_total = p.rows_seq * G;
    const int past = p.past_lens[b];
    const int qlen = past < 0 ? 0 : min(p.query_lens[b], p.rows_seq);

    // The CTA's token range, in warp tiles; query row r is token j = r / G of the step.
    int t_lo, t_end, tile_first, tile_last;
    if (!kv_range<kWarpTile>(p, past, 0, min((kDecodeRows - 1) / G, qlen - 1), split, t_lo, t_end, tile_first,
                             tile_last))
        return;
    const int n_tiles = max(0, tile_last - tile_first);
    const int mine = n_tiles > warp ? (n_tiles - warp + kWarps - 1) / kWarps : 0;

    // This thread's two fragment rows (quad and quad + 8): validity, position, window start.
    bool row_ok[2];
    int row_pos[2], row_lo[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = quad + 8 * h, j = r / G;
        row_ok[h] = r < rows_total && j < qlen;
        row_pos[h] = past + j;
        row_lo[h] = p.window > 0 ? row_pos[h] - p.window + 1 : 0;
    }

    // Q as A fragments, straight from global memory (rotated with kRope), zero for padding rows.
    const T* query = static_cast<const T*>(p.query);
    uint32_t qa[kSteps][4];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = quad + 8 * h, j = r / G;
        const T* row = query + head_row(p, b, kvh * G + r % G, j) * D;
#pragma unroll
        for (int k = 0; k < kSteps; ++k) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int d = 16 * k + 8 * half + 2 * tq;
                uint32_t v = 0;
                if (row_ok[h]) {
                    T x0 = row[d], x1 = row[d + 1];
                    if constexpr (kRope) {
                        if (d < p.rotary_dim) {
                            const T r0 = rotated_element<T>(p, row, b, j, d, x0, x1);
                            x1 = rotated_element<T>(p, row, b, j, d + 1, x1, x0);
                            x0 = r0;
                        }
                    }
                    v = pack2<T>(x0, x1);
                }
                qa[k][h + 2 * half] = v;
            }
        }
    }

    const T* k_cache = static_cast<const T*>(p.cache);
    const T* v_cache = k_cache + p.cache_half;
    const int32_t* table = p.block_tables + static_cast<int64_t>(b) * p.max_blocks;
    T* ring = reinterpret_cast<T*>(smem + warp * L::kRing);
    auto k_stage = [&](int s) { return ring + s * 2 * kWarpTile * L::kLd; };
    auto v_stage = [&](int s) { return k_stage(s) + kWarpTile * L::kLd; };

    // Tile i of this warp into stage s; tokens outside [t_lo, t_end) or without a block read as 0.
    auto tile_start = [&](int i) { return (tile_first + warp + i * kWarps) * kWarpTile; };   // this warp's i-th
    auto load_tile = [&](int i, int s) {
        const int t0 = tile_start(i);
#pragma unroll
        for (int it = 0; it < kWarpTile * kChunks / 32; ++it) {
            const int c = lane + 32 * it, e = c / kChunks, dc = c % kChunks;
            bool ok;
            const int64_t off = kv_offset<D>(p, table, t0 + e, t_lo, t_end, kvh, dc, ok);
            cp_async16(k_stage(s) + e * L::kLd + dc * 8, k_cache + off, ok);
            cp_async16(v_stage(s) + e * L::kLd + dc * 8, v_cache + off, ok);
        }
    };

    float acc[kNTiles][4];
#pragma unroll
    for (int n = 0; n < kNTiles; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};   // l: this thread's columns only

#pragma unroll
    for (int s = 0; s < kDecodeStages - 1; ++s) {
        if (s < mine) load_tile(s, s);
        cp_async_commit();
    }
    for (int i = 0; i < mine; ++i) {
        const int ahead = i + kDecodeStages - 1;   // its stage is the one step i - 1 finished with
        if (ahead < mine) load_tile(ahead, ahead % kDecodeStages);
        cp_async_commit();
        cp_async_wait<kDecodeStages - 1>();
        __syncwarp();
        const T* k_tile = k_stage(i % kDecodeStages);
        const T* v_tile = v_stage(i % kDecodeStages);

        // S = Q.K^T, two n8 tiles of tokens; ldmatrix's four 8x8 matrices are four k8 slices.
        float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
            for (int k = 0; k < kSteps; k += 2) {
                uint32_t kb[4];
                ldmatrix_x4(kb, k_tile + (nt * 8 + lane % 8) * L::kLd + 16 * k + (lane / 8) * 8);
                mma16816<T>(s[nt], qa[k], kb[0], kb[1]);
                mma16816<T>(s[nt], qa[k + 1], kb[2], kb[3]);
            }
        }

        // Online softmax in log2 units. Element e of n8 tile nt: row quad + 8 * (e / 2), token
        // t0 + 8 * nt + 2 * tq + e % 2; a row's 16 tokens live in one quad of lanes.
        const int t0 = tile_start(i) + 2 * tq;
        float alpha[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float m_tile = -INFINITY;
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int t = t0 + 8 * nt + e;
                    float x = -INFINITY;
                    if (row_ok[h] && t <= row_pos[h] && t >= row_lo[h]) {
                        x = s[nt][2 * h + e] * p.scale;
                        if (p.softcap > 0.f) x = p.softcap * tanhf(x / p.softcap);
                        x *= kLog2e;
                    }
                    s[nt][2 * h + e] = x;
                    m_tile = fmaxf(m_tile, x);
                }
            }
            m_tile = fmaxf(m_tile, __shfl_xor_sync(0xffffffffu, m_tile, 1));
            m_tile = fmaxf(m_tile, __shfl_xor_sync(0xffffffffu, m_tile, 2));
            const float m_new = fmaxf(m[h], m_tile);
            // m_new == -inf: nothing allowed yet, so O and l stay zero.
            alpha[h] = m_new != -INFINITY ? exp2f(m[h] - m_new) : 1.f;
            float sum = 0.f;
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float x = s[nt][2 * h + e];
                    const float prob = x != -INFINITY ? exp2f(x - m_new) : 0.f;
                    s[nt][2 * h + e] = prob;
                    sum += prob;
                }
            }
            m[h] = m_new;
            l[h] = l[h] * alpha[h] + sum;
        }

        // P's accumulator layout is the A layout of the next product (k16 = the tile's tokens).
        const uint32_t pa[4] = {pack2<T>(Num<T>::from_float(s[0][0]), Num<T>::from_float(s[0][1])),
                                pack2<T>(Num<T>::from_float(s[0][2]), Num<T>::from_float(s[0][3])),
                                pack2<T>(Num<T>::from_float(s[1][0]), Num<T>::from_float(s[1][1])),
                                pack2<T>(Num<T>::from_float(s[1][2]), Num<T>::from_float(s[1][3]))};
#pragma unroll
        for (int n = 0; n < kNTiles; ++n) {
            acc[n][0] *= alpha[0];
            acc[n][1] *= alpha[0];
            acc[n][2] *= alpha[1];
            acc[n][3] *= alpha[1];
        }
        // O += P.V: ldmatrix.trans gives V's column-major B fragments, two n8 tiles per load.
#pragma unroll
        for (int n = 0; n < kNTiles; n += 2) {
            uint32_t vb[4];
            ldmatrix_x4_trans(vb, v_tile + ((lane / 8) % 2 * 8 + lane % 8) * L::kLd + 8 * n + (lane / 16) * 8);
            mma16816<T>(acc[n], pa, vb[0], vb[1]);
            mma16816<T>(acc[n + 1], pa, vb[2], vb[3]);
        }
        __syncwarp();   // the next step's prefetch overwrites this stage
    }
    cp_async_wait<0>();
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
    }
    __syncthreads();   // every ring is drained: the merge area overlays them

    float* o_w = reinterpret_cast<float*>(smem);
    float* m_w = reinterpret_cast<float*>(smem + L::kMergeO);
    float* l_w = m_w + kWarps * kDecodeRows;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = quad + 8 * h;
        float* o_row = o_w + (warp * kDecodeRows + r) * L::kOld + 2 * tq;
#pragma unroll
        for (int n = 0; n < kNTiles; ++n)
            *reinterpret_cast<float2*>(o_row + 8 * n) = make_float2(acc[n][2 * h], acc[n][2 * h + 1]);
        if (tq == 0) {
            m_w[warp * kDecodeRows + r] = m[h];
            l_w[warp * kDecodeRows + r] = l[h];
        }
    }
    __syncthreads();

    T* out = static_cast<T*>(p.output);
    for (int c = tid; c < kDecodeRows * D; c += kThreads) {
        const int r = c / D, d = c % D;
        if (r >= rows_total) break;   // r grows with c
        const int j = r / G, gh = r % G;
        float mx = -INFINITY;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, m_w[w * kDecodeRows + r]);
        float o = 0.f, den = 0.f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) {
            const float mw = m_w[w * kDecodeRows + r];
            if (mw == -INFINITY) continue;   // a warp with nothing allowed for this row
            const float scale = exp2f(mw - mx);
            o += scale * o_w[(w * kDecodeRows + r) * L::kOld + d];
            den += scale * l_w[w * kDecodeRows + r];
        }
        if (p.num_splits == 1) {
            const bool valid = j < qlen && den > 0.f;
            out[head_row(p, b, kvh * G + gh, j) * D + d] =
                Num<T>::from_float(valid ? o / den : 0.f);
        } else if (j < qlen) {
            const int64_t prow = partial_row(p, b, kvh * G + gh, j, split);
            p.partial_o[prow * D + d] = o;
            if (d == 0) p.partial_ml[prow] = make_float2(mx, den);
        }
    }
}

template <typename T, int D, bool kRope>
__global__ void __launch_bounds__(kThreads) paged_attention_decode(Params p) {
    decode<T, D, kRope>(p);
}

template <typename T, int D, bool kRope>
__global__ void __launch_bounds__(kThreads) paged_attention_prefill(Params p) {
    attend<T, D, kRope>(p);
}

// One warp per (row, head, token): merges the splits that overlap the token's attention range,
// which are exactly the ones whose CTAs wrote its partials.
template <typename T, int D>
__global__ void __launch_bounds__(kThreads) paged_attention_split_reduce(Params p) {
    constexpr int kPer = D / 32;
    const int64_t w = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x % 32;
    const int64_t rows = static_cast<int64_t>(p.batch) * p.num_heads * p.rows_seq;
    if (w >= rows) return;
    const int j = static_cast<int>(w % p.rows_seq);
    const int h = static_cast<int>(w / p.rows_seq % p.num_heads);
    const int b = static_cast<int>(w / (static_cast<int64_t>(p.rows_seq) * p.num_heads));
    T* out = static_cast<T*>(p.output) + head_row(p, b, h, j) * D + lane * kPer;
    const int past = p.past_lens[b];
    const int qlen = past < 0 ? 0 : min(p.query_lens[b], p.rows_seq);

    float acc[kPer];
#pragma unroll
    for (int e = 0; e < kPer; ++e) acc[e] = 0.f;
    float den = 0.f;
    if (j < qlen) {
        const int pos = past + j;
        const int lo = p.window > 0 ? max(0, pos - p.window + 1) : 0;
        const int s0 = lo / p.partition, s1 = min(pos / p.partition, p.num_splits - 1);
        const int64_t prow = w * p.num_splits;
        float mx = -INFINITY;
        for (int s = s0 + lane; s <= s1; s += 32) mx = fmaxf(mx, p.partial_ml[prow + s].x);
        mx = warp_max(mx);
        // A few splits' partials are loaded before any is summed: one at a time, a long context at
        // batch 1 (32 splits) paid a round trip to L2 per split.
        constexpr int kBatch = 8;
        for (int base = s0; base <= s1; base += kBatch) {
            float2 ml[kBatch];
#pragma unroll
            for (int u = 0; u < kBatch; ++u)
                ml[u] = base + u <= s1 ? p.partial_ml[prow + base + u] : make_float2(0.f, 0.f);
            float part[kBatch][kPer];
#pragma unroll
            for (int u = 0; u < kBatch; ++u) {
                const float* o = p.partial_o + (prow + base + u) * D + lane * kPer;
#pragma unroll
                for (int e = 0; e < kPer; ++e) part[u][e] = ml[u].y > 0.f ? o[e] : 0.f;
            }
#pragma unroll
            for (int u = 0; u < kBatch; ++u) {
                if (ml[u].y <= 0.f) continue;   // a split with nothing allowed for this row (or past s1)
                const float scale = exp2f(ml[u].x - mx);
                den += scale * ml[u].y;
#pragma unroll
                for (int e = 0; e < kPer; ++e) acc[e] += scale * part[u][e];
            }
        }
    }
    const float inv = den > 0.f ? 1.f / den : 0.f;
#pragma unroll
    for (int e = 0; e < kPer; ++e) out[e] = Num<T>::from_float(acc[e] * inv);
}

// One 16-byte chunk of a key head row (D elements of T, `row`), rotated: the chunk is loaded once
// and rotated in registers; an interleaved pair lies within the chunk (chunks start at even
// elements).
template <typename T>
__device__ __forceinline__ Pack8<T> rotated_key_chunk(const Params& p, const T* row, int b, int j, int dc) {
    const Pack8<T> x = *reinterpret_cast<const Pack8<T>*>(row + dc * 8);
    Pack8<T> out;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        const int d = dc * 8 + e;
        out.v[e] = d < p.rotary_dim ? rotated_element<T>(p, row, b, j, d, x.v[e], x.v[e ^ 1]) : x.v[e];
    }
    return out;
}

// One CTA per (token, row): copies the token's K and V head rows (16 bytes a thread) to its slot,
// rotating K's first rotary_dim elements on the way with kRope. Without RoPE it copies bits, so
// one instantiation (T = __half) serves both dtypes. Padding tokens are skipped: their slot would
// be scratch block 0, which nothing reads.
template <typename T, bool kRope>
__global__ void __launch_bounds__(kThreads) kv_write(Params p) {
    const int j = blockIdx.x, b = blockIdx.y;
    const int past = p.past_lens[b];
    if (past < 0 || j >= min(p.query_lens[b], p.seq)) return;
    const int pos = past + j;
    const int col = pos / p.block_size;
    if (col >= p.max_blocks) return;
    const int blk = p.block_tables[static_cast<int64_t>(b) * p.max_blocks + col];
    if (blk < 0 || blk >= p.num_blocks) return;
    const int chunks = p.head_dim / 8;
    const int per_token = p.num_kv_heads * chunks;
    uint4* k_dst = static_cast<uint4*>(p.cache) +
                   (static_cast<int64_t>(blk) * p.block_size + pos % p.block_size) * per_token;
    uint4* v_dst = k_dst + p.cache_half / 8;
    const uint4* key = static_cast<const uint4*>(p.key);
    const uint4* value = static_cast<const uint4*>(p.value);
    for (int c = threadIdx.x; c < 2 * per_token; c += blockDim.x) {
        const bool is_v = c >= per_token;
        const int cc = is_v ? c - per_token : c;
        const int h = cc / chunks, dc = cc % chunks;
        const int64_t src = ((static_cast<int64_t>(b) * p.num_kv_heads + h) * p.seq + j) * chunks + dc;
        if (is_v) {
            v_dst[cc] = value[src];
        } else if constexpr (kRope) {
            if (dc * 8 < p.rotary_dim)
                *reinterpret_cast<Pack8<T>*>(k_dst + cc) =
                    rotated_key_chunk<T>(p, reinterpret_cast<const T*>(key + (src - dc)), b, j, dc);
            else
                k_dst[cc] = key[src];
        } else {
            k_dst[cc] = key[src];
        }
    }
}

struct Plan {
    int rows_seq;        // query tokens per row the kernels cover (<= seq)
    bool decode;
    int row_tiles;
    int num_splits;
    int partition;
    int max_splits;      // before rounding to whole partitions: the bound the workspace is sized by
};

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

Plan make_plan(const LlmcPagedAttentionArgs& a, int split_cap) {
    Plan plan{};
    plan.rows_seq = a.max_query_len > 0 && a.max_query_len < a.seq ? a.max_query_len : a.seq;
    const int group = a.num_heads / a.num_kv_heads;
    const int64_t rows = static_cast<int64_t>(plan.rows_seq) * group;
    plan.decode = rows <= kDecodeRows;
    plan.row_tiles = static_cast<int>(ceil_div(rows, plan.decode ? kDecodeRows : kPrefillRows));
    const int64_t ctas = static_cast<int64_t>(a.batch) * a.num_kv_heads * plan.row_tiles;
    const int64_t context = static_cast<int64_t>(a.max_blocks) * a.block_size;
    int64_t splits = 1;
    const int target = plan.decode ? kDecodeTargetCtas : kPrefillTargetCtas;
    if (ctas < target) {
        splits = ceil_div(target, ctas);
        const int64_t by_length = ceil_div(context, kMinPartition);
        if (splits > by_length) splits = by_length;
    }
    if (splits > split_cap) splits = split_cap;
    if (splits < 1) splits = 1;
    plan.max_splits = static_cast<int>(splits);
    const int64_t tiles = ceil_div(context, kKvTile);
    const int64_t per = ceil_div(tiles, splits);
    plan.partition = static_cast<int>(per * kKvTile);
    plan.num_splits = static_cast<int>(ceil_div(tiles, per));
    return plan;
}

size_t partial_bytes(const LlmcPagedAttentionArgs& a, int rows_seq, int splits) {
    if (splits <= 1) return 0;
    const size_t rows = static_cast<size_t>(a.batch) * a.num_heads * rows_seq * splits;
    return rows * a.head_dim * sizeof(float) + rows * sizeof(float2);
}

// The error behind this thread's last LLMC_ERR_CUDA: the status code alone cannot say which.
thread_local cudaError_t last_cuda_error = cudaSuccess;

int cuda_status(cudaError_t err) {
    if (err == cudaSuccess) return LLMC_OK;
    last_cuda_error = err;
    return LLMC_ERR_CUDA;
}

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }

int check(const LlmcPagedAttentionArgs* a) {
    if (a == nullptr) return LLMC_ERR_NULL_POINTER;
    if (a->batch < 0 || a->seq < 0 || a->max_query_len < 0) return LLMC_ERR_BAD_SHAPE;
    if (a->num_heads <= 0 || a->num_kv_heads <= 0 || a->num_blocks <= 0 || a->block_size <= 0 || a->max_blocks <= 0)
        return LLMC_ERR_BAD_SHAPE;
    if (a->num_heads % a->num_kv_heads != 0) return LLMC_ERR_HEADS;
    if (a->head_dim != 64 && a->head_dim != 128) return LLMC_ERR_HEAD_DIM;
    if (a->dtype != LLMC_DTYPE_FP16 && a->dtype != LLMC_DTYPE_BF16) return LLMC_ERR_DTYPE;
    if (a->sliding_window < 0 || !(a->softcap >= 0.f) || !std::isfinite(a->softcap) || !std::isfinite(a->scale))
        return LLMC_ERR_ATTRIBUTE;
    if (a->rotary_dim < 0 || a->rotary_dim % 2 != 0 || a->rotary_dim > a->head_dim ||
        (a->rotary_interleaved != 0 && a->rotary_interleaved != 1))
        return LLMC_ERR_ROTARY;
    return LLMC_OK;
}

// The attention kernels need more than the default 48 KiB of dynamic shared memory; the opt-in is
// per device, so remember it per device instead of paying a driver call every layer of every step.
template <typename Kernel>
cudaError_t allow_smem(Kernel kernel, size_t bytes, std::atomic<uint64_t>& done) {
    int device = 0;
    cudaError_t err = cudaGetDevice(&device);
    if (err != cudaSuccess) return err;
    const uint64_t bit = device < 64 ? uint64_t(1) << device : 0;
    if (bit && (done.load(std::memory_order_relaxed) & bit)) return cudaSuccess;
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
    if (err == cudaSuccess && bit) done.fetch_or(bit, std::memory_order_relaxed);
    return err;
}

template <typename T, int D, bool kRope>
cudaError_t launch(const Params& p, const Plan& plan, cudaStream_t stream) {
    const dim3 grid(plan.row_tiles * plan.num_splits, p.num_kv_heads, p.batch);
    cudaError_t err;
    if (plan.decode) {
        static std::atomic<uint64_t> done{0};
        constexpr size_t bytes = DecodeSmem<D>::bytes;
        err = allow_smem(paged_attention_decode<T, D, kRope>, bytes, done);
        if (err != cudaSuccess) return err;
        paged_attention_decode<T, D, kRope><<<grid, kThreads, bytes, stream>>>(p);
    } else {
        static std::atomic<uint64_t> done{0};
        constexpr size_t bytes = PrefillSmem<D>::bytes;
        err = allow_smem(paged_attention_prefill<T, D, kRope>, bytes, done);
        if (err != cudaSuccess) return err;
        paged_attention_prefill<T, D, kRope><<<grid, kThreads, bytes, stream>>>(p);
    }
    if (plan.num_splits > 1) {
        const int64_t warps = static_cast<int64_t>(p.batch) * p.num_heads * p.rows_seq;
        const unsigned blocks = static_cast<unsigned>(ceil_div(warps, kWarps));
        paged_attention_split_reduce<T, D><<<blocks, kThreads, 0, stream>>>(p);
    }
    return cudaGetLastError();
}

template <typename T>
cudaError_t launch_all(const Params& p, const Plan& plan, bool rope, cudaStream_t stream) {
    if (rope) {
        kv_write<T, true><<<dim3(plan.rows_seq, p.batch), kThreads, 0, stream>>>(p);
    } else {
        kv_write<__half, false><<<dim3(plan.rows_seq, p.batch), kThreads, 0, stream>>>(p);
    }
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    if (p.head_dim == 64) return rope ? launch<T, 64, true>(p, plan, stream) : launch<T, 64, false>(p, plan, stream);
    return rope ? launch<T, 128, true>(p, plan, stream) : launch<T, 128, false>(p, plan, stream);
}

}  // namespace llmc

extern "C" size_t llmc_paged_attention_workspace(const LlmcPagedAttentionArgs* args) {
    if (llmc::check(args) != LLMC_OK || args->batch == 0 || args->seq == 0) return 0;
    const llmc::Plan plan = llmc::make_plan(*args, 1 << 30);
    // Sized by the split count before rounding: it never decreases with max_blocks, so the size
    // for the largest block table also covers every smaller one.
    return llmc::partial_bytes(*args, plan.rows_seq, plan.max_splits);
}

extern "C" int llmc_paged_attention(const LlmcPagedAttentionArgs* args, cudaStream_t stream) {
    using namespace llmc;
    const int status = check(args);
    if (status != LLMC_OK) return status;
    const LlmcPagedAttentionArgs& a = *args;
    if (a.batch == 0 || a.seq == 0) return LLMC_OK;
    if (!a.query || !a.key || !a.value || !a.cache || !a.output || !a.past_lens || !a.query_lens || !a.block_tables)
        return LLMC_ERR_NULL_POINTER;
    // RoPE is on iff rotary_dim > 0, and then needs both tables; off, it takes neither.
    const bool rope = a.rotary_dim > 0;
    if ((a.rope_cos != nullptr) != rope || (a.rope_sin != nullptr) != rope) return LLMC_ERR_ROTARY;
    if (!aligned16(a.query) || !aligned16(a.key) || !aligned16(a.value) || !aligned16(a.cache) ||
        !aligned16(a.output) || !aligned16(a.workspace))
        return LLMC_ERR_ALIGNMENT;

    Plan plan = make_plan(a, 1 << 30);
    const size_t available = a.workspace ? a.workspace_size : 0;
    if (partial_bytes(a, plan.rows_seq, plan.num_splits) > available) {
        // Fewer splits rather than failing: correctness never depends on the workspace.
        const size_t per_split = partial_bytes(a, plan.rows_seq, 2) / 2;
        const size_t fit = per_split ? available / per_split : 0;
        plan = make_plan(a, fit > 1 ? static_cast<int>(fit < (1u << 30) ? fit : (1u << 30)) : 1);
    }

    Params p{};
    p.query = a.query;
    p.key = a.key;
    p.value = a.value;
    p.cache = a.cache;
    p.output = a.output;
    p.past_lens = a.past_lens;
    p.query_lens = a.query_lens;
    p.block_tables = a.block_tables;
    p.cache_half = static_cast<int64_t>(a.num_blocks) * a.block_size * a.num_kv_heads * a.head_dim;
    p.batch = a.batch;
    p.seq = a.seq;
    p.rows_seq = plan.rows_seq;
    p.num_heads = a.num_heads;
    p.num_kv_heads = a.num_kv_heads;
    p.group = a.num_heads / a.num_kv_heads;
    p.head_dim = a.head_dim;
    p.num_blocks = a.num_blocks;
    p.block_size = a.block_size;
    p.max_blocks = a.max_blocks;
    p.window = a.sliding_window;
    p.scale = a.scale;
    p.softcap = a.softcap;
    p.num_splits = plan.num_splits;
    p.partition = plan.partition;
    p.rope_cos = a.rope_cos;
    p.rope_sin = a.rope_sin;
    p.rotary_dim = a.rotary_dim;
    p.rotary_interleaved = a.rotary_interleaved;
    if (plan.num_splits > 1) {
        const size_t rows = static_cast<size_t>(a.batch) * a.num_heads * plan.rows_seq * plan.num_splits;
        p.partial_o = static_cast<float*>(a.workspace);
        p.partial_ml = reinterpret_cast<float2*>(static_cast<char*>(a.workspace) + rows * a.head_dim * sizeof(float));
    }

    // Rows past max_query_len are covered by no kernel; they are padding and read as zeros.
    if (plan.rows_seq < a.seq) {
        const size_t bytes = static_cast<size_t>(a.batch) * a.num_heads * a.seq * a.head_dim * 2;
        const int zeroed = cuda_status(cudaMemsetAsync(a.output, 0, bytes, stream));
        if (zeroed != LLMC_OK) return zeroed;
    }
    return cuda_status(a.dtype == LLMC_DTYPE_BF16 ? launch_all<__nv_bfloat16>(p, plan, rope, stream)
                                                  : launch_all<__half>(p, plan, rope, stream));
}

extern "C" const char* llmc_error_string(int status) {
    switch (status) {
        case LLMC_OK: return "ok";
        case LLMC_ERR_NULL_POINTER: return "a required pointer is null";
        case LLMC_ERR_BAD_SHAPE: return "a dimension is out of range (negative, or zero heads/blocks/block size)";
        case LLMC_ERR_HEAD_DIM: return "head_dim must be 64 or 128";
        case LLMC_ERR_DTYPE: return "dtype must be fp16 or bf16";
        case LLMC_ERR_HEADS: return "num_kv_heads must divide num_heads";
        case LLMC_ERR_ALIGNMENT: return "query, key, value, cache, output and workspace must be 16-byte aligned";
        case LLMC_ERR_ATTRIBUTE: return "sliding_window and softcap must be >= 0 and scale finite";
        case LLMC_ERR_CUDA: return "a CUDA kernel launch failed (llmc_last_cuda_error() says why)";
        case LLMC_ERR_ROTARY:
            return "rotary_dim must be even, >= 0 and <= head_dim, rotary_interleaved 0 or 1, and rope_cos and "
                   "rope_sin both set when rotary_dim > 0 and both null when it is 0";
        default: return "unknown llmc attention status";
    }
}

extern "C" const char* llmc_last_cuda_error(void) { return cudaGetErrorString(llmc::last_cuda_error); }

extern "C" int llmc_attention_abi_version(void) { return LLMC_ATTENTION_ABI_VERSION; }

extern "C" size_t llmc_attention_args_size(void) { return sizeof(LlmcPagedAttentionArgs); }
