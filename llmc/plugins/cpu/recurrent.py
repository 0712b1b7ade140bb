"""The recurrent layers of hybrid models as llmc.cpu runs them (kernels.h, "recurrent layers"):
numpy references of CausalConv1d (LFM2's short convolution) and GatedDeltaRule (Qwen3.5's Gated
DeltaNet), the oracle the kernels are tested against, and the ops' names and attributes.

Both carry per-sequence state in a pool of slots bound in place: row b of a step continues slot
state_slots[b] when past_lens[b] > 0 (else starts from zeros), runs its query_lens[b] valid tokens
(outputs past them are 0) and leaves its state in the slot. Without a pool every row starts from
zeros and all of its tokens are valid."""

from __future__ import annotations

import numpy as np

CONV_OP = "CausalConv1d"
DELTA_OP = "GatedDeltaRule"
ACT_NONE, ACT_SILU = 0, 1  # CausalConv1d's `activation` (LLMC_CONV_ACT_* in kernels.h)
CONV_ACTIVATION = "activation"
DELTA_ATTRIBUTES = ("num_k_heads", "num_v_heads", "k_head_dim", "v_head_dim")


def _rows(batch, seq, state, past_lens, query_lens, state_slots):
    """Per row: (valid tokens, the slot or None, whether it continues the slot's state)."""
    if state is None:
        return [(seq, None, False)] * batch
    return [(int(query_lens[b]), int(state_slots[b]), int(past_lens[b]) > 0) for b in range(batch)]


def causal_conv1d_reference(x, weight, bias, activation, state=None, past_lens=None, query_lens=None,
                            state_slots=None):
    """x [B, S, C], weight [C, K], bias [C] or None, state [slots, K - 1, C] or None -> (y [B, S, C],
    the updated copy of state, or None)."""
    x = np.asarray(x, np.float32)
    batch, seq, channels = x.shape
    width = weight.shape[1]
    y = np.zeros_like(x)
    new_state = None if state is None else np.array(state, np.float32, copy=True)
    for b, (n, slot, resumes) in enumerate(_rows(batch, seq, state, past_lens, query_lens, state_slots)):
        window = state[slot] if resumes else np.zeros((width - 1, channels), np.float32)
        rows = np.concatenate([window, x[b, :n]]).astype(np.float32)
        for t in range(n):
            acc = np.zeros(channels, np.float32) if bias is None else np.array(bias, np.float32)
            for j in range(width):
                acc = acc + weight[:, j] * rows[t + j]
            y[b, t] = acc / (np.float32(1) + np.exp(-acc)) if activation == ACT_SILU else acc
        if new_state is not None:
            new_state[slot] = rows[len(rows) - (width - 1):]
    return y, new_state


def _l2norm(x, scale=1.0):
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + np.float32(1e-6)) * np.float32(scale)


def gated_delta_rule_reference(q, k, v, g, beta, state=None, past_lens=None, query_lens=None, state_slots=None):
    """q, k [B, S, Hk, dk], v [B, S, Hv, dv], g, beta [B, S, Hv], state [slots, Hv, dk, dv] or None
    -> (out [B, S, Hv, dv], the updated copy of state, or None)."""
    batch, seq, hk, dk = q.shape
    hv, dv = v.shape[2:]
    group = hv // hk
    q = _l2norm(np.repeat(np.asarray(q, np.float32), group, axis=2), dk ** -0.5)
    k = _l2norm(np.repeat(np.asarray(k, np.float32), group, axis=2))
    out = np.zeros((batch, seq, hv, dv), np.float32)
    new_state = None if state is None else np.array(state, np.float32, copy=True)
    for b, (n, slot, resumes) in enumerate(_rows(batch, seq, state, past_lens, query_lens, state_slots)):
        s = np.array(state[slot], np.float32) if resumes else np.zeros((hv, dk, dv), np.float32)
        for t in range(n):
            s = s * np.exp(g[b, t]).astype(np.float32)[:, None, None]
            kv_mem = np.einsum("hij,hi->hj", s, k[b, t])
            delta = (v[b, t] - kv_mem) * beta[b, t][:, None]
            s = s + k[b, t][:, :, None] * delta[:, None, :]
            out[b, t] = np.einsum("hij,hi->hj", s, q[b, t])
        if new_state is not None:
            new_state[slot] = s
    return out, new_state
