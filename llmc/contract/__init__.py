"""The engine contract: what the compiler writes and the runtime, bench and server read.

A leaf package (standard library, numpy, llmc.errors and llmc.version only) that every other part imports:
- graph_io: the engine graph's input and output names, their types, the scratch block;
- kv_layout: how a layer's KV pool lays out its blocks;
- model_spec: ModelSpec, the model facts every stage after the frontend reads;
- options: BuildOptions and RuntimeOptions, each validated once;
- manifest: the typed, frozen Manifest (manifest.json) and its sections;
- engine_dir: EngineWriter (atomic builds) and open_engine (the one way to read an engine);
- tuning: tuning.json, the tuned runtime options beside the manifest;
- json_file: reading those JSON files, every failure one line (below both engine_dir and tuning).
"""

from llmc.contract.engine_dir import MANIFEST, EngineFiles, EngineWriter, open_engine
from llmc.contract.graph_io import GraphIO
from llmc.contract.manifest import Manifest
from llmc.contract.model_spec import ModelSpec
from llmc.contract.options import BuildOptions, RuntimeOptions

__all__ = ["MANIFEST", "BuildOptions", "EngineFiles", "EngineWriter", "GraphIO", "Manifest", "ModelSpec",
           "RuntimeOptions", "open_engine"]
