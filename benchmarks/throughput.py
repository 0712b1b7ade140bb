"""Serving throughput and latency under in-flight batching.

    python benchmarks/throughput.py [--model smollm2-135m-shape] [--engine DIR] [--threads 2]

Workload: 64 seeded requests, prompts 32-512 tokens, outputs 32-256 tokens, no early stop.
Three runs on one engine: all requests at once, Poisson arrivals, and one request at a time.
Also pure decode at 1 and 16 running sequences over the workload's prompts, in alternating
rounds: throughput and per-token latency (the batching win and its latency cost, which the
targets are about). The served runs' metrics come from llmc.runtime.metrics, the one place they
are defined; pure decode is timed per step here, each request's TPOT the mean of its steps.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from common import decode_steps, engine_for


def workload(n: int, seed: int, vocab: int):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, vocab, int(rng.integers(32, 513))).tolist() for _ in range(n)]
    outputs = [int(rng.integers(32, 257)) for _ in range(n)]
    return prompts, outputs


def run(llm, prompts, outputs, arrivals=None):
    """Send each request at its arrival time (all at once by default) through the same client
    loop `llmc bench` uses; returns (outputs, wall time)."""
    from llmc.bench.runner import run_requests
    from llmc.bench.workloads import BenchRequest

    arrivals = arrivals if arrivals is not None else [0.0] * len(prompts)
    records, _, wall = run_requests(llm, [BenchRequest(p, o, a) for p, o, a in zip(prompts, outputs, arrivals)])
    return [r.output for r in records], wall


def one_at_a_time(llm, prompts, outputs):
    outs, wall = [], 0.0
    for p, o in zip(prompts, outputs):
        got, seconds = run(llm, [p], [o])
        outs += got
        wall += seconds
    return outs, wall


def row(name, outs, wall):
    from llmc.bench.summary import summarize_requests

    s = summarize_requests([o.metrics for o in outs])
    tokens = s["counts"]["output_tokens"]
    return (f"{name:22s}{tokens / wall:10.1f}{s['ttft']['p50'] * 1e3:10.0f}{s['ttft']['p99'] * 1e3:10.0f}"
            f"{s['tpot']['p50'] * 1e3:10.1f}{s['tpot']['p99'] * 1e3:10.1f}{wall:9.1f}"), s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-shape")
    ap.add_argument("--engine", type=Path, default=None, help="reuse an engine instead of building")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--qps", type=float, default=2.0, help="Poisson arrival rate")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=12, help="alternating pure-decode rounds of 16 steps each")
    args = ap.parse_args()

    from llmc.runtime.llm import LLM

    engine, _, _ = engine_for(args.model, args.engine, "--max-context", "1024")
    llm = LLM(engine, num_threads=args.threads, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=512,
              chunk_size=256, kv_cache_bytes=1 << 30,
              enable_prefix_caching=False)  # the three runs reuse prompts: no cross-run hits
    prompts, outputs = workload(args.requests, seed=0, vocab=llm.engine.spec.vocab_size)
    rng = np.random.default_rng(1)
    arrivals = np.cumsum(rng.exponential(1.0 / args.qps, args.requests)).tolist()

    decode_steps(llm, prompts[:2], steps=4)  # warm-up
    # Pure decode over the workload's own prompts (contexts 32-512 and growing), batch 1 vs full,
    # in alternating rounds so that both see the same swings of this machine's memory bandwidth.
    solo, full = [], []  # per round: the step times of its 16 steps
    for i in range(args.rounds):
        solo.append(decode_steps(llm, [prompts[i]], steps=16))
        full.append(decode_steps(llm, [prompts[(i + j) % len(prompts)] for j in range(args.max_num_seqs)], steps=16))
    runs = [("all at once", *run(llm, prompts, outputs)),
            (f"Poisson {args.qps:g} req/s", *run(llm, prompts, outputs, arrivals)),
            ("one at a time", *one_at_a_time(llm, prompts, outputs))]

    print(f"model {args.model} · {args.requests} requests · prompts 32-512 · outputs 32-256 · "
          f"max_num_seqs {args.max_num_seqs} · {args.threads} threads")
    print(f"{'run':22s}{'out tok/s':>10s}{'TTFT p50':>10s}{'TTFT p99':>10s}{'TPOT p50':>10s}{'TPOT p99':>10s}{'wall s':>9s}")
    summaries = {}
    for name, outs, wall in runs:
        line, summaries[name] = row(name, outs, wall)
        print(line)
    print("(TTFT and TPOT in ms)")
    n = args.max_num_seqs
    # A request's TPOT is its mean time per output token (llmc.runtime.metrics); in a round every
    # running request gets one token per step, so each of its requests has the round's mean.
    tpot_1 = [np.mean(r) for r in solo]
    tpot_n = [np.mean(r) for r in full for _ in range(n)]
    itl_1, itl_n = np.concatenate(solo), np.concatenate(full)
    print(f"pure decode ({args.rounds} alternating rounds of 16 steps), per-token latency (ITL) p50/p99: "
          f"batch 1 {np.percentile(itl_1, 50) * 1e3:.1f}/{np.percentile(itl_1, 99) * 1e3:.1f} ms · "
          f"batch {n} {np.percentile(itl_n, 50) * 1e3:.1f}/{np.percentile(itl_n, 99) * 1e3:.1f} ms")
    print(f"pure decode throughput: batch 1 {1 / itl_1.mean():.1f} tok/s · batch {n} {n / itl_n.mean():.1f} tok/s · "
          f"{itl_1.mean() * n / itl_n.mean():.2f}x (target >= 4x)")
    tpot1_p50 = np.percentile(tpot_1, 50)
    print(f"P99 TPOT at {n} decoding / batch-1 TPOT p50: {np.percentile(tpot_n, 99) * 1e3:.1f} / "
          f"{tpot1_p50 * 1e3:.1f} ms = {np.percentile(tpot_n, 99) / tpot1_p50:.2f}x (target <= 2.5x)")
    print(f"P99 ITL at {n} decoding / batch-1 TPOT p50 (one step's jitter, stricter): "
          f"{np.percentile(itl_n, 99) / tpot1_p50:.2f}x")
    tpot1 = summaries["one at a time"]["tpot"]["p50"]
    tpot_p99 = summaries["all at once"]["tpot"]["p99"]
    print(f"P99 TPOT all at once (prefills of newcomers share the steps) / batch-1 TPOT: "
          f"{tpot_p99 * 1e3:.1f} / {tpot1 * 1e3:.1f} ms = {tpot_p99 / tpot1:.2f}x")
    print(f"prefix cache hits: {llm.blocks.stats.hit_tokens} tokens · preemptions: {llm.scheduler.num_preemptions}")


if __name__ == "__main__":
    main()
