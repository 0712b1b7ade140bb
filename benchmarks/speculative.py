"""Speculative decoding against the same engine without it: batch-1 TPOT per workload, interleaved.

    python benchmarks/speculative.py --target ENGINE --draft DRAFT_ENGINE [--requests 8] [--rounds 3]
                                     [--k 8] [--new 96] [--batch 16]

Workloads, all from the held-out half of the standard library (the models never trained on it):
- grounded: an excerpt of a file, blank lines, then the excerpt's first two lines again (cut in
  tokens, to the third line's indentation): code whose continuation repeats the input's
  identifiers and lines (prompt lookup's case);
- open: the start of a file, continued freely (the draft model's case);
- random: random token ids, so proposals miss (with these models they do not: the models loop);
- sampled: the random prompts sampled at temperature 1, each request with its own seed, so the
  proposals do miss (outputs differ from plain decoding's, as samples do: "same" is "-").
Each configuration runs in its own process (two sessions in one process disturb each other's
thread pools); each request runs alone (batch 1) on every configuration in turn, the order rotating
per request and round, so drift on this noisy machine hits them alike. TPOT is each request's own (E2E -
TTFT) / (n - 1); the table gives the mean over requests and rounds, the ratio to plain decoding,
acceptance and output tokens per decode step. `--batch N` also runs N open-ended requests at once,
three times per round after one untimed run (as the batch-1 side is warmed: a fresh process's
first run at a batch size pays its step shapes and the adaptive rule's first measurements there,
once in a server's life), and compares output tokens per second.
"""

from __future__ import annotations

import argparse
import multiprocessing
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
    bos, gap = llm.encode(""), llm.encode("\n\n\n", add_special_tokens=False)  # bos: [<s>] where the tokenizer adds it
    for text in picked:
        start = text.index("\n", len(text) // 3) + 1  # past the module docstring and imports
        excerpt = llm.encode(text[start:], add_special_tokens=False)[:prompt_tokens - 24 - len(bos)]
        grounded.append(bos + excerpt + gap + excerpt[:_after_lines(llm, excerpt, 2)])
        opened.append(llm.encode(text[start:])[:prompt_tokens])
    vocab = prompt_vocab(llm.engine.spec.vocab_size, llm.eos_ids)
    random = [rng.choice(vocab, prompt_tokens).tolist() for _ in range(count)]
    return {"grounded": grounded, "open": opened, "random": random, "sampled": random}


def _after_lines(llm: LLM, ids: list[int], lines: int) -> int:
    """Where `ids`'s first `lines` lines end, in tokens. The cut is made in tokens, not text: a
    byte-level BPE folds a line's indentation into the newline's token, so a prompt whose text
    ends in a newline ends in a token that says the next line starts at column 0, and the models
    mostly went on with a new `def` instead of the excerpt's next line."""
    seen = 0
    for i, t in enumerate(ids):
        seen += llm.tokenizer.decode([t]).count("\n")
        if seen >= lines:
            return i + 1
    return len(ids)


def _sampled(seed: int, new: int) -> SamplingParams:
    return SamplingParams(max_tokens=new, ignore_eos=True, temperature=1.0, seed=seed)


def _worker(conn, target: str, options: dict) -> None:
    """One configuration in a process of its own: sessions of two LLMs in one process disturb
    each other's thread pools (a plain decode step measured 2x slower next to an idle one)."""
    llm = LLM(target, **options)
    conn.send("ready")
    while (job := conn.recv()) is not None:
        prompts, params = job
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        seconds = time.perf_counter() - start
        conn.send([(o.token_ids, o.metrics.tpot, o.metrics.proposed_tokens, o.metrics.accepted_tokens,
                    o.metrics.num_tokens, o.metrics.decode_steps) for o in outs] + [seconds])


class Config:
    def __init__(self, ctx, target: str, options: dict):
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker, args=(child, target, options), daemon=True)
        self.process.start()
        assert self.conn.recv() == "ready"

    def run(self, prompts, params):
        time.sleep(0.05)  # let the last worker's idle threads stop spinning first
        self.conn.send((prompts, params))
        *outs, seconds = self.conn.recv()
        return outs, seconds

    def close(self):
        self.conn.send(None)
        self.process.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--draft")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=96)
    parser.add_argument("--batch", type=int, default=0)
    parser.add_argument("--fixed", action="store_true", help="also run each proposer with speculative_adaptive off")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workloads", default="grounded,open,random,sampled", help="which of them to time")
    args = parser.parse_args()

    options = {"plain": {}, "ngram": dict(speculative="ngram", num_speculative_tokens=args.k)}
    if args.draft:
        options["draft"] = dict(speculative=args.draft, num_speculative_tokens=args.k)
    if args.fixed:
        for name in [n for n in options if n != "plain"]:
            options[f"{name}-fixed"] = dict(options[name], speculative_adaptive=False)
    if args.draft:  # what the draft alone gives, without prompt lookup's proposals first
        options["draft-only"] = dict(options["draft"], draft_prompt_lookup=False)
    ctx = multiprocessing.get_context("spawn")
    names = list(options)
    loads = workloads(LLM(args.target), args.requests, args.prompt, args.seed)
    unknown = set(args.workloads.split(",")) - set(loads)
    if unknown:
        parser.error(f"--workloads: unknown {', '.join(sorted(unknown))}; choose from {', '.join(loads)}")
    timed = {load: loads[load] for load in args.workloads.split(",")}
    params = SamplingParams(max_tokens=args.new, ignore_eos=True)
    tpot = {(load, n): [] for load in timed for n in names}
    stats = {(load, n): [0, 0, 0, 0] for load in timed for n in names}  # proposed, accepted, tokens, steps
    same = {(load, n): True for load in timed for n in names}
    rates = {n: [] for n in names}
    batch = (loads["open"] * (args.batch // len(loads["open"]) + 1))[:args.batch]
    for rnd in range(args.rounds):
        # Fresh processes each round: a process's own memory placement shifts its speed by as
        # much as the effects measured here, so rounds average over placements too.
        configs = {name: Config(ctx, args.target, options[name]) for name in names}
        for config in configs.values():  # warm: sessions, step shapes, the adaptive rule's first steps
            for prompt in loads["open"][:2] + loads["random"][:2]:
                config.run([prompt], params)
            for i, prompt in enumerate(loads["random"][:2]):  # sampled steps are measured apart from greedy ones
                config.run([prompt], _sampled(10**6 + i, args.new))
            if args.batch:  # the same at the batch size: its shapes, and the rule's first measurements there
                config.run(batch, params)
        for load, prompts in timed.items():
            for i, prompt in enumerate(prompts):
                shift = (i + rnd) % len(names)
                outs = {}
                sampled = load == "sampled"
                p = _sampled(rnd * 1000 + i, args.new) if sampled else params
                for n in names[shift:] + names[:shift]:
                    (ids, t, proposed, accepted, num_tokens, steps), = configs[n].run([prompt], p)[0]
                    tpot[load, n].append(t)
                    s = stats[load, n]
                    s[0] += proposed
                    s[1] += accepted
                    s[2] += num_tokens - 1
                    s[3] += steps
                    outs[n] = ids
                for n in names:
                    same[load, n] = None if sampled else same[load, n] and outs[n] == outs["plain"]
        for rep in range(3 if args.batch else 0):
            shift = (rnd + rep) % len(names)
            for n in names[shift:] + names[:shift]:
                outs, seconds = configs[n].run(batch, params)
                rates[n].append(sum(len(o[0]) for o in outs) / seconds)
        for config in configs.values():
            config.close()

    print(f"target {args.target}, draft {args.draft}, k <= {args.k}, {args.requests} requests x {args.rounds} rounds "
          f"(fresh processes each), prompts ~{args.prompt} tokens, {args.new} new, batch 1")
    print(f"{'workload':>9} {'config':>11} {'TPOT ms':>8} {'x plain':>8} {'speed-up':>8} {'accept':>7} {'tok/step':>9} "
          f"{'same':>5}")
    for load in timed:
        base = statistics.mean(tpot[load, "plain"])
        for n in names:
            mean = statistics.mean(tpot[load, n])
            p, a, t, st = stats[load, n]
            accept = f"{a / p:.2f}" if p else "-"
            print(f"{load:>9} {n:>11} {mean * 1e3:8.3f} {mean / base:8.3f} {base / mean:8.2f} {accept:>7} "
                  f"{t / st:9.2f} {'-' if same[load, n] is None else str(same[load, n]):>5}")
    if args.batch:
        print(f"\nbatch {args.batch} (open workload, all at once): output tokens/s, mean of {len(rates['plain'])} runs")
        base = statistics.mean(rates["plain"])
        for n in names:
            mean = statistics.mean(rates[n])
            print(f"{n:>11} {mean:9.1f} tok/s  {mean / base:6.3f}x plain   [{min(rates[n]):.0f}..{max(rates[n]):.0f}]")


if __name__ == "__main__":
    main()
