"""`llmc eval`: perplexity, bits per byte and KL against a reference, checked against a direct
computation (engine logits of every position, transformers' logits, torch's log-softmax) over the
same windows; the windowing rule; every bad input a one-line error; the CLI."""

from __future__ import annotations

import copy
import hashlib
import json
import math
import shutil

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from llmc.bench import corpus
from llmc.bench.eval import evaluate, windows
from llmc.cli import main
from llmc.errors import LlmcError
from llmc.runtime.engine import Engine

# Non-ASCII on purpose: bytes are UTF-8 bytes, not characters.
SHORT = "def área(x):\n    return x * 3.14  # €\n\nprint(área(2))\n"
LONG = "".join(f"def f{i}(x, y={i}):\n    return x * {i} + y  # é{i}\n\n" for i in range(40))  # ~900 tokens


# -- the direct computation ---------------------------------------------------------------------

def _engine_logits(engine: Engine):
    def run(tokens: np.ndarray) -> np.ndarray:  # every position of one window, in one call
        n = len(tokens)
        table = np.arange(1, -(-n // engine.block_size) + 1, dtype=np.int32)[None]
        return engine.forward(tokens[None], np.arange(n)[None], np.array([0], np.int32), np.array([n], np.int32),
                              table, logits_indices=np.arange(n)).copy()
    return run


def _hf_logits(model):
    def run(tokens: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return model(torch.tensor(tokens[None])).logits[0].numpy()
    return run


def _direct(tokens: np.ndarray, context: int, overlap: int, ours, ref=None, num_bytes: int | None = None) -> dict:
    """The HF perplexity guide's strided windows, ends anchored: windows end at context,
    context + stride, ... and at the text's end; each scores the tokens after the previous end."""
    n, stride = len(tokens), context - overlap
    ends = [min(context + k * stride, n) for k in range(max(0, math.ceil((n - context) / stride)) + 1)]
    lq, lp, targets = [], [], []
    prev = 1
    for end in ends:
        begin = max(0, end - context)
        window = tokens[begin:end]
        rows = slice(prev - 1 - begin, end - 1 - begin)
        lq.append(torch.log_softmax(torch.from_numpy(ours(window)[rows]).double(), -1))
        if ref is not None:
            lp.append(torch.log_softmax(torch.from_numpy(ref(window)[rows]).double(), -1))
        targets.append(torch.from_numpy(tokens[prev:end]))
        prev = end
    lq, targets = torch.cat(lq), torch.cat(targets)
    nll = -lq.gather(1, targets[:, None])[:, 0]
    out = {"windows": len(ends), "scored": len(targets), "perplexity": math.exp(nll.mean().item()),
           "nll": nll.sum().item()}
    if num_bytes is not None:
        out["bits_per_byte"] = nll.sum().item() / math.log(2) / num_bytes
    if ref is not None:
        lp = torch.cat(lp)
        kl = torch.nn.functional.kl_div(lq, lp, log_target=True, reduction="none").sum(-1).numpy()
        ref_ppl = math.exp(-lp.gather(1, targets[:, None]).mean().item())
        out.update(ref_perplexity=ref_ppl, delta=out["perplexity"] - ref_ppl, kl_mean=kl.mean(),
                   kl_median=np.median(kl), kl_p99=np.percentile(kl, 99), kl_max=kl.max(),
                   top1=(lq.argmax(-1) == lp.argmax(-1)).double().mean().item())
    return out


def _check(result, want: dict, rtol: float = 1e-5) -> None:
    assert result.windows == want["windows"]
    assert result.scored_tokens == want["scored"]
    assert result.perplexity == pytest.approx(want["perplexity"], rel=rtol)
    assert result.nll == pytest.approx(want["nll"], rel=rtol)
    if "bits_per_byte" in want:
        assert result.bits_per_byte == pytest.approx(want["bits_per_byte"], rel=rtol)
    if "kl_mean" in want:
        c = result.reference
        assert c.perplexity == pytest.approx(want["ref_perplexity"], rel=rtol)
        assert c.delta_perplexity == pytest.approx(want["delta"], rel=1e-4, abs=1e-6)
        for key in ("kl_mean", "kl_median", "kl_p99", "kl_max"):
            assert getattr(c, key) == pytest.approx(want[key], rel=1e-4, abs=1e-7), key
        assert c.top1_agreement == want["top1"]


# -- fixtures -----------------------------------------------------------------------------------

@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """transformers' tiny forward passes are fastest on one thread (and not at the mercy of a
    busy machine's other processes); restored for the rest of the session."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def llama(engines):
    return engines("tiny-llama")


@pytest.fixture(scope="module")
def engine(llama):
    return Engine(llama)


@pytest.fixture(scope="module")
def tokens(engine):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(engine.files.tokenizer))
    return lambda text: np.array(tok.encode(text).ids, np.int64)  # BOS first (tiny-llama's adds one)


def _copy_hf(folder, dest):
    shutil.copytree(folder, dest)
    return dest


@pytest.fixture(scope="module")
def perturbed(hf_models, tmp_path_factory):
    """tiny-llama with noise on its LM head, saved as an HF folder: a reference that differs."""
    model, folder = hf_models("tiny-llama")
    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        head = other.get_output_embeddings().weight
        head += 0.15 * head.std() * torch.randn(head.shape, generator=gen)
    dest = tmp_path_factory.mktemp("perturbed") / "tiny-llama-noisy"
    other.save_pretrained(dest)
    for f in folder.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy(f, dest / f.name)
    return other, dest


@pytest.fixture(scope="module")
def no_bos_engine(llama, tmp_path_factory):
    """The tiny-llama engine with a tokenizer that adds no BOS (its manifest's checksums redone)."""
    dest = tmp_path_factory.mktemp("nobos") / "engine"
    shutil.copytree(llama, dest)
    tok_path = dest / "tokenizer" / "tokenizer.json"
    data = json.loads(tok_path.read_text())
    data["post_processor"] = None
    tok_path.write_text(json.dumps(data))
    manifest = json.loads((dest / "manifest.json").read_text())
    raw = tok_path.read_bytes()
    manifest["files"]["tokenizer/tokenizer.json"] = {"sha256": hashlib.sha256(raw).hexdigest(), "bytes": len(raw)}
    (dest / "manifest.json").write_text(json.dumps(manifest))
    return dest


# -- (1) the numbers are the direct computation's -----------------------------------------------

def test_numbers_equal_direct_computation(engine, tokens, perturbed):
    model, folder = perturbed
    ids = tokens(SHORT)
    assert len(ids) < engine.max_context  # one window
    result = evaluate(engine, SHORT, reference=folder)
    want = _direct(ids, engine.max_context, engine.max_context // 2, _engine_logits(engine), _hf_logits(model),
                   num_bytes=len(SHORT.encode("utf-8")))
    _check(result, want)
    assert result.bos and result.tokens == len(ids) and result.bytes == len(SHORT.encode("utf-8"))
    assert 0 < result.reference.top1_agreement < 1  # a reference that differs, but not everywhere
    assert result.reference.kl_mean > 1e-3
    assert result.reference.kind == "transformers"
    assert result.bits_per_token == pytest.approx(result.nll / math.log(2) / result.scored_tokens)


# -- (2) against transformers on the same weights: KL 0 -----------------------------------------

def test_same_recipe_reference_has_zero_kl_and_full_agreement(engine, hf_models):
    _, folder = hf_models("tiny-llama")
    result = evaluate(engine, LONG, reference=folder, threads=1)
    c = result.reference
    assert c.kl_mean < 1e-6 and c.kl_max < 1e-5
    assert c.top1_agreement == 1.0
    assert abs(c.delta_perplexity) < 1e-4 * result.perplexity


# -- (3) windows --------------------------------------------------------------------------------

@pytest.mark.parametrize("context, overlap, chunk", [(64, 24, 20), (None, None, 512)])
def test_text_longer_than_the_window(engine, tokens, perturbed, context, overlap, chunk):
    model, folder = perturbed
    ids = tokens(LONG)
    assert len(ids) > engine.max_context
    result = evaluate(engine, LONG, reference=folder, context=context, overlap=overlap, chunk_size=chunk)
    context = context or engine.max_context
    overlap = overlap if overlap is not None else context // 2
    assert (result.context, result.overlap) == (context, overlap)
    want = _direct(ids, context, overlap, _engine_logits(engine), _hf_logits(model),
                   num_bytes=len(LONG.encode("utf-8")))
    assert want["windows"] > 2 and want["scored"] == len(ids) - 1
    _check(result, want)


@pytest.mark.parametrize("n", [2, 3, 10, 63, 64, 65, 100, 257])
@pytest.mark.parametrize("context, overlap", [(64, 1), (64, 24), (64, 63), (8, 4), (2, 1)])
def test_windows_score_each_token_once_with_overlap_context(n, context, overlap):
    scored = []
    for begin, end, first in windows(n, context, overlap):
        assert 0 <= begin < first <= end <= n and end - begin <= context
        assert begin == 0 or first - begin >= overlap  # every token after the first window: >= overlap context
        scored += range(first, end)
    assert scored == list(range(1, n))


def test_chunks_do_not_change_the_numbers(engine):
    whole = evaluate(engine, LONG, context=128, overlap=32)
    chunked = evaluate(engine, LONG, context=128, overlap=32, chunk_size=7)
    assert chunked.nll == pytest.approx(whole.nll, rel=1e-6)


def test_corpus_documents_are_separate(engine, monkeypatch, tmp_path):
    names = [n for n in (f"mod{i}.py" for i in range(400)) if corpus.split_of(n) == "heldout"][:3]
    texts = [SHORT, "", LONG[:300]]  # the empty file has only its BOS: skipped
    for name, text in zip(names, texts):
        (tmp_path / name).write_text(text, encoding="utf-8")
    (tmp_path / "other.py").write_text("x = 1\n")
    monkeypatch.setattr(corpus, "stdlib_root", lambda: tmp_path)
    result = evaluate(engine, corpus="heldout")
    alone = [evaluate(engine, t) for t in (texts[0], texts[2])]
    assert (result.documents, result.skipped_documents) == (2, 1)
    assert result.data == "corpus:heldout"
    assert result.bytes == sum(len(t.encode("utf-8")) for t in texts)
    assert result.scored_tokens == sum(r.scored_tokens for r in alone)
    assert result.nll == pytest.approx(sum(r.nll for r in alone), rel=1e-6)


def test_without_bos_the_first_token_is_context(no_bos_engine):
    engine = Engine(no_bos_engine)
    from tokenizers import Tokenizer

    ids = np.array(Tokenizer.from_file(str(engine.files.tokenizer)).encode(SHORT).ids, np.int64)
    result = evaluate(engine, SHORT)
    assert not result.bos and result.tokens == len(ids) and result.scored_tokens == len(ids) - 1
    first = len(b"def")  # SHORT's first token, whose bytes nothing predicts
    assert result.bytes == len(SHORT.encode("utf-8")) - first
    _check(result, _direct(ids, engine.max_context, engine.max_context // 2, _engine_logits(engine),
                           num_bytes=result.bytes))
    split = "€x = 1"  # byte-level BPE splits € over the first tokens: its bytes are partly predicted, so counted
    assert evaluate(engine, split).bytes == len(split.encode("utf-8"))


# -- (4) bad inputs: one line each --------------------------------------------------------------

def _error(call) -> str:
    with pytest.raises(LlmcError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message
    return message


def test_bad_inputs_are_one_line_errors(llama, engine, no_bos_engine, hf_models, tmp_path):
    _, folder = hf_models("tiny-llama")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\xe9 au lait".encode("latin-1"))
    wide = _copy_hf(folder, tmp_path / "wide")
    config = json.loads((wide / "config.json").read_text())
    (wide / "config.json").write_text(json.dumps({**config, "vocab_size": 2048}))
    other_tok = _copy_hf(folder, tmp_path / "other-tokenizer")
    data = json.loads((other_tok / "tokenizer.json").read_text())
    data["model"]["merges"] = data["model"]["merges"][:-200]  # same vocabulary, other merges
    (other_tok / "tokenizer.json").write_text(json.dumps(data))

    cases = {
        "missing file": (lambda: evaluate(engine, file=tmp_path / "nope.txt"), "no file at"),
        "folder as file": (lambda: evaluate(engine, file=tmp_path), "is a folder, not a text file"),
        "empty file": (lambda: evaluate(engine, file=empty), "is empty"),
        "not UTF-8": (lambda: evaluate(engine, file=latin1), "is not UTF-8 text (byte 0xe9 at offset 3)"),
        "one token": (lambda: evaluate(no_bos_engine, "x"), "text is 1 token long; eval needs at least two"),
        "nothing": (lambda: evaluate(engine), "nothing to evaluate"),
        "lone surrogate": (lambda: evaluate(engine, "ab\ud800"), "unpaired surrogate '\\ud800' at index 2"),
        "two sources": (lambda: evaluate(engine, SHORT, corpus="heldout"), "text and corpus given together"),
        "unknown corpus": (lambda: evaluate(engine, corpus="train"), "unknown corpus 'train'"),
        "missing engine": (lambda: evaluate(tmp_path / "no-engine", SHORT), "no engine at"),
        "missing reference": (lambda: evaluate(engine, SHORT, reference=tmp_path / "no-ref"), "no reference at"),
        "reference not a model": (lambda: evaluate(engine, SHORT, reference=tmp_path),
                                  "is neither an llmc engine"),
        "other vocabulary": (lambda: evaluate(engine, SHORT, reference=wide),
                             "has a vocabulary of 2048 tokens and the engine 1024"),
        "other tokenizer": (lambda: evaluate(engine, LONG, reference=other_tok), "tokenizes text differently"),
        "other tokenizer (engine)": (lambda: evaluate(engine, SHORT, reference=no_bos_engine),
                                     "tokenizes text differently"),
        "context too long": (lambda: evaluate(engine, SHORT, context=1000), "longer than the engine's max context"),
        "overlap too long": (lambda: evaluate(engine, SHORT, context=64, overlap=64), "--overlap must be"),
        "no overlap": (lambda: evaluate(engine, SHORT, context=64, overlap=0), "--overlap must be at least 1"),
    }
    for name, (call, expected) in cases.items():
        assert expected in _error(call), name


# -- (5) the CLI --------------------------------------------------------------------------------

def test_cli_report_and_json(llama, hf_models, tmp_path):
    _, folder = hf_models("tiny-llama")
    text = tmp_path / "sample.py"
    text.write_text(LONG, encoding="utf-8")
    runner = CliRunner()
    result = runner.invoke(main, ["eval", str(llama), str(text), "--reference", str(folder)])
    assert result.exit_code == 0, result.output
    for line in ("perplexity", "bits per byte", "mean KL divergence", "P99 KL divergence", "same top token",
                 "Δ perplexity", "windows of up to 256 tokens, overlap 128"):
        assert line in result.stdout
    result = runner.invoke(main, ["eval", str(llama), "--file", str(text), "--context", "64", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["context"] == 64 and report["overlap"] == 32 and report["reference"] is None
    assert report["bytes"] == len(LONG.encode("utf-8")) and report["perplexity"] > 1
    python = evaluate(llama, file=text, context=64)
    assert report["nll"] == pytest.approx(python.nll, rel=1e-9)
    result = runner.invoke(main, ["eval", str(llama), str(tmp_path / "nope.txt")])
    assert result.exit_code == 2 and result.stderr.strip().startswith("error: no file at")
    assert len(result.stderr.strip().splitlines()) == 1
