"""What a long context costs a decode step: batch-1 TPOT after a short and after a long prompt, in
one interleaved run, and a sequence's memory beside the KV a transformer of the same layers keeps.

    python benchmarks/context_cost.py --engine DIR [--contexts 128,4000] [--new-tokens 64] [--reps 3]

A hybrid's recurrent layers keep a fixed-size state, so only its attention layers' KV grows with
the context; this prints the TPOT at each context, its ratio to the shortest, and the bytes.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", type=Path, required=True)
    ap.add_argument("--contexts", default="128,4000", help="prompt lengths, comma-separated")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import numpy as np

    from llmc.runtime.llm import LLM
    from llmc.runtime.sampling import SamplingParams

    contexts = [int(c) for c in args.contexts.split(",")]
    llm = LLM(args.engine, num_threads=args.threads, enable_prefix_caching=False)
    m = llm.engine.manifest
    if max(contexts) + args.new_tokens > m.max_context:
        raise SystemExit(f"error: {max(contexts)} + {args.new_tokens} tokens exceed the engine's max context "
                         f"{m.max_context}; rebuild it with --max-context")
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
    llm.generate(rng.integers(3, m.model_spec.vocab_size, 32).tolist(), params)  # warm-up
    tpot: dict[int, list[float]] = {c: [] for c in contexts}
    for rep in range(args.reps):
        order = contexts[rep % len(contexts):] + contexts[:rep % len(contexts)]  # rotate: noise hits all alike
        for c in order:
            out = llm.generate(rng.integers(3, m.model_spec.vocab_size, c).tolist(), params)
            tpot[c].append(out.metrics.tpot)
            print(f"rep {rep + 1}/{args.reps}: context {c} TPOT {out.metrics.tpot * 1e3:.2f} ms", flush=True)

    base = statistics.median(tpot[contexts[0]])
    print(f"\n{args.engine} · {m.model_spec.architecture} · {args.threads} threads · batch 1, {args.new_tokens} new "
          f"tokens · median of {args.reps} interleaved reps [min..max]")
    for c in contexts:
        med = statistics.median(tpot[c])
        print(f"  context {c:>6}: TPOT {med * 1e3:7.2f} ms [{min(tpot[c]) * 1e3:.2f}..{max(tpot[c]) * 1e3:.2f}]  "
              f"{med / base:.2f}x the {contexts[0]}-token context's")
    per_token = m.kv_cache.block_bytes / m.kv_cache.block_size
    state = sum(s.slot_bytes for s in m.states)
    every_layer = per_token / m.kv_cache.num_layers * m.model_spec.num_layers
    print(f"  memory a sequence: state {state / 2**20:.2f} MiB (fixed) + KV {per_token / 1024:.1f} KiB a token "
          f"({m.kv_cache.num_layers} attention layers, {m.kv_cache.dtype})")
    for c in contexts:
        print(f"    at {c:>6} tokens: {(state + per_token * c) / 2**20:8.1f} MiB; a transformer of its "
              f"{m.model_spec.num_layers} layers: {every_layer * c / 2**20:8.1f} MiB")


if __name__ == "__main__":
    main()
