"""DRAM read bandwidth, the roofline's denominator: a worker backend of its own, measured next to
every measurement."""

from __future__ import annotations

import os
import time

import numpy as np

READ_KERNEL = r"""
#include <immintrin.h>
#include <omp.h>
#include <stddef.h>
/* Sums a float buffer: each OpenMP thread streams its contiguous slice through four independent
   vector accumulators, so the loop is bound by how fast memory delivers, not by add latency. */
float read_sum(const float *p, size_t n, int threads) {
    float total = 0.f;
    #pragma omp parallel num_threads(threads) reduction(+:total)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        size_t chunk = (n / nt) & ~(size_t)63, lo = t * chunk, hi = (t == nt - 1) ? n : lo + chunk, i = lo;
#if defined(__AVX512F__)
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (; i + 64 <= hi; i += 64) {
            a0 = _mm512_add_ps(a0, _mm512_loadu_ps(p + i));
            a1 = _mm512_add_ps(a1, _mm512_loadu_ps(p + i + 16));
            a2 = _mm512_add_ps(a2, _mm512_loadu_ps(p + i + 32));
            a3 = _mm512_add_ps(a3, _mm512_loadu_ps(p + i + 48));
        }
        float s = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
#elif defined(__AVX2__)
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (; i + 32 <= hi; i += 32) {
            a0 = _mm256_add_ps(a0, _mm256_loadu_ps(p + i));
            a1 = _mm256_add_ps(a1, _mm256_loadu_ps(p + i + 8));
            a2 = _mm256_add_ps(a2, _mm256_loadu_ps(p + i + 16));
            a3 = _mm256_add_ps(a3, _mm256_loadu_ps(p + i + 24));
        }
        __m256 v = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
        float lanes[8];
        _mm256_storeu_ps(lanes, v);
        float s = lanes[0] + lanes[1] + lanes[2] + lanes[3] + lanes[4] + lanes[5] + lanes[6] + lanes[7];
#else
        float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
        for (; i + 4 <= hi; i += 4) { s0 += p[i]; s1 += p[i + 1]; s2 += p[i + 2]; s3 += p[i + 3]; }
        float s = s0 + s1 + s2 + s3;
#endif
        for (; i < hi; i++) s += p[i];
        total += s;
    }
    return total;
}
/* Which vector width the loop above was compiled with, for the method string. */
int read_isa(void) {
#if defined(__AVX512F__)
    return 512;
#elif defined(__AVX2__)
    return 256;
#else
    return 0;
#endif
}
"""


def _read_kernel(cache: str):
    """The C read kernel, compiled for this CPU once per source and cached; None without a compiler."""
    import ctypes
    import hashlib
    import shutil
    import subprocess

    cc = shutil.which("cc") or shutil.which("gcc")
    if not cc or not cache:
        return None, "no C compiler" if not cc else "no cache dir"
    os.makedirs(cache, exist_ok=True)
    tag = hashlib.sha256(READ_KERNEL.encode()).hexdigest()[:12]
    lib = os.path.join(cache, f"read_sum-{tag}.so")
    if not os.path.isfile(lib):
        src = os.path.join(cache, f"read_sum-{tag}.c")
        with open(src, "w") as f:
            f.write(READ_KERNEL)
        tmp = f"{lib}.{os.getpid()}.tmp"
        r = subprocess.run([cc, "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", src, "-o", tmp],
                           capture_output=True, text=True)
        if r.returncode != 0:
            return None, f"compile failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}"
        os.replace(tmp, lib)
    so = ctypes.CDLL(lib)
    fn = so.read_sum
    fn.restype = ctypes.c_float
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.isa = {512: "AVX-512", 256: "AVX2"}.get(so.read_isa(), "scalar")
    return fn, lib


class BandwidthBackend:
    """DRAM read bandwidth of `threads` threads streaming a buffer far larger than any cache.

    Preferred: a tiny C kernel compiled here with -O3 -march=native -fopenmp (AVX-512 loads into
    four accumulators per thread, ctypes releases the GIL). Fallback without a compiler: numpy's
    SIMD np.max over one slice per Python thread, which reads ~10% slower on this machine, so its
    roofline is looser, and the method string says which one ran. A pass is the wall time until
    every thread is done; the result is the best of `passes`, as STREAM reports: the rate memory
    can deliver, which is what a roofline needs.
    """

    def __init__(self, threads: int, mib: int, cache: str):
        self.threads = threads
        self.buf = np.ones(mib * 2**20 // 4, dtype=np.float32)  # touched now: no page faults later
        self.kernel, note = _read_kernel(cache)
        if self.kernel is not None:
            method = f"C {self.kernel.isa} read kernel, {threads} OpenMP threads, {mib} MiB float32 buffer, best pass"
        else:
            from concurrent.futures import ThreadPoolExecutor

            self.slices = np.array_split(self.buf, threads)
            self.pool = ThreadPoolExecutor(threads)
            method = f"np.max, {threads} Python threads, {mib} MiB float32 buffer, best pass (C kernel: {note})"
        self.info = {"runtime": "bandwidth", "threads": threads, "buffer_mib": mib, "method": method}

    def _pass(self):
        if self.kernel is not None:
            self.kernel(self.buf.ctypes.data, self.buf.size, self.threads)
        else:
            list(self.pool.map(np.max, self.slices))

    def bandwidth(self, passes):
        best = 0.0
        for _ in range(passes):
            start = time.perf_counter()
            self._pass()
            best = max(best, self.buf.nbytes / (time.perf_counter() - start))
        return {"bytes_per_s": best}
