/* What the kernel sources share to vectorize portably. */
#ifndef LLMC_SIMD_H
#define LLMC_SIMD_H

/* Each exported kernel is cloned for AVX-512, AVX2 and baseline x86-64; the loader picks the
 * best the CPU has, so one build runs anywhere. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define LLMC_CLONES __attribute__((target_clones("avx512f", "avx2,fma", "default")))
#else
#define LLMC_CLONES
#endif

/* 16 floats: one AVX-512 register (two AVX2 ones in the avx2 clone). GCC/clang's vector
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
/* PREFETCH_ONCE is for data read once and not again soon (a weight streamed by a single pass):
 * the non-temporal hint keeps it from displacing what the caches hold for the rest of the step. */

#endif
