"""The kernel choices of this host, measured here rather than ruled once for every CPU.

Hosts differ in what bounds a decode step's products: on one the weights stream at the memory's
rate through any tile, on another the tile's instructions per weight byte decide
(docs/quantization.md). Two choices are measured per weight format: which tile a decode step (1-2
rows) takes for the quantized formats, AVX-512 VNNI or AVX2 (llmc_probe_quant), and which the
16-bit formats take, AVX-512 or AVX2 (llmc_probe_16bit; the same sums to the bit either way). The
probes time both tiles on a weight larger than the caches, on one thread, and the faster wins. The
result is kept per host (CPU model and ISA flags) and per build of the kernel library, under the
llmc cache (LLMC_CACHE or ~/.cache/llmc), so the probe runs once per host, and the choice is set in
the library before any session of the process runs its ops.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import logging
import os
import platform
from pathlib import Path

from llmc.plugins.cpu.library import native

log = logging.getLogger("llmc")

# Per weight format, the tiles a choice is between (the first is the one every host can run), the
# probe that times them and the setter that takes a choice (-1: the library's default). The quantized
# formats by their weight_format (LLMC_FORMAT_* in kernels.h).
QUANT_FORMATS = {"int4": 4, "int6": 5, "int8": 3, "mxfp4": 6}
SIXTEEN_BIT = {"fp16": 0, "bf16": 1}
TILES = {**{fmt: ("avx2", "vnni") for fmt in QUANT_FORMATS}, **{fmt: ("avx2", "avx512") for fmt in SIXTEEN_BIT}}
# The probes' weights, more than the 32 MB L3 of the hosts met: [4096, 16384] quantized (36-68 MB),
# [4096, 8192] 16-bit (64 MB); the fastest of PROBE_REPS calls of each tile, the tiles taking turns.
PROBE_SHAPES = {"quant": (4096, 16384), "16bit": (4096, 8192)}
PROBE_REPS = 3
VERSION = 2
# The flags a kernel choice depends on; the rest of /proc/cpuinfo's line does not change one.
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni", "avx512_bf16",
             "avx512_fp16", "amx_tile", "amx_int8", "amx_bf16")


def host() -> dict:
    """The CPU's model name and the ISA flags of ISA_FLAGS it has."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    return {"cpu": model, "isa": [f for f in ISA_FLAGS if f in flags]}


def choices_path(library: Path, cache_dir: Path | None = None) -> Path:
    """Where this host's choices for this build of the library are kept."""
    from llmc.compiler.recipes import cache_root

    stat = library.stat()
    key = json.dumps([host(), library.name, stat.st_size, stat.st_mtime_ns, VERSION])
    return cache_root(cache_dir) / "hosts" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def measure(lib: ctypes.CDLL) -> dict:
    """{format: {"tile": the faster, "seconds": {tile: best seconds}}}: for the quantized formats the
    tile of a decode step (one row), for the 16-bit ones the tile of every product."""
    tiles = {}
    for fmt in TILES:
        seconds = (ctypes.c_double * 2)()
        if fmt in QUANT_FORMATS:
            status = _probe(lib, "llmc_probe_quant")(QUANT_FORMATS[fmt], 1, *PROBE_SHAPES["quant"], PROBE_REPS,
                                                     seconds)
        else:
            status = _probe(lib, "llmc_probe_16bit")(SIXTEEN_BIT[fmt], 1, *PROBE_SHAPES["16bit"], PROBE_REPS, seconds)
        measured = {tile: s for tile, s in zip(TILES[fmt], seconds) if s > 0}
        if status == 0 and measured:
            tiles[fmt] = {"tile": min(measured, key=measured.get), "seconds": measured}
    return tiles


def _probe(lib: ctypes.CDLL, name: str):
    """llmc_probe_quant(format, m, k, n, reps, double seconds[2]) or llmc_probe_16bit(bf16, ...) -> 0 | -1."""
    fn = getattr(lib, name)
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
                   ctypes.POINTER(ctypes.c_double)]
    fn.restype = ctypes.c_int
    return fn


def apply(lib: ctypes.CDLL, tiles: dict) -> None:
    """Set each format's measured tile in the library (the default where none was measured)."""
    for fmt, names in TILES.items():
        chosen = tiles.get(fmt, {}).get("tile")
        choice = -1 if chosen not in names else names.index(chosen)
        if fmt in QUANT_FORMATS:
            lib.llmc_set_decode_tile(QUANT_FORMATS[fmt], choice)
        else:
            lib.llmc_set_16bit_tile(SIXTEEN_BIT[fmt], choice)


@functools.cache
def use_measured_kernels(library: Path) -> dict:
    """Set this host's measured tiles in `library` (ORT's copy of it: the same loaded object),
    measuring them first where no earlier process of this host did. Returns what was set:
    {format: {"tile": ..., "seconds": {tile: ...}}}."""
    lib = native(library)
    if not hasattr(lib, "llmc_probe_16bit"):  # a library from before the probes
        return {}
    path = choices_path(library)
    try:
        tiles = json.loads(path.read_text())["tiles"]
    except (OSError, ValueError, KeyError, TypeError):
        tiles = measure(lib)
        summary = ", ".join(f"{fmt} {c['tile']}" for fmt, c in tiles.items()) or "no fast path on this CPU"
        log.info("llmc: measured this host's kernel tiles (%s), kept in %s", summary, path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"host": host(), "tiles": tiles}, indent=2))
            tmp.replace(path)
        except OSError:  # a read-only cache: measured again next time
            pass
    apply(lib, tiles)
    return tiles
