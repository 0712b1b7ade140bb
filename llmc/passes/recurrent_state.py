"""recurrent-state: each recurrent op of a hybrid reads and writes its state in a pool of slots.

Before: `llmc.cpu::CausalConv1d(x, weight[, bias])` and `llmc.cpu::GatedDeltaRule(q, k, v, g,
beta)` as exported (compiler/recurrent.py) run each call from a zero state over the whole row.
After: each takes its pool state.{i} [num_slots, ...] and the step's past_lens, query_lens and
state_slots, starts a row from its slot (from zero where the row's past is 0), computes its
valid tokens only, and returns the pool, written in place, as state_out.{i} (the contract's
state I/O: llmc.contract.graph_io). What each pool holds is recorded in the model's metadata
(`METADATA_KEY`) for the manifest's `states`.
"""

from __future__ import annotations

import json

import onnx_ir as ir

from llmc.contract import graph_io as io
from llmc.contract.model_spec import ModelSpec
from llmc.passes.paged_kv_cache import contract_input_order
from llmc.passes.rewrite import Rule, RulePass
from llmc.plugins import cpu
from llmc.plugins.cpu import recurrent as ops

METADATA_KEY = "llmc.recurrent_state"  # JSON: [{"layer", "kind", "shape"}] per state pool


class StatefulOp(Rule):
    def __init__(self, spec: ModelSpec, op_type: str):
        self.spec, self.op_type = spec, op_type
        self.name = {ops.CONV_OP: "conv_state", ops.DELTA_OP: "delta_state"}[op_type]

    def pattern(self, op, x):
        return getattr(op, self.op_type)(x, _other_inputs=True, _domain=cpu.DOMAIN, _name="node")

    def check(self, m):
        if len(m.node.inputs) > (3 if self.op_type == ops.CONV_OP else 5):
            return "the op already has its state"
        if self.state_shape(m.node) is None:
            return "the state's size is not known from the op's inputs and attributes"
        return None

    def state_shape(self, node: ir.Node) -> tuple[int, ...] | None:
        if self.op_type == ops.DELTA_OP:
            sizes = [node.attributes.get_int(name, 0) for name in ("num_v_heads", "k_head_dim", "v_head_dim")]
            return tuple(sizes) if min(sizes) > 0 else None
        weight = node.inputs[1]
        shape = weight.shape
        if (shape is None or not all(isinstance(d, int) for d in shape)) and weight.producer() is not None:
            shape = weight.producer().inputs[0].shape  # a Reshape of the [C, 1, K] Conv1d weight
        if shape is None or not all(isinstance(d, int) for d in shape):
            return None
        return shape[-1] - 1, shape[0]

    def rewrite(self, op, m):
        node = m.node
        index = sum(io.is_state(v.name) for v in op.graph.inputs)  # pools added so far
        shape = self.state_shape(node)
        pool = op.graph_input(io.state_input(index), ir.DataType.FLOAT, [io.NUM_SLOTS, *shape])
        width = 3 if self.op_type == ops.CONV_OP else 5
        inputs = [*node.inputs, *[None] * (width - len(node.inputs))]
        out, pool_out = op.like(node, *inputs, pool, *map(op.step_input, (io.PAST_LENS, io.QUERY_LENS, io.STATE_SLOTS)),
                                num_outputs=2)
        pool_out.type, pool_out.shape = pool.type, pool.shape
        op.graph_output(pool_out, io.state_output(index))
        return out


class RecurrentState(RulePass):
    name = "recurrent-state"
    description = "give each recurrent op (convolution, delta rule) its state pool and the step's state I/O"
    required = True

    def rules(self, spec: ModelSpec):
        return [StatefulOp(spec, ops.CONV_OP), StatefulOp(spec, ops.DELTA_OP)]

    def finish(self, model: ir.Model, spec: ModelSpec, counts) -> None:
        # Each recurrent layer has one convolution, and a DeltaNet layer a delta rule after it: in
        # graph order, the n-th convolution is the n-th recurrent layer's.
        states, convs = {}, 0
        for node in model.graph:
            pool = node.inputs[-4] if node.domain == cpu.DOMAIN and node.op_type in (ops.CONV_OP, ops.DELTA_OP) \
                and len(node.inputs) > 4 else None
            if pool is None or not io.is_state(pool.name):
                continue
            conv = node.op_type == ops.CONV_OP
            convs += conv
            states[pool.name] = {"layer": spec.recurrent_layers[max(convs - 1, 0)], "kind": "conv" if conv else "delta",
                                 "shape": list(pool.shape[1:])}
        ordered = [states[io.state_input(i)] for i in range(len(states))]
        model.metadata_props[METADATA_KEY] = json.dumps(ordered)
        contract_input_order(model)


def states_of(model: ir.Model) -> list[dict]:
    """What each state pool of a rewritten model holds ([] for a transformer)."""
    return json.loads(model.metadata_props.get(METADATA_KEY, "[]"))
