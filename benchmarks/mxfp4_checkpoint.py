"""A gpt-oss model folder with float experts -> the same folder as OpenAI releases gpt-oss: each
expert stack in MXFP4 (`*_blocks`, `*_scales`; rows the output features), everything else as it
was, config.json's quantization_config saying so. For measuring llmc's MXFP4 experts beside
llama.cpp's on the same codes (docs/moe.md):

    python benchmarks/mxfp4_checkpoint.py SRC DST

Each output shard is held whole until it is written (its stacks rounded an expert at a time).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np

from safetensors import safe_open
from safetensors.numpy import save_file

from llmc.plugins.cpu.quant import quantize_mxfp4

STACKS = ("experts.gate_up_proj", "experts.down_proj")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path, help="a gpt-oss folder with float experts (e.g. a recipe's)")
    ap.add_argument("dst", type=Path)
    args = ap.parse_args()
    args.dst.mkdir(parents=True)
    for f in args.src.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, args.dst / f.name)
    weight_map = {}
    for shard in sorted(args.src.glob("*.safetensors")):
        out = {}
        with safe_open(shard, "np") as f:
            for name in f.keys():
                w = f.get_tensor(name)
                if name.endswith(STACKS):  # transformers' [E, in, out]; MXFP4 rows are the outputs
                    parts = [quantize_mxfp4(np.ascontiguousarray(expert.T)) for expert in w]
                    out[name + "_blocks"], out[name + "_scales"] = (np.stack(p) for p in zip(*parts))
                else:
                    out[name] = w
        save_file(out, args.dst / shard.name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(out, shard.name))
    if (args.src / "model.safetensors.index.json").exists():
        index = json.loads((args.src / "model.safetensors.index.json").read_text())
        (args.dst / "model.safetensors.index.json").write_text(json.dumps({**index, "weight_map": weight_map}))
    config = json.loads((args.src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (args.dst / "config.json").write_text(json.dumps(config, indent=2))
    print(f"wrote {args.dst}: experts in MXFP4")


if __name__ == "__main__":
    main()
