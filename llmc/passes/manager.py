"""Passes and the manager that runs them.

A `Pass` rewrites an onnx_ir Model in place and returns a `PassResult`: whether it changed the
graph, named counts of what it did and, for what it left alone, why. A pass may declare a
precondition (`requires`): when it does not hold, the pass changes nothing and says why. The
`PassManager` runs a pipeline's passes in order, timing each, optionally verifying it numerically
against the graph before it and dumping the graph after it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import onnx_ir as ir

from llmc.contract.manifest import PassRecord
from llmc.contract.model_spec import ModelSpec
from llmc.passes.graph import count_nodes


@dataclass
class PassResult:
    changed: bool
    counts: dict[str, int] = field(default_factory=dict)
    misses: list[str] = field(default_factory=list)


class Pass:
    name: str = ""
    description: str = ""
    required: bool = False  # the engine contract needs it: it cannot be disabled
    lossy: bool = False  # changes the numbers on purpose (quantization): verified, not held to a tolerance
    same_outputs: bool = True  # False: the outputs change shape (draft-vocab's logits), so it is not verified

    def requires(self, model: ir.Model, spec: ModelSpec) -> str | None:
        """None when the pass can run on `model`, else why it cannot."""
        return None

    def apply(self, model: ir.Model, spec: ModelSpec) -> PassResult:
        raise NotImplementedError

    def run(self, model: ir.Model, spec: ModelSpec) -> PassResult:
        why = self.requires(model, spec)
        if why is not None:
            return PassResult(False, {}, [why])
        return self.apply(model, spec)


# (graph before, graph after, strict) -> max abs difference of their outputs; strict, it raises
# beyond the tolerance.
Verifier = Callable[[ir.Model, ir.Model, bool], float]
MAX_MISSES_RECORDED = 20


class PassManager:
    def __init__(self, passes: list[Pass], *, verifier: Verifier | None = None, dump_dir: Path | None = None,
                 on_pass: Callable[[PassRecord], None] | None = None):
        self.passes = passes
        self.verifier = verifier
        self.dump_dir = dump_dir
        self.on_pass = on_pass
        self.misses: list[tuple[str, str]] = []  # (pass, why a rule did not fire), all of them

    def run(self, model: ir.Model, spec: ModelSpec) -> list[PassRecord]:
        records = []
        for i, p in enumerate(self.passes):
            before = _clone(model) if self.verifier else None
            nodes_before = count_nodes(model)
            start = time.perf_counter()
            result = p.run(model, spec)
            seconds = time.perf_counter() - start
            verified = before is not None and result.changed and p.same_outputs
            diff = self.verifier(before, model, not p.lossy) if verified else None
            if self.dump_dir is not None:
                self.dump_dir.mkdir(parents=True, exist_ok=True)
                ir.save(model, self.dump_dir / f"{i:02d}-{p.name}.onnx", external_data=f"{i:02d}-{p.name}.onnx.data")
            record = PassRecord(p.name, result.changed, dict(result.counts), round(seconds, 4), nodes_before,
                                count_nodes(model), diff, tuple(result.misses[:MAX_MISSES_RECORDED]))
            records.append(record)
            self.misses += [(p.name, why) for why in result.misses]
            if self.on_pass:
                self.on_pass(record)
        return records


def _clone(model: ir.Model) -> ir.Model:
    return ir.from_proto(ir.to_proto(model))
