"""Declarative patterns over onnx_ir graphs, and their matcher.

A rule declares its pattern as a function that builds it, the way a rewrite builds nodes:

    def pattern(self, op, gate, up):
        silu = op.Mul(gate, op.Sigmoid(gate, _name="sigmoid"), _commute=True, _name="silu")
        return op.Mul(silu, up, _commute=True)

Parameters after `op` are variables: each binds one graph value, the same one wherever it appears
(`op.weight(w)` where it must be a constant initializer).
`op.<OpType>(*inputs, ...)` is a node pattern; its keyword options:
  _domain        the node's domain ("" also matches "ai.onnx")
  _outputs       how many outputs it has, at least (returns a tuple of them when > 1); a node
                 with fewer does not match
  _name          bind the matched node under this name (`m.sigmoid`)
  _commute       a two-input node may match with its inputs swapped
  _other_inputs  the node may have more (trailing) inputs than the pattern lists
  _keep          the node is context: the rewrite does not replace it, and it stays while used
What `pattern` returns are the values the rewrite replaces. The first one's producer is the root:
matching starts there and walks inputs upward, so every pattern node is an ancestor of the root.
Every matched node but the `_keep` ones goes once the rewrite is applied, so their outputs may
only be read inside the match or be pattern outputs (`Pattern.unreplaceable` says which are not).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import onnx_ir as ir

from llmc.passes.graph import ONNX_DOMAINS


@dataclass(frozen=True, eq=False)
class Var:
    name: str
    weight: bool = False  # binds only a constant initializer


@dataclass(eq=False)
class NodePattern:
    op_type: str
    domain: str
    inputs: list
    num_outputs: int = 1
    name: str | None = None
    commute: bool = False
    other_inputs: bool = False
    keep: bool = False

    def accepts(self, node: ir.Node) -> bool:
        domains = ONNX_DOMAINS if self.domain in ONNX_DOMAINS else (self.domain,)
        return node.op_type == self.op_type and node.domain in domains


@dataclass(frozen=True, eq=False)
class Output:
    node: NodePattern
    index: int


class _Builder:
    """The `op` a pattern function receives: `op.MatMul(x, w)` makes a node pattern, and
    `op.weight(w)` says that variable `w` binds only a constant initializer."""

    @staticmethod
    def weight(var: Var) -> Var:
        return Var(var.name, weight=True)

    def __getattr__(self, op_type: str) -> Callable:
        if not op_type[:1].isupper():
            raise AttributeError(op_type)

        def make(*inputs, _domain: str = "", _outputs: int = 1, _name: str | None = None, _commute: bool = False,
                 _other_inputs: bool = False, _keep: bool = False):
            if _commute and len(inputs) != 2:
                raise ValueError(f"{op_type}: only a two-input node can commute")
            node = NodePattern(op_type, _domain, list(inputs), _outputs, _name, _commute, _other_inputs, _keep)
            outputs = tuple(Output(node, i) for i in range(_outputs))
            return outputs if _outputs > 1 else outputs[0]

        return make


@dataclass
class _Bindings:
    values: dict[str, ir.Value | None] = field(default_factory=dict)
    nodes: dict[NodePattern, ir.Node] = field(default_factory=dict)

    def bind_value(self, name: str, value: ir.Value | None) -> "_Bindings":
        return _Bindings({**self.values, name: value}, self.nodes)

    def bind_node(self, pattern: NodePattern, node: ir.Node) -> "_Bindings":
        return _Bindings(self.values, {**self.nodes, pattern: node})


class Match:
    """A matched pattern: `m.<variable>` is a bound value, `m.<_name>` a bound node; `nodes` are
    all matched nodes, `removed` those the rewrite takes away, `outputs` the values it replaces."""

    def __init__(self, root: ir.Node, nodes: list[ir.Node], removed: list[ir.Node], outputs: list[ir.Value],
                 named: dict):
        self.root, self.nodes, self.removed, self.outputs = root, nodes, removed, outputs
        self._named = named

    def __getattr__(self, name: str):
        try:
            return self.__dict__["_named"][name]
        except KeyError:
            raise AttributeError(name) from None


class Pattern:
    def __init__(self, fn: Callable):
        names = list(inspect.signature(fn).parameters)[1:]  # after `op`
        result = fn(_Builder(), *map(Var, names))
        self.outputs: tuple[Output, ...] = result if isinstance(result, tuple) else (result,)
        self.root = self.outputs[0].node
        self.nodes: list[NodePattern] = []
        self._collect(self.root)
        stray = [o for o in self.outputs if o.node not in self.nodes]
        if stray:
            raise ValueError(f"pattern output of {stray[0].node.op_type} is not an ancestor of the root")

    def _collect(self, node: NodePattern) -> None:
        if node in self.nodes:
            return
        self.nodes.append(node)
        for value in node.inputs:
            if isinstance(value, Output):
                self._collect(value.node)

    def match(self, node: ir.Node) -> Match | None:
        if not self.root.accepts(node):
            return None
        for b in self._node(self.root, node, _Bindings()):
            return Match(root=b.nodes[self.root], nodes=[b.nodes[p] for p in self.nodes],
                         removed=[b.nodes[p] for p in self.nodes if not p.keep],
                         outputs=[b.nodes[o.node].outputs[o.index] for o in self.outputs],
                         named={**b.values, **{p.name: n for p, n in b.nodes.items() if p.name}})
        return None

    @staticmethod
    def unreplaceable(m: Match) -> str | None:
        """Why the match cannot be replaced: a node that goes has an output read outside the match."""
        removed, replaced = set(m.removed), set(m.outputs)
        for node in m.removed:
            for value in node.outputs:
                if value in replaced:
                    continue
                if value.is_graph_output() or any(user not in removed for user, _ in value.uses()):
                    return f"{node.op_type} {node.name}'s output {value.name} has other consumers"
        return None

    # -- matching: depth-first, backtracking over commuted inputs ------------------------------

    def _node(self, p: NodePattern, node: ir.Node, b: _Bindings) -> Iterator[_Bindings]:
        if p in b.nodes:
            if b.nodes[p] is node:
                yield b
            return
        if not p.accepts(node) or len(node.outputs) < p.num_outputs \
                or any(bound is node for bound in b.nodes.values()):
            return
        inputs = list(node.inputs)
        while inputs and inputs[-1] is None:  # absent trailing optional inputs
            inputs.pop()
        if len(inputs) < len(p.inputs) or (len(inputs) > len(p.inputs) and not p.other_inputs):
            return
        b = b.bind_node(p, node)
        orders = [p.inputs, p.inputs[::-1]] if p.commute else [p.inputs]
        for order in orders:
            yield from self._inputs(order, inputs, 0, b)

    def _inputs(self, patterns: list, values: list, i: int, b: _Bindings) -> Iterator[_Bindings]:
        if i == len(patterns):
            yield b
            return
        for bound in self._value(patterns[i], values[i], b):
            yield from self._inputs(patterns, values, i + 1, bound)

    def _value(self, p: Var | Output, value: ir.Value | None, b: _Bindings) -> Iterator[_Bindings]:
        if isinstance(p, Var):
            if p.weight and (value is None or value.const_value is None or not value.is_initializer()):
                return
            if p.name not in b.values:
                yield b.bind_value(p.name, value)
            elif b.values[p.name] is value:
                yield b
            return
        node = value.producer() if value is not None else None
        if node is not None and value.index() == p.index:
            yield from self._node(p.node, node, b)
