"""Serving throughput and latency under in-flight batching.

    python benchmarks/throughput.py [--model smollm2-135m-shape] [--engine DIR] [--threads 2]

Workload: 64 seeded requests, prompts 32-512 tokens, outputs 32-256 tokens, no early stop.
Three runs on one engine: all requests at once, Poisson arrivals, and one request at a time.
Also the pure-decode throughput at 1 and 16 running sequences (the batching win the targets
are about). Every metric comes from llmc.runtime.metrics, the one place they are defined.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def workload(n: int, seed: int, vocab: int):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, vocab, int(rng.integers(32, 513))).tolist() for _ in range(n)]
    outputs = [int(rng.integers(32, 257)) for _ in range(n)]
    return prompts, outputs


def run(llm, prompts, outputs, arrivals=None):
    """Drive the engine loop; requests join when their arrival time has passed."""
    from llmc.runtime.sampling import SamplingParams

    order = list(range(len(prompts)))
    arrivals = arrivals if arrivals is not None else [0.0] * len(prompts)
    outs, start = [], time.perf_counter()
    while order or llm.has_unfinished():
        now = time.perf_counter() - start
        while order and arrivals[order[0]] <= now:
            i = order.pop(0)
            out = llm.output(llm.add_request(prompts[i], SamplingParams(max_tokens=outputs[i], ignore_eos=True)))
            out.metrics.arrival = start + arrivals[i]  # the request's real arrival, not the step boundary
            outs.append(out)
        if llm.has_unfinished():
            llm.step()
        elif order:
            time.sleep(max(0.0, arrivals[order[0]] - (time.perf_counter() - start)))
    return outs, time.perf_counter() - start


def one_at_a_time(llm, prompts, outputs):
    outs, wall = [], 0.0
    for p, o in zip(prompts, outputs):
        got, seconds = run(llm, [p], [o])
        outs += got
        wall += seconds
    return outs, wall


def decode_rate(llm, batch: int, steps: int = 24) -> float:
    """Output tokens/s of steps where `batch` sequences all decode (prefills done)."""
    from llmc.runtime.sampling import SamplingParams

    rng = np.random.default_rng(batch)
    ids = [llm.add_request(rng.integers(3, 1000, 32).tolist(), SamplingParams(max_tokens=steps + 8, ignore_eos=True))
           for _ in range(batch)]
    outs = [llm.output(i) for i in ids]
    while any(not o.token_ids for o in outs):
        llm.step()
    start = time.perf_counter()
    for _ in range(steps):
        llm.step()
    rate = batch * steps / (time.perf_counter() - start)
    for i in ids:
        llm.abort(i)
    return rate


def row(name, outs, wall):
    from llmc.runtime.metrics import summarize_requests

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
    args = ap.parse_args()

    from llmc.runtime.llm import LLM

    engine = args.engine
    if engine is None:
        engine = Path(tempfile.mkdtemp(prefix="llmc-bench-")) / "engine"
        subprocess.run([sys.executable, "-m", "llmc.cli", "build", args.model, "-o", str(engine),
                        "--max-context", "1024"], check=True, stdout=subprocess.DEVNULL)
    llm = LLM(engine, num_threads=args.threads, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=512,
              chunk_size=256, kv_cache_bytes=1 << 30,
              enable_prefix_caching=False)  # the three runs reuse prompts: no cross-run hits
    prompts, outputs = workload(args.requests, seed=0, vocab=llm.engine.spec.vocab_size)
    rng = np.random.default_rng(1)
    arrivals = np.cumsum(rng.exponential(1.0 / args.qps, args.requests)).tolist()

    decode_rate(llm, 2, steps=4)  # warm-up
    rate1, rate16 = decode_rate(llm, 1), decode_rate(llm, args.max_num_seqs)
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
    print(f"pure decode: batch 1 {rate1:.1f} tok/s · batch {args.max_num_seqs} {rate16:.1f} tok/s · "
          f"{rate16 / rate1:.2f}x (target >= 4x)")
    tpot1 = summaries["one at a time"]["tpot"]["p50"]
    tpot_p99 = summaries["all at once"]["tpot"]["p99"]
    print(f"P99 TPOT all at once / batch-1 TPOT: {tpot_p99 * 1e3:.1f} / {tpot1 * 1e3:.1f} ms = "
          f"{tpot_p99 / tpot1:.2f}x (target <= 2.5x)")
    print(f"prefix cache hits: {llm.blocks.stats.hit_tokens} tokens · preemptions: {llm.scheduler.num_preemptions}")


if __name__ == "__main__":
    main()
