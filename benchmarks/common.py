"""What the benchmark scripts share: the engine under test."""

from __future__ import annotations

import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def engine_for(model: str, engine: Path | None, *build_args: str) -> tuple[Path, float | None, float | None]:
    """`engine` if given, else a fresh build of `model` in a temp dir. Returns (engine dir, build
    seconds, build peak RSS MB); the build runs in a child process so its time and memory are its own."""
    if engine is not None:
        return engine, None, None
    out = Path(tempfile.mkdtemp(prefix="llmc-bench-")) / "engine"
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "llmc.cli", "build", model, "-o", str(out), *build_args],
                   check=True, stdout=subprocess.DEVNULL)
    return out, time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024.0


def decode_steps(llm, prompts, steps: int = 48, after_step=None) -> list[float]:
    """Step times while exactly len(prompts) sequences decode (their prefills done first), so
    each step is one output token for every sequence: the per-token latency at that batch.
    `after_step(seconds)` runs after each timed step (e.g. to read a timer the step set)."""
    from llmc.runtime.sampling import SamplingParams

    ids = [llm.add_request(p, SamplingParams(max_tokens=steps + 8, ignore_eos=True)) for p in prompts]
    while any(not llm.output(i).token_ids for i in ids):
        llm.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        llm.step()
        times.append(time.perf_counter() - start)
        if after_step is not None:
            after_step(times[-1])
    for i in ids:
        llm.abort(i)
    return times
