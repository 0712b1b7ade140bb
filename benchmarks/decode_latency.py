"""Batch-1 decode latency: llmc engine vs HuggingFace transformers eager, measured in one run.

    python benchmarks/decode_latency.py [--model smollm2-135m-shape] [--threads 2]

Builds the engine in a child process (so its build time and peak RSS are its own), then
alternates llmc and HF runs (128-token prompt, 128 new tokens, no early stop) so machine noise
hits both, and prints TTFT and TPOT medians with the llmc/HF ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from common import engine_for


def run_llmc(llm, prompt_ids, new_tokens):
    from llmc.runtime.sampling import SamplingParams

    out = llm.generate(prompt_ids, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    assert len(out.token_ids) == new_tokens
    return out.metrics.ttft, out.metrics.tpot


def run_hf(model, prompt_ids, new_tokens):
    import torch

    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        start = time.perf_counter()
        out = model(ids, use_cache=True)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        first = time.perf_counter()
        past = out.past_key_values
        for _ in range(new_tokens - 1):
            out = model(token, past_key_values=past, use_cache=True)
            past = out.past_key_values
            token = out.logits[:, -1].argmax(-1, keepdim=True)
        end = time.perf_counter()
    return first - start, (end - first) / (new_tokens - 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-shape")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--engine", type=Path, default=None, help="reuse an engine instead of building")
    args = ap.parse_args()

    import numpy as np
    import torch

    from llmc.compiler.recipes import is_recipe, materialize
    from llmc.runtime.llm import LLM

    folder = materialize(args.model) if is_recipe(args.model) else Path(args.model)
    engine, build_s, build_rss = engine_for(args.model, args.engine)

    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    # HF's two CPU attention paths differ a lot per torch version; compare against the faster.
    hf_models = {impl: AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation=impl).eval()
                 for impl in ("sdpa", "eager")}
    # No spinning: ORT's idle workers would otherwise steal the cores torch runs on in between.
    # Cold prefill every repeat: the same prompt would otherwise hit the prefix cache.
    llm = LLM(engine, num_threads=args.threads, allow_spinning=False, enable_prefix_caching=False)
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, llm.engine.spec.vocab_size, args.prompt_len).tolist()

    run_llmc(llm, prompt, 8)  # warm-up: first-touch of buffers, ORT kernel caches
    for hf in hf_models.values():
        run_hf(hf, prompt, 8)
    results = {"llmc": [], "hf-sdpa": [], "hf-eager": []}
    for _ in range(args.repeats):  # interleaved, so machine noise hits every contender
        results["llmc"].append(run_llmc(llm, prompt, args.new_tokens))
        for impl, hf in hf_models.items():
            results[f"hf-{impl}"].append(run_hf(hf, prompt, args.new_tokens))

    def med(name, i):
        return statistics.median(r[i] for r in results[name])

    print(f"model {args.model} · batch 1 · prompt {args.prompt_len} · {args.new_tokens} new tokens · "
          f"{args.threads} threads · median of {args.repeats}")
    labels = {"llmc": "llmc (ORT CPU)", "hf-sdpa": "HF eager, sdpa", "hf-eager": "HF eager, eager attn"}
    print(f"{'':22s}{'TTFT ms':>10s}{'TPOT ms':>10s}{'tok/s':>9s}")
    for name, label in labels.items():
        ttft, tpot = med(name, 0), med(name, 1)
        print(f"{label:22s}{ttft * 1e3:10.1f}{tpot * 1e3:10.2f}{1 / tpot:9.1f}")
    best = min(("hf-sdpa", "hf-eager"), key=lambda n: med(n, 1))
    print(f"ratio llmc / best HF ({labels[best]}): TTFT {med('llmc', 0) / med(best, 0):.2f}x · "
          f"TPOT {med('llmc', 1) / med(best, 1):.2f}x (target TPOT <= 0.80x)")
    if build_s is not None:
        print(f"build: {build_s:.1f}s wall, peak RSS {build_rss:.0f} MB")


if __name__ == "__main__":
    main()
