"""The pattern engine itself (llmc.passes.pattern, llmc.passes.rewrite) on small hand-built graphs:
what a match binds, what each node-pattern option allows, what a rule's check and the
replaceability rule refuse (and how the refusal is reported), what a rewrite does to the graph,
and how a RulePass sweeps (first rule wins, all-or-none, fixed point)."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest

from llmc.ir_builder import OpBuilder
from llmc.passes.graph import weight
from llmc.passes.manager import PassResult
from llmc.passes.pattern import Pattern
from llmc.passes.rewrite import Replacement, Rule, RulePass, apply

FLOAT = ir.DataType.FLOAT
SHAPE = (2, 4)


# -- building graphs -------------------------------------------------------------------------

def build(body, initializers: dict | None = None) -> ir.Model:
    """A model reading float [2, 4] graph inputs x and y and the float `initializers` ({name:
    values}); `body(op, x, y, *initializers)` builds its nodes and returns its outputs, which are
    named out0, out1, ... (typed [2, 4] float where the builder left them untyped)."""
    graph = ir.Graph([_float("x"), _float("y")], [], nodes=[], opset_imports={"": 23}, name="test")
    consts = []
    for name, values in (initializers or {}).items():
        array = np.broadcast_to(np.asarray(values, np.float32), SHAPE).copy()
        value = ir.Value(name=name, type=ir.TensorType(FLOAT), shape=ir.Shape(SHAPE), const_value=ir.tensor(array))
        graph.register_initializer(value)
        consts.append(value)
    outputs = body(OpBuilder(graph, name_prefix="n"), *graph.inputs, *consts)
    for i, value in enumerate(outputs if isinstance(outputs, tuple) else (outputs,)):
        value.name = f"out{i}"
        value.type = value.type or ir.TensorType(FLOAT)
        value.shape = value.shape or ir.Shape(SHAPE)
        graph.outputs.append(value)
    return ir.Model(graph, ir_version=10)


def _float(name: str) -> ir.Value:
    return ir.Value(name=name, type=ir.TensorType(FLOAT), shape=ir.Shape(SHAPE))


def root(model: ir.Model, output: int = 0) -> ir.Node:
    """The node producing graph output `output`."""
    return model.graph.outputs[output].producer()


def nodes(model: ir.Model, op_type: str) -> list[ir.Node]:
    return [n for n in model.graph if n.op_type == op_type]


def op_types(model: ir.Model) -> list[str]:
    return [n.op_type for n in model.graph]


def inputs(model: ir.Model) -> tuple[ir.Value, ir.Value]:
    return model.graph.inputs[0], model.graph.inputs[1]


def ort_run(model: ir.Model) -> list[np.ndarray]:
    """The model's outputs in ONNX Runtime (CPU) on fixed random x and y."""
    rng = np.random.default_rng(0)
    feeds = {name: rng.standard_normal(SHAPE).astype(np.float32) for name in ("x", "y")}
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


# -- rules and passes from functions -----------------------------------------------------------

class FnRule(Rule):
    """A rule whose pattern, rewrite and (optional) check are the functions given."""

    def __init__(self, name, pattern, rewrite=None, check=None, all_or_none=False):
        self.name, self.pattern, self.all_or_none = name, pattern, all_or_none
        self.rewrite = rewrite or (lambda op, m: pytest.fail(f"{name} should not rewrite"))
        if check is not None:
            self.check = check


class Rules(RulePass):
    name = "test-rules"

    def __init__(self, *rules: Rule, fixed_point: bool = False, max_sweeps: int = 8):
        self._rules, self.fixed_point, self.max_sweeps = rules, fixed_point, max_sweeps

    def rules(self, spec):
        return list(self._rules)


def run(model: ir.Model, *rules: Rule, **options) -> PassResult:
    return Rules(*rules, **options).run(model, None)


def silu(op, a):
    return op.Mul(a, op.Sigmoid(a), _commute=True)


# -- matching ----------------------------------------------------------------------------------

def test_match_binds_variables_named_nodes_and_outputs():
    model = build(lambda op, x, y: op.Mul(op.Sigmoid(x), y))
    x, y = inputs(model)
    sigmoid, mul = model.graph
    m = Pattern(lambda op, a, b: op.Mul(op.Sigmoid(a, _name="sig"), b, _name="mul")).match(mul)
    assert m is not None
    assert m.a is x and m.b is y
    assert m.sig is sigmoid and m.mul is mul and m.root is mul
    assert m.nodes == [mul, sigmoid] and m.removed == [mul, sigmoid]
    assert m.outputs == [mul.outputs[0]]
    with pytest.raises(AttributeError):
        m.c


def test_a_variable_used_twice_binds_one_value():
    pattern = Pattern(lambda op, a: op.Mul(a, op.Sigmoid(a)))
    same = build(lambda op, x, y: op.Mul(x, op.Sigmoid(x)))
    different = build(lambda op, x, y: op.Mul(y, op.Sigmoid(x)))
    assert pattern.match(root(same)).a is inputs(same)[0]
    assert pattern.match(root(different)) is None


def test_matching_starts_at_the_root_and_needs_every_op_type():
    pattern = Pattern(lambda op, a, b: op.Mul(op.Sigmoid(a), b))
    model = build(lambda op, x, y: (op.Mul(op.Sigmoid(x), y), op.Mul(op.Tanh(x), y), op.Add(op.Sigmoid(x), y)))
    assert pattern.match(root(model, 0)) is not None
    assert pattern.match(nodes(model, "Sigmoid")[0]) is None  # an inner node is no root
    assert pattern.match(root(model, 1)) is None  # Tanh is no Sigmoid
    assert pattern.match(root(model, 2)) is None  # Add is no Mul


@pytest.mark.parametrize("sigmoid_first", [False, True])
def test_commute_matches_either_input_order(sigmoid_first):
    model = build(lambda op, x, y: op.Mul(op.Sigmoid(x), x) if sigmoid_first else op.Mul(x, op.Sigmoid(x)))
    m = Pattern(silu).match(root(model))
    assert m is not None and m.a is inputs(model)[0]


def test_without_commute_the_swapped_order_does_not_match():
    pattern = Pattern(lambda op, a: op.Mul(a, op.Sigmoid(a)))
    assert pattern.match(root(build(lambda op, x, y: op.Mul(x, op.Sigmoid(x))))) is not None
    assert pattern.match(root(build(lambda op, x, y: op.Mul(op.Sigmoid(x), x)))) is None


def test_domain_must_match_and_the_default_domain_is_also_ai_onnx():
    model = build(lambda op, x, y: (op.Gelu(x), op.Gelu(x, domain="ai.onnx"), op.Gelu(x, domain="com.microsoft")))
    onnx_gelu, ai_onnx_gelu, ms_gelu = (root(model, i) for i in range(3))
    default = Pattern(lambda op, a: op.Gelu(a))
    microsoft = Pattern(lambda op, a: op.Gelu(a, _domain="com.microsoft"))
    assert default.match(onnx_gelu) and default.match(ai_onnx_gelu) and not default.match(ms_gelu)
    assert microsoft.match(ms_gelu) and not microsoft.match(onnx_gelu)


def _split_sub(op, a):
    first, second = op.Split(a, _outputs=2, _name="split")
    return op.Sub(first, second)


def test_a_multi_output_node_pattern_matches_each_output_by_index():
    model = build(lambda op, x, y: (op.Sub(*op.Split(x, axis=-1, num_outputs=2)),
                                    op.Sub(*reversed(op.Split(x, axis=-1, num_outputs=2)))))
    pattern = Pattern(_split_sub)
    m = pattern.match(root(model, 0))
    assert m is not None and m.split is nodes(model, "Split")[0]
    assert pattern.match(root(model, 1)) is None  # Sub(second, first)


def test_a_multi_output_root_replaces_all_its_outputs():
    model = build(lambda op, x, y: op.Split(x, axis=-1, num_outputs=2))
    m = Pattern(lambda op, a: op.Split(a, _outputs=2)).match(root(model))
    assert m.outputs == list(root(model).outputs)


def test_a_node_with_fewer_outputs_than_declared_does_not_match():
    # Used to raise IndexError while building the match (m.outputs read an output the node lacks).
    model = build(lambda op, x, y: op.Split(x, axis=-1, num_outputs=1))
    assert Pattern(lambda op, a: op.Split(a, _outputs=2)).match(root(model)) is None


def test_extra_inputs_match_only_with_other_inputs():
    model = build(lambda op, x, y, lo, hi: (op.Clip(x, lo, hi), op.Clip(x, None, None)),
                  initializers={"lo": 0.0, "hi": 6.0})
    bounded, unbounded = root(model, 0), root(model, 1)
    plain = Pattern(lambda op, a: op.Clip(a))
    other = Pattern(lambda op, a: op.Clip(a, _other_inputs=True))
    assert plain.match(bounded) is None
    assert other.match(bounded).a is inputs(model)[0]
    assert plain.match(unbounded) is not None  # absent trailing optional inputs are no inputs
    assert Pattern(lambda op, a, lo, hi: op.Clip(a, lo, hi)).match(unbounded) is None  # too few


def test_weight_binds_only_a_constant_initializer():
    model = build(lambda op, x, y, w: (op.Mul(x, w), op.Mul(x, y),
                                       op.Mul(x, op.Constant(value=ir.tensor(np.ones(SHAPE, np.float32))))),
                  initializers={"w": 1.0})
    by_initializer, by_input, by_constant_node = (root(model, i) for i in range(3))
    weighted = Pattern(lambda op, a, w: op.Mul(a, op.weight(w)))
    assert weighted.match(by_initializer).w is model.graph.initializers["w"]
    assert weighted.match(by_input) is None
    assert weighted.match(by_constant_node) is None
    assert Pattern(lambda op, a, w: op.Mul(a, w)).match(by_input) is not None


def test_pattern_declarations_that_cannot_work_are_refused():
    with pytest.raises(ValueError, match="two-input"):
        Pattern(lambda op, a, b, c: op.Sum(a, b, c, _commute=True))
    with pytest.raises(ValueError, match="not an ancestor of the root"):
        Pattern(lambda op, a: (op.Relu(a), op.Neg(a)))


# -- what a RulePass refuses, and how it says so ----------------------------------------------------

def test_a_check_reason_is_recorded_as_a_miss_and_changes_nothing():
    model = build(lambda op, x, y: op.Relu(x))
    relu = root(model)
    rule = FnRule("relu_rule", lambda op, a: op.Relu(a), check=lambda m: "not today")
    result = run(model, rule)
    assert result == PassResult(False, {}, [f"relu_rule at {relu.name}: not today"])
    assert list(model.graph) == [relu] and root(model) is relu


@pytest.mark.parametrize("first_refuses", [False, True])
def test_the_first_rule_that_fires_wins(first_refuses):
    model = build(lambda op, x, y: op.Relu(x))
    first = FnRule("first", lambda op, a: op.Relu(a), lambda op, m: op.Sigmoid(m.a),
                   check=lambda m: "refused" if first_refuses else None)
    second = FnRule("second", lambda op, a: op.Relu(a), lambda op, m: op.Tanh(m.a))
    result = run(model, first, second)
    assert result.counts == ({"second": 1} if first_refuses else {"first": 1})
    assert op_types(model) == (["Tanh"] if first_refuses else ["Sigmoid"])
    assert len(result.misses) == int(first_refuses)


@pytest.mark.parametrize("reader", ["another node", "the graph"])
def test_a_matched_output_read_outside_the_match_prevents_the_rewrite(reader):
    def body(op, x, y):
        s = op.Sigmoid(x)
        return op.Mul(s, y), (op.Neg(s) if reader == "another node" else s)
    model = build(body)
    before = list(model.graph)
    rule = FnRule("sig_mul", lambda op, a, b: op.Mul(op.Sigmoid(a), b), lambda op, m: op.Add(m.a, m.b))
    why = Pattern.unreplaceable(rule.match(root(model)))
    assert why is not None and "Sigmoid" in why and "other consumers" in why
    result = run(model, rule)
    assert not result.changed and result.misses == [f"sig_mul at {root(model).name}: {why}"]
    assert list(model.graph) == before


def _relus(op, x, y):
    return op.Relu(x), op.Relu(y)


def _refuse_y(m):
    return "it reads y" if m.a.name == "y" else None


@pytest.mark.parametrize("all_or_none", [False, True])
def test_all_or_none_one_refused_match_keeps_every_match(all_or_none):
    model = build(_relus)
    refused = root(model, 1)
    rule = FnRule("relu_to_tanh", lambda op, a: op.Relu(a), lambda op, m: op.Tanh(m.a), check=_refuse_y,
                  all_or_none=all_or_none)
    result = run(model, rule)
    if all_or_none:
        assert result == PassResult(False, {}, [f"relu_to_tanh at {refused.name}: it reads y; "
                                                "every one or none is rewritten"])
        assert op_types(model) == ["Relu", "Relu"]
    else:
        assert result == PassResult(True, {"relu_to_tanh": 1}, [f"relu_to_tanh at {refused.name}: it reads y"])
        assert sorted(op_types(model)) == ["Relu", "Tanh"]


def test_all_or_none_rewrites_every_match_when_none_is_refused():
    model = build(_relus)
    rule = FnRule("relu_to_tanh", lambda op, a: op.Relu(a), lambda op, m: op.Tanh(m.a), all_or_none=True)
    assert run(model, rule) == PassResult(True, {"relu_to_tanh": 2}, [])
    assert op_types(model) == ["Tanh", "Tanh"]


# -- what a rewrite does to the graph ----------------------------------------------------------

def test_a_rewrite_replaces_the_root_outputs_and_removes_the_matched_nodes():
    def body(op, x, y):
        product = op.Mul(op.Sigmoid(x), y)
        return product, op.Neg(product)
    model = build(body)
    x, y = inputs(model)
    rule = FnRule("sig_mul", lambda op, a, b: op.Mul(op.Sigmoid(a), b), lambda op, m: op.Add(m.a, m.b))
    assert run(model, rule) == PassResult(True, {"sig_mul": 1}, [])
    add = root(model, 0)
    assert op_types(model) == ["Add", "Neg"]
    assert add.op_type == "Add" and list(add.inputs) == [x, y]
    assert model.graph.outputs[0].name == "out0"  # the graph output slot keeps its name
    assert root(model, 1).inputs[0] is add.outputs[0]  # consumers moved to the new value


def test_a_rewrite_adds_the_initializers_inputs_outputs_and_counts_it_asked_for():
    def rewrite(op, m):
        scaled = op.Mul(m.a, op.initializer(np.full(SHAPE, 2, np.float32), "two"))
        shifted = op.Add(scaled, op.graph_input("shift", FLOAT, SHAPE))
        assert op.graph_input("y") is m.b  # an input the graph has is returned, not added
        op.graph_output(op.Neg(shifted), "negated")
        op.count("scaled")
        op.count("extras", 2)
        return shifted

    model = build(lambda op, x, y: op.Relu(op.Add(x, y)))
    rule = FnRule("add_rule", lambda op, a, b: op.Add(a, b), rewrite)
    assert run(model, rule) == PassResult(True, {"add_rule": 1, "scaled": 1, "extras": 2}, [])
    graph = model.graph
    assert "two" in graph.initializers
    assert [v.name for v in graph.inputs] == ["x", "y", "shift"]
    assert [v.name for v in graph.outputs] == ["out0", "negated"]
    assert op_types(model) == ["Mul", "Add", "Neg", "Relu"]


def rewrite_once(model: ir.Model, rule: Rule, node: ir.Node) -> None:
    """`rule`'s rewrite at `node` applied alone, without the dead-code removal a RulePass ends with."""
    m = rule.match(node)
    assert m is not None and rule.why_not(m) is None
    op = Replacement(model.graph, prefix=f"{node.name}.{rule.name}.")
    apply(model, m, op, (rule.rewrite(op, m),))


def test_a_rewrite_removes_at_once_the_weights_only_the_removed_nodes_read():
    model = build(lambda op, x, y, only, shared: (op.Mul(x, only), op.Mul(y, shared), op.Add(y, shared)),
                  initializers={"only": 3.0, "shared": 5.0})
    rule = FnRule("mul_to_neg", lambda op, a, w: op.Mul(a, op.weight(w)), lambda op, m: op.Neg(m.a))
    rewrite_once(model, rule, root(model, 0))
    assert list(model.graph.initializers) == ["shared"]
    rewrite_once(model, rule, root(model, 1))
    assert list(model.graph.initializers) == ["shared"]  # Add still reads it
    assert op_types(model) == ["Neg", "Neg", "Add"]


def split_relu_mul(keep: bool):
    """The pattern Mul(Relu(first), second) of a Split's two halves, the Split kept or not."""
    def pattern(op, a):
        first, second = op.Split(a, _outputs=2, _keep=keep, _name="split")
        return op.Mul(op.Relu(first), second)
    return pattern


def split_relu_mul_graph(op, x, y, neg_reads_first: bool = False):
    first, second = op.Split(x, axis=0, num_outputs=2)
    product = op.Mul(op.Relu(first), second)
    return (product, op.Neg(first)) if neg_reads_first else product


def test_a_kept_node_is_not_removed_while_something_reads_it():
    model = build(lambda op, x, y: split_relu_mul_graph(op, x, y, neg_reads_first=True))
    split = nodes(model, "Split")[0]
    rule = FnRule("split_rule", split_relu_mul(keep=True), lambda op, m: op.Tanh(m.a))
    m = rule.match(root(model))
    assert split in m.nodes and split not in m.removed
    assert run(model, rule).counts == {"split_rule": 1}
    assert op_types(model) == ["Split", "Tanh", "Neg"]
    assert root(model, 1).inputs[0] is split.outputs[0]

    # the same pattern without _keep may not take a Split whose output Neg reads
    unkept = build(lambda op, x, y: split_relu_mul_graph(op, x, y, neg_reads_first=True))
    result = run(unkept, FnRule("split_rule", split_relu_mul(keep=False)))
    assert not result.changed and "other consumers" in result.misses[0]


def test_a_kept_node_goes_once_nothing_reads_it():
    model = build(split_relu_mul_graph)
    rewrite_once(model, FnRule("split_rule", split_relu_mul(keep=True), lambda op, m: op.Tanh(m.a)), root(model))
    assert op_types(model) == ["Tanh"]


# -- sweeps ------------------------------------------------------------------------------------

ABS_TO_NEG = FnRule("abs_to_neg", lambda op, a: op.Abs(a), lambda op, m: op.Neg(m.a))
DOUBLE_NEG = FnRule("double_neg", lambda op, a: op.Neg(op.Neg(a)), lambda op, m: m.a)


@pytest.mark.parametrize("fixed_point", [False, True])
def test_fixed_point_sweeps_until_a_sweep_changes_nothing(fixed_point):
    # abs_to_neg makes a Neg(Neg(x)) whose root is new, so only a second sweep sees it
    model = build(lambda op, x, y: op.Relu(op.Abs(op.Neg(x))))
    result = run(model, ABS_TO_NEG, DOUBLE_NEG, fixed_point=fixed_point)
    if fixed_point:
        assert result.counts == {"abs_to_neg": 1, "double_neg": 1}
        assert op_types(model) == ["Relu"] and root(model).inputs[0] is inputs(model)[0]
    else:
        assert result.counts == {"abs_to_neg": 1}
        assert op_types(model) == ["Neg", "Neg", "Relu"]


def test_fixed_point_stops_after_max_sweeps():
    model = build(lambda op, x, y: op.Relu(x))
    again = FnRule("again", lambda op, a: op.Relu(a), lambda op, m: op.Relu(m.a))  # always fires
    assert run(model, again, fixed_point=True, max_sweeps=3).counts == {"again": 3}


# -- rewritten graphs still compute the same -----------------------------------------------------

def _times_one(m):
    return None if np.all(weight(m.w) == 1) else "the weight is not all ones"


def test_multiplications_by_one_removed_compute_the_same_in_onnx_runtime():
    model = build(lambda op, x, y, one, two: (op.Add(op.Mul(x, one), op.Mul(one, y)), op.Relu(op.Mul(x, two))),
                  initializers={"one": 1.0, "two": 2.0})
    expected = ort_run(model)
    rule = FnRule("mul_by_one", lambda op, a, w: op.Mul(a, op.weight(w), _commute=True), lambda op, m: m.a,
                  check=_times_one)
    result = run(model, rule)
    assert result.counts == {"mul_by_one": 2}
    assert result.misses == [f"mul_by_one at {nodes(model, 'Mul')[0].name}: the weight is not all ones"]
    assert op_types(model) == ["Add", "Mul", "Relu"] and list(model.graph.initializers) == ["two"]
    for got, want in zip(ort_run(model), expected, strict=True):
        np.testing.assert_array_equal(got, want)


def test_commuted_silu_to_quick_gelu_computes_the_same_in_onnx_runtime():
    model = build(lambda op, x, y: (op.Mul(x, op.Sigmoid(x)), op.Mul(op.Sigmoid(y), y)))
    expected = ort_run(model)
    rule = FnRule("silu", silu, lambda op, m: op.QuickGelu(m.a, domain="com.microsoft", alpha=1.0))
    assert run(model, rule).counts == {"silu": 2}
    assert op_types(model) == ["QuickGelu", "QuickGelu"]
    assert model.opset_imports["com.microsoft"] == 1  # added for the new node's domain
    assert [v.name for v in model.graph.outputs] == ["out0", "out1"]
    for got, want in zip(ort_run(model), expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
