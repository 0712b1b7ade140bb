"""ONNX Runtime GenAI: the pin, its builder's options and conversion (`python -m
onnxruntime_genai.models.builder`), and the worker backend."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from peer_runtimes.accuracy import accuracy
from peer_runtimes.shared import peer_env, read_stamp, run_step, source_key

ORT_GENAI = "0.18.0"
ORT_GENAI_OPTIONS = ("prune_lm_head=true", "fuse_mlp_gate_up=true")
# ORT GenAI variants beyond a bare precision: (precision, more builder options). llama.cpp keeps
# a tied embedding / LM head at Q6_K in its Q4_0 and Q4_K_M files; the closest ORT GenAI build
# quantizes its LM head (the last MatMul) to int8 instead of int4.
# (algo_config=rtn: the builder's "default" algo names an int8 LM head's initializer wrongly in 0.18
# and the model does not load; rtn is the same round-to-nearest quantizer, named consistently.)
ORT_GENAI_VARIANTS = {"int4-lm-head-int8": ("int4", ("algo_config=rtn", "matmul_mixed_precision=last_matmul:int8"))}
# ORT GenAI's weight-only quantization (MatMulNBits, RTN): blocks of 32 weights, symmetric, every
# MatMul including the LM head; the embedding Gather stays fp32. accuracy_level 4 quantizes the
# activations to int8 for the integer dot products (its CPU default), 1 keeps them fp32.
ORT_GENAI_BLOCK_SIZE = 32
ORT_GENAI_ACCURACY_LEVEL = 4


def ort_genai_options(variant: str, all_logits: bool = False, accuracy_level: int = ORT_GENAI_ACCURACY_LEVEL):
    precision, more = ORT_GENAI_VARIANTS.get(variant, (variant, ()))
    opts = list(ORT_GENAI_OPTIONS)
    if all_logits:  # every position's logits (benchmarks/quant_accuracy.py), not only the last one's
        opts = [o for o in opts if not o.startswith("prune_lm_head=")] + ["prune_lm_head=false"]
    if precision in ("int4", "int8"):
        opts += [f"accuracy_level={accuracy_level}", f"block_size={ORT_GENAI_BLOCK_SIZE}", *more]
    return tuple(opts)


def convert_ort(python: Path, root: Path, folder: Path, log: Path, variant: str, all_logits: bool = False,
                accuracy_level: int = ORT_GENAI_ACCURACY_LEVEL) -> Path:
    """`python -m onnxruntime_genai.models.builder -p PRECISION -e cpu` of `folder`; cached."""
    out = root / "models" / folder.name
    out.mkdir(parents=True, exist_ok=True)
    options = ort_genai_options(variant, all_logits, accuracy_level)
    precision = ORT_GENAI_VARIANTS.get(variant, (variant,))[0]
    if precision == "fp32" and not all_logits:  # the fp32 names and key the cache has always used
        og, stamp = out / "ort-genai-fp32-cpu", out / "ort-genai.json"
        key = dict(source_key(folder), builder=f"onnxruntime-genai {ORT_GENAI}", options=list(options))
    else:
        name = f"ort-genai-{variant}-cpu" + (f"-acc{accuracy_level}" if precision in ("int4", "int8") else "") \
            + ("-all-logits" if all_logits else "")
        og, stamp = out / name, out / f"{name}.json"
        key = dict(source_key(folder), builder=f"onnxruntime-genai {ORT_GENAI}", precision=precision,
                   options=list(options))
    if read_stamp(stamp) != key or not (og / "genai_config.json").is_file():
        print(f"setup: converting {folder} with onnxruntime_genai.models.builder ({precision}, cpu, "
              f"{' '.join(options)})", flush=True)
        tmp = Path(tempfile.mkdtemp(prefix=".ort-genai-", dir=out))
        try:
            run_step(f"convert to ORT GenAI {precision}", [python, "-m", "onnxruntime_genai.models.builder", "-i",
                     folder, "-o", tmp / "model", "-p", precision, "-e", "cpu", "-c", tmp / "cache",
                     "--extra_options", "hf_token=false", *options], log,
                     "see the builder's message at the end of the log", env=peer_env())
            shutil.rmtree(og, ignore_errors=True)
            os.replace(tmp / "model", og)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        stamp.write_text(json.dumps(key, indent=1) + "\n")
    return og


# -- worker backend --------------------------------------------------------------------------------


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
