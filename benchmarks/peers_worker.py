"""Worker side of benchmarks/peers.py: one runtime per process, driven over a JSON-lines pipe.

    python benchmarks/peers_worker.py serve {llmc,llama.cpp,ort-genai,bandwidth} --model PATH --threads N
    python benchmarks/peers_worker.py convert-gguf --src HF_DIR --out FILE.gguf --llama-cpp SRC_DIR

This file runs under two interpreters: the repo's venv (llmc, bandwidth) and the peers' venv
(llama.cpp, ORT GenAI), so at module level it imports only the standard library and numpy, and
each backend imports its own runtime lazily.

Protocol: the driver writes one JSON request per line on stdin; the worker answers one JSON line
on the protocol pipe, which is the process's original stdout. fd 1 itself is pointed at stderr
before any runtime loads, so a C library printing to stdout cannot corrupt the protocol.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import numpy as np


# -- llmc ---------------------------------------------------------------------------------------


class LlmcBackend:
    def __init__(self, engine_dir: str, threads: int, max_seqs: int):
        from llmc.runtime.llm import LLM

        # Cold prefill every time: the repeated prompt would otherwise hit the prefix cache,
        # which no peer has enabled here.
        self.llm = LLM(engine_dir, num_threads=threads, max_num_seqs=max(max_seqs, 8),
                       enable_prefix_caching=False)
        manifest = self.llm.engine.manifest
        self.info = {"runtime": "llmc", "engine": str(engine_dir), "threads": threads,
                     "disabled_passes": list(manifest.build_options.disable_passes), "kv_dtype": manifest.kv_cache.dtype}

    def _params(self, n: int):
        from llmc.runtime.sampling import SamplingParams

        return SamplingParams(max_tokens=n, ignore_eos=True)  # temperature 0 = greedy

    def greedy(self, prompt, n):
        return [int(t) for t in self.llm.generate(prompt, self._params(n)).token_ids]

    def latency(self, prompt, n):
        # Metrics come from llmc.runtime.metrics: TTFT = first token - arrival (add_request),
        # TPOT = (E2E - TTFT) / (n - 1). The peers below time exactly the same span.
        out = self.llm.generate(prompt, self._params(n))
        assert len(out.token_ids) == n, (len(out.token_ids), n)
        return {"ttft": out.metrics.ttft, "tpot": out.metrics.tpot}

    def decode(self, prompts, steps):
        llm = self.llm
        ids = [llm.add_request(p, self._params(steps + 1)) for p in prompts]
        outs = [llm.output(i) for i in ids]
        while any(not o.token_ids for o in outs):  # prefills (chunked), untimed
            llm.step()
        start = time.perf_counter()
        for _ in range(steps):  # every step decodes all len(prompts) sequences
            llm.step()
        seconds = time.perf_counter() - start
        assert all(len(o.token_ids) == steps + 1 for o in outs)
        assert not llm.has_unfinished()
        return {"tok_s": len(prompts) * steps / seconds}


# -- llama.cpp (llama-cpp-python, low-level C API) -------------------------------------------------


class LlamaCppBackend:
    def __init__(self, gguf: str, threads: int, max_seqs: int, ctx_per_seq: int, kv_type: str):
        import llama_cpp as ll

        self.ll = ll
        ll.llama_backend_init()
        mparams = ll.llama_model_default_params()
        mparams.n_gpu_layers = 0
        self.model = ll.llama_model_load_from_file(gguf.encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        self.n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(self.model))
        kv = {"f32": ll.GGML_TYPE_F32, "f16": ll.GGML_TYPE_F16}[kv_type]

        def context(n_seq: int):
            p = ll.llama_context_default_params()
            p.n_ctx = n_seq * ctx_per_seq  # split per sequence when n_seq > 1 (kv_unified off)
            p.n_seq_max = n_seq
            p.n_batch = p.n_ubatch = max(512, n_seq * 128)  # a whole prompt batch in one ubatch
            p.n_threads = p.n_threads_batch = threads
            p.type_k = p.type_v = kv
            p.no_perf = True
            ctx = ll.llama_init_from_model(self.model, p)
            if not ctx:
                raise RuntimeError(f"llama.cpp could not create a context for {n_seq} sequences")
            return ctx

        # One context per shape, both made up front so no allocation lands inside a measurement.
        self.ctx1, self.ctxn = context(1), context(max_seqs)
        self.batch = ll.llama_batch_init(max_seqs * ctx_per_seq, 0, 1)
        self.info = {"runtime": "llama.cpp", "gguf": gguf, "threads": threads, "kv_type": kv_type,
                     "llama_cpp_python": ll.__version__,
                     "system_info": ll.llama_print_system_info().decode(errors="replace").strip()}

    def _fill(self, items):
        """items: (token, pos, seq, want_logits) rows into the shared batch."""
        b = self.batch
        for i, (tok, pos, seq, logits) in enumerate(items):
            b.token[i] = tok
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = logits
        b.n_tokens = len(items)

    def _decode(self, ctx):
        rc = self.ll.llama_decode(ctx, self.batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def _logits(self, ctx, i):
        ptr = self.ll.llama_get_logits_ith(ctx, i)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))

    def _clear(self, ctx):
        self.ll.llama_memory_clear(self.ll.llama_get_memory(ctx), True)

    def _run1(self, prompt, n):
        """Greedy batch-1 generation; returns tokens and the perf_counter time of each."""
        ctx = self.ctx1
        self._clear(ctx)
        times, tokens = [], []
        self._fill([(t, p, 0, p == len(prompt) - 1) for p, t in enumerate(prompt)])
        self._decode(ctx)
        tok = int(self._logits(ctx, len(prompt) - 1).argmax())
        times.append(time.perf_counter())
        tokens.append(tok)
        for pos in range(len(prompt), len(prompt) + n - 1):
            self._fill([(tok, pos, 0, True)])
            self._decode(ctx)
            tok = int(self._logits(ctx, 0).argmax())
            times.append(time.perf_counter())
            tokens.append(tok)
        return tokens, times

    def greedy(self, prompt, n):
        return self._run1(prompt, n)[0]

    def forced(self, prompt, cont):
        """Top-1 after the prompt and after each prefix of `cont` (teacher forcing), with margins."""
        ctx = self.ctx1
        self._clear(ctx)
        seq = list(prompt) + list(cont[:-1])
        self._fill([(t, p, 0, p >= len(prompt) - 1) for p, t in enumerate(seq)])
        self._decode(ctx)
        out = []
        for k in range(len(cont)):
            logits = self._logits(ctx, len(prompt) - 1 + k)
            top2 = np.partition(logits, -2)[-2:]
            out.append((int(logits.argmax()), float(top2[1] - top2[0])))
        return out

    def latency(self, prompt, n):
        start = time.perf_counter()
        tokens, times = self._run1(prompt, n)
        return {"ttft": times[0] - start, "tpot": (times[-1] - times[0]) / (n - 1)}

    def decode(self, prompts, steps):
        ctx = self.ctxn
        self._clear(ctx)
        rows = [(t, p, s, p == len(pr) - 1) for s, pr in enumerate(prompts) for p, t in enumerate(pr)]
        self._fill(rows)
        self._decode(ctx)  # all prefills in one batch, untimed
        last = np.cumsum([len(p) for p in prompts]) - 1
        toks = [int(self._logits(ctx, int(i)).argmax()) for i in last]
        pos = [len(p) for p in prompts]
        start = time.perf_counter()
        for _ in range(steps):
            self._fill([(toks[s], pos[s], s, True) for s in range(len(prompts))])
            self._decode(ctx)
            toks = [int(self._logits(ctx, s).argmax()) for s in range(len(prompts))]
            pos = [p + 1 for p in pos]
        seconds = time.perf_counter() - start
        return {"tok_s": len(prompts) * steps / seconds}


# -- ONNX Runtime GenAI ---------------------------------------------------------------------------


class OrtGenAIBackend:
    def __init__(self, model_dir: str, threads: int):
        import onnxruntime_genai as og

        self.og = og
        cfg = og.Config(model_dir)
        # The same thread budget as everyone: ORT's intra-op pool, no inter-op parallelism.
        cfg.overlay(json.dumps({"model": {"decoder": {"session_options": {
            "intra_op_num_threads": threads, "inter_op_num_threads": 1}}}}))
        self.model = og.Model(cfg)
        self.info = {"runtime": "ort-genai", "model": model_dir, "threads": threads,
                     "onnxruntime_genai": getattr(og, "__version__", "?")}

    def _generator(self, batch, total_len):
        params = self.og.GeneratorParams(self.model)
        # min_length = max_length: no early stop at EOS, like ignore_eos elsewhere. max_length
        # also sizes the KV buffer, so it is the real need rather than the 8192 default.
        params.set_search_options(max_length=total_len, min_length=total_len, do_sample=False,
                                  batch_size=batch)
        return self.og.Generator(self.model, params)

    def _run1(self, prompt, n):
        # The generator is ORT GenAI's per-request object, so making it is part of the request.
        gen = self._generator(1, len(prompt) + n)
        self.made = time.perf_counter()
        gen.append_tokens(np.asarray([prompt], dtype=np.int32))  # runs the prefill
        times, tokens = [], []
        for _ in range(n):
            gen.generate_next_token()  # first call samples the prefill's logits; later ones decode
            times.append(time.perf_counter())
            tokens.append(int(gen.get_next_tokens()[0]))
        return tokens, times

    def greedy(self, prompt, n):
        return self._run1(prompt, n)[0]

    def forced(self, prompt, cont):
        gen = self._generator(1, len(prompt) + len(cont))
        out = []
        gen.append_tokens(np.asarray([prompt], dtype=np.int32))
        for k in range(len(cont)):
            logits = np.asarray(gen.get_logits())
            logits = logits.reshape(-1, logits.shape[-1])[-1]  # the last position's row
            top2 = np.partition(logits, -2)[-2:]
            out.append((int(logits.argmax()), float(top2[1] - top2[0])))
            if k + 1 < len(cont):
                gen.append_tokens(np.asarray([[cont[k]]], dtype=np.int32))
        return out

    def latency(self, prompt, n):
        start = time.perf_counter()
        tokens, times = self._run1(prompt, n)
        # "setup" (making the Generator) is inside TTFT; reported so a reader can take it out.
        return {"ttft": times[0] - start, "tpot": (times[-1] - times[0]) / (n - 1), "setup": self.made - start}

    def decode(self, prompts, steps):
        gen = self._generator(len(prompts), len(prompts[0]) + steps + 1)
        gen.append_tokens(np.asarray(prompts, dtype=np.int32))
        gen.generate_next_token()  # samples the first token from the prefill; untimed
        start = time.perf_counter()
        for _ in range(steps):
            gen.generate_next_token()
        seconds = time.perf_counter() - start
        return {"tok_s": len(prompts) * steps / seconds}


# -- DRAM read bandwidth ----------------------------------------------------------------------------


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
    fn = ctypes.CDLL(lib).read_sum
    fn.restype = ctypes.c_float
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
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
            method = f"C AVX-512 read kernel, {threads} OpenMP threads, {mib} MiB float32 buffer, best pass"
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


# -- serving loop -------------------------------------------------------------------------------------


def serve(args) -> None:
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything a runtime prints to stdout now lands in the log, not the protocol
    sys.stdout = sys.stderr

    def send(obj):
        proto.write(json.dumps(obj) + "\n")

    try:
        if args.backend == "llmc":
            backend = LlmcBackend(args.model, args.threads, args.max_seqs)
        elif args.backend == "llama.cpp":
            backend = LlamaCppBackend(args.model, args.threads, args.max_seqs, args.ctx_per_seq, args.kv_type)
        elif args.backend == "ort-genai":
            backend = OrtGenAIBackend(args.model, args.threads)
        else:
            backend = BandwidthBackend(args.threads, args.buffer_mib, args.cache)
    except Exception as exc:
        traceback.print_exc()
        send({"error": f"{type(exc).__name__}: {exc}"})
        return
    send({"ready": True, "info": backend.info, "pid": os.getpid()})
    for line in sys.stdin:
        req = json.loads(line)
        cmd = req.pop("cmd")
        if cmd == "quit":
            break
        try:
            send({"result": getattr(backend, cmd)(**req)})
        except Exception as exc:
            traceback.print_exc()
            send({"error": f"{cmd}: {type(exc).__name__}: {exc}"})


# -- GGUF conversion ----------------------------------------------------------------------------------


def convert_gguf(args) -> None:
    """Run llama.cpp's convert_hf_to_gguf.py with one documented workaround.

    The converter names a BPE tokenizer's pre-tokenizer by hashing how it splits a fixed text,
    and refuses hashes it does not list. llmc's tokenizer is trained in this repo, so its hash is
    unknown, but its pre-tokenizer is exactly GPT-2's: a ByteLevel step with GPT-2's regex
    (use_regex=true) and nothing else. For such a tokenizer, and only then, an unrecognised
    hash is answered with "gpt-2", the name llama.cpp uses for that regex. Anything else still
    fails as upstream would. The benchmark feeds token ids, so the tokenizer never touches timing.
    """
    src = os.path.abspath(args.llama_cpp)
    sys.path.insert(0, src)
    sys.path.insert(1, os.path.join(src, "gguf-py"))
    from conversion.base import TextModel

    original = TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer):
        try:
            return original(self, tokenizer)
        except NotImplementedError:
            with open(os.path.join(self.dir_model, "tokenizer.json"), encoding="utf-8") as f:
                pre = json.load(f).get("pre_tokenizer") or {}
            if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
                print("peers: unknown BPE pre-tokenizer hash; it is a plain GPT-2 ByteLevel regex "
                      "split, so using tokenizer.ggml.pre = 'gpt-2'", file=sys.stderr)
                return "gpt-2"
            raise

    TextModel.get_vocab_base_pre = get_vocab_base_pre
    sys.argv = ["convert_hf_to_gguf.py", args.src, "--outfile", args.out, "--outtype", args.outtype,
                *args.extra]
    import runpy

    runpy.run_path(os.path.join(src, "convert_hf_to_gguf.py"), run_name="__main__")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="mode", required=True)
    s = sub.add_parser("serve")
    s.add_argument("backend", choices=["llmc", "llama.cpp", "ort-genai", "bandwidth"])
    s.add_argument("--model", default="")
    s.add_argument("--threads", type=int, default=2)
    s.add_argument("--max-seqs", type=int, default=8)
    s.add_argument("--ctx-per-seq", type=int, default=512)
    s.add_argument("--kv-type", choices=["f32", "f16"], default="f16")
    s.add_argument("--buffer-mib", type=int, default=1024)
    s.add_argument("--cache", default="", help="where the bandwidth kernel is compiled to")
    c = sub.add_parser("convert-gguf")
    c.add_argument("--src", required=True)
    c.add_argument("--out", required=True)
    c.add_argument("--llama-cpp", required=True, help="llama.cpp source tree (vendor/llama.cpp of the sdist)")
    c.add_argument("--outtype", default="f32")
    c.add_argument("extra", nargs="*", help="more converter flags, after --")
    args = ap.parse_args()
    if args.mode == "serve":
        serve(args)
    else:
        convert_gguf(args)


if __name__ == "__main__":
    main()
