"""llmc's side of the peers benchmark: the engines to measure (built here or given with --llmc, run
from this checkout or another one with --llmc-src), and the worker backend."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from peer_runtimes.shared import REPO, WORKER

# Bytes per KV element of an llmc pool, by the manifest's kv_cache.dtype (an int8 pool's per token
# and head scales, 4 bytes per head_dim elements, are left out).
LLMC_KV_BYTES = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "int8": 1.0}


# -- engines -----------------------------------------------------------------------------------------


def optional_passes() -> list[str]:
    from llmc.passes.pipeline import optional_passes

    return optional_passes()


def build_engine(model: str, out: Path, flags: list[str]) -> str | None:
    """Build an engine; None on success, else the build's last error line."""
    print(f"build: llmc build {model} {' '.join(flags)}".rstrip(), flush=True)
    r = subprocess.run([sys.executable, "-m", "llmc.cli", "build", model, "-o", str(out), "--overwrite", *flags],
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if r.returncode == 0:
        return None
    return (r.stderr.strip().splitlines() or ["(no output)"])[-1]


def disable(passes) -> list[str]:
    return [f for p in passes for f in ("--disable-pass", p)]


def build_variants(args, work: Path) -> tuple[list[tuple[str, Path]], dict[str, str]]:
    """The llmc engines to measure, and a build error per variant that could not be built."""
    engines, failed = parse_llmc(args.llmc), {}

    def variant(name: str, out: Path, flags: list[str]) -> None:
        engines.append((name, out))
        err = build_engine(args.model, out, flags)
        if err:
            failed[name] = f"build failed: {err}"

    if not engines:
        engines.append(("llmc", work / "engine"))
        err = build_engine(args.model, engines[-1][1], [])
        if err:
            raise SystemExit(f"error: llmc build {args.model} failed: {err}")
    if args.lossless:
        variant("llmc --lossless-weights", work / "engine-lossless", ["--lossless-weights"])
    optional = optional_passes()
    if args.no_fusions:
        out = work / "engine-no-fusions"
        off = list(optional)
        err = build_engine(args.model, out, disable(off))
        if err and "native-gqa" in off:
            # At the time of writing, paged-kv-cache only recognises attention once native-gqa has
            # removed the K/V head expansion, so with it off the build fails; keep it and say so.
            print(f"build: without any optional pass the build fails ({err}); retrying with native-gqa on",
                  flush=True)
            off.remove("native-gqa")
            err = build_engine(args.model, out, disable(off))
        kept = [p for p in optional if p not in off]
        name = "llmc, no fusions" + (f" (+{','.join(kept)})" if kept else "")
        engines.append((name, out))
        if err:
            failed[name] = f"build failed: {err}"
    if args.ablate:
        for p in optional:
            variant(f"llmc -{p}", work / f"engine-no-{p}", disable([p]))
    return engines, failed


def parse_llmc(specs: list[str]) -> list[tuple[str, Path]]:
    from llmc.contract import MANIFEST

    out = []
    for s in specs:
        name, sep, path = s.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"error: --llmc wants NAME=ENGINE_DIR (got {s!r})")
        if not (Path(path) / MANIFEST).is_file():
            raise SystemExit(f"error: --llmc {name}: {path} is not an llmc engine (no {MANIFEST}); build one "
                             "with `llmc build MODEL -o DIR`")
        out.append((name, Path(path)))
    return out


def parse_llmc_src(specs: list[str], names: list[str]) -> dict[str, Path]:
    out = {}
    for s in specs:
        name, sep, path = s.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"error: --llmc-src wants NAME=CHECKOUT_DIR (got {s!r})")
        if name not in names:
            raise SystemExit(f"error: --llmc-src {name}: no --llmc {name}=ENGINE_DIR to run from it")
        src = Path(path).expanduser().resolve()
        if not ((src / "llmc" / "__init__.py").is_file() and (src / WORKER.relative_to(REPO)).is_file()):
            raise SystemExit(f"error: --llmc-src {name}: {src} is not an llmc checkout (no llmc/__init__.py and "
                             f"{WORKER.relative_to(REPO)}); its C kernels must be built there too "
                             "(python setup.py build_ext --inplace)")
        out[name] = src
    return out


def src_env(src: Path) -> dict:
    # PYTHONPATH puts the checkout's llmc ahead of the editable install's finder (which only
    # answers what sys.path does not). The worker imports only llmc.runtime, never llmc.models
    # (which that finder maps to this repo's models/).
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(src)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))


# -- worker backend --------------------------------------------------------------------------------


class LlmcBackend:
    def __init__(self, engine_dir: str, threads: int, max_seqs: int, speculative: str | None = None,
                 num_speculative_tokens: int | None = None):
        from llmc.runtime.llm import LLM

        # Cold prefill every time: the repeated prompt would otherwise hit the prefix cache,
        # which no peer has enabled here.
        self.llm = LLM(engine_dir, num_threads=threads, max_num_seqs=max(max_seqs, 8),
                       enable_prefix_caching=False, speculative=speculative,
                       num_speculative_tokens=num_speculative_tokens)
        manifest = self.llm.engine.manifest
        self.info = {"runtime": "llmc", "engine": str(engine_dir), "threads": threads,
                     "disabled_passes": list(manifest.build_options.disable_passes), "kv_dtype": manifest.kv_cache.dtype}

    def _params(self, n: int):
        from llmc.runtime.sampling import SamplingParams

        return SamplingParams(max_tokens=n, ignore_eos=True)  # temperature 0 = greedy

    def greedy(self, prompt, n):
        return [int(t) for t in self.llm.generate(prompt, self._params(n)).token_ids]

    def latency(self, prompt, n):
        # Metrics come from llmc.runtime.metrics: TTFT = first token - arrival (add_request),
        # TPOT = (E2E - TTFT) / (n - 1). The peers time exactly the same span.
        llm = self.llm
        out = llm.output(llm.add_request(prompt, self._params(n)))
        while not out.token_ids:
            llm.step()
        read = _experts_bytes_read()
        while llm.has_unfinished():
            llm.step()
        assert len(out.token_ids) == n, (len(out.token_ids), n)
        m = out.metrics
        return {"ttft": m.ttft, "tpot": m.tpot, "tokens": [int(t) for t in out.token_ids],
                "steps": m.decode_steps, "proposed": m.proposed_tokens, "accepted": m.accepted_tokens,
                "expert_bytes": (_experts_bytes_read() - read) / max(m.decode_steps, 1)}

    def decode(self, prompts, steps):
        llm = self.llm
        ids = [llm.add_request(p, self._params(steps + 1)) for p in prompts]
        outs = [llm.output(i) for i in ids]
        while any(not o.token_ids for o in outs):  # prefills (chunked), untimed
            llm.step()
        read = _experts_bytes_read()
        start = time.perf_counter()
        for _ in range(steps):  # every step decodes all len(prompts) sequences
            llm.step()
        seconds = time.perf_counter() - start
        assert all(len(o.token_ids) == steps + 1 for o in outs)
        assert not llm.has_unfinished()
        return {"tok_s": len(prompts) * steps / seconds, "expert_bytes": (_experts_bytes_read() - read) / steps}


def _experts_bytes_read() -> int:
    """The expert weight bytes llmc.cpu::Experts has read in this process (0 without the kernels)."""
    import ctypes

    from llmc.plugins.cpu.library import library_path, native

    if library_path() is None:
        return 0
    counter = native(library_path()).llmc_experts_bytes_read
    counter.restype = ctypes.c_uint64
    return counter()
