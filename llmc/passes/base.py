"""Pass infrastructure.

A `Pass` rewrites an onnx_ir Model in place and returns a `PassResult` saying what it changed
(named counts) and, for rules that did not fire, why. A `RewriteRule` is the unit most passes
are made of: `match` finds a candidate anchored at one node, `check` accepts it or explains the
miss, `rewrite` replaces it. `PassManager` runs a named pipeline, timing each pass, optionally
verifying it numerically and dumping the graph after it.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import onnx_ir as ir

from llmc.spec import ModelSpec


@dataclass
class BuildContext:
    """What passes may know besides the graph: the model facts and the build options."""

    spec: ModelSpec
    block_size: int = 16
    max_context: int = 2048
    last_token_logits: bool = True
    lossless_weights: bool = False  # also store the packed weights in the lossless format


@dataclass
class PassResult:
    changed: bool
    counts: dict[str, int] = field(default_factory=dict)
    misses: list[str] = field(default_factory=list)


@dataclass
class PassRecord:
    name: str
    changed: bool
    counts: dict[str, int]
    seconds: float
    nodes_before: int
    nodes_after: int
    max_abs_diff: float | None = None
    misses: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "changed": self.changed,
            "counts": self.counts,
            "seconds": round(self.seconds, 4),
            "nodes_before": self.nodes_before,
            "nodes_after": self.nodes_after,
            "max_abs_diff": self.max_abs_diff,
            "misses": self.misses[:20],
        }


class Pass:
    name: str = ""
    description: str = ""

    def run(self, model: ir.Model, ctx: BuildContext) -> PassResult:
        raise NotImplementedError


class RewriteRule:
    """One local rewrite. `match` returns the bindings of a candidate (or None when the anchor
    node is not even a candidate); `check` returns None to accept or a reason for the miss."""

    name: str = ""

    def match(self, node: ir.Node, ctx: BuildContext) -> dict[str, Any] | None:
        raise NotImplementedError

    def check(self, m: dict[str, Any], ctx: BuildContext) -> str | None:
        return None

    def rewrite(self, m: dict[str, Any], ctx: BuildContext, model: ir.Model) -> dict[str, int] | None:
        """Applies the rewrite; may return counts of what rode along (folded into the pass's counts)."""
        raise NotImplementedError


class RulePass(Pass):
    """Applies its rules to every node in graph order; counts hits per rule. With `fixed_point`,
    sweeps again while a sweep changed something (one rewrite can expose the next)."""

    rules: tuple[RewriteRule, ...] = ()
    fixed_point: bool = False
    max_sweeps: int = 8

    def prepare(self, model: ir.Model, ctx: BuildContext) -> None:
        """Hook run before matching (e.g. to add graph inputs the rewrites will use)."""

    def finish(self, model: ir.Model, ctx: BuildContext, counts: Counter) -> None:
        """Hook run after all rewrites (e.g. to drop what the rewrites made dead)."""

    def run(self, model: ir.Model, ctx: BuildContext) -> PassResult:
        counts: Counter = Counter()
        self.prepare(model, ctx)
        for _ in range(self.max_sweeps if self.fixed_point else 1):
            hits, misses = self._sweep(model, ctx)
            counts.update(hits)
            if not hits:
                break
        self.finish(model, ctx, counts)
        return PassResult(any(counts.values()), dict(counts), misses)

    def _sweep(self, model: ir.Model, ctx: BuildContext) -> tuple[Counter, list[str]]:
        hits: Counter = Counter()
        misses: list[str] = []
        for node in list(model.graph):
            if node.graph is None:  # removed by an earlier rewrite in this sweep
                continue
            for rule in self.rules:
                m = rule.match(node, ctx)
                if m is None:
                    continue
                reason = rule.check(m, ctx)
                if reason is not None:
                    misses.append(f"{rule.name} at {node.name}: {reason}")
                    continue
                extra = rule.rewrite(m, ctx, model)
                hits[rule.name] += 1
                hits.update({k: v for k, v in (extra or {}).items() if v})
                break
        return hits, misses


def graph_input(graph: ir.Graph, name: str) -> ir.Value | None:
    return next((v for v in graph.inputs if v.name == name), None)


def take_graph_output(graph: ir.Graph, old: ir.Value, new: ir.Value) -> None:
    """`new` replaces graph output `old` in place and under its name (the runtime binds outputs by
    name, and for the KV caches the producing node's own output must be the graph output)."""
    position = list(graph.outputs).index(old)
    name = old.name
    old.name = f"{name}.replaced"
    new.name, new.type, new.shape = name, old.type, old.shape
    graph.outputs[position] = new


def producer(value: ir.Value | None, op_type: str) -> ir.Node | None:
    """The node producing `value` if it is an `op_type` from the default domain."""
    if value is None:
        return None
    node = value.producer()
    if node is None or node.op_type != op_type or node.domain not in ("", "ai.onnx"):
        return None
    return node


def const_ints(value: ir.Value | None) -> list[int] | None:
    """The integer contents of a constant/initializer input, or None if not constant."""
    if value is None:
        return None
    tensor = value.const_value
    if tensor is None:
        node = value.producer()
        if node is not None and node.op_type == "Constant" and "value" in node.attributes:
            tensor = node.attributes["value"].as_tensor()
    if tensor is None:
        return None
    return [int(x) for x in tensor.numpy().reshape(-1)]


def weight(value: ir.Value | None):
    """The numpy contents of a constant initializer (a weight), or None."""
    if value is None or value.const_value is None or not value.is_initializer():
        return None
    return value.const_value.numpy()


def count_nodes(model: ir.Model) -> int:
    return sum(1 for _ in model.graph)


Verifier = Callable[[ir.Model, ir.Model, BuildContext], float]


class PassManager:
    """Runs passes in order. With a verifier, each pass is checked against the graph before it
    (the verifier raises if outputs diverge); with a dump dir, the graph after each pass is
    written as `NN-<pass>.onnx`."""

    def __init__(self, passes: list[Pass], *, verifier: Verifier | None = None,
                 dump_dir: Path | None = None,
                 on_pass: Callable[[PassRecord], None] | None = None):
        self.passes = passes
        self.verifier = verifier
        self.dump_dir = dump_dir
        self.on_pass = on_pass

    def run(self, model: ir.Model, ctx: BuildContext) -> list[PassRecord]:
        records = []
        for i, p in enumerate(self.passes):
            before = _clone(model) if self.verifier else None
            nodes_before = count_nodes(model)
            start = time.perf_counter()
            result = p.run(model, ctx)
            seconds = time.perf_counter() - start
            record = PassRecord(p.name, result.changed, result.counts, seconds, nodes_before,
                                count_nodes(model), misses=result.misses)
            if before is not None and result.changed:
                record.max_abs_diff = self.verifier(before, model, ctx)
            if self.dump_dir is not None:
                self.dump_dir.mkdir(parents=True, exist_ok=True)
                ir.save(model, self.dump_dir / f"{i:02d}-{p.name}.onnx",
                        external_data=f"{i:02d}-{p.name}.onnx.data")
            records.append(record)
            if self.on_pass:
                self.on_pass(record)
        return records


def _clone(model: ir.Model) -> ir.Model:
    return ir.from_proto(ir.to_proto(model))
