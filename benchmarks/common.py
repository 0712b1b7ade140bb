"""What the benchmark scripts share: the engine under test."""

from __future__ import annotations

import os
import platform
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


# ISA extensions that decide which kernels llmc and its peers run, as /proc/cpuinfo spells them.
_ISA_FLAGS = ("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
              "avx512_fp16", "amx_tile", "amx_int8", "amx_bf16", "asimd", "asimddp", "sve", "sve2", "i8mm", "bf16")


def host() -> dict:
    """The machine a result came from: CPU model, logical CPUs, memory and the ISA flags above."""
    cpu, flags = None, set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and cpu is None:
                cpu = value.strip()
            elif key in ("flags", "Features"):  # x86, arm64
                flags |= set(value.split())
    except OSError:
        pass
    return {"cpu": cpu or platform.processor() or platform.machine(), "machine": platform.machine(),
            "logical_cpus": os.cpu_count(), "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
            "isa": [f for f in _ISA_FLAGS if f in flags]}


def host_line(h: dict | None = None) -> str:
    h = h or host()
    return (f"{h['cpu']} ({h['machine']}), {h['logical_cpus']} logical CPUs, {h['memory_bytes'] / 2**30:.1f} GiB; "
            f"ISA: {' '.join(h['isa']) or 'none of ' + ', '.join(_ISA_FLAGS[:3])}")
