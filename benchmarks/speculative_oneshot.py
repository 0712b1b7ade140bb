"""One-shot `llmc run --speculative ngram` against plain `llmc run`: each run a fresh process, as a user runs it.

    python benchmarks/speculative_oneshot.py ENGINE [--runs 5] [--max-tokens 64] [--load]

Each prompt is input-grounded (benchmarks/speculative.py's "grounded" workload): an excerpt of a
held-out standard-library file, blank lines, then the excerpt's first two lines again, so the
model's continuation repeats its input (the case prompt lookup is for). Prompt i runs plain, then speculative, then
plain again (the order alternating per prompt), each in its own `llmc run` process; the decode
rate is the run's TPOT from its summary line, and a run's ratio is plain TPOT (the mean of its two
plain runs) over speculative TPOT. The texts must be identical. `--load` starts processes that
keep every core busy (numpy matrix products) for the whole run: speculation must then not lose
to plain decoding.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import re
import statistics
import subprocess
import sys

import numpy as np

from llmc.runtime.llm import LLM

# The summary's TPOT has 0.1 ms steps; E2E - TTFT over the tokens after the first is finer.
TIMES = re.compile(r"\[(\d+) tokens.*TTFT ([0-9.]+) ms.*E2E ([0-9.]+) ms")
ACCEPTED = re.compile(r"accepted (\d+)/(\d+)")


def grounded_prompts(engine: str, count: int, prompt_tokens: int, seed: int) -> list[str]:
    """benchmarks/speculative.py's grounded prompts, as the text a user would pass."""
    from speculative import workloads

    llm = LLM(engine)
    bos = len(llm.encode(""))
    return [llm.tokenizer.decode(ids[bos:], skip_special_tokens=False)
            for ids in workloads(llm, count, prompt_tokens, seed)["grounded"]]


def llmc_run(engine: str, prompt: str, max_tokens: int, speculative: bool) -> tuple[str, float, str]:
    command = [sys.executable, "-m", "llmc.cli", "run", engine, prompt, "--max-tokens", str(max_tokens),
               "--ignore-eos", "--no-tuning"]
    if speculative:
        command += ["--speculative", "ngram"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"llmc run failed: {done.stderr.strip().splitlines()[-1]}")
    summary = done.stderr.strip().splitlines()[-1]
    n, ttft, e2e = TIMES.search(summary).groups()
    return done.stdout, (float(e2e) - float(ttft)) / (int(n) - 1), summary


def _burn(seconds_left) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    a = np.random.default_rng(0).random((384, 384), np.float32)
    while True:
        a = np.tanh(a @ a)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("engine")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--load", action="store_true", help="keep every core busy with another process")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    burners = []
    if args.load:
        ctx = multiprocessing.get_context("spawn")
        burners = [ctx.Process(target=_burn, args=(None,), daemon=True) for _ in range(os.cpu_count() or 1)]
        for p in burners:
            p.start()
    ratios = []
    try:
        for i, prompt in enumerate(grounded_prompts(args.engine, args.runs, args.prompt_tokens, args.seed)):
            order = (False, True, False) if i % 2 == 0 else (True, False, True)
            runs = [(spec, llmc_run(args.engine, prompt, args.max_tokens, spec)) for spec in order]
            plain = [r for spec, r in runs if not spec]
            spec = [r for spec, r in runs if spec]
            plain_tpot = statistics.mean(r[1] for r in plain)
            spec_tpot = statistics.mean(r[1] for r in spec)
            same = all(r[0] == plain[0][0] for r in plain + spec)
            accepted = ACCEPTED.search(spec[0][2])
            ratios.append(plain_tpot / spec_tpot)
            print(f"run {i + 1}: plain TPOT {plain_tpot:.3f} ms ({', '.join(f'{r[1]:.3f}' for r in plain)}), "
                  f"ngram {spec_tpot:.3f} ms: {ratios[-1]:.2f}x, same text: {same}, "
                  f"accepted {accepted.group(0) if accepted else 'none'}", flush=True)
    finally:
        for p in burners:
            p.terminate()
    print(f"{'loaded' if args.load else 'quiet'}: speed-up {min(ratios):.2f}-{max(ratios):.2f}x "
          f"(median {statistics.median(ratios):.2f}x) over {len(ratios)} runs")


if __name__ == "__main__":
    main()
