"""Peer comparison: llmc against llama.cpp and ONNX Runtime GenAI on the same model, in one run.

    python benchmarks/peers.py --setup [--bits B]       # peers' venv + conversions, then exit
    python benchmarks/peers.py --model code-small --speculative [--spec-tokens 8]  # prompt lookup vs llama.cpp's
    python benchmarks/peers.py [--reps 5] [--lossless] [--no-fusions] [--ablate] [--llmc NAME=ENGINE_DIR ...]
                               [--llmc-src NAME=CHECKOUT_DIR ...] [--peers ""] [--bits fp32|bf16|int8|int4]
                               [--json OUT]

--llmc-src runs that --llmc engine's worker from another llmc source checkout (its own
benchmarks/peers_worker.py, with PYTHONPATH=CHECKOUT_DIR ahead of the editable install), so two
versions of llmc are measured in one interleaved run; --peers "" measures llmc engines only.

Peers. llama.cpp through llama-cpp-python, built here from its source distribution for this CPU,
and onnxruntime-genai. Both live in their own virtual environment outside the repo (default
$LLMC_CACHE/peers-venv, i.e. ~/.cache/llmc/peers-venv), never as llmc dependencies. Both convert
the very HF folder llmc builds from (llmc.compiler.recipes.materialize), so all run the same
weights: llama.cpp with the convert_hf_to_gguf.py shipped inside the sdist (f32 GGUF), ORT GenAI
with `python -m onnxruntime_genai.models.builder` (fp32, cpu). Each peer gets its best honest
configuration: llama.cpp built with GGML_NATIVE (AVX-512 here), OpenMP and the llamafile sgemm,
the converter's --fuse-qkv, its default f16 KV cache (f32 KV measured ~30% slower at batch 8; the
weights and math stay f32; --llama-kv-type f32 to compare); ORT GenAI with its builder's
prune_lm_head (prefill computes only the last token's logits, as llmc does) and fuse_mlp_gate_up.
Conversions are cached per recipe folder.

Bits. --bits picks the peers' configurations (PEER_ROWS): fp32 as above; bf16: llama.cpp bf16 and
f16; int8: llama.cpp Q8_0 and ORT GenAI int8; int4: llama.cpp Q4_0 and Q4_K_M and ORT GenAI int4.
llama.cpp's are made from the f32 GGUF by its own quantizer (llama_model_quantize, default params,
no importance matrix); ORT GenAI's by its builder with -p int8/int4 -e cpu (MatMulNBits, RTN,
symmetric, blocks of ORT_GENAI_BLOCK_SIZE, --ort-accuracy-level). llmc engines of that width are
passed with --llmc. At any --bits but fp32 the "%roofline" column holds each row against its own
roofline, the weight bytes its own files store (GGUF tensors; ONNX initializers, an embedding
table that only Gather reads counted as one row) plus its own KV element size, and the int4
ideal (4.5 bits x the safetensors' parameter count) is printed too (and a column at int4).

Interleaving. Every runtime lives in its own long-lived worker process (benchmarks/peers_worker.py;
llmc in the repo's venv, peers in theirs), loaded once. The driver loops over repetitions and, in
each, asks every worker in turn for one measurement (the order rotates per repetition), with a
short pause between calls so no idle thread pool still spins, so machine noise hits all alike.
Numbers are medians over repetitions, with [min..max].

Metrics, defined as llmc.runtime.metrics defines them, 2 threads for everyone:
  TTFT  batch 1: request start -> first generated token (prefill of a 128-token prompt of random
        ids + the first greedy pick). The start is add_request for llmc, making the generator for
        ORT GenAI (its per-request object), clearing the KV cache for llama.cpp.
  TPOT  batch 1, same request: (last token time - first token time) / (128 - 1), greedy, no early
        stop (ignore_eos; ORT GenAI: min_length = max_length).
  b8    batch 8: 8 sequences with distinct 128-token prompts are prefilled (untimed), then 127
        decode steps in which all 8 decode together are timed: 8 * 127 / seconds. llmc: 8
        concurrent requests; llama.cpp: its batch API with 8 sequence ids; ORT GenAI: a batch of 8.

Roofline. Bandwidth is measured in the same run by a worker of its own, before every measurement:
2 OpenMP threads each sum their half of a 1 GiB float32 buffer (32x the L3) with a small C kernel
compiled here for this CPU (AVX-512 loads into 4 accumulators, so memory is the limit); best of 3
passes, the rate memory can deliver (as STREAM reports). numpy's np.max, the fallback without a C
compiler, reads ~10% slower here, and llama.cpp's decode was seen to beat a roofline built on it,
so the compiled kernel is preferred. Bandwidth on this shared VM moves with the neighbours
(28-66 GB/s seen in one session), which is why it is measured next to every measurement.
Roofline TPOT = (weight bytes read per token + KV bytes read per token) / bandwidth, where
weights are every tensor in the safetensors (the tied embedding is read whole as the LM head) and
KV is 2 x layers x kv_heads x head_dim x 4 bytes x the mean attended length over the timed tokens
(prompt + new/2). The batch-8 roofline reads the weights once and 8 sequences' KV per step.
"% roofline" = roofline TPOT / TPOT, per repetition against the bandwidth measured just before
that runtime's batch-1 run (bandwidth here moves within seconds), then the median.

Contention. Other processes on the machine distort everything, llama.cpp most (its threads spin at
a barrier after every op, so one preempted thread stalls the other: TPOT 60x worse was seen). The
run reads /proc to report how much CPU everything except its own processes used per repetition.

Same model. Before timing, each runtime's greedy continuation of a short prompt is compared with
the first llmc engine's; peers are also teacher-forced along llmc's tokens and their top-1 checked
at every position. At fp32 a runtime that disagrees is flagged and left out of "best peer"; below fp32
the check is reported only (a random-weight model's argmaxes move with any 4-bit rounding;
benchmarks/quant_accuracy.py measures accuracy on the trained model).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tarfile
import tempfile
import time
from pathlib import Path

# This file is the driver: the peers' setup, the interleaved measurement loop and the report. Each
# runtime's own part (its pins, conversions, byte counts and worker backend) is a module of
# benchmarks/peer_runtimes/, and the worker process is benchmarks/peers_worker.py.
from peer_runtimes.shared import HERE, REPO, SetupError, Worker, cache_root, peer_env, read_stamp, run_step
from peer_runtimes.llama_cpp import CMAKE_ARGS, GGUF_FLAGS, LLAMA_CPP_PYTHON, convert_gguf
from peer_runtimes.llmc_engine import LLMC_KV_BYTES, build_variants, parse_llmc_src, src_env
from peer_runtimes.ort_genai import (ORT_GENAI, ORT_GENAI_ACCURACY_LEVEL, ORT_GENAI_OPTIONS, convert_ort,
                                     ort_genai_options)
from peer_runtimes.roofline import (experts_read, kv_bytes_per_position, onnx_weight_bytes, own_bytes,
                                    parameter_count, weight_bytes)

TORCH = "2.13.0"  # this pin resolves to a local CPU wheel; any other pulls GBs of CUDA
# The converters read this folder's config.json, written by transformers 5 (rope_parameters);
# transformers 4 would silently fall back to the default RoPE base.
PEER_PACKAGES = (f"torch=={TORCH}", "transformers>=5,<6", f"onnxruntime-genai=={ORT_GENAI}", "onnx",
                 "onnx-ir", "sentencepiece", "protobuf", "numpy", "safetensors", "tqdm", "pyyaml", "requests")
PEERS = ("llama.cpp", "ort-genai")
BITS = ("fp32", "bf16", "int8", "int4")
# The peer configurations --bits runs: (row name, peer, variant). A llama.cpp variant is a GGUF
# type: f32 is converted from the HF folder, every other one quantized from that f32 GGUF by
# llama.cpp's own quantizer (llama_model_quantize, default params, no imatrix). An ORT GenAI
# variant is its builder's --precision for the cpu execution provider.
PEER_ROWS = {
    "fp32": (("llama.cpp", "llama.cpp", "f32"), ("ort-genai", "ort-genai", "fp32")),
    "bf16": (("llama.cpp bf16", "llama.cpp", "bf16"), ("llama.cpp f16", "llama.cpp", "f16")),
    "int8": (("llama.cpp Q8_0", "llama.cpp", "q8_0"), ("ort-genai int8", "ort-genai", "int8")),
    "int4": (("llama.cpp Q4_0", "llama.cpp", "q4_0"), ("llama.cpp Q4_K_M", "llama.cpp", "q4_k_m"),
             ("ort-genai int4", "ort-genai", "int4"),
             ("ort-genai int4, LM head int8", "ort-genai", "int4-lm-head-int8")),
}
PAUSE_S = 0.3  # lets the previous worker's spinning threads park before the next one runs


# -- setup ----------------------------------------------------------------------------------------


def setup_venv(venv: Path, root: Path, log: Path) -> Path:
    """The peers' venv with llama-cpp-python built from source and onnxruntime-genai; idempotent."""
    python = venv / "bin" / "python"
    want = {"llama_cpp_python": LLAMA_CPP_PYTHON, "onnxruntime_genai": ORT_GENAI, "torch": TORCH,
            "cmake_args": CMAKE_ARGS, "packages": list(PEER_PACKAGES)}
    src = root / "src" / f"llama_cpp_python-{LLAMA_CPP_PYTHON}"
    stamp = venv / ".llmc-peers.json"
    if read_stamp(stamp) == want and python.is_file() and (src / "vendor" / "llama.cpp").is_dir():
        return python
    env = peer_env()
    if not python.is_file():
        print(f"setup: creating the peers' venv {venv}", flush=True)
        base = getattr(sys, "_base_executable", sys.executable)
        run_step("venv", [base, "-m", "venv", venv], log,
                 f"check that `{base} -m venv` works and {venv.parent} is writable")
    print(f"setup: installing {', '.join(PEER_PACKAGES)} into it", flush=True)
    run_step("pip install peer packages", [python, "-m", "pip", "install", *PEER_PACKAGES], log,
             "check the package index is reachable (pip config) and the pins resolve", env=env)
    if not (src / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py").is_file():
        print(f"setup: fetching the llama-cpp-python {LLAMA_CPP_PYTHON} source distribution", flush=True)
        dl = root / "src"
        dl.mkdir(parents=True, exist_ok=True)
        # --no-binary: the sdist, which carries llama.cpp's own HF->GGUF converter and gguf-py.
        run_step("download llama-cpp-python sdist", [python, "-m", "pip", "download", "--no-deps", "--no-binary",
                 ":all:", f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", dl], log, "check that PyPI is reachable",
                 env=env)
        tarball = dl / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
        if not tarball.is_file():
            raise SetupError(f"setup step 'unpack sdist' failed: {tarball} not found after download; log: {log}")
        with tarfile.open(tarball) as tf:
            tf.extractall(dl, filter="data")
        if not (src / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py").is_file():
            raise SetupError(f"setup step 'unpack sdist' failed: no vendor/llama.cpp/convert_hf_to_gguf.py in "
                             f"{tarball}; "
                             "pick a llama-cpp-python version whose sdist vendors llama.cpp")
    print(f"setup: building llama-cpp-python {LLAMA_CPP_PYTHON} for this CPU ({CMAKE_ARGS}); "
          f"this takes several minutes on 2 cores, log: {log}", flush=True)
    build_env = dict(env, CMAKE_ARGS=CMAKE_ARGS, CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 2))
    run_step("build llama-cpp-python", [python, "-m", "pip", "install", "--force-reinstall", "--no-cache-dir",
             "--verbose", src], log, "it needs cmake, ninja or make, and a C++17 compiler (apt-get install cmake "
             "build-essential)", env=build_env)
    run_step("import check", [python, "-c", "import llama_cpp, onnxruntime_genai"], log,
             "the peers' venv is broken; delete it and rerun --setup", env=env)
    stamp.write_text(json.dumps(want, indent=1) + "\n")
    return python


def convert(python: Path, root: Path, folder: Path, log: Path, wanted=(("llama.cpp", "f32"), ("ort-genai", "fp32")),
            accuracy_level: int = ORT_GENAI_ACCURACY_LEVEL) -> dict:
    """{(peer, variant): converted model} for every wanted configuration, each cached in
    root/models/<folder name>/."""
    got = {}
    for peer, variant in wanted:
        if peer == "llama.cpp":
            got[(peer, variant)] = convert_gguf(python, root, folder, log, variant)
        else:
            got[(peer, variant)] = convert_ort(python, root, folder, log, variant, accuracy_level=accuracy_level)
    return got


def peer_rows(bits: str, peers: list[str]) -> list[tuple[str, str, str]]:
    return [row for row in PEER_ROWS[bits] if row[1] in peers]


def setup(args, folder: Path, wanted=None) -> tuple[Path, dict]:
    venv, root = args.peers_venv.expanduser().resolve(), args.peers_dir.expanduser().resolve()
    for p in (venv, root):
        if p == REPO or REPO in p.parents:
            raise SetupError(f"setup refused: {p} is inside the repo; the peers must never live in llmc's tree "
                             "(pass --peers-venv/--peers-dir outside it)")
    if venv == Path(sys.prefix).resolve():
        raise SetupError(f"setup refused: {venv} is the venv running this script; peers get their own")
    root.mkdir(parents=True, exist_ok=True)
    log = root / "setup.log"
    python = setup_venv(venv, root, log)
    if wanted is None:
        wanted = [(peer, variant) for _, peer, variant in peer_rows(args.bits, PEERS)]
    return python, convert(python, root, folder, log, wanted, args.ort_accuracy_level)


# -- measurement -------------------------------------------------------------------------------------


def cpu_times(pids) -> tuple[float, float] | None:
    """(busy CPU seconds of the whole machine incl. steal, CPU seconds of `pids`); None off Linux."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
        ours = 0
        for pid in pids:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            ours += int(fields[11]) + int(fields[12])  # utime, stime
        tick = os.sysconf("SC_CLK_TCK")
        return (sum(v) - v[3] - v[4]) / tick, ours / tick
    except (OSError, ValueError, IndexError):
        return None


def measure(args, folder: Path, peers: list[str], python: Path | None, converted: dict, work: Path) -> bool:
    """Build/load everything, check, measure interleaved, print; True when nothing failed."""
    import numpy as np

    engines, build_failed = build_variants(args, work)

    cfg = json.loads((folder / "config.json").read_text())
    vocab = int(cfg["vocab_size"])
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, vocab, args.prompt_len).tolist()
    prompts_b = [rng.integers(3, vocab, args.prompt_len).tolist() for _ in range(args.batch)]
    check_prompt = rng.integers(3, vocab, 32).tolist()
    steps = args.new_tokens - 1

    # Rows in the order the engines were asked for; a variant that did not build keeps its row.
    rows: dict[str, dict] = {name: {"kind": "llmc", "ttft": [], "tpot": [], "b8": [], "bw": [], "check": "-",
                                    **({"failed": build_failed[name]} if name in build_failed else {})}
                             for name, _ in engines}
    workers: dict[str, Worker] = {}
    common = ["--threads", str(args.threads), "--max-seqs", str(args.batch),
              "--ctx-per-seq", str(args.prompt_len + args.new_tokens + 64)]
    srcs = parse_llmc_src(args.llmc_src, [name for name, _ in engines])
    specs = [(name, "llmc", Path(sys.executable), ["llmc", "--model", str(path), *common],
              src_env(srcs[name]) if name in srcs else None, srcs.get(name, REPO))
             for name, path in engines if name not in build_failed]
    kv_args = ["--kv-type", args.llama_kv_type] + (["--flash-attn", "on"] if args.llama_kv_type == "q8_0" else [])
    specs += [(name, peer, python, [peer, "--model", str(converted[(peer, variant)]), *common, *kv_args], peer_env(),
               REPO) for name, peer, variant in peer_rows(args.bits, peers)]
    files = {name: path for name, path in engines}  # what each row's own roofline counts the bytes of
    files.update({name: converted[(peer, variant)] for name, peer, variant in peer_rows(args.bits, peers)})
    try:
        for name, kind, py, wargs, env, src in specs:
            rows.setdefault(name, {"kind": kind, "ttft": [], "tpot": [], "b8": [], "bw": [], "check": "-"})
            print(f"load: {name}" + (f" (llmc from {src})" if src != REPO else ""), flush=True)
            try:
                workers[name] = Worker(name, py, wargs, work / f"{kind}-{len(workers)}.log", env, src)
                rows[name]["info"] = dict(workers[name].info, src=str(src))
            except RuntimeError as exc:
                rows[name]["failed"] = str(exc)
                print(f"error: {exc}", flush=True)
        bw_worker = Worker("bandwidth", Path(sys.executable), ["bandwidth", "--threads", str(args.threads),
                           "--cache", str(args.peers_dir.expanduser() / "bandwidth")], work / "bandwidth.log")

        def drop(name, exc):
            rows[name]["failed"] = str(exc)
            print(f"error: {exc}", flush=True)
            workers.pop(name).close()

        # Same-model check against the first llmc engine.
        ref_name = engines[0][0]
        ref = (workers[ref_name].call("greedy", prompt=check_prompt, n=args.check_tokens)
               if ref_name in workers else None)
        for name in list(workers):
            r = rows[name]
            if ref is None:
                r["check"], r["check_ok"] = "no reference", False
                continue
            if name == ref_name:
                r["check"], r["check_ok"] = "reference", True
                continue
            try:
                got = workers[name].call("greedy", prompt=check_prompt, n=args.check_tokens)
                same = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), len(ref))
                # Below fp32 the check only informs: a random-weight model's top two logits are so
                # close that 4-bit weights move most argmaxes (smollm2-135m-shape: 3-5 of 16 for
                # every int4 runtime, llmc's included); quant_accuracy.py measures how far each is.
                informative = args.bits != "fp32"
                if r["kind"] == "llmc":
                    r["check_ok"] = informative or same == len(ref)
                    r["check"] = f"greedy {same}/{len(ref)}" + ("" if r["check_ok"] else " FLAG")
                else:
                    forced = workers[name].call("forced", prompt=check_prompt, cont=ref)
                    agree = sum(a == b for (a, _), b in zip(forced, ref))
                    r["check_ok"] = informative or agree == len(ref)
                    r["check"] = f"top-1 {agree}/{len(ref)}" + ("" if r["check_ok"] else " FLAG")
                    margins = [m for (a, m), b in zip(forced, ref) if a != b]
                    r["check_detail"] = (f"free-running greedy identical for {same}/{len(ref)} tokens; teacher-forced "
                                         f"top-1 agrees at {agree}/{len(ref)} positions"
                                         + (f"; top-1/top-2 margins where it differs: "
                                            f"{', '.join(f'{m:.3g}' for m in margins)}" if margins else ""))
            except RuntimeError as exc:
                drop(name, exc)

        print("warm-up", flush=True)
        for name in list(workers):
            try:
                workers[name].call("latency", prompt=prompt, n=8)
                workers[name].call("decode", prompts=prompts_b, steps=4)
            except RuntimeError as exc:
                drop(name, exc)
        bw_worker.call("bandwidth", passes=1)

        bw, others = [], []
        for rep in range(args.reps):
            pids = [os.getpid(), bw_worker.proc.pid] + [w.proc.pid for w in workers.values()]
            t0, c0 = time.perf_counter(), cpu_times(pids)
            order = list(workers)
            order = order[rep % len(order):] + order[:rep % len(order)] if order else order
            for what in ("latency", "decode"):
                for name in order:
                    if name not in workers:
                        continue
                    time.sleep(PAUSE_S)
                    # Bandwidth right before every measurement: it moves with the neighbours within
                    # seconds, so each TPOT is held against the rate memory gave just then. The
                    # 1 GiB sweep also leaves every runtime the same cold cache.
                    b = bw_worker.call("bandwidth", passes=3)["bytes_per_s"]
                    bw.append(b)
                    try:
                        if what == "latency":
                            m = workers[name].call("latency", prompt=prompt, n=args.new_tokens)
                            rows[name]["ttft"].append(m["ttft"])
                            rows[name]["tpot"].append(m["tpot"])
                            rows[name]["bw"].append(b)
                            if m.get("expert_bytes"):
                                rows[name].setdefault("expert_bytes_b1", []).append(m["expert_bytes"])
                            if "setup" in m:
                                rows[name].setdefault("setup", []).append(m["setup"])
                        else:
                            m = workers[name].call("decode", prompts=prompts_b, steps=steps)
                            rows[name]["b8"].append(m["tok_s"])
                            if m.get("expert_bytes"):
                                rows[name].setdefault("expert_bytes_b8", []).append(m["expert_bytes"])
                    except RuntimeError as exc:
                        drop(name, exc)
            c1 = cpu_times(pids)
            if c0 and c1:  # CPU the rest of the machine used, as a share of all cores over the rep
                used = max(0.0, (c1[0] - c0[0]) - (c1[1] - c0[1]))
                others.append(used / ((time.perf_counter() - t0) * os.cpu_count()))
            print(f"rep {rep + 1}/{args.reps}: " + " · ".join(
                f"{n} TPOT {rows[n]['tpot'][-1] * 1e3:.1f} ms, b8 {rows[n]['b8'][-1]:.0f} tok/s"
                for n in order if n in workers) + f" · {med(bw[-2 * len(order):]) / 1e9:.1f} GB/s"
                + (f" · others used {others[-1] * 100:.0f}% CPU" if others else ""), flush=True)
    finally:
        for w in list(workers.values()) + ([bw_worker] if "bw_worker" in locals() else []):
            w.close()

    bw_method = bw_worker.info["method"]
    kv_dtype = LLMC_KV_BYTES.get(
        next((r["info"].get("kv_dtype") for r in rows.values() if r["kind"] == "llmc" and "info" in r), None), 4)
    wb = weight_bytes(folder)
    per_pos = kv_bytes_per_position(folder, kv_dtype)
    mean_ctx = args.prompt_len + args.new_tokens / 2  # attended length averaged over the timed decode steps
    bw_med = med(bw)
    token_bytes = wb + per_pos * mean_ctx
    roof = {"weight_bytes": wb, "kv_bytes": per_pos * mean_ctx, "kv_dtype_bytes": kv_dtype,
            "tpot": token_bytes / bw_med,
            "b8_tok_s": args.batch * bw_med / (weight_bytes(folder, args.batch) + args.batch * per_pos * mean_ctx)}
    for r in rows.values():  # each TPOT against the bandwidth measured just before it
        r["roofline_share"] = [token_bytes / b / t for b, t in zip(r.get("bw", []), r["tpot"])]
    # Each row's own roofline: the weight bytes its own files store (at its bit width) and its own
    # KV element size. The fp32 report keeps the shared one above; other --bits report these.
    per_elem = per_pos / kv_dtype
    for name, r in rows.items():
        own = own_bytes(r["kind"], files.get(name), r.get("info", {}), args, experts_read(cfg))
        if own is None:
            continue
        r["own_roofline"] = own
        own_token = own["weight_bytes"] + per_elem * own["kv_dtype_bytes"] * mean_ctx
        own["kv_bytes"] = per_elem * own["kv_dtype_bytes"] * mean_ctx
        own["tpot"] = own_token / bw_med
        r["own_roofline_share"] = [own_token / b / t for b, t in zip(r.get("bw", []), r["tpot"])]
        if r.get("expert_bytes_b1"):  # the engine's experts, all of them: its stacks' bytes
            from llmc.contract.engine_dir import open_engine

            model = Path(files[name]) / open_engine(files[name]).manifest.payload.model
            r["experts_total_bytes"] = onnx_weight_bytes(model, 1.0)[0] - onnx_weight_bytes(model, 0.0)[0]
            r["experts_share"] = (experts_read(cfg), experts_read(cfg, args.batch))
    params = parameter_count(folder)
    ideal = {"bits_per_weight": 4.5, "parameters": params, "weight_bytes": params * 4.5 / 8,
             "kv_bytes": per_pos * mean_ctx}
    ideal["tpot"] = (ideal["weight_bytes"] + ideal["kv_bytes"]) / bw_med
    for r in rows.values():
        r["int4_ideal_share"] = [(ideal["weight_bytes"] + ideal["kv_bytes"]) / b / t
                                 for b, t in zip(r.get("bw", []), r["tpot"])]
    roof["int4_ideal"] = ideal
    res = {"model": args.model, "bits": args.bits, "folder": str(folder), "threads": args.threads,
           "prompt_len": args.prompt_len,
           "new_tokens": args.new_tokens, "batch": args.batch, "reps": args.reps,
           "bandwidth_bytes_per_s": bw, "bandwidth_method": bw_method, "others_cpu_share": others,
           "roofline": roof, "runtimes": rows,
           "setup": {"llama_cpp_python": LLAMA_CPP_PYTHON, "cmake_args": CMAKE_ARGS, "gguf_flags": GGUF_FLAGS,
                     "onnxruntime_genai": ORT_GENAI, "ort_genai_options": ORT_GENAI_OPTIONS,
                     "llama_kv_type": args.llama_kv_type,
                     "peer_rows": {name: {"peer": peer, "variant": variant, "path": str(converted[(peer, variant)]),
                                          **({"ort_genai_options": ort_genai_options(variant, False,
                                                                                     args.ort_accuracy_level)}
                                             if peer == "ort-genai" else {})}
                                   for name, peer, variant in peer_rows(args.bits, peers)}}}
    print()
    print(report(res, args))
    if args.json:
        args.json.write_text(json.dumps(res, indent=1) + "\n")
        print(f"raw numbers: {args.json}")
    return not any(r.get("failed") for r in rows.values())


def measure_speculative(args, folder: Path, python: Path, converted: dict, work: Path) -> bool:
    """Prompt-lookup decoding, llmc's against llama.cpp's, on benchmarks/speculative.py's
    input-grounded workload: each runtime with and without it, batch 1, interleaved; each one's
    speed-up is over its own plain decoding."""
    sys.path.insert(0, str(HERE))
    from speculative import workloads

    from llmc.runtime.llm import LLM

    engines, build_failed = build_variants(args, work)
    if build_failed:
        raise SystemExit(f"error: {build_failed}")
    engine = engines[0][1]
    prompts = workloads(LLM(engine), args.spec_requests, args.prompt_len, 0)["grounded"]
    n, k = args.new_tokens, args.spec_tokens
    ctx = ["--ctx-per-seq", str(max(len(p) for p in prompts) + n + 64)]
    gguf = str(converted[("llama.cpp", "f32")])
    specs = {
        "llmc": (Path(sys.executable), ["llmc", "--model", str(engine)], None),
        "llmc ngram": (Path(sys.executable), ["llmc", "--model", str(engine), "--speculative", "ngram",
                                              "--num-speculative-tokens", str(k)], None),
        "llama.cpp": (python, ["llama.cpp-lookup", "--model", gguf, *ctx], peer_env()),
        f"llama.cpp lookup {k}": (python, ["llama.cpp-lookup", "--model", gguf, *ctx, "--lookup", str(k)],
                                  peer_env()),
        "llama.cpp lookup 10": (python, ["llama.cpp-lookup", "--model", gguf, *ctx, "--lookup", "10"], peer_env()),
    }
    workers = {}
    try:
        for name, (py, wargs, env) in specs.items():
            print(f"load: {name}", flush=True)
            workers[name] = Worker(name, py, [*wargs, "--threads", str(args.threads)], work / f"spec-{len(workers)}.log",
                                   env)
        names = list(workers)
        tpot = {name: [] for name in names}
        tokens = {name: [] for name in names}
        extra = {name: [0, 0, 0] for name in names}  # llmc: proposed, accepted, decode steps
        for prompt in prompts[:1]:  # warm-up
            for w in workers.values():
                w.call("latency", prompt=prompt, n=n)
        for rep in range(args.reps):
            for i, prompt in enumerate(prompts):
                shift = (i + rep) % len(names)
                for name in names[shift:] + names[:shift]:
                    time.sleep(PAUSE_S)
                    out = workers[name].call("latency", prompt=prompt, n=n)
                    tpot[name].append(out["tpot"])
                    if rep == 0:
                        tokens[name].append(out["tokens"])
                    if "proposed" in out:
                        extra[name][0] += out["proposed"]
                        extra[name][1] += out["accepted"]
                        extra[name][2] += out["steps"]
    finally:
        for w in workers.values():
            w.close()

    print(f"\nprompt-lookup decoding on {folder.name}: {len(prompts)} input-grounded prompts "
          f"(benchmarks/speculative.py) of ~{args.prompt_len} tokens, {n} new, greedy, batch 1, "
          f"{args.threads} threads, {args.reps} reps interleaved; TPOT mean ms; speed-up over the same "
          "runtime without lookup")
    print(f"{'runtime':>22} {'TPOT ms':>8} {'speed-up':>8} {'same tokens':>12} {'accept':>7} {'tok/step':>9}")
    for name in names:
        own = "llmc" if name.startswith("llmc") else "llama.cpp"
        mean = statistics.mean(tpot[name])
        same = sum(a == b for a, b in zip(tokens[name], tokens[own]))
        p, a, st = extra[name]
        accept = f"{a / p:.2f}" if p else "-"
        per_step = f"{(len(prompts) * args.reps * (n - 1)) / st:.2f}" if st else "-"
        print(f"{name:>22} {mean * 1e3:8.3f} {statistics.mean(tpot[own]) / mean:8.2f} "
              f"{same:>5}/{len(prompts):<6} {accept:>7} {per_step:>9}")
    agree = sum(a == b for a, b in zip(tokens["llmc"], tokens["llama.cpp"]))
    print(f"llmc and llama.cpp give the same greedy tokens for {agree}/{len(prompts)} prompts")
    return True


# -- report -------------------------------------------------------------------------------------------------


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def fmt(xs, scale, digits):
    if not xs:
        return "-"
    return f"{med(xs) * scale:.{digits}f} [{min(xs) * scale:.{digits}f}..{max(xs) * scale:.{digits}f}]"


def report(res: dict, args) -> str:
    rows, roof = res["runtimes"], res["roofline"]
    peers_ok = [n for n, r in rows.items() if r["kind"] != "llmc" and r.get("check_ok") and r["tpot"]]
    best = {}
    for metric, pick in (("ttft", min), ("tpot", min), ("b8", max)):
        vals = {n: med(rows[n][metric]) for n in peers_ok if rows[n][metric]}
        best[metric] = pick(vals.items(), key=lambda kv: kv[1]) if vals else None
    bw = res["bandwidth_bytes_per_s"]
    quant = args.bits != "fp32"
    share = "own_roofline_share" if quant else "roofline_share"  # the "%roofline" column
    out = [f"{args.model} {'fp32' if not quant else args.bits + ' peers'} · batch 1: {args.prompt_len}-token prompt, "
           f"{args.new_tokens} new tokens, greedy, "
           f"no early stop · batch {args.batch} (b8 columns): {args.new_tokens - 1} decode steps after "
           f"{args.prompt_len}-token prompts · "
           f"{args.threads} threads · median of {args.reps} interleaved reps [min..max]",
           f"DRAM read bandwidth ({res['bandwidth_method']}), measured before every measurement: "
           f"{fmt(bw, 1e-9, 1)} GB/s",
           f"  -> at the median, roofline TPOT "
           f"{roof['tpot'] * 1e3:.2f} ms ({roof['weight_bytes'] / 1e6:.1f} MB weights + "
           f"{roof['kv_bytes'] / 1e6:.1f} MB KV per token), batch-{args.batch} roofline {roof['b8_tok_s']:.0f} tok/s"]
    if quant:
        out[-1] = out[-1].replace("  -> at the median, roofline", "  -> at the median, the source's roofline")
        i = roof["int4_ideal"]
        out.append(f"  -> int4 ideal ({i['bits_per_weight']} bits x {i['parameters'] / 1e6:.1f} M parameters = "
                   f"{i['weight_bytes'] / 1e6:.1f} MB weights + {i['kv_bytes'] / 1e6:.1f} MB KV per token): "
                   f"roofline TPOT {i['tpot'] * 1e3:.2f} ms")
        out.append("  each row's own roofline (its own stored weight bytes + its KV), the %roofline column:")
        for name, r in rows.items():
            o = r.get("own_roofline")
            if o:
                out.append(f"     {name}: {o['weight_bytes'] / 1e6:.1f} MB weights ({o['how']}) + "
                           f"{o['kv_bytes'] / 1e6:.1f} MB {o['kv_dtype']} KV -> {o['tpot'] * 1e3:.2f} ms")
    for name, r in rows.items():  # what the Experts kernel counted it read, beside what uniform routing predicts
        if r.get("expert_bytes_b1") and r.get("experts_total_bytes"):
            total, (share1, share8) = r["experts_total_bytes"], r["experts_share"]
            out.append(f"  {name}: expert bytes read per decode step, counted by the kernel: batch 1 "
                       f"{med(r['expert_bytes_b1']) / 1e6:.1f} MB, batch {args.batch} "
                       f"{med(r.get('expert_bytes_b8') or [0]) / 1e6:.1f} MB, of {total / 1e6:.1f} MB of experts "
                       f"(uniform routing would read {share1 * total / 1e6:.1f} MB and {share8 * total / 1e6:.1f} MB)")
    w = max(len("runtime"), *(len(n) for n in rows)) + 2
    head = (f"{'runtime':{w}s}{'same model?':16s}{'TTFT ms':>27s}{'TPOT ms':>27s}{'b8 tok/s':>27s}"
            f"{'%roofline':>10s}{'TTFT/best':>10s}{'TPOT/best':>10s}{'b8/best':>9s}"
            + (f"{'%int4 ideal':>12s}" if args.bits == "int4" else ""))
    if res["others_cpu_share"]:
        o = res["others_cpu_share"]
        out.append(f"CPU used by other processes during the reps: {fmt(o, 100, 0)} % of the machine"
                   + ("  << contended: numbers are noisy" if max(o) > 0.05 else ""))
    out += ["", head, "-" * len(head)]
    for name, r in rows.items():
        if r.get("failed"):
            out.append(f"{name:{w}s}FAILED: {r['failed']}")
            continue
        ratios = []
        for metric in ("ttft", "tpot", "b8"):
            b = best[metric]
            ratios.append(f"{med(r[metric]) / b[1]:.2f}x" if b and r[metric] else "-")
        pct = f"{med(r[share]) * 100:.0f}%" if r.get(share) else "-"
        ideal = ""
        if args.bits == "int4":
            ideal = f"{med(r['int4_ideal_share']) * 100:.0f}%" if r.get("int4_ideal_share") else "-"
            ideal = f"{ideal:>12s}"
        out.append(f"{name:{w}s}{r['check']:16s} {fmt(r['ttft'], 1e3, 1):>26s} {fmt(r['tpot'], 1e3, 2):>26s} "
                   f"{fmt(r['b8'], 1, 1):>26s}{pct:>10s}{ratios[0]:>10s}{ratios[1]:>10s}{ratios[2]:>9s}{ideal}")
    names = {m: (b[0] if b else "none") for m, b in best.items()}
    out.append(f"best peer: TTFT {names['ttft']} · TPOT {names['tpot']} · b8 {names['b8']}"
               + ("" if len(peers_ok) == len([r for r in rows.values() if r["kind"] != "llmc"])
                  else " (peers that failed or disagreed in the same-model check are left out)"))
    for name, r in rows.items():
        if r["kind"] != "llmc" or not r["tpot"] or not all(best.values()):
            continue
        t = med(r["tpot"]) / best["tpot"][1]
        f = med(r["ttft"]) / best["ttft"][1]
        b = med(r["b8"]) / best["b8"][1]
        p = med(r.get(share) or [float("nan")])

        def ok(c):
            return "PASS" if c else "FAIL"

        out.append(f"targets {name}: TPOT {t:.2f}x best peer (<= 0.90x) {ok(t <= 0.9)} · {p * 100:.0f}% of roofline "
                   f"(>= 85%) {ok(p >= 0.85)} · TTFT {f:.2f}x (<= 0.90x) {ok(f <= 0.9)} · b8 {b:.2f}x (>= 1.30x) "
                   f"{ok(b >= 1.3)}")
    for name, r in rows.items():
        if r.get("setup"):
            out.append(f"note {name}: its TTFT includes {med(r['setup']) * 1e3:.1f} ms making the Generator, "
                       "its per-request object (KV buffers sized to the request)")
    for name, r in rows.items():
        if r.get("check_detail"):
            out.append(f"check {name}: {r['check_detail']}")
    return "\n".join(out)


# -- main ----------------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-shape", help="recipe name or local HF folder")
    ap.add_argument("--setup", action="store_true", help="set up the peers' venv and conversions, then exit")
    ap.add_argument("--peers-venv", type=Path, default=cache_root() / "peers-venv")
    ap.add_argument("--peers-dir", type=Path, default=cache_root() / "peers",
                    help="sdist, build log and converted models")
    ap.add_argument("--peers", default=",".join(PEERS),
                    help=f"comma-separated subset of {','.join(PEERS)}; \"\" for llmc engines only")
    ap.add_argument("--llmc", action="append", default=[], metavar="NAME=ENGINE_DIR",
                    help="an llmc engine to measure (repeatable); default: build one from --model")
    ap.add_argument("--llmc-src", action="append", default=[], metavar="NAME=CHECKOUT_DIR",
                    help="run --llmc NAME's worker from another llmc checkout (repeatable), e.g. the code "
                         "before a change, to compare both in one run")
    ap.add_argument("--lossless", action="store_true",
                    help="also build and measure an engine with --lossless-weights")
    ap.add_argument("--no-fusions", action="store_true",
                    help="also build and measure an engine with every optional pass disabled")
    ap.add_argument("--ablate", action="store_true",
                    help="also build and measure one engine per optional pass, with only that pass disabled")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--check-tokens", type=int, default=16)
    ap.add_argument("--llama-kv-type", choices=["f32", "f16", "q8_0"], default="f16",
                    help="llama.cpp KV cache type; f16 is its default and measured ~30%% faster at batch 8 "
                         "here than f32 (which would keep its numerics fp32 end to end); q8_0 turns flash "
                         "attention on, which a quantized V cache needs")
    ap.add_argument("--bits", choices=BITS, default="fp32",
                    help="which peer configurations run: fp32 (llama.cpp f32, ORT GenAI fp32), bf16 (llama.cpp "
                         "bf16 and f16), int8 (llama.cpp Q8_0, ORT GenAI int8), int4 (llama.cpp Q4_0 and "
                         "Q4_K_M, ORT GenAI int4); llmc engines of that width come with --llmc. Other than fp32, "
                         "%%roofline holds each row against the bytes its own files store")
    ap.add_argument("--ort-accuracy-level", type=int, choices=[1, 2, 3, 4], default=ORT_GENAI_ACCURACY_LEVEL,
                    help="ORT GenAI int4/int8 MatMulNBits accuracy_level: 4 = int8 activations (its CPU "
                         "default), 1 = fp32 activations")
    ap.add_argument("--json", type=Path, default=None, help="write the raw numbers here")
    ap.add_argument("--speculative", action="store_true",
                    help="instead: prompt-lookup decoding, llmc's ngram against llama.cpp's LlamaPromptLookupDecoding, "
                         "on benchmarks/speculative.py's input-grounded workload (use --model code-small)")
    ap.add_argument("--spec-tokens", type=int, default=8, help="--speculative: tokens proposed per step")
    ap.add_argument("--spec-requests", type=int, default=8, help="--speculative: prompts")
    args = ap.parse_args()

    from llmc.compiler.recipes import is_recipe, materialize

    folder = materialize(args.model) if is_recipe(args.model) else Path(args.model).resolve()
    peers = [p for p in args.peers.split(",") if p]
    unknown = set(peers) - set(PEERS)
    if unknown:
        raise SystemExit(f"error: unknown peer {sorted(unknown)[0]!r}; peers are {', '.join(PEERS)}")
    try:
        wanted = ([("llama.cpp", "f32")] if args.speculative else
                  [(peer, variant) for _, peer, variant in peer_rows(args.bits, peers)])
        python, converted = setup(args, folder, wanted) if (peers or args.setup) else (None, {})
    except SetupError as exc:
        raise SystemExit(f"error: {exc}") from None
    if args.setup:
        print(f"setup done: venv {args.peers_venv}, models {args.peers_dir / 'models' / folder.name} "
              f"({', '.join(str(p.name) for p in converted.values())})")
        return

    work = Path(tempfile.mkdtemp(prefix="llmc-peers-"))
    ok = False
    try:
        ok = (measure_speculative(args, folder, python, converted, work) if args.speculative
              else measure(args, folder, peers, python, converted, work))
    finally:
        # Engines are big; the worker logs are kept only when something failed, since the
        # error lines point at them.
        for d in work.glob("engine*"):
            shutil.rmtree(d, ignore_errors=True)
        if ok or not any(work.glob("*.log")):
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"worker logs kept in {work}")


if __name__ == "__main__":
    main()
