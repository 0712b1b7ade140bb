"""A small node builder over onnx_ir, shared by passes and op definitions.

`ops = OpBuilder(graph_or_function); y = ops.Add(a, b)` appends `Add` to the tape; keyword
arguments become attributes. An op's ONNX function is built with one (plugins), and so is a
rewrite's replacement (passes.rewrite.Replacement), which the pass framework then inserts.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir


class OpBuilder:
    def __init__(self, graph_like: ir.Graph | ir.Function | None = None, *, name_prefix: str = ""):
        self._tape = ir.tape.Tape(graph_like)
        self._prefix = name_prefix

    @property
    def nodes(self) -> tuple[ir.Node, ...]:
        return tuple(self._tape.nodes)

    def op(self, op_type: str, *inputs: ir.Value | None, domain: str = "", num_outputs: int = 1,
           **attributes: Any):
        # A function body refers to its own attributes by name; the node attribute's name is the key.
        attributes = {
            key: ir.RefAttr(key, val.ref_attr_name, val.type) if getattr(val, "is_ref", lambda: False)() else val
            for key, val in attributes.items()
        }
        node_name = f"{self._prefix}{op_type}_{len(self._tape.nodes)}" if self._prefix else None
        if num_outputs == 1:
            return self._tape.op(op_type, inputs, attributes or None, domain=domain, name=node_name)
        return self._tape.op_multi_out(op_type, inputs, attributes or None, domain=domain,
                                       num_outputs=num_outputs, name=node_name)

    def const(self, values, dtype=np.int64) -> ir.Value:
        return self.op("Constant", value=ir.tensor(np.asarray(values, dtype=dtype)))

    def __getattr__(self, op_type: str):
        if not op_type[:1].isupper():
            raise AttributeError(op_type)
        return lambda *inputs, **attributes: self.op(op_type, *inputs, **attributes)
