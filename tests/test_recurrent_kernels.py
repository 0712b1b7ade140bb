"""llmc.cpu's recurrent layers, CausalConv1d and GatedDeltaRule, in real ONNX Runtime sessions:
against their numpy references (llmc/plugins/cpu/recurrent.py), the references against
transformers' torch functions, the state pool across chunked prefill and bound in place, and the
errors bad inputs give."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from conftest import needs_kernels
from llmc.plugins import cpu
from llmc.plugins.cpu import recurrent as rec

F32, I32 = TensorProto.FLOAT, TensorProto.INT32
INT_INPUTS = {"past", "qlen", "slots"}
CONV_IN = ["x", "weight", "bias", "state", "past", "qlen", "slots"]
DELTA_IN = ["q", "k", "v", "g", "beta", "state", "past", "qlen", "slots"]


def _session(op_type: str, inputs: list[str], outputs: list[str], **attrs) -> ort.InferenceSession:
    """One llmc.cpu node in a session; inputs named in INT_INPUTS are int32, the rest float32."""
    node = helper.make_node(op_type, inputs, outputs, domain=cpu.DOMAIN, **attrs)
    graph = helper.make_graph([node], "kernel", [helper.make_tensor_value_info(n, I32 if n in INT_INPUTS else F32, None)
                                                 for n in inputs if n],
                              [helper.make_tensor_value_info(n, F32, None) for n in outputs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                    helper.make_opsetid(cpu.DOMAIN, cpu.VERSION)])
    model.ir_version = 10
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    cpu.register(opts)
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def _conv_session(state: bool, activation: int, bias: bool = True) -> ort.InferenceSession:
    inputs = CONV_IN if state else CONV_IN[:3]
    if not bias:
        inputs = [n if n != "bias" else "" for n in inputs]
    return _session(rec.CONV_OP, inputs, ["y", "state_out"] if state else ["y"], activation=activation)


def _delta_session(state: bool, hk: int, hv: int, dk: int, dv: int) -> ort.InferenceSession:
    return _session(rec.DELTA_OP, DELTA_IN if state else DELTA_IN[:5], ["out", "state_out"] if state else ["out"],
                    num_k_heads=hk, num_v_heads=hv, k_head_dim=dk, v_head_dim=dv)


def _i32(values) -> np.ndarray:
    return np.asarray(values, np.int32)


def _conv_data(rng, batch, seq, channels, width, slots=5):
    return dict(x=rng.standard_normal((batch, seq, channels), np.float32),
                weight=rng.standard_normal((channels, width), np.float32) * np.float32(0.5),
                bias=rng.standard_normal(channels).astype(np.float32),
                state=rng.standard_normal((slots, width - 1, channels), np.float32))


def _delta_data(rng, batch, seq, hk, hv, dk, dv, slots=5):
    return dict(q=rng.standard_normal((batch, seq, hk, dk), np.float32),
                k=rng.standard_normal((batch, seq, hk, dk), np.float32),
                v=rng.standard_normal((batch, seq, hv, dv), np.float32),
                g=-rng.uniform(0.01, 1.0, (batch, seq, hv)).astype(np.float32),
                beta=rng.uniform(0.0, 1.0, (batch, seq, hv)).astype(np.float32),
                state=rng.standard_normal((slots, hv, dk, dv), np.float32) * np.float32(0.1))


def _rows(seq):
    """Three rows: a new sequence with every token, a continued one with padding, and one with
    no token this step (its slot must keep its state); slots 3, 0, 4 of 5, so 1 and 2 stay as
    they are."""
    return dict(past=_i32([0, 9, 4]), qlen=_i32([seq, max(seq - 3, 1), 0]), slots=_i32([3, 0, 4]))


# -- against the numpy references -------------------------------------------------------------------

@needs_kernels
@pytest.mark.parametrize("seq", [1, 37, 130])
@pytest.mark.parametrize("width,activation", [(3, rec.ACT_NONE), (4, rec.ACT_SILU), (4, rec.ACT_NONE),
                                              (3, rec.ACT_SILU)])
@pytest.mark.parametrize("with_state", [False, True], ids=["no-state", "pool"])
def test_conv_matches_reference(seq, width, activation, with_state):
    rng = np.random.default_rng(seq * 10 + width)
    d = _conv_data(rng, 3, seq, 200, width)  # 200 channels: a full block of 128 and a partial one
    if not with_state:
        (y,) = _conv_session(False, activation).run(None, {n: d[n] for n in CONV_IN[:3]})
        want, _ = rec.causal_conv1d_reference(d["x"], d["weight"], d["bias"], activation)
        np.testing.assert_allclose(y, want, atol=1e-5, rtol=1e-5)
        return
    rows = _rows(seq)
    y, state = _conv_session(True, activation).run(None, {**d, **rows})
    want, want_state = rec.causal_conv1d_reference(d["x"], d["weight"], d["bias"], activation, d["state"],
                                                   rows["past"], rows["qlen"], rows["slots"])
    np.testing.assert_allclose(y, want, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(state, want_state, atol=1e-6)
    np.testing.assert_array_equal(state[[1, 2]], d["state"][[1, 2]])  # slots no row names
    np.testing.assert_array_equal(state[4], d["state"][4])  # n = 0 with a past: unchanged
    assert not y[1, max(seq - 3, 1):].any() and not y[2].any()  # padding outputs 0


@needs_kernels
def test_conv_without_bias_and_new_empty_row():
    rng = np.random.default_rng(1)
    d = _conv_data(rng, 2, 5, 16, 5)  # width 5: the kernel's generic weight transpose
    rows = dict(past=_i32([0, 3]), qlen=_i32([0, 5]), slots=_i32([2, 1]))
    y, state = _conv_session(True, rec.ACT_SILU, bias=False).run(
        None, {"x": d["x"], "weight": d["weight"], "state": d["state"], **rows})
    want, want_state = rec.causal_conv1d_reference(d["x"], d["weight"], None, rec.ACT_SILU, d["state"], **{
        "past_lens": rows["past"], "query_lens": rows["qlen"], "state_slots": rows["slots"]})
    np.testing.assert_allclose(y, want, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(state, want_state, atol=1e-6)
    assert not state[2].any()  # a new sequence with no token yet leaves its slot zeroed


@needs_kernels
@pytest.mark.parametrize("seq", [1, 37, 130])
@pytest.mark.parametrize("with_state", [False, True], ids=["no-state", "pool"])
# dv 24: the plain loops; 80 and 48 (with an odd dk): the register-blocked columns, 64 + 16 and 48
@pytest.mark.parametrize("dk,dv", [(16, 24), (32, 80), (17, 48)])
def test_delta_matches_reference(seq, with_state, dk, dv):
    hk, hv = 2, 4
    rng = np.random.default_rng(seq + dv)
    d = _delta_data(rng, 3, seq, hk, hv, dk, dv)
    sess = _delta_session(with_state, hk, hv, dk, dv)
    if not with_state:
        (out,) = sess.run(None, {n: d[n] for n in DELTA_IN[:5]})
        want, _ = rec.gated_delta_rule_reference(*(d[n] for n in DELTA_IN[:5]))
        np.testing.assert_allclose(out, want, atol=2e-5, rtol=1e-4)
        return
    rows = _rows(seq)
    out, state = sess.run(None, {**d, **rows})
    want, want_state = rec.gated_delta_rule_reference(*(d[n] for n in DELTA_IN[:6]), rows["past"], rows["qlen"],
                                                      rows["slots"])
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(state, want_state, atol=2e-5, rtol=1e-4)
    np.testing.assert_array_equal(state[[1, 2, 4]], d["state"][[1, 2, 4]])
    assert not out[1, max(seq - 3, 1):].any() and not out[2].any()


@needs_kernels
def test_delta_takes_flattened_heads():
    hk, hv, dk, dv = 1, 3, 8, 12
    rng = np.random.default_rng(7)
    d = _delta_data(rng, 2, 6, hk, hv, dk, dv)
    flat = {n: d[n].reshape(2, 6, -1) for n in ("q", "k", "v")}
    (out,) = _delta_session(False, hk, hv, dk, dv).run(None, {**flat, "g": d["g"], "beta": d["beta"]})
    want, _ = rec.gated_delta_rule_reference(*(d[n] for n in DELTA_IN[:5]))
    assert out.shape == (2, 6, hv, dv)
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=1e-4)


# -- the references against transformers -------------------------------------------------------------

@pytest.mark.parametrize("activation", [rec.ACT_NONE, rec.ACT_SILU])
def test_conv_reference_matches_transformers(activation):
    torch = pytest.importorskip("torch")
    lfm2 = pytest.importorskip("transformers.models.lfm2.modeling_lfm2")
    rng = np.random.default_rng(3)
    d = _conv_data(rng, 2, 9, 12, 3, slots=2)
    name = None if activation == rec.ACT_NONE else "silu"
    want = lfm2.causal_conv1d_fn(torch.from_numpy(d["x"]).transpose(1, 2), torch.from_numpy(d["weight"]),
                                 torch.from_numpy(d["bias"]), activation=name).transpose(1, 2).numpy()
    y, _ = rec.causal_conv1d_reference(d["x"], d["weight"], d["bias"], activation)
    np.testing.assert_allclose(y, want, atol=1e-5, rtol=1e-5)
    # a continued sequence: transformers keeps the window channels-first, [B, C, K - 1]
    conv_state = torch.from_numpy(d["state"].transpose(0, 2, 1).copy())
    want = lfm2.causal_conv1d_update(torch.from_numpy(d["x"]).transpose(1, 2), conv_state,
                                     torch.from_numpy(d["weight"]), torch.from_numpy(d["bias"]),
                                     activation=name).transpose(1, 2).numpy()
    y, state = rec.causal_conv1d_reference(d["x"], d["weight"], d["bias"], activation, d["state"], _i32([4, 4]),
                                           _i32([9, 9]), _i32([0, 1]))
    np.testing.assert_allclose(y, want, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(state, conv_state.numpy().transpose(0, 2, 1), atol=1e-6)


@pytest.mark.parametrize("function", ["torch_recurrent_gated_delta_rule", "torch_chunk_gated_delta_rule"])
def test_delta_reference_matches_transformers(function):
    torch = pytest.importorskip("torch")
    qwen = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    hk, hv, dk, dv, seq = 2, 4, 16, 8, 70  # 70 tokens: the chunked form's two chunks, one padded
    rng = np.random.default_rng(4)
    d = _delta_data(rng, 2, seq, hk, hv, dk, dv, slots=2)
    tensors = [torch.from_numpy(d[n]) for n in DELTA_IN[:5]]
    out, final = getattr(qwen, function)(*tensors, initial_state=torch.from_numpy(d["state"]),
                                         output_final_state=True, use_qk_l2norm_in_kernel=True)
    want, state = rec.gated_delta_rule_reference(*(d[n] for n in DELTA_IN[:6]), _i32([5, 5]), _i32([seq, seq]),
                                                 _i32([0, 1]))
    np.testing.assert_allclose(want, out.numpy(), atol=1e-5, rtol=1e-4)
    np.testing.assert_allclose(state, final.numpy(), atol=1e-5, rtol=1e-4)


# -- the pool: chunked prefill, in place ----------------------------------------------------------------

def _chunked(sess, data, token_inputs, chunks, fixed=()):
    """Runs the tokens of every row in `chunks`, the state through the pool (rows in slots 1, 0),
    and returns the outputs concatenated and the final pool; `fixed` names the inputs every
    chunk takes whole (the weights)."""
    state, past, outs = np.zeros_like(data["state"]), 0, []
    for size in chunks:
        feed = {n: np.ascontiguousarray(data[n][:, past:past + size]) for n in token_inputs}
        feed.update({n: data[n] for n in fixed})
        out, state = sess.run(None, {**feed, "state": state, "past": _i32([past, past]),
                                     "qlen": _i32([size, size]), "slots": _i32([1, 0])})
        outs.append(out)
        past += size
    return np.concatenate(outs, axis=1), state


@needs_kernels
def test_chunked_prefill_carries_state():
    rng = np.random.default_rng(5)
    conv = _conv_data(rng, 2, 40, 20, 4, slots=2)
    sess = _conv_session(True, rec.ACT_SILU)
    whole, whole_state = _chunked(sess, conv, ["x"], [40], fixed=("weight", "bias"))
    parts, parts_state = _chunked(sess, conv, ["x"], [16, 16, 8], fixed=("weight", "bias"))
    np.testing.assert_allclose(parts, whole, atol=1e-6)
    np.testing.assert_allclose(parts_state, whole_state, atol=1e-6)
    np.testing.assert_array_equal(whole_state[1], conv["x"][0, -3:])
    delta = _delta_data(rng, 2, 40, 1, 2, 8, 12, slots=2)
    sess = _delta_session(True, 1, 2, 8, 12)
    whole, whole_state = _chunked(sess, delta, DELTA_IN[:5], [40])
    parts, parts_state = _chunked(sess, delta, DELTA_IN[:5], [16, 16, 8])
    np.testing.assert_allclose(parts, whole, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(parts_state, whole_state, atol=1e-5, rtol=1e-5)
    want, _ = rec.gated_delta_rule_reference(*(delta[n] for n in DELTA_IN[:5]))
    np.testing.assert_allclose(whole, want, atol=2e-5, rtol=1e-4)


def _bound_run(sess, feeds, pool):
    """Runs with `pool` bound as both the state input and state_out, as the runtime binds it."""
    binding = sess.io_binding()
    value = ort.OrtValue.ortvalue_from_numpy(pool)
    for name, array in feeds.items():
        binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(array))
    binding.bind_ortvalue_input("state", value)
    binding.bind_output(sess.get_outputs()[0].name)
    binding.bind_ortvalue_output("state_out", value)
    sess.run_with_iobinding(binding)
    return binding.copy_outputs_to_cpu()[0]


@needs_kernels
def test_state_updates_in_place():
    rng = np.random.default_rng(6)
    rows = dict(past=_i32([2, 0]), qlen=_i32([1, 1]), slots=_i32([4, 1]))
    conv = _conv_data(rng, 2, 1, 24, 3)
    pool = conv["state"].copy()
    y = _bound_run(_conv_session(True, rec.ACT_NONE), {n: conv[n] for n in CONV_IN[:3]} | rows, pool)
    want, want_state = rec.causal_conv1d_reference(conv["x"], conv["weight"], conv["bias"], rec.ACT_NONE,
                                                   conv["state"], rows["past"], rows["qlen"], rows["slots"])
    np.testing.assert_allclose(y, want, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(pool, want_state, atol=1e-6)
    delta = _delta_data(rng, 2, 1, 2, 2, 8, 8)
    pool = delta["state"].copy()
    out = _bound_run(_delta_session(True, 2, 2, 8, 8), {n: delta[n] for n in DELTA_IN[:5]} | rows, pool)
    want, want_state = rec.gated_delta_rule_reference(*(delta[n] for n in DELTA_IN[:6]), rows["past"], rows["qlen"],
                                                      rows["slots"])
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(pool, want_state, atol=2e-5, rtol=1e-4)
    assert not np.array_equal(pool[4], delta["state"][4])


# -- bad inputs --------------------------------------------------------------------------------------

def _error(sess, feeds) -> str:
    with pytest.raises(Exception) as caught:
        sess.run(None, feeds)
    return str(caught.value)


@needs_kernels
def test_bad_inputs_name_the_op():
    rng = np.random.default_rng(8)
    conv = _conv_data(rng, 2, 3, 8, 3)
    rows = dict(past=_i32([0, 1]), qlen=_i32([3, 3]), slots=_i32([0, 5]))
    sess = _conv_session(True, rec.ACT_NONE)
    message = _error(sess, {**conv, **rows})
    assert "llmc.cpu::CausalConv1d: state_slots[1] is 5, outside the pool's 5 slots" in message
    assert "\n" not in message.split("llmc.cpu::")[1]
    assert "both name state slot 0" in _error(sess, {**conv, **rows, "slots": _i32([0, 0])})
    assert "query_lens[0] is 4" in _error(sess, {**conv, **rows, "qlen": _i32([4, 3]), "slots": _i32([0, 1])})
    assert "llmc.cpu::CausalConv1d: weight must be float32 [channels, width]" in _error(
        sess, {**conv, **rows, "weight": conv["weight"][:7]})
    assert "llmc.cpu::CausalConv1d: state must be" in _error(sess, {**conv, **rows, "state": conv["state"][:, :1]})
    assert "past_lens, query_lens and state_slots must be int32 [batch]" in _error(
        sess, {**conv, **rows, "past": _i32([0])})
    no_state_out = _session(rec.CONV_OP, CONV_IN, ["y"], activation=0)
    assert "a state input needs output 1, state_out" in _error(no_state_out, {**conv, **rows, "slots": _i32([0, 1])})
    no_pool = _session(rec.CONV_OP, ["x", "weight", "bias", "", "past", "qlen", "slots"], ["y"], activation=0)
    assert "come with the state input" in _error(no_pool, {n: v for n, v in {**conv, **rows}.items() if n != "state"})
    delta = _delta_data(rng, 2, 3, 1, 2, 4, 4)
    sess = _delta_session(True, 1, 2, 4, 4)
    assert "llmc.cpu::GatedDeltaRule: state_slots[1] is 5" in _error(sess, {**delta, **rows})
    assert "llmc.cpu::GatedDeltaRule: v must be" in _error(sess, {**delta, **rows, "v": delta["v"][:, :, :1]})
    assert "llmc.cpu::GatedDeltaRule: g and beta" in _error(sess, {**delta, **rows, "g": delta["g"][:, :2]})
    with pytest.raises(Exception, match="num_v_heads must be a multiple of num_k_heads"):
        _delta_session(False, 2, 3, 4, 4)
    with pytest.raises(Exception, match="activation must be 0 \\(none\\) or 1 \\(SiLU\\)"):
        _conv_session(False, 2)
