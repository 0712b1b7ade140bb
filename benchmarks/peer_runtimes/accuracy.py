"""Accuracy against reference logits: the per-token arithmetic every model backend's `accuracy`
request runs (benchmarks/quant_accuracy.py), so only per-token numbers travel over the pipe."""

from __future__ import annotations

import time

import numpy as np

_ROWS = 64  # rows per float64 log-softmax, as llmc.bench.eval


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    x -= np.log(np.exp(x).sum(axis=-1, keepdims=True))
    return x


def token_stats(logits: np.ndarray, targets: np.ndarray, ref_logits: np.ndarray):
    """Per token, exactly as llmc.bench.eval._token_stats: NLL of the target under `logits` and
    under the reference, KL(reference || logits) in nats over the whole vocabulary (float64), and
    whether both argmaxes agree."""
    n = len(targets)
    nll, ref_nll, kl = np.empty(n), np.empty(n), np.empty(n)
    for start in range(0, n, _ROWS):
        rows = slice(start, start + _ROWS)
        ar = np.arange(len(targets[rows]))
        lq = _log_softmax(logits[rows])
        lp = _log_softmax(ref_logits[rows])
        nll[rows] = -lq[ar, targets[rows]]
        ref_nll[rows] = -lp[ar, targets[rows]]
        kl[rows] = (np.exp(lp) * (lp - lq)).sum(axis=-1)
    return nll, ref_nll, kl, logits.argmax(axis=-1) == ref_logits.argmax(axis=-1)


def accuracy(window_logits, plan: str, ref: str, vocab: int) -> dict:
    """Runs `window_logits(tokens, need) -> [len(need), >= vocab]` over every window of `plan`
    (an .npz: `tokens`, the windows' tokens end to end, and `windows`, rows of (token offset,
    length, first needed position, count, reference row)) and holds each position's logits,
    sliced to the model's `vocab` (a GGUF vocabulary may be padded), against the reference's
    row in `ref` (an .npy [rows, vocab], memory-mapped). Windows are independent sequences from
    position 0, as llmc eval runs them."""
    p = np.load(plan)
    tokens, wins = p["tokens"], p["windows"]
    reference = np.load(ref, mmap_mode="r")
    out = {"nll": [], "ref_nll": [], "kl": [], "same": []}
    start = time.perf_counter()
    for off, length, first, count, row in wins.tolist():
        toks = tokens[off:off + length]
        need = np.arange(first, first + count)
        logits = np.asarray(window_logits(toks, need), dtype=np.float32)[:, :vocab]
        nll, ref_nll, kl, same = token_stats(logits, toks[need + 1].astype(np.int64),
                                             np.asarray(reference[row:row + count]))
        out["nll"] += nll.tolist()
        out["ref_nll"] += ref_nll.tolist()
        out["kl"] += kl.tolist()
        out["same"] += [bool(x) for x in same]
    out["seconds"] = time.perf_counter() - start
    return out
