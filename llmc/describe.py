"""`llmc inspect`: an engine's manifest as text people read."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

from llmc.contract import graph_io
from llmc.contract.codec import to_json
from llmc.contract.manifest import Manifest


def _human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _value(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, (dict, list, tuple)):
        return json.dumps(v, separators=(", ", ": ")) if v else "-"
    return str(v)


def _state_rows(m) -> list[str]:
    """Each state pool, and a sequence's state beside the KV a transformer of its layers would keep."""
    rows = [f"  {graph_io.state_input(i):<10} layer {s.layer:<3} {s.kind:<5} {list(s.shape)} per slot, "
            f"{s.slot_bytes / 1024:,.1f} KiB" for i, s in enumerate(m.states)]
    per_sequence = sum(s.slot_bytes for s in m.states)
    per_token = m.kv_cache.block_bytes / m.kv_cache.block_size
    attending = per_token / m.kv_cache.num_layers * m.model_spec.num_layers
    context = m.max_context
    return rows + [
        f"  per sequence  {per_sequence / 2**20:,.2f} MiB of state, whatever its length; KV {per_token / 1024:,.1f} KiB "
        f"a token in its {m.kv_cache.num_layers} attention layers ({per_token * context / 2**20:,.1f} MiB at "
        f"{context} tokens)",
        f"  a transformer of its {m.model_spec.num_layers} layers would keep {attending / 1024:,.1f} KiB a token "
        f"({attending * context / 2**20:,.1f} MiB at {context} tokens)"]


def _rows(d: dict[str, Any]) -> list[str]:
    width = max(len(str(k)) for k in d)
    return [f"  {str(k):<{width}}  {_value(v)}" for k, v in d.items()]


def describe(manifest: Manifest, engine_dir: str | Path, host_kernels: dict | None = None) -> str:
    """`host_kernels`: what plugins/cpu/host.py measured on this host (an engine on llmc's CPU kernels)."""
    m = manifest
    lines: list[str] = [f"Engine {Path(engine_dir)}"]
    lines += _rows({"source": m.source.model, "llmc version": f"{m.llmc_version} (schema {m.schema_version})",
                    "created": m.created_at, "backend": f"{m.backend.name} (target {m.backend.target})",
                    "custom ops": list(m.backend.custom_ops)})

    def section(title: str, body: list[str]) -> None:
        lines.extend(["", title, *body])

    if m.backend.name == "tensorrt":  # what the plan runs on, and the step shapes it holds
        b = m.backend
        section("TensorRT plan", _rows({"gpu architecture": b.gpu_arch, "TensorRT": b.tensorrt_version,
                                        "plugin library": b.plugin_library}) + [
            f"  profile {p.name:<8} rows {p.batch.min}-{p.batch.max}, tokens {p.seq.min}-{p.seq.max}, "
            f"logits {p.num_logits.min}-{p.num_logits.max}, table blocks {p.max_blocks.min}-{p.max_blocks.max}, "
            f"pool blocks {p.num_blocks.min}-{p.num_blocks.max}" for p in b.profiles])
    section("Model spec", _rows(to_json(m.model_spec)))
    pool = "[" + ", ".join(map(str, m.kv_cache.pool_shape(graph_io.NUM_BLOCKS))) + "]"
    section("KV cache", _rows({**to_json(m.kv_cache), "pool shape": pool}))
    if m.states:
        section("Recurrent state", _state_rows(m))
    io_lines = []
    for kind, names in (("inputs", m.io.inputs), ("outputs", m.io.outputs)):
        prefix = f"  {f'{kind} ({len(names)})':<14}  "
        # Engines with many layers have hundreds of pool names: wrap rather than one huge line.
        io_lines += textwrap.wrap(", ".join(names), width=100, initial_indent=prefix,
                                  subsequent_indent=" " * len(prefix))
    kept = m.lm_head_tokens
    logits = f"  {graph_io.LOGITS:<14}  [{graph_io.NUM_LOGITS}, {'vocab' if kept is None else len(kept)}]: one row " \
             f"per token in {graph_io.LOGITS_INDICES}"
    if kept is not None:
        logits += f", a column per token in lm_head_tokens (a draft's; ids {kept[0]}..{kept[-1]})"
    io_lines.append(logits)
    section("I/O", io_lines)
    section("Build options", _rows(to_json(m.build_options)))
    q = m.quantization
    body = _rows({"method": q.method, "block size": q.block_size, "symmetric": q.symmetric,
                  "scale dtype": q.scale_dtype, "calibration": q.calibration,
                  "tensors": ", ".join(f"{n} {fmt}" for fmt, n in q.formats.items()) or "none (all fp32)",
                  "KV cache": m.kv_cache.dtype})
    if q.tensors:
        width = max(len(name) for name in q.tensors)
        body += [f"  {'tensor':<{width}}  {'role':<9}  {'format':<6}  {'shape':>12}  rel. error"]
        body += [f"  {name:<{width}}  {t.role:<9}  {t.format:<6}  {'x'.join(map(str, t.shape)):>12}  "
                 f"{t.relative_error:.2e}" for name, t in q.tensors.items()]
    section("Quantization", body)
    section("Tokenizer", _rows(to_json(m.tokenizer)))
    if m.passes:
        width = max(len("pass"), *(len(p.name) for p in m.passes))
        body = [f"  {'pass':<{width}}  changed  {'time':>8}  counts"]
        body += [f"  {p.name:<{width}}  {_value(p.changed):<7}  {p.seconds:>7.2f}s  "
                 f"{', '.join(f'{k}={v}' for k, v in p.counts.items()) or '-'}" for p in m.passes]
        section(f"Passes ({len(m.passes)})", body)
    if host_kernels:
        from llmc.plugins.cpu.host import PROBE_SHAPES, QUANT_FORMATS, host

        def line(fmt: str, c: dict) -> str:
            k, n = PROBE_SHAPES["quant" if fmt in QUANT_FORMATS else "16bit"]
            times = ", ".join(f"{tile} {s * 1e3:.2f} ms" for tile, s in c["seconds"].items())
            rows = "decode rows" if fmt in QUANT_FORMATS else "every product"
            return f"  {fmt} {rows:<13}  {c['tile']:<6}  ({times} for a [{k}, {n}] weight on one thread)"

        section(f"This host's kernels ({host()['cpu']}: {' '.join(host()['isa'])}), measured once per host",
                [line(fmt, c) for fmt, c in host_kernels.items()])
    if m.files:
        width = max(len(rel) for rel in m.files)
        body = [f"  {rel:<{width}}  {_human_bytes(e.bytes):>10}" for rel, e in m.files.items()]
        body.append(f"  {'total':<{width}}  {_human_bytes(sum(e.bytes for e in m.files.values())):>10}")
        section(f"Files ({len(m.files)})", body)
    return "\n".join(lines)
