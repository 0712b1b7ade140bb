"""The bytes a decode step reads, for the rooflines: of the safetensors a model is built from, of an
ONNX model (ORT GenAI's, an llmc engine's), and of each row's own files."""

from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path

from peer_runtimes.llama_cpp import LLAMA_KV_BYTES, gguf_weight_bytes
from peer_runtimes.llmc_engine import LLMC_KV_BYTES


def experts_read(cfg: dict, batch: int = 1) -> float:
    """The share of a mixture-of-experts layer's experts a decode step of `batch` rows reads: k / E
    for one row; for more, the expected share of experts at least one row chose, 1 - (1 - k/E)^batch,
    if each row's k experts were drawn uniformly (1.0 for a dense model)."""
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    if not experts:
        return 1.0
    return 1 - (1 - cfg["num_experts_per_tok"] / experts) ** batch


# A checkpoint's per-expert tensor, or a stack of every expert's (transformers 5's names, gpt-oss's
# biases and MXFP4 parts), of which a step reads the chosen experts' rows.
PER_EXPERT = re.compile(r"\.experts\.(\d+\.|(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$)")


def _decode_step_reads(folder: Path, size, batch: int = 1) -> int:
    """What one decode step reads of the safetensors in `folder`, each tensor counted as size(bytes,
    shape, name): every tensor, but an untied embedding only one row (a Gather reads one row a token)
    and each expert's tensors the share of experts a row chooses (experts_read)."""
    cfg = json.loads((folder / "config.json").read_text())
    active = experts_read(cfg, batch)
    total, embed, row = 0, 0, 0
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb") as fh:
            header = json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
        for name, t in header.items():
            if name == "__metadata__":
                continue
            n = size(t["data_offsets"][1] - t["data_offsets"][0], t["shape"], name)
            total += n * active if PER_EXPERT.search(name) else n
            if name.endswith("embed_tokens.weight"):
                embed, row = n, n // t["shape"][0]
    if not cfg.get("tie_word_embeddings", False):
        total += row - embed
    return int(total)


def weight_bytes(folder: Path, batch: int = 1) -> int:
    """Bytes of weights one decode step of `batch` rows reads."""
    return _decode_step_reads(folder, lambda nbytes, shape, name: nbytes, batch)


def parameter_count(folder: Path) -> int:
    """Parameters one decode step reads, counted as weight_bytes counts bytes (an MXFP4 stack's: two
    a byte of its blocks, none in its scales)."""
    per_element = {"_blocks": 2, "_scales": 0}
    return _decode_step_reads(folder, lambda nbytes, shape, name: math.prod(shape) * per_element.get(name[-7:], 1))


def onnx_weight_bytes(model: Path, experts_active: float = 1.0) -> tuple[int, str, float | None]:
    """(bytes of the initializers one decode step reads, how counted, bytes per KV element) of an
    ONNX model with its external data: every initializer, but one that only Gather-type nodes take
    as their data (an embedding table looked up by token id) counts one row of its first dim, and
    an Experts node's stacks (inputs 3 and 4) the share `experts_active` of them."""
    import onnx

    g = onnx.load(str(model), load_external_data=False).graph
    users: dict[str, set] = {}
    for n in g.node:
        for i, x in enumerate(n.input):
            users.setdefault(x, set()).add((n.op_type, i))
    total, gathered = 0, 0
    for t in g.initializer:
        ext = {e.key: e.value for e in t.external_data}
        if "length" in ext:
            n = int(ext["length"])
        elif t.raw_data:
            n = len(t.raw_data)
        else:
            count = 1
            for d in t.dims:
                count *= d
            n = count * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
        u = users.get(t.name, set())
        if u and t.dims and all(op.startswith("Gather") and i != 1 for op, i in u):
            gathered += n - n // t.dims[0]
            n //= t.dims[0]
        elif u and all(op == "Experts" and i in (3, 4) for op, i in u):
            n = int(n * experts_active)
        total += n
    kv = None
    elem = {1: 4.0, 10: 2.0, 16: 2.0}
    for i in g.input:
        if i.name.startswith(("past_key_values", "kv_cache")):
            kv = elem.get(i.type.tensor_type.elem_type)
            break
    note = "ONNX initializers" + (f", gathered tables one row ({gathered / 1e6:.1f} MB not read)" if gathered else "")
    return total, note, kv


def kv_bytes_per_position(folder: Path, dtype_bytes: int) -> int:
    cfg = json.loads((folder / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return 2 * cfg["num_hidden_layers"] * cfg.get("num_key_value_heads", heads) * head_dim * dtype_bytes


def own_bytes(kind: str, path: Path | None, info: dict, args, experts_active: float = 1.0) -> dict | None:
    """A row's own weight bytes per decode step and KV element size, from its own files (a MoE's
    experts counted as the share of them a step reads: experts_read)."""
    if path is None:
        return None
    try:
        if kind == "llama.cpp":
            wb, note = gguf_weight_bytes(Path(path), experts_active)
            return {"weight_bytes": wb, "how": note, "kv_dtype_bytes": LLAMA_KV_BYTES[args.llama_kv_type],
                    "kv_dtype": args.llama_kv_type}
        if kind == "ort-genai":
            wb, note, kv = onnx_weight_bytes(Path(path) / "model.onnx")
            return {"weight_bytes": wb, "how": note, "kv_dtype_bytes": kv or 4.0,
                    "kv_dtype": {4.0: "fp32", 2.0: "16-bit"}.get(kv or 4.0)}
        from llmc.contract.engine_dir import open_engine

        m = open_engine(path).manifest
        wb, note, _ = onnx_weight_bytes(Path(path) / m.payload.model, experts_active)
        if m.build_options.lossless_weights:
            note += "; a --lossless-weights engine stores two copies and both are counted"
        kv = m.kv_cache.dtype
        return {"weight_bytes": wb, "how": note, "kv_dtype_bytes": LLMC_KV_BYTES.get(kv, 4.0), "kv_dtype": kv}
    except Exception as exc:  # noqa: BLE001  (a roofline we cannot count is left out, not fatal)
        print(f"warning: cannot count the weight bytes of {path}: {type(exc).__name__}: {exc}", flush=True)
        return None
