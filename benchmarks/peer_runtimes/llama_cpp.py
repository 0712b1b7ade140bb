"""llama.cpp through llama-cpp-python, built from its source distribution for this CPU: the pins,
the GGUF conversion (llama.cpp's own convert_hf_to_gguf.py) and quantization (llama_model_quantize),
the bytes a GGUF's decode step reads, and the worker backends."""

from __future__ import annotations

import json
import os
import struct
import sys
import time
from pathlib import Path

import numpy as np

from peer_runtimes.accuracy import accuracy
from peer_runtimes.shared import WORKER, peer_env, read_stamp, run_step, source_key

LLAMA_CPP_PYTHON = "0.3.36"
# GGML_NATIVE: -march=native, i.e. this CPU's AVX-512 kernels. OpenMP is llama.cpp's default thread
# pool on Linux and the llamafile sgemm (on by default) covers f32 prompt matmuls, so no BLAS.
# Everything not needed to run a model from Python is off, to keep a 2-core build short.
CMAKE_ARGS = ("-DGGML_NATIVE=ON -DGGML_OPENMP=ON -DGGML_BLAS=OFF -DLLAVA_BUILD=OFF "
              "-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF "
              "-DLLAMA_BUILD_SERVER=OFF")
GGUF_FLAGS = ("--fuse-qkv",)
GGUF_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_k_m")
LLAMA_KV_BYTES = {"f32": 4.0, "f16": 2.0, "q8_0": 34 / 32}  # q8_0: blocks of 32 int8 + an f16 scale
# llama_ftype names of llama.cpp's include/llama.h (LLAMA_FTYPE_MOSTLY_*), as GGUF_TYPES spells them.
GGUF_FTYPES = {"f16": "F16", "bf16": "BF16", "q8_0": "Q8_0", "q4_0": "Q4_0", "q4_k_m": "Q4_K_M"}


# -- conversion (driver side: the commands, cached per recipe folder) -------------------------------


def llama_cpp_source(root: Path) -> Path:
    """llama.cpp's tree inside the unpacked sdist: its convert_hf_to_gguf.py and gguf-py."""
    return root / "src" / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"


def gguf_flags(folder: Path) -> tuple[str, ...]:
    """GGUF_FLAGS, and --no-mtp for a Qwen3.5 checkpoint without multi-token-prediction layers (the
    converter expects them otherwise: llmc's recipes, like transformers' Qwen3_5ForCausalLM, have none)."""
    config = json.loads((folder / "config.json").read_text())
    no_mtp = config.get("model_type") in ("qwen3_5_text", "qwen3_5") and not config.get("mtp_num_hidden_layers")
    return (*GGUF_FLAGS, *(("--no-mtp",) if no_mtp else ()))


def gguf_convert_cmd(python: Path, root: Path, folder: Path, out: Path, outtype: str = "f32") -> list:
    """llama.cpp's converter on `folder`, through the worker's tokenizer workaround, with gguf_flags."""
    return [python, WORKER, "convert-gguf", "--src", folder, "--out", out, "--llama-cpp", llama_cpp_source(root),
            "--outtype", outtype, "--", *gguf_flags(folder)]


def gguf_quantize_cmd(python: Path, src: Path, out: Path, ftype: str) -> list:
    """llama.cpp's quantizer (llama_model_quantize, default params) from the GGUF `src` to `ftype`."""
    return [python, WORKER, "quantize-gguf", "--src", src, "--out", out, "--ftype", ftype]


def _gguf_f32(python: Path, root: Path, folder: Path, log: Path) -> tuple[Path, dict]:
    out = root / "models" / folder.name
    out.mkdir(parents=True, exist_ok=True)
    gguf = out / "model-f32.gguf"
    key = dict(source_key(folder), converter=f"llama-cpp-python {LLAMA_CPP_PYTHON}", flags=list(gguf_flags(folder)))
    if read_stamp(out / "gguf.json") != key or not gguf.is_file():
        print(f"setup: converting {folder} to GGUF f32 with llama.cpp's convert_hf_to_gguf.py", flush=True)
        tmp = out / "model-f32.gguf.tmp"
        run_step("convert to GGUF", gguf_convert_cmd(python, root, folder, tmp), log,
                 "see the converter's message at the end of the log", env=peer_env())
        os.replace(tmp, gguf)
        (out / "gguf.json").write_text(json.dumps(key, indent=1) + "\n")
    return gguf, key


def convert_gguf(python: Path, root: Path, folder: Path, log: Path, variant: str) -> Path:
    """The GGUF of `variant` (GGUF_TYPES): f32 converted, the rest quantized from it; cached."""
    f32, f32_key = _gguf_f32(python, root, folder, log)
    if variant == "f32":
        return f32
    out = f32.parent
    gguf = out / f"model-{variant}.gguf"
    key = dict(f32_key, quantizer=f"llama-cpp-python {LLAMA_CPP_PYTHON} llama_model_quantize", ftype=variant)
    if read_stamp(out / f"gguf-{variant}.json") != key or not gguf.is_file():
        print(f"setup: quantizing the f32 GGUF to {variant} with llama.cpp's llama_model_quantize", flush=True)
        tmp = out / f"model-{variant}.gguf.tmp"
        run_step(f"quantize GGUF to {variant}", gguf_quantize_cmd(python, f32, tmp, variant), log,
                 "see llama.cpp's message at the end of the log", env=peer_env())
        os.replace(tmp, gguf)
        (out / f"gguf-{variant}.json").write_text(json.dumps(key, indent=1) + "\n")
    return gguf


# -- conversion (worker side, in the peers' venv) ---------------------------------------------------


def run_convert_gguf(args) -> None:
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


def run_quantize_gguf(args) -> None:
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


# -- the bytes a decode step reads -----------------------------------------------------------------


def gguf_tensors(path: Path) -> dict[str, tuple[int, list[int]]]:
    """{tensor name: (bytes stored, dims)} of a GGUF file (v2/v3), read from its header; a tensor's
    bytes are the distance to the next tensor's data (so alignment padding, < 32 bytes, is counted)."""
    scalar = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
    with open(path, "rb") as f:
        def read(fmt):
            return struct.unpack("<" + fmt, f.read(struct.calcsize("<" + fmt)))[0]

        def string():
            return f.read(read("Q")).decode("utf-8", "replace")

        def value(vtype):
            if vtype == 8:
                return string()
            if vtype == 9:
                item, n = read("I"), read("Q")
                if item in scalar:  # skip numeric arrays without decoding them
                    f.seek(n * struct.calcsize("<" + scalar[item]), 1)
                    return None
                return [value(item) for _ in range(n)]
            return read(scalar[vtype])

        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        read("I")  # version
        n_tensors, n_kv = read("Q"), read("Q")
        align = 32
        for _ in range(n_kv):
            k = string()
            v = value(read("I"))
            if k == "general.alignment":
                align = int(v)
        infos = []
        for _ in range(n_tensors):
            name = string()
            dims = [read("Q") for _ in range(read("I"))]
            read("I")  # ggml type
            infos.append((read("Q"), name, dims))
        data = (f.tell() + align - 1) // align * align
    size = path.stat().st_size
    infos.sort()
    ends = [o for o, _, _ in infos[1:]] + [size - data]
    return {name: (end - off, dims) for (off, name, dims), end in zip(infos, ends)}


def gguf_weight_bytes(path: Path, experts_active: float = 1.0) -> tuple[int, str]:
    """Bytes of a GGUF's tensors one decode step reads: all of them, but token_embd only one row
    when an output.weight of its own exists (tied, token_embd is the LM head and read whole), and
    the stacked experts (`*_exps`) the share `experts_active` of them."""
    t = gguf_tensors(path)
    total = int(sum(b * experts_active if "_exps." in name else b for name, (b, _) in t.items()))
    if "output.weight" in t and "token_embd.weight" in t:
        b, dims = t["token_embd.weight"]
        total -= b - b // dims[-1]
        return total, "GGUF tensors, token_embd one row"
    return total, "GGUF tensors (tied token_embd read whole as the output)"


# -- worker backends (llama-cpp-python: the low-level C API; Llama.generate) -------------------------


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
