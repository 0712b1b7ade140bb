/* What the kernel sources share to vectorize portably. */
#ifndef LLMC_SIMD_H
#define LLMC_SIMD_H

#include <math.h>
#include <stdint.h>

/* Each exported kernel is cloned for AVX-512, AVX2 + FMA and baseline x86-64; the loader picks the
 * best the CPU has, so one build runs anywhere. In target_clones a comma separates clones, so the
 * middle one cannot be "avx2,fma" (that makes an AVX2 clone without FMA, which the resolver picks
 * over an FMA one without AVX2): it is the x86-64-v3 level (AVX2, FMA, F16C, BMI1/2), which GCC's
 * resolver ranks below avx512f and above everything else. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define LLMC_CLONES __attribute__((target_clones("avx512f", "arch=x86-64-v3", "default")))
#else
#define LLMC_CLONES
#endif

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

/* What Python calls through ctypes (the library is built with hidden visibility). */
#define LLMC_EXPORT __attribute__((visibility("default")))

/* 16 floats: one AVX-512 register (two AVX2 ones in the x86-64-v3 clone). GCC/clang's vector
 * extension keeps register-blocked loops portable across the clones. */
typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4), may_alias));
#define VLOAD(p) (*(const v16u *)(p))
#define VSTORE(p, v) (*(v16u *)(p) = (v))

/* Fetch the cache line at p towards L1, inside register-blocked loops. GCC's __builtin_prefetch
 * counts as a memory access there and demotes the loop's accumulator arrays to the stack (a
 * store per FMA); the asm form names only the address, so they stay in registers. */
#if defined(__x86_64__) && defined(__GNUC__)
#define PREFETCH(p) __asm__("prefetcht0 (%0)" : : "r"(p))
#define PREFETCH_ONCE(p) __asm__("prefetchnta (%0)" : : "r"(p))
#else
#define PREFETCH(p) __builtin_prefetch((p), 0, 3)
#define PREFETCH_ONCE(p) __builtin_prefetch((p), 0, 0)
#endif
#if defined(__x86_64__) && defined(__GNUC__)
#include <stdlib.h>
/* Whether the environment variable `name` is set to 1: how the tests steer the kernels off a path. */
static inline int llmc_env_on(const char *name) {
    const char *value = getenv(name);
    return value != NULL && value[0] == '1';
}

/* Whether the hand-written AVX2 paths may run: the CPU has AVX2, FMA and F16C, and
 * LLMC_CPU_PLAIN=1 in the environment (which the tests also run) does not force the portable
 * code. Kernels whose AVX-512 clone is the better path also check for avx512f. */
static inline int llmc_avx2(void) {
    static int cached = -1;
    if (cached < 0)
        cached = !llmc_env_on("LLMC_CPU_PLAIN") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                 __builtin_cpu_supports("f16c");
    return cached;
}
#endif

/* PREFETCH_ONCE is for data read once and not again soon (a weight streamed by a single pass):
 * the non-temporal hint keeps it from displacing what the caches hold for the rest of the step.
 * PREFETCH_FOR picks between the two by whether this pass is the data's only one. */
#define PREFETCH_FOR(once, p)                                                                      \
    do {                                                                                           \
        if (once)                                                                                  \
            PREFETCH_ONCE(p);                                                                      \
        else                                                                                       \
            PREFETCH(p);                                                                           \
    } while (0)

/* TILE(..., R) for rows = R, each R a constant: register-blocked tiles are specialized per row
 * count, so a product of up to LLMC_ROWS_<max> rows takes one pass over its weights (a speculative
 * step's k + 1 rows, or an in-flight batch of 5, rather than 4 rows and another pass for 1). */
#define LLMC_ROWS_2(rows, TILE, ...)                                                               \
    switch (rows) {                                                                                \
    case 2: TILE(__VA_ARGS__, 2); break;                                                           \
    default: TILE(__VA_ARGS__, 1); break;                                                          \
    }
#define LLMC_ROWS_3(rows, TILE, ...)                                                               \
    switch (rows) {                                                                                \
    case 3: TILE(__VA_ARGS__, 3); break;                                                           \
    default: LLMC_ROWS_2(rows, TILE, __VA_ARGS__);                                                 \
    }
#define LLMC_ROWS_4(rows, TILE, ...)                                                               \
    switch (rows) {                                                                                \
    case 4: TILE(__VA_ARGS__, 4); break;                                                           \
    case 3: TILE(__VA_ARGS__, 3); break;                                                           \
    default: LLMC_ROWS_2(rows, TILE, __VA_ARGS__);                                                 \
    }
#define LLMC_ROWS_8(rows, TILE, ...)                                                               \
    switch (rows) {                                                                                \
    case 8: TILE(__VA_ARGS__, 8); break;                                                           \
    case 7: TILE(__VA_ARGS__, 7); break;                                                           \
    case 6: TILE(__VA_ARGS__, 6); break;                                                           \
    case 5: TILE(__VA_ARGS__, 5); break;                                                           \
    default: LLMC_ROWS_4(rows, TILE, __VA_ARGS__);                                                 \
    }
#define LLMC_ROWS_12(rows, TILE, ...)                                                              \
    switch (rows) {                                                                                \
    case 12: TILE(__VA_ARGS__, 12); break;                                                         \
    case 11: TILE(__VA_ARGS__, 11); break;                                                         \
    case 10: TILE(__VA_ARGS__, 10); break;                                                         \
    case 9: TILE(__VA_ARGS__, 9); break;                                                           \
    default: LLMC_ROWS_8(rows, TILE, __VA_ARGS__);                                                 \
    }

#endif
