"""Rewrite rules and the one place that changes the graph for them.

A `Rule` declares a `pattern` (pattern.py), may `check` a match (read only: None to accept, or
the reason it does not fire, which `llmc build --explain` lists) and `rewrite`s it: the rewrite
builds new nodes with `op` and returns the values that replace the pattern's outputs. `apply`
then does the surgery every rule used to do by hand: new initializers, nodes inserted where
their inputs exist, uses (and graph-output slots, under their names) moved to the new values,
the matched nodes and the weights only they read removed, opset imports added.

A `RulePass` runs its rules over the graph in order, counts what fired per rule, collects the
misses, and removes what the rewrites left dead. A rule with `all_or_none` is a graph-wide
decision: its matches are all checked before any is rewritten, and one miss keeps them all.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from functools import cached_property
from typing import Any

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import common as ir_passes

from llmc.contract import graph_io as io
from llmc.contract.model_spec import ModelSpec
from llmc.ir_builder import OpBuilder
from llmc.passes.graph import count_nodes, graph_input, rotary_attrs
from llmc.passes.manager import Pass, PassResult
from llmc.passes.pattern import Match, Pattern
from llmc.plugins import cpu
from llmc.plugins import paged_attention as pa

# The version of each non-ONNX domain a rewrite may emit.
DOMAIN_VERSIONS = {"com.microsoft": 1, pa.DOMAIN: pa.VERSION, cpu.DOMAIN: cpu.VERSION}


class Replacement(OpBuilder):
    """The `op` a rewrite receives: builds detached nodes, and records what else the rewrite adds."""

    def __init__(self, graph: ir.Graph, prefix: str):
        super().__init__(name_prefix=prefix)
        self.graph = graph
        self.initializers: list[ir.Value] = []
        self.graph_inputs: list[ir.Value] = []
        self.graph_outputs: list[ir.Value] = []
        self.counts: Counter = Counter()

    def initializer(self, array: np.ndarray | ir.TensorProtocol, name: str) -> ir.Value:
        """A new initializer: an array, or a tensor computed when read (llmc.passes.lazy)."""
        value = ir.Value(name=name, const_value=array if isinstance(array, ir.TensorProtocol) else ir.tensor(array))
        if isinstance(array, ir.TensorProtocol):
            value.type, value.shape = ir.TensorType(array.dtype), ir.Shape(array.shape)
        self.initializers.append(value)
        return value

    def graph_input(self, name: str, dtype: ir.DataType | None = None, shape: Sequence | None = None) -> ir.Value:
        """The graph input `name`; with a type, created when the graph has none yet."""
        value = graph_input(self.graph, name) or next((v for v in self.graph_inputs if v.name == name), None)
        if value is None:
            if dtype is None:
                raise KeyError(f"the graph has no input {name!r}")  # a pass precondition let this through
            value = ir.Value(name=name, type=ir.TensorType(dtype), shape=ir.Shape(shape))
            self.graph_inputs.append(value)
        return value

    def step_input(self, name: str) -> ir.Value:
        """The graph input `name` of the step contract (graph_io: past_lens, state_slots, ...),
        created with the contract's type and shape when the graph has none yet."""
        dtype, shape = (io.STATE_SLOTS_TYPE, io.STATE_SLOTS_SHAPE) if name == io.STATE_SLOTS else \
            (io.STEP_INPUTS[name], io.STEP_SHAPES[name])
        return self.graph_input(name, ir.DataType[dtype.upper()], list(shape))

    def graph_output(self, value: ir.Value, name: str) -> ir.Value:
        """`value` becomes a new graph output called `name`."""
        value.name = name
        self.graph_outputs.append(value)
        return value

    def like(self, node: ir.Node, *inputs: ir.Value | None, num_outputs: int = 1, **attributes: Any):
        """A node of `node`'s type, domain and attributes (unless overridden), reading `inputs`."""
        attrs = {**{a.name: a for a in node.attributes.values()}, **attributes}
        return self.op(node.op_type, *inputs, domain=node.domain, num_outputs=num_outputs, **attrs)

    def count(self, key: str, n: int = 1) -> None:
        """Something that rode along with the rewrite, counted under its own key."""
        self.counts[key] += n


def rotary_operands(op: Replacement, rope: ir.Node | None) -> tuple[ir.Value | None, ir.Value | None, int]:
    """(cos, sin, interleaved) an attention kernel takes to apply a RotaryEmbedding itself:
    cos/sin cut to the rotated half-width (the kernel learns the rotary dim from their last
    axis), or (None, None, 0) without one."""
    if rope is None:
        return None, None, 0
    interleaved, rotary_dim = rotary_attrs(rope)
    cos, sin = rope.inputs[1:3]
    if rotary_dim:  # partial rotation
        cos, sin = (op.Slice(v, op.const([0]), op.const([rotary_dim // 2]), op.const([-1])) for v in (cos, sin))
    return cos, sin, interleaved


class Rule:
    name: str = ""
    all_or_none: bool = False

    def pattern(self, op, *variables):
        raise NotImplementedError

    def check(self, m: Match) -> str | None:
        return None

    def rewrite(self, op: Replacement, m: Match):
        raise NotImplementedError

    @cached_property
    def _pattern(self) -> Pattern:
        return Pattern(self.pattern)

    def match(self, node: ir.Node) -> Match | None:
        """The match anchored at `node`, if any, by the declared pattern; a rule whose shape is not
        a tree under one root (siblings) overrides this."""
        return self._pattern.match(node)

    def why_not(self, m: Match) -> str | None:
        return Pattern.unreplaceable(m) or self.check(m)


def _insertion_point(graph: ir.Graph, m: Match, new_nodes: Sequence[ir.Node]) -> ir.Node:
    """Where the new nodes go. Before the root, where every input of the match exists, unless a
    value the match replaces is produced earlier and read before the root: then before the first
    matched node, which must follow every producer the new nodes read."""
    root_outputs = set(m.root.outputs)
    if all(value in root_outputs for value in m.outputs):
        return m.root
    matched, created = set(m.nodes), set(new_nodes)
    needed = {v.producer() for n in new_nodes for v in n.inputs
              if v is not None and v.producer() is not None and v.producer() not in created}
    for node in graph:
        if node in matched:
            if needed - matched:
                raise RuntimeError(f"cannot place the rewrite of {m.root.name}: an input is produced after it")
            return node
        needed.discard(node)
    raise RuntimeError(f"{m.root.name} is not in the graph")


def _hand_over(graph: ir.Graph, old: ir.Value, new: ir.Value, created: bool) -> None:
    """`new` takes `old`'s place: its consumers, its type and shape where it has none and, when the
    rewrite created it, its name and graph-output slot (the runtime binds outputs by name)."""
    if new.type is None:
        new.type = old.type
    if new.shape is None:
        new.shape = old.shape
    if created:
        name, old.name = old.name, f"{old.name}.replaced"
        new.name = name
        if old.is_graph_output():
            graph.outputs[list(graph.outputs).index(old)] = new
    elif old.is_graph_output():
        raise RuntimeError(f"graph output {old.name} cannot be replaced by the existing value {new.name}")
    ir.convenience.replace_all_uses_with(old, new)


def apply(model: ir.Model, m: Match, op: Replacement, new_values: Sequence[ir.Value | None]) -> None:
    """Replace the match by what `op` built: `new_values[i]` takes the place of `m.outputs[i]`."""
    graph = model.graph
    if len(new_values) != len(m.outputs):
        raise ValueError(f"a rewrite of {m.root.name} returned {len(new_values)} values for "
                         f"{len(m.outputs)} pattern outputs")
    for value in op.initializers:
        graph.register_initializer(value)
    if op.nodes:
        graph.insert_before(_insertion_point(graph, m, op.nodes), op.nodes)
    created = set(op.nodes)
    for old, new in zip(m.outputs, new_values):
        if new is not None and new is not old:
            _hand_over(graph, old, new, new.producer() in created)
    graph.inputs.extend(op.graph_inputs)
    graph.outputs.extend(op.graph_outputs)
    _remove(graph, m.removed, m.nodes)
    for node in op.nodes:
        if node.domain in DOMAIN_VERSIONS:
            model.opset_imports.setdefault(node.domain, DOMAIN_VERSIONS[node.domain])


def _remove(graph: ir.Graph, nodes: list[ir.Node], context: list[ir.Node]) -> None:
    """Remove `nodes` and what that leaves unread upstream of them or among the match's kept
    `context` nodes, with the weights only they read: dead code goes at once, so a later match never
    anchors on it and a replaced weight's memory is freed before the next one is made."""
    dead = set(nodes)

    def unread(node: ir.Node) -> bool:
        return all(not v.is_graph_output() and all(user in dead for user, _ in v.uses()) for v in node.outputs)

    candidates = [v.producer() for n in nodes for v in n.inputs if v is not None] + list(context)
    while candidates:
        node = candidates.pop()
        if node is None or node in dead or node.graph is None or not unread(node):
            continue
        dead.add(node)
        candidates += [v.producer() for v in node.inputs if v is not None]
    weights = {v for n in dead for v in n.inputs if v is not None and v.is_initializer()}
    graph.remove(dead, safe=True)
    for value in weights:
        if not value.uses() and not value.is_graph_output():
            graph.initializers.pop(value.name, None)


def remove_dead_code(model: ir.Model) -> int:
    """Drop nodes and initializers nothing reads and opset imports nothing uses; returns how many
    nodes went. Graph inputs stay: they are the engine's interface."""
    before = count_nodes(model)
    ir_passes.RemoveUnusedNodesPass()(model)
    ir_passes.RemoveUnusedOpsetsPass()(model)
    return before - count_nodes(model)


class RulePass(Pass):
    """Applies its rules to every node in graph order, the first rule that fires winning. With
    `fixed_point`, sweeps again while a sweep changed something (one rewrite can expose the next)."""

    fixed_point: bool = False
    max_sweeps: int = 8

    def rules(self, spec: ModelSpec) -> list[Rule]:
        raise NotImplementedError

    def apply(self, model: ir.Model, spec: ModelSpec) -> PassResult:
        rules = self.rules(spec)
        counts: Counter = Counter()
        misses: list[str] = []
        for rule in [r for r in rules if r.all_or_none]:
            refused = self._survey(model, rule)
            if refused:
                rules.remove(rule)
                misses += refused
        for _ in range(self.max_sweeps if self.fixed_point else 1):
            hits, sweep_misses = self._sweep(model, rules)
            counts.update(hits)
            if not hits:
                break
        if counts:
            remove_dead_code(model)
            self.finish(model, spec, counts)
        return PassResult(bool(counts), dict(counts), misses + sweep_misses)

    def finish(self, model: ir.Model, spec: ModelSpec, counts: Counter) -> None:
        """After the rewrites, when some fired: what the pass does to the graph as a whole."""

    @staticmethod
    def _survey(model: ir.Model, rule: Rule) -> list[str]:
        """The misses that keep an all-or-none rule from rewriting anything."""
        reasons = [(node.name, why) for node in model.graph
                   if (m := rule.match(node)) is not None and (why := rule.why_not(m)) is not None]
        return [f"{rule.name} at {name}: {why}; every one or none is rewritten" for name, why in reasons]

    @staticmethod
    def _sweep(model: ir.Model, rules: list[Rule]) -> tuple[Counter, list[str]]:
        hits: Counter = Counter()
        misses: list[str] = []
        for node in list(model.graph):
            if node.graph is None:  # removed by an earlier rewrite in this sweep
                continue
            for rule in rules:
                m = rule.match(node)
                if m is None:
                    continue
                why = rule.why_not(m)
                if why is not None:
                    misses.append(f"{rule.name} at {node.name}: {why}")
                    continue
                op = Replacement(model.graph, prefix=f"{node.name}.{rule.name}.")
                result: Any = rule.rewrite(op, m)
                apply(model, m, op, result if isinstance(result, tuple) else (result,))
                hits[rule.name] += 1
                hits.update(op.counts)
                break
        return hits, misses
