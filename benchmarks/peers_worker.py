"""Worker side of benchmarks/peers.py: one runtime per process, driven over a JSON-lines pipe.

    python benchmarks/peers_worker.py serve {llmc,llama.cpp,llama.cpp-lookup,ort-genai,bandwidth} --model PATH --threads N
    python benchmarks/peers_worker.py convert-gguf --src HF_DIR --out FILE.gguf --llama-cpp SRC_DIR
    python benchmarks/peers_worker.py quantize-gguf --src F32.gguf --out FILE.gguf --ftype {f16,bf16,q8_0,q4_0,q4_k_m}

This file runs under two interpreters: the repo's venv (llmc, bandwidth) and the peers' venv
(llama.cpp, ORT GenAI), so at module level it imports only the standard library and numpy, and
each backend imports its own runtime lazily.

Besides timing, every model backend answers `accuracy` (benchmarks/quant_accuracy.py): the logits
it gives at chosen positions of token windows, held against a reference's logits saved to an .npy
file, so only per-token numbers (KL, NLL, top-1 match) travel back over the pipe.

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


# -- accuracy against reference logits -----------------------------------------------------------

_ROWS = 64  # rows per float64 log-softmax, as llmc.bench.eval


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    x -= np.log(np.exp(x).sum(axis=-1, keepdims=True))
    return x


def token_stats(logits: np.ndarray, targets: np.ndarray, ref_logits: np.ndarray):
    """Per token, exactly as llmc.bench.eval._token_stats: NLL of the target under `logits` and
    under the reference, KL(reference || logits) in nats over the whole vocabulary (float64), and
    whether both argmaxes agree."""
    n = len(targets)
    nll, ref_nll, kl = np.empty(n), np.empty(n), np.empty(n)
    for start in range(0, n, _ROWS):
        rows = slice(start, start + _ROWS)
        ar = np.arange(len(targets[rows]))
        lq = _log_softmax(logits[rows])
        lp = _log_softmax(ref_logits[rows])
        nll[rows] = -lq[ar, targets[rows]]
        ref_nll[rows] = -lp[ar, targets[rows]]
        kl[rows] = (np.exp(lp) * (lp - lq)).sum(axis=-1)
    return nll, ref_nll, kl, logits.argmax(axis=-1) == ref_logits.argmax(axis=-1)


def accuracy(window_logits, plan: str, ref: str, vocab: int) -> dict:
    """Runs `window_logits(tokens, need) -> [len(need), >= vocab]` over every window of `plan`
    (an .npz: `tokens`, the windows' tokens end to end, and `windows`, rows of (token offset,
    length, first needed position, count, reference row)) and holds each position's logits,
    sliced to the model's `vocab` (a GGUF vocabulary may be padded), against the reference's
    row in `ref` (an .npy [rows, vocab], memory-mapped). Windows are independent sequences from
    position 0, as llmc eval runs them."""
    p = np.load(plan)
    tokens, wins = p["tokens"], p["windows"]
    reference = np.load(ref, mmap_mode="r")
    out = {"nll": [], "ref_nll": [], "kl": [], "same": []}
    start = time.perf_counter()
    for off, length, first, count, row in wins.tolist():
        toks = tokens[off:off + length]
        need = np.arange(first, first + count)
        logits = np.asarray(window_logits(toks, need), dtype=np.float32)[:, :vocab]
        nll, ref_nll, kl, same = token_stats(logits, toks[need + 1].astype(np.int64),
                                             np.asarray(reference[row:row + count]))
        out["nll"] += nll.tolist()
        out["ref_nll"] += ref_nll.tolist()
        out["kl"] += kl.tolist()
        out["same"] += [bool(x) for x in same]
    out["seconds"] = time.perf_counter() - start
    return out


# -- llmc ---------------------------------------------------------------------------------------


class LlmcBackend:
    def __init__(self, engine_dir: str, threads: int, max_seqs: int, speculative: str | None = None,
                 num_speculative_tokens: int | None = None):
        from llmc.runtime.llm import LLM

        # Cold prefill every time: the repeated prompt would otherwise hit the prefix cache,
        # which no peer has enabled here.
        self.llm = LLM(engine_dir, num_threads=threads, max_num_seqs=max(max_seqs, 8),
                       enable_prefix_caching=False, speculative=speculative,
                       num_speculative_tokens=num_speculative_tokens)
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
        llm = self.llm
        out = llm.output(llm.add_request(prompt, self._params(n)))
        while not out.token_ids:
            llm.step()
        read = _experts_bytes_read()
        while llm.has_unfinished():
            llm.step()
        assert len(out.token_ids) == n, (len(out.token_ids), n)
        m = out.metrics
        return {"ttft": m.ttft, "tpot": m.tpot, "tokens": [int(t) for t in out.token_ids],
                "steps": m.decode_steps, "proposed": m.proposed_tokens, "accepted": m.accepted_tokens,
                "expert_bytes": (_experts_bytes_read() - read) / max(m.decode_steps, 1)}

    def decode(self, prompts, steps):
        llm = self.llm
        ids = [llm.add_request(p, self._params(steps + 1)) for p in prompts]
        outs = [llm.output(i) for i in ids]
        while any(not o.token_ids for o in outs):  # prefills (chunked), untimed
            llm.step()
        read = _experts_bytes_read()
        start = time.perf_counter()
        for _ in range(steps):  # every step decodes all len(prompts) sequences
            llm.step()
        seconds = time.perf_counter() - start
        assert all(len(o.token_ids) == steps + 1 for o in outs)
        assert not llm.has_unfinished()
        return {"tok_s": len(prompts) * steps / seconds, "expert_bytes": (_experts_bytes_read() - read) / steps}


def _experts_bytes_read() -> int:
    """The expert weight bytes llmc.cpu::Experts has read in this process (0 without the kernels)."""
    import ctypes

    from llmc.plugins.cpu.library import library_path, native

    if library_path() is None:
        return 0
    counter = native(library_path()).llmc_experts_bytes_read
    counter.restype = ctypes.c_uint64
    return counter()


# -- llama.cpp (llama-cpp-python, low-level C API) -------------------------------------------------


class LlamaCppBackend:
    def __init__(self, gguf: str, threads: int, max_seqs: int, ctx_per_seq: int, kv_type: str,
                 flash_attn: str = "auto"):
        import llama_cpp as ll

        self.ll = ll
        ll.llama_backend_init()
        mparams = ll.llama_model_default_params()
        mparams.n_gpu_layers = 0
        self.model = ll.llama_model_load_from_file(gguf.encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        self.n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(self.model))
        kv = {"f32": ll.GGML_TYPE_F32, "f16": ll.GGML_TYPE_F16, "q8_0": ll.GGML_TYPE_Q8_0}[kv_type]
        # A quantized V cache needs flash attention; "auto" (llama.cpp's default) leaves the choice to it.
        fa = {"auto": ll.LLAMA_FLASH_ATTN_TYPE_AUTO, "on": ll.LLAMA_FLASH_ATTN_TYPE_ENABLED,
              "off": ll.LLAMA_FLASH_ATTN_TYPE_DISABLED}[flash_attn]

        def context(n_seq: int):
            p = ll.llama_context_default_params()
            p.n_ctx = n_seq * ctx_per_seq  # split per sequence when n_seq > 1 (kv_unified off)
            p.n_seq_max = n_seq
            p.n_batch = p.n_ubatch = max(512, n_seq * 128)  # a whole prompt batch in one ubatch
            p.n_threads = p.n_threads_batch = threads
            p.type_k = p.type_v = kv
            p.flash_attn_type = fa
            p.no_perf = True
            ctx = ll.llama_init_from_model(self.model, p)
            if not ctx:
                raise RuntimeError(f"llama.cpp could not create a context for {n_seq} sequences")
            return ctx

        # One context per shape, both made up front so no allocation lands inside a measurement.
        self.ctx1 = context(1)
        self.ctxn = context(max_seqs) if max_seqs > 1 else self.ctx1
        self.batch = ll.llama_batch_init(max_seqs * ctx_per_seq, 0, 1)
        self.info = {"runtime": "llama.cpp", "gguf": gguf, "threads": threads, "kv_type": kv_type,
                     "flash_attn": flash_attn,
                     "ftype": ll.llama_model_ftype(self.model) if hasattr(ll, "llama_model_ftype") else None,
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

    def window_logits(self, tokens, need):
        """Logits at positions `need` of one window run from position 0 in a fresh cache."""
        ctx = self.ctx1
        self._clear(ctx)
        want = set(need.tolist())
        self._fill([(int(t), p, 0, p in want) for p, t in enumerate(tokens)])
        self._decode(ctx)
        return np.stack([self._logits(ctx, int(i)).copy() for i in need])

    def accuracy(self, plan, ref, vocab):
        return accuracy(self.window_logits, plan, ref, vocab)

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


class LlamaCppLookupBackend:
    """llama.cpp through llama-cpp-python's high-level Llama.generate, with its prompt-lookup draft
    (LlamaPromptLookupDecoding) or without one (num_pred_tokens 0): the API its users call for
    prompt-lookup decoding, greedy (temp 0), the same threads and f16 KV cache as the other rows."""

    def __init__(self, gguf: str, threads: int, ctx: int, lookup: int, max_ngram: int):
        from llama_cpp import GGML_TYPE_F16, Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = LlamaPromptLookupDecoding(max_ngram_size=max_ngram, num_pred_tokens=lookup) if lookup else None
        self.llm = Llama(gguf, n_ctx=ctx, n_batch=ctx, n_threads=threads, n_threads_batch=threads,
                         type_k=GGML_TYPE_F16, type_v=GGML_TYPE_F16, draft_model=draft, verbose=False)
        import llama_cpp

        self.info = {"runtime": "llama.cpp", "model": gguf, "threads": threads, "lookup": lookup,
                     "max_ngram": max_ngram, "llama_cpp_python": llama_cpp.__version__}

    def latency(self, prompt, n):
        # TTFT from the call to the first token, TPOT over the rest, as llmc.runtime.metrics.
        start = time.perf_counter()
        times, tokens = [], []
        gen = self.llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True)
        for token in gen:
            times.append(time.perf_counter())
            tokens.append(int(token))
            if len(tokens) == n:
                break
        gen.close()
        return {"ttft": times[0] - start, "tpot": (times[-1] - times[0]) / (n - 1), "tokens": tokens}


class OrtGenAIBackend:
    def __init__(self, model_dir: str, threads: int):
        import onnxruntime_genai as og

        self.og = og
        cfg = og.Config(model_dir)
        # The same thread budget as everyone: ORT's intra-op pool, no inter-op parallelism.
        cfg.overlay(json.dumps({"model": {"decoder": {"session_options": {
            "intra_op_num_threads": threads, "inter_op_num_threads": 1}}}}))
        self.model = og.Model(cfg)
        self.model_dir, self.threads = model_dir, threads
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

    def window_logits(self, tokens, need):
        """Logits at positions `need` of one window, from the builder's model.onnx run by onnxruntime
        (the library onnxruntime-genai itself loads) with an empty past: ORT GenAI's Generator hands
        out only the last position's logits, the graph (built without prune_lm_head) all of them."""
        if getattr(self, "session", None) is None:
            import onnxruntime as ort

            with open(os.path.join(self.model_dir, "genai_config.json")) as f:
                decoder = json.load(f)["model"]["decoder"]
            self.decoder = decoder
            so = ort.SessionOptions()
            so.intra_op_num_threads, so.inter_op_num_threads = self.threads, 1
            self.session = ort.InferenceSession(os.path.join(self.model_dir, decoder["filename"]), so,
                                                providers=["CPUExecutionProvider"])
        n = len(tokens)
        feeds = {}
        for i in self.session.get_inputs():
            if i.name == "input_ids":
                feeds[i.name] = np.asarray(tokens, np.int64)[None, :]
            elif i.name == "attention_mask":
                feeds[i.name] = np.ones((1, n), np.int64)
            elif i.name == "position_ids":
                feeds[i.name] = np.arange(n, dtype=np.int64)[None, :]
            elif i.name.startswith("past_key_values"):
                dtype = {"tensor(float)": np.float32, "tensor(float16)": np.float16}[i.type]
                dims = [d if isinstance(d, int) else None for d in i.shape]  # [batch, kv heads, past, head dim]
                feeds[i.name] = np.zeros((1, dims[1] or self.decoder["num_key_value_heads"], 0,
                                          dims[3] or self.decoder["head_size"]), dtype)
            else:
                raise RuntimeError(f"unexpected input {i.name} of the ORT GenAI model")
        logits = self.session.run(["logits"], feeds)[0]
        if logits.shape[1] != n:
            raise RuntimeError(f"the model returns {logits.shape[1]} positions' logits for {n} tokens; build it "
                               "without prune_lm_head")
        return logits[0, need].astype(np.float32)

    def accuracy(self, plan, ref, vocab):
        return accuracy(self.window_logits, plan, ref, vocab)

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


# -- serving loop -------------------------------------------------------------------------------------


def serve(args) -> None:
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything a runtime prints to stdout now lands in the log, not the protocol
    sys.stdout = sys.stderr

    def send(obj):
        proto.write(json.dumps(obj) + "\n")

    try:
        if args.backend == "llmc":
            backend = LlmcBackend(args.model, args.threads, args.max_seqs, args.speculative,
                                  args.num_speculative_tokens)
        elif args.backend == "llama.cpp-lookup":
            backend = LlamaCppLookupBackend(args.model, args.threads, args.ctx_per_seq, args.lookup, args.max_ngram)
        elif args.backend == "llama.cpp":
            backend = LlamaCppBackend(args.model, args.threads, args.max_seqs, args.ctx_per_seq, args.kv_type,
                                      args.flash_attn)
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
    hash is answered with "gpt-2", the name llama.cpp uses for that regex; for a Sequence of
    Digits(individual_digits) then that same ByteLevel step (the trained code models' tokenizer),
    with "starcoder", llama.cpp's name for single digits followed by GPT-2's regex. Anything else
    still fails as upstream would. The benchmark feeds token ids, so the tokenizer never touches timing.
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
            if byte_level(pre):
                print("peers: unknown BPE pre-tokenizer hash; it is a plain GPT-2 ByteLevel regex "
                      "split, so using tokenizer.ggml.pre = 'gpt-2'", file=sys.stderr)
                return "gpt-2"
            steps = (pre.get("pretokenizers") or []) if pre.get("type") == "Sequence" else []
            if (len(steps) == 2 and steps[0].get("type") == "Digits" and steps[0].get("individual_digits")
                    and byte_level(steps[1])):
                # StarCoder's: every digit on its own (llama.cpp's first regex, \p{N}), then GPT-2's.
                print("peers: unknown BPE pre-tokenizer hash; it is single digits then a GPT-2 ByteLevel "
                      "regex split, so using tokenizer.ggml.pre = 'starcoder'", file=sys.stderr)
                return "starcoder"
            raise

    def byte_level(step):
        return (step.get("type") == "ByteLevel" and step.get("use_regex", True)
                and not step.get("add_prefix_space", False))

    TextModel.get_vocab_base_pre = get_vocab_base_pre
    keep_embedding_rows(src)
    sys.argv = ["convert_hf_to_gguf.py", args.src, "--outfile", args.out, "--outtype", args.outtype,
                *args.extra]
    import runpy

    runpy.run_path(os.path.join(src, "convert_hf_to_gguf.py"), run_name="__main__")


def keep_embedding_rows(src: str) -> None:
    """The second workaround, for Gemma 3 only: its converter cuts the embedding to the
    tokenizer's token count (the rows past it are unused padding in Google's checkpoints). With
    llmc's 1024-token tokenizer standing in for the real one, that would turn a 262k-token model
    into a 1024-token one, whose LM head reads 256x fewer bytes than llmc's engine of the same
    checkpoint. Without a tokenizer.model (the case the GPT-2 vocabulary path handles, which pads
    the vocabulary to vocab_size as for every other family) the rows are kept."""
    sys.path.insert(0, src)
    from conversion.base import TextModel
    from conversion.gemma import Gemma3Model

    original = Gemma3Model.modify_tensors

    def modify_tensors(self, data_torch, name, bid):
        if "embed_tokens.weight" in name and not (self.dir_model / "tokenizer.model").is_file():
            yield from TextModel.modify_tensors(self, data_torch, name, bid)  # no norm shift: not a norm
            return
        yield from original(self, data_torch, name, bid)

    Gemma3Model.modify_tensors = modify_tensors


# llama_ftype names of llama.cpp's include/llama.h (LLAMA_FTYPE_MOSTLY_*), as peers.py spells them.
GGUF_FTYPES = {"f16": "F16", "bf16": "BF16", "q8_0": "Q8_0", "q4_0": "Q4_0", "q4_k_m": "Q4_K_M"}


def quantize_gguf(args) -> None:
    """llama.cpp's own quantizer (what `llama-quantize` runs) through llama-cpp-python's C API:
    llama_model_quantize with llama_model_quantize_default_params() and only the ftype set, so
    the output tensor, the embedding and the 1-d tensors get the types llama.cpp picks for that
    ftype by default (no importance matrix)."""
    import ctypes

    import llama_cpp as ll

    ll.llama_backend_init()
    params = ll.llama_model_quantize_default_params()
    params.ftype = getattr(ll, f"LLAMA_FTYPE_MOSTLY_{GGUF_FTYPES[args.ftype]}")
    params.nthread = args.threads
    rc = ll.llama_model_quantize(args.src.encode(), args.out.encode(), ctypes.byref(params))
    if rc != 0:
        raise SystemExit(f"llama_model_quantize returned {rc}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="mode", required=True)
    s = sub.add_parser("serve")
    s.add_argument("backend", choices=["llmc", "llama.cpp", "llama.cpp-lookup", "ort-genai", "bandwidth"])
    s.add_argument("--model", default="")
    s.add_argument("--threads", type=int, default=2)
    s.add_argument("--max-seqs", type=int, default=8)
    s.add_argument("--ctx-per-seq", type=int, default=512)
    s.add_argument("--kv-type", choices=["f32", "f16", "q8_0"], default="f16")
    s.add_argument("--flash-attn", choices=["auto", "on", "off"], default="auto", help="llama.cpp only")
    s.add_argument("--buffer-mib", type=int, default=1024)
    s.add_argument("--cache", default="", help="where the bandwidth kernel is compiled to")
    s.add_argument("--speculative", default=None, help="llmc only: ngram or a draft engine")
    s.add_argument("--num-speculative-tokens", type=int, default=None, help="llmc only")
    s.add_argument("--lookup", type=int, default=0, help="llama.cpp-lookup: tokens proposed (0: no draft)")
    s.add_argument("--max-ngram", type=int, default=3, help="llama.cpp-lookup: longest n-gram matched")
    c = sub.add_parser("convert-gguf")
    c.add_argument("--src", required=True)
    c.add_argument("--out", required=True)
    c.add_argument("--llama-cpp", required=True, help="llama.cpp source tree (vendor/llama.cpp of the sdist)")
    c.add_argument("--outtype", default="f32")
    c.add_argument("extra", nargs="*", help="more converter flags, after --")
    q = sub.add_parser("quantize-gguf")
    q.add_argument("--src", required=True, help="the f32 GGUF")
    q.add_argument("--out", required=True)
    q.add_argument("--ftype", required=True, choices=sorted(GGUF_FTYPES))
    q.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.mode == "serve":
        serve(args)
    elif args.mode == "quantize-gguf":
        quantize_gguf(args)
    else:
        convert_gguf(args)


if __name__ == "__main__":
    main()
