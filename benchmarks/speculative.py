"""Speculative decoding against the same engine without it: batch-1 TPOT per workload, interleaved.

    python benchmarks/speculative.py --target ENGINE --draft DRAFT_ENGINE [--requests 8] [--rounds 3]
                                     [--k 4] [--new 96] [--batch 16]

Workloads, all from the held-out half of the standard library (the models never trained on it):
- grounded: an excerpt of a file, a blank line, then the excerpt's first lines again: code whose
  continuation repeats the input's identifiers and lines (prompt lookup's case);
- open: the start of a file, continued freely (the draft model's case);
- random: random token ids, so proposals miss.
Each request runs alone (batch 1) on every configuration in turn, the order rotating per request
and round, so drift on this noisy machine hits them alike. TPOT is each request's own (E2E -
TTFT) / (n - 1); the table gives the mean over requests and rounds, the ratio to plain decoding,
acceptance and output tokens per decode step. `--batch N` also runs N open-ended requests at once
and compares output tokens per second.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from llmc.bench import corpus
from llmc.bench.workloads import prompt_vocab
from llmc.runtime.llm import LLM
from llmc.runtime.sampling import SamplingParams


def workloads(llm: LLM, count: int, prompt_tokens: int, seed: int) -> dict[str, list[list[int]]]:
    texts = [t for t in corpus.read(corpus.files("heldout")) if len(t) > 4000]
    rng = np.random.default_rng(seed)
    picked = [texts[i] for i in rng.choice(len(texts), count, replace=False)]
    grounded, opened = [], []
    for text in picked:
        start = text.index("\n", len(text) // 3) + 1  # past the module docstring and imports
        excerpt = llm.encode(text[start:])[:prompt_tokens - 24]
        body = llm.tokenizer.decode(excerpt)
        lines = body.split("\n")
        head = "\n".join(lines[:2]) + "\n"
        grounded.append(llm.encode(body + "\n\n\n" + head))
        opened.append(llm.encode(text[start:])[:prompt_tokens])
    vocab = prompt_vocab(llm.engine.spec.vocab_size, llm.eos_ids)
    random = [rng.choice(vocab, prompt_tokens).tolist() for _ in range(count)]
    return {"grounded": grounded, "open": opened, "random": random}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--draft")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=96)
    parser.add_argument("--batch", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    configs = {"plain": LLM(args.target),
               "ngram": LLM(args.target, speculative="ngram", num_speculative_tokens=args.k)}
    if args.draft:
        configs["draft"] = LLM(args.target, speculative=args.draft, num_speculative_tokens=args.k)
    names = list(configs)
    loads = workloads(configs["plain"], args.requests, args.prompt, args.seed)
    params = SamplingParams(max_tokens=args.new, ignore_eos=True)
    for llm in configs.values():  # warm: sessions, step shapes, the cost model's first steps
        llm.generate(loads["open"][:2], params)
        llm.generate(loads["open"][0], params)

    print(f"target {args.target}, draft {args.draft}, k <= {args.k}, {args.requests} requests x {args.rounds} rounds, "
          f"prompts ~{args.prompt} tokens, {args.new} new, batch 1")
    print(f"{'workload':>9} {'config':>6} {'TPOT ms':>8} {'x plain':>8} {'accept':>7} {'tok/step':>9} {'same':>5}")
    for load, prompts in loads.items():
        tpot = {n: [] for n in names}
        stats = {n: [0, 0, 0, 0] for n in names}  # proposed, accepted, tokens after the first, steps
        same = {n: True for n in names}
        for rnd in range(args.rounds):
            for i, prompt in enumerate(prompts):
                order = names[(i + rnd) % len(names):] + names[:(i + rnd) % len(names)]
                outs = {}
                for n in order:
                    out = configs[n].generate(prompt, params)
                    m = out.metrics
                    tpot[n].append(m.tpot)
                    s = stats[n]
                    s[0] += m.proposed_tokens
                    s[1] += m.accepted_tokens
                    s[2] += m.num_tokens - 1
                    s[3] += m.decode_steps
                    outs[n] = out.token_ids
                for n in names:
                    same[n] &= outs[n] == outs["plain"]
        base = statistics.mean(tpot["plain"])
        for n in names:
            mean = statistics.mean(tpot[n])
            p, a, t, st = stats[n]
            accept = f"{a / p:.2f}" if p else "-"
            print(f"{load:>9} {n:>6} {mean * 1e3:8.3f} {mean / base:8.3f} {accept:>7} {t / st:9.2f} {str(same[n]):>5}")

    if args.batch:
        prompts = (loads["open"] * (args.batch // len(loads["open"]) + 1))[:args.batch]
        print(f"\nbatch {args.batch} (open workload, all at once): output tokens/s")
        rates = {n: [] for n in names}
        for rnd in range(args.rounds):
            for n in names[rnd % len(names):] + names[:rnd % len(names)]:
                start = time.perf_counter()
                outs = configs[n].generate(prompts, params)
                rates[n].append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start))
        base = statistics.mean(rates["plain"])
        for n in names:
            mean = statistics.mean(rates[n])
            print(f"{n:>6} {mean:9.1f} tok/s  {mean / base:6.3f}x plain")


if __name__ == "__main__":
    main()
