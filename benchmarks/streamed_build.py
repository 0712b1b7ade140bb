"""Streamed build: how long `llmc build` takes and how much memory it peaks at on real-shaped
checkpoints, next to llama.cpp's convert + quantize, and how fast the results decode.

    python benchmarks/streamed_build.py make-checkpoint --shape 8b|1b|30b-a3b-8l --out DIR [--seed N] [--shard-size B] [--verify]
    python benchmarks/streamed_build.py verify DIR [--load]
    python benchmarks/streamed_build.py build DIR --work WORK [--quant int4,int8[,fp32]] [--no-llmc] [--no-llama-cpp]
                                          [--llmc-src CHECKOUT] [--nice N] [--cache warm|cold|asis] [--rss-limit-gb G]
    python benchmarks/streamed_build.py decode DIR --llmc NAME=ENGINE ... --gguf NAME=FILE ... [--reps 5]
                                          [--llmc-src NAME=CHECKOUT ...]
    python benchmarks/streamed_build.py all --shape 1b --checkpoint DIR --work WORK    # all of the above in turn
    python benchmarks/streamed_build.py report --results FILE                         # the tables again

e.g. the numbers before a change, with that commit's llmc exported beside the repo (its C kernels
built or copied there, as peers.py --llmc-src wants):
    git archive HEAD | tar -x -C ../llmc-head && cp llmc/plugins/cpu/_cpu_ops*.so ../llmc-head/llmc/plugins/cpu/
    python benchmarks/streamed_build.py all --shape 1b --checkpoint ../ckpt-1b --work ../work-1b --llmc-src ../llmc-head

Every subcommand that measures merges its numbers into a JSON file (--results; `build` and `all`
default to WORK/results.json) and prints the results as markdown tables, headed by the host's CPU
model, logical CPUs, memory and ISA flags.

make-checkpoint. A random-weight HF checkpoint of the real shape, written without ever holding
the model, or even one shard, in memory: each tensor is drawn in chunks of 4 Mi values and
streamed into a safetensors file written by hand (8-byte little-endian header length, the JSON
header with every tensor's dtype, shape and data_offsets and {"format": "pt"} metadata, padded
with spaces to 8 bytes, then the raw data), so the generator's peak RSS stays ~100 MB for any
shape. Weights are bf16, N(0, 0.02) (drawn as 16 random bits indexing a table of the normal's
65536 quantiles: exact normal quantiles at finer steps than bf16 can tell apart, several times
faster than drawing floats and rounding them); norms 1 + 0.1 N(0, 1) as llmc's recipes, so no two norms are
alike. Deterministic: tensor i draws from PCG64(SeedSequence([seed, i])), so a shape and seed
give the same bytes on every machine. Shards as the hub cuts them (HF's rule: a new shard when
the next tensor would pass --shard-size, 5 GB): 8b gives 4 shards and
model.safetensors.index.json like meta-llama/Llama-3.1-8B; 1b one model.safetensors like
Llama-3.2-1B (--shard-size 1e9 for a sharded 1b). Tensor names are HF Llama's.
  8b: Llama-3.1-8B: hidden 4096, 32 layers, 32 heads, 8 KV heads, head_dim 128, intermediate
      14336, vocab 128256, untied lm_head, rope_theta 500000 with Llama-3.1's llama3 rope_scaling
      (factor 8), max_position_embeddings 131072: 8.03 B parameters, 16.06 GB.
  1b: Llama-3.2-1B: hidden 2048, 16 layers, 32 heads, 8 KV heads, head_dim 64, intermediate 8192,
      vocab 128256, tied embeddings, llama3 rope_scaling factor 32: 1.24 B parameters, 2.47 GB.
  tiny: 2 layers of hidden 256 with the real vocabulary and untied LM head: the script's smoke test.
  30b-a3b-8l: Qwen3-30B-A3B's layer (hidden 2048, 32 heads, 4 KV heads, head_dim 128, QK-norm, 128
      experts of 768 with 8 a token and norm_topk_prob, the per-expert tensors as the hub names
      them), vocab 151936, untied: 8 of its 48 layers, 5.61 B parameters, 11.2 GB (the whole model's
      61 GB does not fit this disk beside its engines).
  config.json is written as the hub writes it (rope_theta + rope_scaling, torch_dtype; `dtype`
  too, transformers 5's name). The tokenizer is the project's (models/tokenizer, 1024 tokens,
  <s>/</s>/<pad> = 0/1/2), as every llmc random-weight recipe (smollm2-135m-shape: vocab 49152)
  uses: llmc builds with it, and llama.cpp's converter takes it through peers_worker.py's
  documented workaround (its GPT-2 ByteLevel pre-tokenizer hash is unknown to llama.cpp; the
  GGUF vocabulary is padded to vocab_size with [PAD] entries). vocab_size stays the real 128256,
  so the embedding and LM head have their real size. No earlier 1B-shape measurement exists in
  docs/peers.md or peers.py to be consistent with; smollm2-135m-shape is the only shape there.

verify. transformers' view of the folder (the repo's venv): AutoConfig (the llama3 RoPE read
back), every tensor's name, shape and dtype against a LlamaForCausalLM built on the meta device
from that config, the index against the shards, the tokenizer; --load also loads the model with
AutoModelForCausalLM.from_pretrained (bf16) and runs a forward pass (needs RAM for the model: 1b).

build. Each step runs as a child process, the CLI as users run it, one at a time:
  llmc build DIR -o WORK/engine-Q --quant Q --overwrite (Q = int4, int8; fp32 = no --quant),
      with the venv's `llmc` script;
  llama.cpp's convert_hf_to_gguf.py (the one vendored in llama-cpp-python's sdist, run through
      peers_worker.py convert-gguf with the peers benchmark's flags --fuse-qkv) to a bf16 GGUF,
      then llama.cpp's quantizer (llama_model_quantize, what the llama-quantize tool calls, via
      peers_worker.py quantize-gguf, default params, no imatrix) to Q4_0 (int4) and Q8_0 (int8).
      peers.py converts to f32 because its sources are fp32 recipe folders and its fp32 row is
      that f32 GGUF; a bf16 checkpoint converts losslessly to bf16 at half the f32 size (16 GB,
      not 32, for 8b), and Q4_0/Q8_0 made from it equal those made from an f32 GGUF of the same
      values (--gguf-outtype to change it). In Q4_0 llama.cpp keeps the output matrix (the tied
      embedding, 1b) at Q6_K.
  --quant fp32 builds llmc without --quant and compares it with the converter's GGUF itself.
  --llmc-src runs llmc build from another checkout (PYTHONPATH ahead of the editable install);
  each llmc step records which llmc it ran (commit, and whether llmc/ had uncommitted changes).
  The peers' venv (llama-cpp-python built from source for this CPU) is peers.py's: it is set up
  on first use, as `python benchmarks/peers.py --setup` does (~10 min on 2 cores).
  Per step: wall time; peak RSS of the largest process (os.wait4's ru_maxrss, exact; it includes
  file pages mapped from the checkpoint, e.g. by mmap); the process tree's peak anonymous and
  file-backed resident memory, sampled from /proc every 0.1 s (anonymous memory is what the
  build itself holds; file pages of an mmap'ed checkpoint count in RSS but the kernel can drop
  them); CPU seconds; output size. Before every step its input files are read into the page cache
  (--cache warm, the default: every step starts from the same warm state, as a build right after
  a download would), or dropped from it with posix_fadvise (--cache cold), or left (--cache asis).
  A step whose tree's anonymous memory passes --rss-limit-gb (default 85% of RAM) is killed and
  reported as such, so an unstreamed 8b build is measured as "killed at N GB" instead of taking
  the machine down. A step that would leave less than --min-free-gb of disk is not started.

decode. Batch-1 decode of the llmc engines and llama.cpp's GGUFs in one interleaved run, with
peers.py's workers (benchmarks/peers_worker.py; llmc in this venv, llama.cpp in the peers'):
a prompt of --prompt-len random token ids (128), --new-tokens greedy tokens (128), no early stop;
TPOT = (last token time - first token time) / (new tokens - 1), TTFT = request start -> first
token, --threads 2 for everyone, llama.cpp with its default f16 KV cache. Repetitions rotate the
order; medians [min..max]. Roofline as peers.py's per-row one: the bytes a decode step reads
from the row's own files (the GGUF's tensors, an untied token_embd one row; the llmc engine's ONNX
initializers, a gathered table one row) plus its KV bytes at the mean attended length (prompt +
new/2), over the DRAM read bandwidth measured (peers.py's compiled read kernel, best of 3
passes) just before that row's measurement; "% roofline" = roofline TPOT / TPOT, median over reps.
A run whose repetitions were partly contended (other processes over 5% of the CPUs) also shows
each row's TPOT over the quiet repetitions alone. Rows whose workers would not fit in the
available memory together (an engine's files, a GGUF's twice: llama.cpp repacks Q4_0 for its
kernels beside the mapped file) are refused: run them in two calls, e.g. the int4 rows, then the
int8 ones (`all` splits by quantization when needed).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shlex
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
import peers  # noqa: E402  (benchmarks/peers.py: the peers' venv, the contention count)
from peer_runtimes import llama_cpp, llmc_engine, roofline, shared  # noqa: E402  (GGUF steps, workers, rooflines)
from common import host, host_line  # noqa: E402

# -- shapes --------------------------------------------------------------------------------------

_COMMON = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False, "attention_dropout": 0.0,
    "hidden_act": "silu", "initializer_range": 0.02, "mlp_bias": False, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "use_cache": True, "vocab_size": 128256, "max_position_embeddings": 131072, "rope_theta": 500000.0,
    "num_attention_heads": 32, "num_key_value_heads": 8, "torch_dtype": "bfloat16", "dtype": "bfloat16",
    # The project tokenizer's <s>, </s>, <pad> (Llama 3's own ids, 128000/128001, are not in it).
    "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,
}
SHAPES = {
    "8b": {"like": "meta-llama/Llama-3.1-8B", "config": dict(
        _COMMON, hidden_size=4096, num_hidden_layers=32, head_dim=128, intermediate_size=14336,
        tie_word_embeddings=False, rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                 "original_max_position_embeddings": 8192, "rope_type": "llama3"})},
    "1b": {"like": "meta-llama/Llama-3.2-1B", "config": dict(
        _COMMON, hidden_size=2048, num_hidden_layers=16, head_dim=64, intermediate_size=8192,
        tie_word_embeddings=True, rope_scaling={"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                "original_max_position_embeddings": 8192, "rope_type": "llama3"})},
    # Not a real model: the script's own smoke test (seconds to make, a minute or two to build).
    "tiny": {"like": "a 2-layer Llama 3 with the real vocabulary", "config": dict(
        _COMMON, hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        intermediate_size=512, max_position_embeddings=4096, tie_word_embeddings=False,
        rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 1024, "rope_type": "llama3"})},
    # Qwen3-30B-A3B's layers (hidden 2048, 32 query / 4 KV heads of 128, QK-norm, 128 experts of 768,
    # 8 a token), 8 of its 48: the whole model (61 GB bf16) does not fit this disk beside its engines.
    "30b-a3b-8l": {"like": "Qwen/Qwen3-30B-A3B, 8 of its 48 layers", "config": dict(
        _COMMON, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936, hidden_size=2048,
        num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128, intermediate_size=6144,
        moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=40960, rope_theta=1000000.0,
        rms_norm_eps=1e-06, tie_word_embeddings=False, use_sliding_window=False, sliding_window=None)},
}
HUB_SHARD_SIZE = 5_000_000_000  # save_pretrained's and the hub's "5GB"
INIT_STD = 0.02
NORM_NOISE = 0.1  # llmc.compiler.recipes' norms: 1 + 0.1 N(0, 1)
CHUNK = 1 << 22  # values drawn and written at a time (8 MiB of bf16): the generator's memory
GB = 1e9
# Written into every generated folder (shape, seed, whether it finished): only such a folder is
# ever overwritten, and `all` regenerates one that did not finish.
MARKER = "streamed_build.json"

# Quantization -> (llmc build flags, llama.cpp GGUF type compared with it); fp32 is compared
# with the unquantized GGUF the converter writes.
QUANTS = {"int4": (["--quant", "int4"], "q4_0"), "int8": (["--quant", "int8"], "q8_0"), "fp32": ([], None)}
GGUF_NAMES = {"q4_0": "Q4_0", "q8_0": "Q8_0", "bf16": "bf16", "f16": "f16", "f32": "f32"}
# Output size over the bf16 checkpoint's, to refuse a step the disk cannot take (generous).
SIZE_RATIO = {"q4_0": 0.35, "q8_0": 0.55, "bf16": 1.01, "f16": 1.01, "f32": 2.02,
              "int4": 0.5, "int8": 0.8, "fp32": 2.2}


def tensors(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """HF Llama's tensors in the order save_pretrained writes them; for a Qwen3-MoE shape, its
    QK-norms, router and per-expert projections as the hub ships them."""
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    out = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", (q, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, q))]
        if cfg.get("num_experts"):
            e_inter = cfg["moe_intermediate_size"]
            out += [(p + "self_attn.q_norm.weight", (hd,)), (p + "self_attn.k_norm.weight", (hd,)),
                    (p + "mlp.gate.weight", (cfg["num_experts"], h))]
            for e in range(cfg["num_experts"]):
                out += [(p + f"mlp.experts.{e}.gate_proj.weight", (e_inter, h)),
                        (p + f"mlp.experts.{e}.up_proj.weight", (e_inter, h)),
                        (p + f"mlp.experts.{e}.down_proj.weight", (h, e_inter))]
        else:
            out += [(p + "mlp.gate_proj.weight", (inter, h)), (p + "mlp.up_proj.weight", (inter, h)),
                    (p + "mlp.down_proj.weight", (h, inter))]
        out += [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))]
    out.append(("model.norm.weight", (h,)))
    if not cfg["tie_word_embeddings"]:
        out.append(("lm_head.weight", (vocab, h)))
    return out


def shards(plan, max_bytes: float) -> list[list[int]]:
    """Tensor indices per shard, cut as HF cuts: a new shard when the next tensor would pass max_bytes."""
    out, size = [[]], 0
    for i, (_, shape) in enumerate(plan):
        n = 2 * math.prod(shape)
        if out[-1] and size + n > max_bytes:
            out.append([])
            size = 0
        out[-1].append(i)
        size += n
    return out


# -- the generator -------------------------------------------------------------------------------


def _bf16_bits(x):
    """float32 -> bf16 bit patterns, rounded to nearest even (x holds no NaN)."""
    import numpy as np

    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _normal_table(std: float):
    """bf16 bits of std x the normal's quantiles at (k + 0.5) / 65536, k = 0..65535."""
    import numpy as np

    nd = statistics.NormalDist(0.0, std)
    return _bf16_bits(np.array([nd.inv_cdf((k + 0.5) / 65536) for k in range(65536)]))


def _tensor_chunks(index: int, shape, seed: int, table, buf):
    """The bf16 bytes of tensor `index`, CHUNK values at a time, each chunk a view of `buf`."""
    import numpy as np

    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, index])))
    n = math.prod(shape)
    if len(shape) == 1:  # a norm: small, drawn as floats
        yield _bf16_bits(1.0 + NORM_NOISE * rng.standard_normal(n, dtype=np.float32))
        return
    for start in range(0, n, CHUNK):
        m = min(CHUNK, n - start)
        bits = rng.bit_generator.random_raw((m + 3) // 4).astype("<u8", copy=False).view("<u2")[:m]
        out = buf[:m]
        np.take(table, bits, out=out, mode="clip")  # mode clip: no bounds check, 16-bit indices fit
        yield out


def _write_shard(path: Path, entries, seed: int, table, buf, progress) -> None:
    header, off = {"__metadata__": {"format": "pt"}}, 0
    for _, name, shape in entries:
        n = 2 * math.prod(shape)
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)  # the data starts 8-byte aligned, as the safetensors writer pads it
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for index, name, shape in entries:
            for chunk in _tensor_chunks(index, shape, seed, table, buf):
                f.write(chunk.data)
                progress(chunk.nbytes)
    os.replace(tmp, path)


def make_checkpoint(shape: str, out: Path, seed: int, shard_size: float) -> dict:
    import numpy as np

    from llmc.compiler import recipes

    cfg = SHAPES[shape]["config"]
    plan = tensors(cfg)
    groups = shards(plan, shard_size)
    total = sum(2 * math.prod(s) for _, s in plan)
    names = (["model.safetensors"] if len(groups) == 1 else
             [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))])
    need = total * 1.01 + 2**30
    free = shutil.disk_usage(out.parent if not out.exists() else out).free
    if need > free:
        raise SystemExit(f"error: {out} needs {need / GB:.1f} GB, the disk has {free / GB:.1f} GB free")
    marker = out / MARKER
    if out.is_dir() and any(out.iterdir()) and not marker.is_file():
        raise SystemExit(f"error: {out} holds files this script did not write (no {MARKER}); pick an empty folder")
    out.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps({"shape": shape, "seed": seed, "shard_size": shard_size, "complete": False}) + "\n")
    for stale in list(out.glob("*.safetensors")) + list(out.glob("*.partial")):
        if stale.name not in names:  # another shape's or shard size's shards would join this model
            stale.unlink()
    print(f"make-checkpoint: {shape} shape ({SHAPES[shape]['like']}), {sum(math.prod(s) for _, s in plan) / 1e9:.3f} B "
          f"parameters, {total / GB:.2f} GB bf16 in {len(groups)} shard(s) -> {out}", flush=True)
    start = time.perf_counter()
    table, buf = _normal_table(INIT_STD), np.empty(CHUNK, np.uint16)
    done, shown = [0], [0.0]

    def progress(nbytes):
        done[0] += nbytes
        if done[0] - shown[0] >= 2 * GB or done[0] == total:
            shown[0] = done[0]
            t = time.perf_counter() - start
            print(f"  {done[0] / GB:6.2f} / {total / GB:.2f} GB, {t:5.0f} s, {done[0] / GB / t:.2f} GB/s", flush=True)

    weight_map = {}
    for name, group in zip(names, groups):
        entries = [(i, plan[i][0], plan[i][1]) for i in group]
        _write_shard(out / name, entries, seed, table, buf, progress)
        weight_map.update({n: name for _, n, _ in entries})
    index = out / "model.safetensors.index.json"
    if len(groups) > 1:
        index.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    elif index.exists():
        index.unlink()
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"],
         "pad_token_id": cfg["pad_token_id"]}, indent=2) + "\n")
    # The project tokenizer, as llmc.compiler.recipes gives every random-weight recipe.
    for f in recipes._TOKENIZER_FILES:
        shutil.copyfile(recipes._TOKENIZER_DIR / f, out / f)
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    tok_cfg["model_max_length"] = cfg["max_position_embeddings"]
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    marker.write_text(json.dumps({"shape": shape, "seed": seed, "shard_size": shard_size, "complete": True}) + "\n")
    seconds = time.perf_counter() - start
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    res = {"shape": shape, "like": SHAPES[shape]["like"], "folder": str(out.resolve()), "seed": seed,
           "parameters": sum(math.prod(s) for _, s in plan), "bytes": total, "shards": names,
           "seconds": seconds, "peak_rss_bytes": rss,
           "command": shlex.join(["python", "benchmarks/streamed_build.py", "make-checkpoint", "--shape", shape,
                                  "--out", str(out), "--seed", str(seed)]
                                 + (["--shard-size", f"{shard_size:g}"] if shard_size != HUB_SHARD_SIZE else []))}
    print(f"make-checkpoint: {total / GB:.2f} GB in {seconds:.0f} s ({total / GB / seconds:.2f} GB/s); "
          f"generator peak RSS {rss / 2**20:.0f} MiB", flush=True)
    return res


# -- verify ----------------------------------------------------------------------------------------


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return [folder / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return [folder / "model.safetensors"]


def verify(folder: Path, load: bool) -> dict:
    """transformers' view of the folder; raises SystemExit naming the first thing wrong."""
    import torch
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    problems = []
    cfg = AutoConfig.from_pretrained(folder)
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    theta = rope.get("rope_theta", getattr(cfg, "rope_theta", None))
    if rope.get("rope_type") != "llama3" or theta != 500000.0:
        problems.append(f"transformers reads RoPE as {rope} (theta {theta}), not llama3 with theta 500000")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        want.pop("lm_head.weight", None)  # saved once, as the embedding
    got, where = {}, {}
    stats = {}
    for f in safetensors_files(folder):
        with safe_open(f, framework="pt") as s:
            for k in s.keys():
                sl = s.get_slice(k)
                got[k] = tuple(sl.get_shape())
                where[k] = f.name
                if sl.get_dtype() != "BF16":
                    problems.append(f"{k} is {sl.get_dtype()}, not BF16")
            # One projection and one norm per shard, read whole: the values look like the recipe's.
            for k in [k for k in s.keys() if k.endswith(("k_proj.weight", "norm.weight"))][:2]:
                t = s.get_tensor(k).float()
                stats[k] = (float(t.mean()), float(t.std()))
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    if missing or extra:
        problems.append(f"tensor names differ from LlamaForCausalLM's: missing {missing[:4]}, unexpected {extra[:4]}")
    bad = [f"{k}: {got[k]} (want {want[k]})" for k in want if k in got and got[k] != want[k]]
    if bad:
        problems.append("shapes differ: " + "; ".join(bad[:4]))
    for k, (mean, std) in stats.items():
        ok = abs(mean - 1) < 0.05 and abs(std - NORM_NOISE) < 0.02 if "norm" in k else abs(std - INIT_STD) < 1e-3
        if not ok:
            problems.append(f"{k}: mean {mean:.4f} std {std:.4f} is not what the generator draws")
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        idx = json.loads(index.read_text())
        if idx["weight_map"] != where:
            problems.append("model.safetensors.index.json's weight_map does not match the shards")
        if idx["metadata"]["total_size"] != sum(2 * math.prod(s) for s in got.values()):
            problems.append("the index's total_size is not the shards' data size")
    tok = AutoTokenizer.from_pretrained(folder)
    text = "def f(x):\n    return x + 1  # ok"
    if tok.decode(tok(text, add_special_tokens=False)["input_ids"]) != text:
        problems.append("the tokenizer does not round-trip a short text")
    res = {"tensors": len(got), "parameters": sum(math.prod(s) for s in got.values()),
           "rope": {k: v for k, v in rope.items()}, "sampled_stats": stats}
    if load and not problems:
        start = time.perf_counter()
        m = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
        with torch.no_grad():
            logits = m(torch.tensor([[0, 5, 17, 300, 1000, 77, 9, 12]])).logits
        res["load_seconds"] = time.perf_counter() - start
        res["load_peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        if not torch.isfinite(logits).all() or logits.shape[-1] != cfg.vocab_size:
            problems.append(f"from_pretrained's forward gave logits of shape {tuple(logits.shape)}, finite: "
                            f"{bool(torch.isfinite(logits).all())}")
    if problems:
        raise SystemExit("verify: " + "\n  ".join(["FAILED"] + problems))
    print(f"verify: {folder}: {res['tensors']} tensors, {res['parameters'] / 1e9:.3f} B parameters, names/shapes/"
          f"dtypes as LlamaForCausalLM's, RoPE {res['rope']}, tokenizer round-trips"
          + (f"; from_pretrained + forward OK in {res['load_seconds']:.0f} s" if "load_seconds" in res else ""),
          flush=True)
    return res


# -- measured child processes -----------------------------------------------------------------------


def _tree(pid: int) -> list[int]:
    import psutil

    try:
        p = psutil.Process(pid)
        return [pid] + [c.pid for c in p.children(recursive=True)]
    except psutil.Error:
        return []


def _rss_parts(pid: int) -> tuple[int, int]:
    """(anonymous + shmem, file-backed) resident bytes of one process."""
    anon = file = 0
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("RssAnon:", "RssShmem:")):
                    anon += int(line.split()[1]) * 1024
                elif line.startswith("RssFile:"):
                    file += int(line.split()[1]) * 1024
    except OSError:
        pass
    return anon, file


class TreeSampler(threading.Thread):
    """Peak resident memory of a process tree, sampled; kills the tree past `limit` anonymous bytes."""

    def __init__(self, pid: int, limit: float | None, period: float = 0.1):
        super().__init__(daemon=True)
        self.pid, self.limit, self.period = pid, limit, period
        self.peak_anon = self.peak_file = self.peak_total = 0
        self.killed = None
        self._done = threading.Event()
        self._t0 = time.perf_counter()

    def run(self):
        while not self._done.is_set():
            pids = _tree(self.pid)
            parts = [_rss_parts(p) for p in pids]
            anon, file = sum(a for a, _ in parts), sum(f for _, f in parts)
            self.peak_anon, self.peak_file = max(self.peak_anon, anon), max(self.peak_file, file)
            self.peak_total = max(self.peak_total, anon + file)
            if self.limit and anon > self.limit and self.killed is None:
                self.killed = {"anon_bytes": anon, "after_s": time.perf_counter() - self._t0}
                for p in reversed(pids):  # only the tree this script started
                    try:
                        os.kill(p, signal.SIGKILL)
                    except OSError:
                        pass
            self._done.wait(self.period)

    def stop(self):
        self._done.set()
        self.join()


def _cache(files: list[Path], how: str) -> float:
    """Put `files` in the page cache (warm) or drop them from it (cold); seconds spent."""
    start = time.perf_counter()
    buf = bytearray(16 << 20)
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            if how == "cold":
                os.fsync(fh.fileno())  # dirty pages cannot be dropped
                os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            elif how == "warm":
                while fh.readinto(buf):
                    pass
    return time.perf_counter() - start


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def run_measured(label: str, cmd: list, log: Path, inputs: list[Path], output: Path, *, env=None, nice=0,
                 cache="warm", rss_limit=None) -> dict:
    cmd = [str(c) for c in cmd]
    cache_s = _cache(inputs, cache) if cache != "asis" else 0.0
    print(f"{label}: {shlex.join(cmd)}", flush=True)
    with open(log, "w") as f:
        f.write(f"$ {shlex.join(cmd)}\n")
        f.flush()
        start, busy0 = time.perf_counter(), peers.cpu_times([])
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                preexec_fn=(lambda: os.nice(nice)) if nice else None)
    sampler = TreeSampler(proc.pid, rss_limit)
    sampler.start()
    # wait4 gives this child's own rusage (its reaped descendants included), not the sum over
    # every child this script ever had, as RUSAGE_CHILDREN would.
    _, status, ru = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    sampler.stop()
    busy1 = peers.cpu_times([])
    # The machine's busy CPU seconds less the step's own: what everything else took meanwhile.
    others = (max(0.0, busy1[0] - busy0[0] - ru.ru_utime - ru.ru_stime) / (wall * (os.cpu_count() or 1))
              if busy0 and busy1 else None)
    res = {"label": label, "command": shlex.join(cmd), "rc": proc.returncode, "wall_s": wall,
           "peak_rss_bytes": ru.ru_maxrss * 1024, "peak_tree_anon_bytes": sampler.peak_anon,
           "peak_tree_file_bytes": sampler.peak_file, "peak_tree_rss_bytes": sampler.peak_total,
           "user_s": ru.ru_utime, "sys_s": ru.ru_stime, "others_cpu_share": others, "cache": cache,
           "cache_prep_s": cache_s, "nice": nice,
           "log": str(log), "output": str(output), "output_bytes": _size(output) if proc.returncode == 0 else None}
    if sampler.killed:
        res["killed"] = sampler.killed
    status = ("ok" if proc.returncode == 0 else
              f"KILLED at {sampler.killed['anon_bytes'] / GB:.1f} GB anonymous (--rss-limit-gb)" if sampler.killed
              else f"FAILED (exit {proc.returncode}; log {log})")
    res["status"] = status
    print(f"{label}: {status}, {wall:.1f} s wall, peak RSS {res['peak_rss_bytes'] / GB:.2f} GB, tree anon peak "
          f"{sampler.peak_anon / GB:.2f} GB (file-backed {sampler.peak_file / GB:.2f} GB), "
          f"CPU {ru.ru_utime + ru.ru_stime:.0f} s"
          + (f", other processes used {others * 100:.0f}% of the CPUs meanwhile" if others is not None else ""),
          flush=True)
    if proc.returncode != 0 and not sampler.killed:
        tail = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()][-5:]
        print("  " + "\n  ".join(tail), flush=True)
    return res


# -- build -----------------------------------------------------------------------------------------------


def _check_disk(where: Path, need: float, min_free: float, what: str) -> str | None:
    free = shutil.disk_usage(where).free
    if free - need < min_free:
        return (f"not started: {what} needs ~{need / GB:.1f} GB and would leave {(free - need) / GB:.1f} GB free "
                f"(< --min-free-gb {min_free / GB:.0f})")
    return None


def _peers_python(args) -> Path:
    venv, root = args.peers_venv.expanduser().resolve(), args.peers_dir.expanduser().resolve()
    root.mkdir(parents=True, exist_ok=True)
    try:
        return peers.setup_venv(venv, root, root / "setup.log")
    except shared.SetupError as exc:
        raise SystemExit(f"error: {exc}") from None


def llmc_revision(src: Path | None) -> str:
    """Which llmc a step ran: the checkout's commit, and whether llmc/ had uncommitted changes."""
    root = src or REPO

    def git(*a):
        return subprocess.run(["git", "-C", str(root), *a], capture_output=True, text=True, check=True).stdout.strip()

    try:
        dirty = git("status", "--porcelain", "--", "llmc")
        return f"{root} at {git('rev-parse', '--short', 'HEAD')}" + (" + uncommitted changes in llmc/" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return f"{root} (not a git checkout)"


def build(args, folder: Path, results: dict) -> None:
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    logs = work / "logs"
    logs.mkdir(exist_ok=True)
    src_files = safetensors_files(folder)
    src_bytes = sum(f.stat().st_size for f in src_files)
    quants = [q for q in args.quant.split(",") if q]
    unknown = set(quants) - set(QUANTS)
    if unknown:
        raise SystemExit(f"error: --quant {sorted(unknown)[0]!r}; choose from {', '.join(QUANTS)}")
    steps = results.setdefault("steps", {})
    common = {"nice": args.nice, "cache": args.cache, "rss_limit": args.rss_limit_gb * GB}
    min_free = args.min_free_gb * GB

    def record(key, res):
        res["quant"] = key[1]
        steps[" ".join(key)] = res
        save(args.results, results)

    def skipped(key, why, cmd=""):
        print(f"{' '.join(key)}: {why}", flush=True)
        record(key, {"label": " ".join(key), "status": why, "command": cmd, "rc": None})

    if not args.no_llama_cpp:
        python = _peers_python(args)
        env = shared.peer_env()
        root = args.peers_dir.expanduser().resolve()
        outtype = args.gguf_outtype
        source = work / f"model-{outtype}.gguf"
        key = ("llama.cpp", f"convert-{outtype}")
        cmd = llama_cpp.gguf_convert_cmd(python, root, folder, source, outtype)
        why = _check_disk(work, SIZE_RATIO[outtype] * src_bytes, min_free, "the GGUF")
        if why:
            skipped(key, why, shlex.join(map(str, cmd)))
        else:
            record(key, run_measured(f"llama.cpp convert_hf_to_gguf.py -> {outtype}", cmd, logs / "convert.log",
                                     src_files, source, env=env, **common))
        converted = steps[" ".join(key)].get("rc") == 0
        for q in quants:
            ftype = QUANTS[q][1]
            if ftype is None or not converted:
                continue
            out = work / f"model-{ftype}.gguf"
            key = ("llama.cpp", ftype)
            cmd = llama_cpp.gguf_quantize_cmd(python, source, out, ftype)
            why = _check_disk(work, SIZE_RATIO[ftype] * src_bytes, min_free, f"the {GGUF_NAMES[ftype]} GGUF")
            if why:
                skipped(key, why, shlex.join(map(str, cmd)))
                continue
            record(key, run_measured(f"llama.cpp quantize -> {GGUF_NAMES[ftype]}", cmd, logs / f"quantize-{ftype}.log",
                                     [source], out, env=env, **common))
        if args.drop_source_gguf and converted and source.exists():
            source.unlink()
            print(f"removed {source} (--drop-source-gguf)", flush=True)

    if not args.no_llmc:
        for q in quants:
            out = work / f"engine-{q}"
            key = ("llmc", q)
            cmd = [args.llmc_cli, "build", folder, "-o", out, "--overwrite", *QUANTS[q][0], *args.build_arg]
            why = _check_disk(work, SIZE_RATIO[q] * src_bytes, min_free, f"the {q} engine")
            if why:
                skipped(key, why, shlex.join(map(str, cmd)))
                continue
            res = run_measured(f"llmc build --quant {q}", cmd, logs / f"llmc-build-{q}.log", src_files, out,
                               env=llmc_engine.src_env(args.llmc_src) if args.llmc_src else None, **common)
            res["llmc"] = llmc_revision(args.llmc_src)
            if args.llmc_src:
                res["command"] = f"PYTHONPATH={args.llmc_src} {res['command']}"
            record(key, res)


# -- decode ------------------------------------------------------------------------------------------------


def _pairs(specs: list[str], flag: str) -> list[tuple[str, Path]]:
    out = []
    for s in specs:
        name, sep, path = s.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"error: {flag} wants NAME=PATH (got {s!r})")
        if not Path(path).exists():
            raise SystemExit(f"error: {flag} {name}: {path} does not exist")
        out.append((name, Path(path).resolve()))
    return out


def _resident(rows) -> int:
    """What the rows' workers will hold: the engine's files, and twice a Q4_0 GGUF's, since
    llama.cpp repacks those weights for its CPU kernels into memory beside the mapped file (an 8b
    Q4_0 worker held 8.5 GB for a 4.66 GB file; a Q8_0 one 8.5 GB for its 8.54 GB); plus the
    bandwidth worker's buffer and some slack."""
    return sum(_size(p) * (2 if kind == "llama.cpp" and "q4_0" in p.name.lower() else 1) for _, kind, p in rows) \
        + 2 * 2**30


def _available_memory() -> int:
    import psutil

    return psutil.virtual_memory().available


def decode(args, folder: Path, rows_in: list[tuple[str, str, Path]], results: dict, srcs: dict | None = None) -> dict:
    """rows_in: (name, "llmc" | "llama.cpp", engine dir or GGUF); srcs: an llmc row's checkout. One
    interleaved run."""
    import numpy as np

    need, avail = _resident(rows_in), _available_memory()
    if need > avail:
        raise SystemExit(f"error: the rows' workers would hold ~{need / GB:.1f} GB and {avail / GB:.1f} GB of memory "
                         "is available; run them in smaller groups")
    python = _peers_python(args) if any(kind == "llama.cpp" for _, kind, _ in rows_in) else None
    cfg = json.loads((folder / "config.json").read_text())
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, cfg["vocab_size"], args.prompt_len).tolist()
    work = Path(tempfile.mkdtemp(prefix="llmc-streamed-decode-"))
    common = ["--threads", str(args.threads), "--max-seqs", "1",
              "--ctx-per-seq", str(args.prompt_len + args.new_tokens + 64)]
    rows = {name: {"kind": kind, "path": str(path), "ttft": [], "tpot": [], "bw": []} for name, kind, path in rows_in}
    workers, bw_worker, others = {}, None, []
    ok = False
    try:
        for name, kind, path in rows_in:
            print(f"load: {name} ({path})", flush=True)
            if kind == "llmc":
                src = (srcs or {}).get(name)
                w = shared.Worker(name, Path(sys.executable), ["llmc", "--model", str(path), *common],
                                  work / f"{len(workers)}-llmc.log", llmc_engine.src_env(src) if src else None,
                                  src or REPO)
                rows[name]["llmc"] = llmc_revision(src)
            else:
                w = shared.Worker(name, python, ["llama.cpp", "--model", str(path), *common,
                                                 "--kv-type", args.llama_kv_type], work / f"{len(workers)}-llama.log",
                                  shared.peer_env())
            workers[name] = w
            rows[name]["info"] = w.info
        bw_worker = shared.Worker("bandwidth", Path(sys.executable), [
            "bandwidth", "--threads", str(args.threads), "--cache", str(args.peers_dir.expanduser() / "bandwidth")],
            work / "bandwidth.log")
        print("warm-up", flush=True)
        for w in workers.values():
            w.call("latency", prompt=prompt, n=8)
        bw_worker.call("bandwidth", passes=1)
        names = list(workers)
        for rep in range(args.reps):
            pids = [os.getpid(), bw_worker.proc.pid] + [w.proc.pid for w in workers.values()]
            t0, c0 = time.perf_counter(), peers.cpu_times(pids)
            order = names[rep % len(names):] + names[:rep % len(names)]
            for name in order:
                time.sleep(peers.PAUSE_S)
                # Bandwidth right before each measurement: it moves within seconds on a shared VM.
                b = bw_worker.call("bandwidth", passes=3)["bytes_per_s"]
                m = workers[name].call("latency", prompt=prompt, n=args.new_tokens)
                rows[name]["ttft"].append(m["ttft"])
                rows[name]["tpot"].append(m["tpot"])
                rows[name]["bw"].append(b)
            c1 = peers.cpu_times(pids)
            if c0 and c1:
                busy = max(0.0, (c1[0] - c0[0]) - (c1[1] - c0[1]))  # CPU seconds not ours
                others.append(busy / ((time.perf_counter() - t0) * os.cpu_count()))
            print(f"rep {rep + 1}/{args.reps}: " + " · ".join(
                f"{n} TPOT {rows[n]['tpot'][-1] * 1e3:.1f} ms" for n in order)
                + (f" · others used {others[-1] * 100:.0f}% CPU" if others else ""), flush=True)
        ok = True
    finally:
        for w in list(workers.values()) + ([bw_worker] if bw_worker else []):
            w.close()
        if ok:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"worker logs kept in {work}", flush=True)

    per_elem = roofline.kv_bytes_per_position(folder, 1)
    mean_ctx = args.prompt_len + args.new_tokens / 2
    experts_active = roofline.experts_read(json.loads((folder / "config.json").read_text()))
    for name, r in rows.items():
        own = roofline.own_bytes(r["kind"], Path(r["path"]), r.get("info", {}),
                                 SimpleNamespace(llama_kv_type=args.llama_kv_type), experts_active)
        if own is None:
            continue
        own["kv_bytes"] = per_elem * own["kv_dtype_bytes"] * mean_ctx
        token = own["weight_bytes"] + own["kv_bytes"]
        own["tpot_at_median_bw"] = token / statistics.median(r["bw"])
        r["own_roofline"] = own
        r["roofline_share"] = [token / b / t for b, t in zip(r["bw"], r["tpot"])]
    run = {"prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "threads": args.threads, "reps": args.reps,
           "llama_kv_type": args.llama_kv_type, "others_cpu_share": others, "rows": rows,
           "bandwidth_method": bw_worker.info["method"] if bw_worker else None,
           "source_weight_bytes": roofline.weight_bytes(folder)}
    results.setdefault("decode", []).append(run)
    save(args.results, results)
    return run


# -- results ------------------------------------------------------------------------------------------------


def load(path: Path | None) -> dict:
    if path and path.is_file():
        return json.loads(path.read_text())
    return {}


def save(path: Path | None, results: dict) -> None:
    if path:
        results["host"] = host()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(results, indent=1) + "\n")
        os.replace(tmp, path)


def _ms(xs):
    if not xs:
        return "-"
    return f"{statistics.median(xs) * 1e3:.1f} [{min(xs) * 1e3:.1f}..{max(xs) * 1e3:.1f}]"


def report(results: dict) -> str:
    out = [f"**Host:** {host_line(results.get('host'))}", ""]
    c = results.get("checkpoint")
    if c:
        out += ["| checkpoint | parameters | bf16 bytes | shards | generator wall | generator peak RSS |",
                "|---|---|---|---|---|---|",
                f"| {c['shape']} shape ({c['like']}), seed {c['seed']} | {c['parameters'] / 1e9:.3f} B | "
                f"{c['bytes'] / GB:.2f} GB | {len(c['shards'])} | {c['seconds']:.0f} s | "
                f"{c['peak_rss_bytes'] / 2**20:.0f} MiB |", "", f"`{c['command']}`", ""]
    steps = results.get("steps", {})
    if steps:
        out += ["| step | status | wall s | peak RSS GB (largest process) | tree peak anon GB (sampled) | "
                "tree peak file-backed GB | CPU s | others' CPU | output GB |", "|---|---|---|---|---|---|---|---|---|"]
        for key, s in steps.items():
            if s.get("rc") is None:
                out.append(f"| {key} | {s['status']} | - | - | - | - | - | - | - |")
                continue
            outb = f"{s['output_bytes'] / GB:.2f}" if s.get("output_bytes") else "-"
            oth = f"{s['others_cpu_share'] * 100:.0f}%" if s.get("others_cpu_share") is not None else "-"
            out.append(f"| {key} | {s['status']} | {s['wall_s']:.1f} | {s['peak_rss_bytes'] / GB:.2f} | "
                       f"{s['peak_tree_anon_bytes'] / GB:.2f} | {s['peak_tree_file_bytes'] / GB:.2f} | "
                       f"{s['user_s'] + s['sys_s']:.0f} | {oth} | {outb} |")
        # llama.cpp's path to a quantized file is convert + quantize; its total next to llmc's one step.
        conv = next((s for k, s in steps.items() if k.startswith("llama.cpp convert-") and s.get("rc") == 0), None)
        for q, (_, ftype) in QUANTS.items():
            qs = steps.get(f"llama.cpp {ftype}") if ftype else None
            if conv and qs and qs.get("rc") == 0:
                out.append(f"| llama.cpp {q} total (convert + {GGUF_NAMES[ftype]}) | ok | "
                           f"{conv['wall_s'] + qs['wall_s']:.1f} | "
                           f"{max(conv['peak_rss_bytes'], qs['peak_rss_bytes']) / GB:.2f} | "
                           f"{max(conv['peak_tree_anon_bytes'], qs['peak_tree_anon_bytes']) / GB:.2f} | "
                           f"{max(conv['peak_tree_file_bytes'], qs['peak_tree_file_bytes']) / GB:.2f} | "
                           f"{conv['user_s'] + conv['sys_s'] + qs['user_s'] + qs['sys_s']:.0f} | - | "
                           f"{qs['output_bytes'] / GB:.2f} |")
        cache = {s.get("cache") for s in steps.values() if s.get("rc") is not None}
        out += ["", f"Page cache before each step: {', '.join(sorted(c for c in cache if c))} (--cache). "
                "Peak RSS counts the checkpoint pages a process maps; anonymous memory is what it allocates."]
        busy = [k for k, s in steps.items() if (s.get("others_cpu_share") or 0) > 0.05]
        if busy:
            out.append(f"Other processes took over 5% of the CPUs during {', '.join(busy)}: their wall times are "
                       "inflated; CPU s is the steadier figure.")
        out.append("")
        out += [f"- {key}: `{s['command']}`" + (f" (llmc: {s['llmc']})" if s.get("llmc") else "")
                for key, s in steps.items() if s.get("command")]
        out.append("")
    for run in results.get("decode", []):
        o = run["others_cpu_share"]
        # On a shared machine some reps are quiet and some not; the quiet ones' TPOT on its own,
        # when the run had both (each row is measured once per rep).
        quiet = [i for i, x in enumerate(o) if x < 0.05] if o and max(o) > 0.05 else []
        out += [f"Batch-1 decode: {run['prompt_len']}-token prompt, {run['new_tokens']} new tokens, greedy, "
                f"{run['threads']} threads, median of {run['reps']} interleaved reps [min..max]; llama.cpp KV "
                f"{run['llama_kv_type']}; bandwidth: {run['bandwidth_method']}"
                + (f"; other processes used {statistics.median(o) * 100:.0f}% [{min(o) * 100:.0f}..{max(o) * 100:.0f}]"
                   " of the CPUs" if o else "")
                + (" << contended: llama.cpp suffers most (its threads meet at a barrier after every op, so one "
                   "preempted thread stalls the step)" if o and max(o) > 0.05 else ""), "",
                "| runtime | weights read / token | KV / token | DRAM GB/s | roofline TPOT ms | TPOT ms | % roofline | "
                "TTFT ms |" + (f" TPOT ms, % roofline over the quiet reps ({len(quiet)}) |" if quiet else ""),
                "|---|---|---|---|---|---|---|---|" + ("---|" if quiet else "")]
        for name, r in run["rows"].items():
            own = r.get("own_roofline") or {}
            share = r.get("roofline_share")
            tail = ""
            if quiet:
                qs = [share[i] for i in quiet if share and i < len(share)]
                tail = (f" {_ms([r['tpot'][i] for i in quiet if i < len(r['tpot'])])}, "
                        f"{statistics.median(qs) * 100 if qs else float('nan'):.0f}% |")
            out.append(f"| {name} | {own.get('weight_bytes', float('nan')) / GB:.3f} GB | "
                       f"{own.get('kv_bytes', float('nan')) / 1e6:.1f} MB {own.get('kv_dtype', '')} | "
                       f"{statistics.median(r['bw']) / GB:.1f} | {own.get('tpot_at_median_bw', float('nan')) * 1e3:.1f}"
                       f" | {_ms(r['tpot'])} | {statistics.median(share) * 100 if share else float('nan'):.0f}% | "
                       f"{_ms(r['ttft'])} |{tail}")
        out += ["", "Weights read per token: " + "; ".join(
            f"{n}: {(r.get('own_roofline') or {}).get('how', '?')}" for n, r in run["rows"].items()), ""]
        out += [f"- {n}: {r['path']}" + (f" (llmc: {r['llmc']})" if r.get("llmc") else "")
                for n, r in run["rows"].items()]
        sysinfo = next((r["info"]["system_info"] for r in run["rows"].values()
                        if (r.get("info") or {}).get("system_info")), None)
        out += ([f"- llama.cpp's system info: {sysinfo}"] if sysinfo else []) + [""]
    return "\n".join(out)


# -- main ---------------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    def results_arg(p, default_help):
        p.add_argument("--results", type=Path, default=None, help=f"JSON file the numbers merge into ({default_help})")

    def peers_args(p):
        p.add_argument("--peers-venv", type=Path, default=shared.cache_root() / "peers-venv",
                       help="the peers' venv (peers.py's; set up on first use)")
        p.add_argument("--peers-dir", type=Path, default=shared.cache_root() / "peers",
                       help="peers.py's sdist, setup log and bandwidth kernel")

    def build_args(p):
        p.add_argument("--quant", default="int4,int8", help="comma-separated: int4, int8, fp32 (default int4,int8)")
        p.add_argument("--no-llmc", action="store_true", help="skip llmc build")
        p.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp's convert + quantize")
        p.add_argument("--llmc-cli", default=str(Path(sys.executable).parent / "llmc"),
                       help="the llmc command (default: this venv's)")
        p.add_argument("--build-arg", action="append", default=[], help="one more llmc build argument (repeatable)")
        p.add_argument("--llmc-src", type=Path, default=None, metavar="CHECKOUT_DIR",
                       help="run llmc from this source checkout (PYTHONPATH ahead of the editable install, as "
                            "peers.py --llmc-src; its C kernels built there), e.g. the code before a change")
        p.add_argument("--gguf-outtype", choices=["bf16", "f16", "f32"], default="bf16",
                       help="the converter's output, the quantizer's input (bf16: lossless for a bf16 checkpoint)")
        p.add_argument("--drop-source-gguf", action="store_true", help="delete the converted GGUF after quantizing")
        p.add_argument("--cache", choices=["warm", "cold", "asis"], default="warm",
                       help="each step's input files: read into the page cache first, dropped from it, or left")
        p.add_argument("--nice", type=int, default=0, help="niceness of the measured processes")
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        p.add_argument("--rss-limit-gb", type=float, default=round(0.85 * mem / GB, 1),
                       help="kill a step whose anonymous memory passes this (default: 85%% of RAM)")
        p.add_argument("--min-free-gb", type=float, default=20.0, help="do not start a step leaving less disk free")

    def decode_args(p):
        p.add_argument("--reps", type=int, default=5)
        p.add_argument("--prompt-len", type=int, default=128)
        p.add_argument("--new-tokens", type=int, default=128)
        p.add_argument("--threads", type=int, default=2)
        p.add_argument("--llama-kv-type", choices=["f32", "f16", "q8_0"], default="f16")

    m = sub.add_parser("make-checkpoint", help="write a random-weight HF checkpoint of a real shape")
    m.add_argument("--shape", choices=sorted(SHAPES), required=True)
    m.add_argument("--out", type=Path, required=True)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--shard-size", type=float, default=HUB_SHARD_SIZE, help="bytes per shard at most (5e9)")
    m.add_argument("--verify", action="store_true", help="then run verify (with --load for 1b)")
    results_arg(m, "none: printed only")

    v = sub.add_parser("verify", help="check a checkpoint folder with transformers")
    v.add_argument("folder", type=Path)
    v.add_argument("--load", action="store_true", help="also from_pretrained + a forward pass (needs the RAM)")

    b = sub.add_parser("build", help="time llmc build and llama.cpp's convert + quantize")
    b.add_argument("folder", type=Path)
    b.add_argument("--work", type=Path, required=True, help="where engines, GGUFs and logs go")
    build_args(b)
    peers_args(b)
    results_arg(b, "default WORK/results.json")

    d = sub.add_parser("decode", help="batch-1 TPOT of llmc engines and GGUFs, interleaved, with rooflines")
    d.add_argument("folder", type=Path, help="the checkpoint the engines and GGUFs were made from")
    d.add_argument("--llmc", action="append", default=[], metavar="NAME=ENGINE_DIR")
    d.add_argument("--gguf", action="append", default=[], metavar="NAME=FILE")
    d.add_argument("--llmc-src", action="append", default=[], metavar="NAME=CHECKOUT_DIR",
                   help="run --llmc NAME's worker from another llmc checkout (as peers.py --llmc-src)")
    decode_args(d)
    peers_args(d)
    results_arg(d, "none: printed only")

    a = sub.add_parser("all", help="make-checkpoint (if missing), verify, build, decode")
    a.add_argument("--shape", choices=sorted(SHAPES), required=True)
    a.add_argument("--checkpoint", type=Path, required=True)
    a.add_argument("--work", type=Path, required=True)
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--no-decode", action="store_true")
    build_args(a)
    decode_args(a)
    peers_args(a)
    results_arg(a, "default WORK/results.json")

    r = sub.add_parser("report", help="print the tables of a results file")
    r.add_argument("--results", type=Path, required=True)
    args = ap.parse_args()

    if args.cmd == "report":
        print(report(load(args.results)))
        return
    if args.cmd == "verify":
        verify(args.folder, args.load)
        return
    if args.cmd in ("build", "all") and args.results is None:
        args.results = args.work.resolve() / "results.json"
    results = load(args.results)

    if args.cmd == "make-checkpoint":
        results["checkpoint"] = make_checkpoint(args.shape, args.out, args.seed, args.shard_size)
        save(args.results, results)
        if args.verify:
            results["verify"] = verify(args.out, load=args.shape == "1b")
            save(args.results, results)
    elif args.cmd == "build":
        build(args, args.folder.resolve(), results)
    elif args.cmd == "decode":
        rows = [(n, "llmc", p) for n, p in _pairs(args.llmc, "--llmc")]
        rows += [(n, "llama.cpp", p) for n, p in _pairs(args.gguf, "--gguf")]
        if not rows:
            raise SystemExit("error: give at least one --llmc NAME=ENGINE_DIR or --gguf NAME=FILE")
        srcs = llmc_engine.parse_llmc_src(args.llmc_src, [n for n, kind, _ in rows if kind == "llmc"])
        decode(args, args.folder.resolve(), rows, results, srcs)
    else:
        folder = args.checkpoint.resolve()
        made = json.loads((folder / MARKER).read_text()) if (folder / MARKER).is_file() else {}
        if not (made.get("complete") and made.get("shape") == args.shape and made.get("seed") == args.seed):
            results["checkpoint"] = make_checkpoint(args.shape, folder, args.seed, HUB_SHARD_SIZE)
            save(args.results, results)
        results["verify"] = verify(folder, load=args.shape == "1b")
        save(args.results, results)
        build(args, folder, results)
        if not args.no_decode:
            work = args.work.resolve()
            rows = []
            for q in [q for q in args.quant.split(",") if q]:
                ftype = QUANTS[q][1] or args.gguf_outtype
                group = []
                if (work / f"engine-{q}").is_dir() and (results["steps"].get(f"llmc {q}") or {}).get("rc") == 0:
                    group.append((f"llmc {q}", "llmc", work / f"engine-{q}"))
                if (work / f"model-{ftype}.gguf").is_file():
                    group.append((f"llama.cpp {GGUF_NAMES[ftype]}", "llama.cpp", work / f"model-{ftype}.gguf"))
                rows.append(group)
            flat = [row for g in rows for row in g]
            # One interleaved run when everything fits in memory, else one per quantization.
            srcs = {n: args.llmc_src for n, kind, _ in flat if kind == "llmc" and args.llmc_src}
            if flat and _resident(flat) <= _available_memory():
                decode(args, folder, flat, results, srcs)
            else:
                for group in rows:
                    if group:
                        decode(args, folder, group, results, srcs)
    print()
    print(report(results))


if __name__ == "__main__":
    main()
