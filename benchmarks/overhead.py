"""Runtime overhead per decode step: time spent in `LLM.step` outside the ONNX Runtime call.

    python benchmarks/overhead.py [--engine DIR | --model smollm2-135m-shape] [--threads 2] [--steps 64]

The session's `run_with_iobinding` is wrapped with a timer, so each step splits into the graph
run and everything around it: scheduling, packing inputs, binding, sampling, appending tokens,
detokenizing and metrics. Both come from the same steps, so machine noise hits them alike.
Target (issue 5): overhead <= 3% of batch-1 TPOT.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
from common import decode_steps, engine_for


class TimedSession:
    """Stands in for the InferenceSession and times each graph run."""

    def __init__(self, session):
        self._session = session
        self.last = 0.0

    def run_with_iobinding(self, binding):
        start = time.perf_counter()
        self._session.run_with_iobinding(binding)
        self.last = time.perf_counter() - start

    def __getattr__(self, name):
        return getattr(self._session, name)


def measure(llm, batch: int, steps: int) -> tuple[float, float]:
    """Median step time and median time outside the graph run, over `steps` pure-decode steps."""
    rng = np.random.default_rng(batch)
    timer, outside = llm.engine.session, []
    totals = decode_steps(llm, [rng.integers(3, 1000, 32).tolist() for _ in range(batch)], steps,
                          after_step=lambda total: outside.append(total - timer.last))
    return statistics.median(totals), statistics.median(outside)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-shape")
    ap.add_argument("--engine", type=Path, default=None, help="reuse an engine instead of building")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=64)
    args = ap.parse_args()

    from llmc.runtime.llm import LLM

    engine, _, _ = engine_for(args.model, args.engine)
    llm = LLM(engine, num_threads=args.threads, enable_prefix_caching=False, use_tuning=False)
    llm.engine.session = TimedSession(llm.engine.session)
    measure(llm, 2, 8)  # warm-up
    print(f"{'batch':>6s}{'step ms':>10s}{'outside ms':>12s}{'share':>8s}")
    for batch in (1, 8, 16):
        step, outside = measure(llm, batch, args.steps)
        print(f"{batch:6d}{step * 1e3:10.2f}{outside * 1e3:12.3f}{outside / step:8.1%}")
    print("(outside = scheduling, input packing and binding, sampling, token bookkeeping; target <= 3% at batch 1)")


if __name__ == "__main__":
    main()
