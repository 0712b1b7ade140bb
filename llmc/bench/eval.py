"""`llmc eval`: perplexity and bits per byte of an engine on a text, and how far its next-token
distributions are from a reference's (an engine, or an HF folder run through transformers in fp32).

Documents. A text file is one document; `corpus="heldout"` is llmc.bench.corpus's held-out
standard-library files, each file one document. A document is tokenized on its own, without
special tokens, and gets the tokenizer's BOS first when the tokenizer puts one there itself (as
transformers' `tokenizer(text)` does: its post-processor / add_bos_token); never an EOS.

Scoring. Every token but a document's first is scored: its negative log-likelihood under the
distribution the model gives it from the tokens before it. A document longer than the window
(`context` tokens, default the engine's max context) is scored in windows of `context` tokens
whose ends advance by `stride = context - overlap`: window k ends at min(context + k·stride, n)
and starts `context` tokens before its end (at 0 for the first); it scores only the tokens after
the previous window's end, so every token is scored once, and each with at least `overlap`
tokens of context (the first window's tokens: all tokens before them). Windows are independent
sequences (positions from 0); only the first starts with the BOS. A window runs through the
engine in chunks of `chunk_size` tokens over its paged KV cache, asking logits only for the
positions that predict a scored token, so memory is bounded by chunk_size x vocab, never by the
text: per token only its NLL (and with a reference its KL and top-1 match) is kept.

Bytes. bits per byte = total NLL in bits / UTF-8 bytes of the text whose tokens were scored:
a document's whole text with a BOS; without one, the text from where the second token starts
(the characters wholly inside the first token, which nothing predicts, are not counted; a
character the first token shares with the second, a byte-level split, is).

Reference. Run on the same token windows and chunks; it must have the engine's vocabulary size
and tokenize every document exactly as the engine does. Per scored token: KL(reference || engine)
in nats over the whole vocabulary (float64), and whether both models' most likely token is the
same; summarized as llama.cpp's `llama-perplexity --kl-divergence` does (mean ± its standard
error, median, P99, max; "same top token" in % ± its binomial standard error; Δ perplexity).
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from collections.abc import Callable, Iterator

import numpy as np

from llmc.errors import LlmcError, check_unicode, first_line

CORPORA = ("heldout",)
DEFAULT_CHUNK = 512  # tokens per engine call within a window: bounds the logits held at once
SCHEMA_VERSION = 1

Progress = Callable[[int, int], None]  # (tokens scored so far, tokens to score)


# -- results ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Comparison:
    """The engine against a reference on the same scored tokens. KL values are in nats."""

    reference: str
    kind: str  # "engine" or "transformers"
    perplexity: float  # the reference's
    bits_per_byte: float  # the reference's
    delta_perplexity: float  # engine - reference
    perplexity_ratio: float  # engine / reference
    kl_mean: float
    kl_mean_stderr: float
    kl_median: float
    kl_p99: float
    kl_max: float
    top1_agreement: float  # fraction of scored tokens whose most likely next token is the same
    top1_agreement_stderr: float


@dataclass(frozen=True)
class EvalResult:
    engine: str
    data: str  # the file, "corpus:heldout" or "text"
    documents: int  # documents scored
    skipped_documents: int  # corpus documents of fewer than two tokens (nothing to score)
    bos: bool  # whether each document starts with the tokenizer's BOS
    tokens: int  # tokens of the scored documents, BOS included
    scored_tokens: int
    bytes: int  # UTF-8 bytes of the text whose tokens were scored
    context: int  # window length in tokens
    overlap: int  # least context of a token scored after the first window
    windows: int
    nll: float  # total, in nats
    perplexity: float
    perplexity_stderr: float
    bits_per_token: float
    bits_per_byte: float
    seconds: float
    reference: Comparison | None = None

    def to_json(self) -> dict:
        return {"schema_version": SCHEMA_VERSION, **asdict(self)}


# -- documents and tokenizers -------------------------------------------------------------------

@dataclass
class _Document:
    name: str
    text: str
    tokens: np.ndarray  # int64, BOS first when the tokenizer adds one
    bytes: int  # scored bytes (see the module docstring)


class _Tokenizer:
    """One tokenizer, used the same way for the engine and for a reference: (ids, the character
    where the second text token starts) of a document, BOS first when the tokenizer adds one."""

    def __init__(self, encode_plain: Callable[[str], tuple[list[int], int | None]],
                 encode_special: Callable[[str], list[int]], id_to_token: Callable[[int], str | None]):
        self._plain, self.id_to_token = encode_plain, id_to_token
        probe = "x = 1"
        plain, _ = encode_plain(probe)
        special = encode_special(probe)
        adds = len(special) > len(plain) and special[1:len(plain) + 1] == plain
        self.bos_id: int | None = special[0] if adds else None

    def encode(self, text: str) -> tuple[list[int], int | None]:
        ids, second_start = self._plain(text)
        return ([self.bos_id, *ids] if self.bos_id is not None else ids), second_start


def _engine_tokenizer(path: Path) -> _Tokenizer:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path))

    def plain(text: str):
        enc = tok.encode(text, add_special_tokens=False)
        return enc.ids, (enc.offsets[1][0] if len(enc.ids) > 1 else len(text))  # where the second token starts

    return _Tokenizer(plain, lambda text: tok.encode(text).ids, tok.id_to_token)


def _hf_tokenizer(folder: Path) -> _Tokenizer:
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    except Exception as exc:
        raise LlmcError(f"cannot load the reference's tokenizer from {folder} ({first_line(exc)}); "
                        "the folder needs tokenizer.json and tokenizer_config.json") from None
    tok.model_max_length = 2**62  # whole documents are encoded: no warning about the model's length
    return _Tokenizer(lambda text: (tok.encode(text, add_special_tokens=False), None),
                      lambda text: tok.encode(text), tok.convert_ids_to_tokens)


def _read_file(path: Path) -> str:
    if not path.exists():
        raise LlmcError(f"no file at {path}; pass a text file to evaluate")
    if path.is_dir():
        raise LlmcError(f"{path} is a folder, not a text file; pass a text file to evaluate")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise LlmcError(f"cannot read {path} ({exc.strerror}); check its permissions") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise LlmcError(f"{path} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}); "
                        "convert it to UTF-8") from None
    if not text:
        raise LlmcError(f"{path} is empty; pass a text of at least two tokens")
    return text


def _sources(text: str | None, file: str | Path | None, corpus: str | None) -> tuple[str, list[tuple[str, str]]]:
    """(what is evaluated, [(document name, text)])."""
    given = [name for name, value in (("text", text), ("file", file), ("corpus", corpus)) if value is not None]
    if len(given) != 1:
        what = "nothing to evaluate" if not given else f"{' and '.join(given)} given together"
        raise LlmcError(f"{what}; pass exactly one of a FILE, --file FILE or --corpus heldout")
    if text is not None:
        if not isinstance(text, str):
            raise LlmcError(f"text must be a str, got {type(text).__name__}")
        if not text:
            raise LlmcError("the text is empty; pass a text of at least two tokens")
        check_unicode(text, "the text")
        return "text", [("text", text)]
    if file is not None:
        path = Path(file)
        return str(path), [(str(path), _read_file(path))]
    if corpus not in CORPORA:
        raise LlmcError(f"unknown corpus {corpus!r}; the corpora are {', '.join(CORPORA)}")
    from llmc.bench import corpus as code_corpus

    paths = code_corpus.files(corpus)
    if not paths:
        raise LlmcError(f"the {corpus} corpus has no files in {code_corpus.stdlib_root()}")
    return f"corpus:{corpus}", list(zip(paths, code_corpus.read(paths)))


def _documents(texts: list[tuple[str, str]], tok: _Tokenizer, single: bool) -> tuple[list[_Document], int]:
    docs, skipped = [], 0
    for name, text in texts:
        ids, second_start = tok.encode(text)
        if len(ids) < 2:
            if single:
                raise LlmcError(f"{name} is {len(ids)} token{'s' * (len(ids) != 1)} long"
                                f"{' (BOS included)' if tok.bos_id is not None else ''}; eval needs at least "
                                "two tokens (one to predict the next from)")
            skipped += 1
            continue
        size = len(text.encode("utf-8"))
        if tok.bos_id is None:  # the first token is context only: what only it covers is not scored
            size -= len(text[:second_start].encode("utf-8"))
        docs.append(_Document(name, text, np.asarray(ids, np.int64), size))
    return docs, skipped


# -- windows ------------------------------------------------------------------------------------

def windows(num_tokens: int, context: int, overlap: int) -> list[tuple[int, int, int]]:
    """(begin, end, first scored token) of each window over a document of num_tokens tokens: the
    window is tokens [begin, end) and scores tokens [first, end)."""
    stride = context - overlap
    end = min(context, num_tokens)
    out = [(0, end, 1)]
    while end < num_tokens:
        new_end = min(end + stride, num_tokens)
        out.append((max(0, new_end - context), new_end, end))
        end = new_end
    return out


def _chunks(length: int, chunk: int) -> Iterator[tuple[int, int]]:
    for start in range(0, length, chunk):
        yield start, min(start + chunk, length)


# -- the models ---------------------------------------------------------------------------------

class _EngineScorer:
    """Logits of chosen positions of a window, through an engine's paged KV cache."""

    kind = "engine"

    def __init__(self, engine, context: int):
        from llmc.runtime.kv_cache import blocks_for

        self.engine = engine
        self.vocab_size = engine.spec.vocab_size
        width = blocks_for(context, engine.block_size)
        if width > engine.num_blocks - 1:  # block 0 is scratch
            raise LlmcError(f"a window of {context} tokens needs {width} KV blocks but the engine's pool has "
                            f"{engine.num_blocks - 1}; pass a smaller --context")
        self.table = np.arange(1, width + 1, dtype=np.int32)[None, :]
        self.longrope = engine.spec.longrope_boundary is not None

    def window(self, tokens: np.ndarray, need: np.ndarray, chunk: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """For each chunk: (window positions in `need` it holds, their logits [n, V]). The logits
        are the engine's buffer, valid until the next chunk."""
        length = len(tokens)
        for start, stop in _chunks(length, chunk):
            n = stop - start
            # Like the runtime's prefill chunks: a padding slot carries the window's last position,
            # from which longrope picks the factors the whole window gets.
            pad = int(self.longrope and stop < length)
            ids = np.zeros((1, n + pad), np.int64)
            ids[0, :n] = tokens[start:stop]
            positions = np.arange(start, stop + pad, dtype=np.int64)[None, :]
            if pad:
                positions[0, -1] = length - 1
            sel = need[(need >= start) & (need < stop)]  # none in a chunk of context only
            yield sel, self.engine.forward(ids, positions, np.array([start], np.int32), np.array([n], np.int32),
                                           self.table, logits_indices=sel - start)


class _HFScorer:
    """The same through transformers (fp32): the window in one forward pass of the decoder, then
    per chunk of chosen positions the model's own forward from those hidden states, so the head is
    followed by what each family does after it (Gemma 2's final softcap, Granite's logits scaling)."""

    kind = "transformers"

    def __init__(self, model):
        self.model = model
        self.vocab_size = model.config.vocab_size

    def window(self, tokens: np.ndarray, need: np.ndarray, chunk: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        import torch

        class Given(torch.nn.Module):  # stands in for the decoder: its output, already computed, cut to `rows`
            def forward(self, **_):
                return type(body_out)(**{**body_out, "last_hidden_state": rows})

        prefix, body = self.model.base_model_prefix, self.model.base_model
        with torch.no_grad():
            body_out = body(input_ids=torch.from_numpy(tokens[None, :]))
            hidden = body_out.last_hidden_state
            try:
                setattr(self.model, prefix, Given())
                for start, stop in _chunks(len(tokens), chunk):
                    sel = need[(need >= start) & (need < stop)]
                    if not sel.size:  # a chunk of context only: the engine's scorer yields it too
                        yield sel, np.empty((0, self.vocab_size), np.float32)
                        continue
                    rows = hidden[:, torch.from_numpy(sel)]
                    logits = self.model(input_ids=torch.zeros((1, sel.size), dtype=torch.long)).logits[0]
                    yield sel, logits.float().numpy()
            finally:
                setattr(self.model, prefix, body)


def _open_engine(engine, context: int | None, threads: int | None):
    """An Engine (from a path or an opened engine's files) with a KV pool of one window, what eval needs."""
    from llmc.contract.engine_dir import EngineFiles, open_engine
    from llmc.contract.options import RuntimeOptions
    from llmc.runtime.engine import Engine
    from llmc.runtime.kv_cache import blocks_for

    if isinstance(engine, Engine):
        return engine
    files = engine if isinstance(engine, EngineFiles) else open_engine(engine)
    limit = files.manifest.max_context
    blocks = blocks_for(min(context or limit, limit), files.manifest.kv_cache.block_size) + 1  # + scratch
    return Engine(files, RuntimeOptions(num_threads=threads, kv_cache_blocks=max(blocks, 2)))


def _reference(ref, vocab_size: int, engine_tok: _Tokenizer, docs: list[_Document], context: int | None,
               threads: int | None):
    """(scorer class, model, longest window, label, kind) of a reference engine or HF folder, its
    vocabulary and tokenization of every document checked against the engine's first."""
    from llmc.contract.engine_dir import MANIFEST, open_engine
    from llmc.runtime.engine import Engine

    if isinstance(ref, Engine):
        path, files = ref.dir, ref.files
    else:
        path = Path(ref)
        if not path.exists():
            raise LlmcError(f"no reference at {path}; pass an llmc engine or a HuggingFace model folder")
        if not path.is_dir() or not ((path / MANIFEST).is_file() or (path / "config.json").is_file()):
            raise LlmcError(f"{path} is neither an llmc engine (no {MANIFEST}) nor a HuggingFace model folder "
                            "(no config.json); pass one of those as the reference")
        files = open_engine(path) if (path / MANIFEST).is_file() else None
    if files is not None:
        ref_vocab, limit, kind = files.manifest.model_spec.vocab_size, files.manifest.max_context, "engine"
    else:
        from llmc.compiler.frontend import model_spec_from_config, read_config

        spec = model_spec_from_config(read_config(path))  # refuses what llmc would not load
        ref_vocab, limit, kind = spec.vocab_size, spec.max_position_embeddings, "transformers"
    if ref_vocab != vocab_size:
        raise LlmcError(f"the reference {path} has a vocabulary of {ref_vocab} tokens and the engine {vocab_size}; "
                        "a reference must use the engine's tokenizer")
    ref_tok = _engine_tokenizer(files.tokenizer) if files is not None else _hf_tokenizer(path)
    for doc in docs:
        ids, ours = ref_tok.encode(doc.text)[0], doc.tokens.tolist()
        if ids != ours:
            at = next((i for i, (a, b) in enumerate(zip(ids, ours)) if a != b), min(len(ids), len(ours)))
            here = repr(engine_tok.id_to_token(ours[at])) if at < len(ours) else "the end"
            there = repr(ref_tok.id_to_token(ids[at])) if at < len(ids) else "the end"
            raise LlmcError(f"the reference {path} tokenizes {doc.name} differently from the engine (token {at}: "
                            f"{there} vs the engine's {here}); a reference must use the engine's tokenizer")
    if context is not None and context > limit:
        raise LlmcError(f"--context {context} is longer than the reference's {limit} tokens; pass --context {limit} "
                        "or less")
    if files is not None:
        return _EngineScorer, _open_engine(ref if isinstance(ref, Engine) else files, context, threads), limit, \
            str(path), kind
    from llmc.compiler.frontend import load_hf_model

    return _HFScorer, load_hf_model(path), limit, str(path), kind


# -- statistics ---------------------------------------------------------------------------------

_ROWS = 64  # rows per float64 log-softmax: bounds the temporaries at 64 x vocab


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    x -= np.log(np.exp(x).sum(axis=-1, keepdims=True))
    return x


def _token_stats(logits: np.ndarray, targets: np.ndarray, ref_logits: np.ndarray | None):
    """Per token: NLL under the engine, and with a reference its NLL, KL(ref || engine) and
    whether the top tokens agree."""
    nll, ref_nll, kl = (np.empty(len(targets)) for _ in range(3))
    for start in range(0, len(targets), _ROWS):
        rows = slice(start, start + _ROWS)
        ar = np.arange(len(targets[rows]))
        lq = _log_softmax(logits[rows])
        nll[rows] = -lq[ar, targets[rows]]
        if ref_logits is not None:
            lp = _log_softmax(ref_logits[rows])
            ref_nll[rows] = -lp[ar, targets[rows]]
            kl[rows] = (np.exp(lp) * (lp - lq)).sum(axis=-1)
    if ref_logits is None:
        return nll, None, None, None
    return nll, ref_nll, kl, logits.argmax(axis=-1) == ref_logits.argmax(axis=-1)


def _stderr_of_mean(values: np.ndarray) -> float:
    return float(values.std(ddof=1) / math.sqrt(len(values))) if len(values) > 1 else 0.0


def _perplexity(nll: np.ndarray) -> float:
    return float(math.exp(nll.mean()))


def _compare(label: str, kind: str, nll: np.ndarray, ref_nll: np.ndarray, kl: np.ndarray, same: np.ndarray,
             num_bytes: int) -> Comparison:
    ppl, ref_ppl = _perplexity(nll), _perplexity(ref_nll)
    agree = float(same.mean())
    return Comparison(
        reference=label, kind=kind, perplexity=ref_ppl, bits_per_byte=float(ref_nll.sum() / math.log(2) / num_bytes),
        delta_perplexity=ppl - ref_ppl, perplexity_ratio=ppl / ref_ppl,
        kl_mean=float(kl.mean()), kl_mean_stderr=_stderr_of_mean(kl), kl_median=float(np.median(kl)),
        kl_p99=float(np.percentile(kl, 99)), kl_max=float(kl.max()),
        top1_agreement=agree, top1_agreement_stderr=math.sqrt(agree * (1 - agree) / len(same)))


# -- the driver ---------------------------------------------------------------------------------

def evaluate(engine, text: str | None = None, *, file: str | Path | None = None, corpus: str | None = None,
             reference=None, context: int | None = None, overlap: int | None = None,
             chunk_size: int = DEFAULT_CHUNK, threads: int | None = None,
             progress: Progress | None = None) -> EvalResult:
    """Perplexity and bits per byte of `engine` (a path or an Engine) on `text`, a `file` or a
    `corpus` ("heldout"); with `reference` (an engine path or Engine, or an HF model folder) also
    KL(reference || engine), top-1 agreement and Δ perplexity. Windows of `context` tokens
    (default: the engine's max context, or the reference's if shorter) overlapping by `overlap`
    (default: half the window); see the module docstring for every rule."""
    began = time.perf_counter()
    data, texts = _sources(text, file, corpus)
    for name, value in (("context", context), ("overlap", overlap), ("chunk_size", chunk_size), ("threads", threads)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise LlmcError(f"{name} must be an integer (got {value!r})")
    if context is not None and context < 2:
        raise LlmcError(f"--context must be at least 2 tokens (got {context})")
    if chunk_size < 1:
        raise LlmcError(f"chunk_size must be at least 1 token (got {chunk_size})")
    model = _open_engine(engine, context, threads)
    if context is not None and context > model.max_context:
        raise LlmcError(f"--context {context} is longer than the engine's max context {model.max_context}; pass "
                        f"--context {model.max_context} or less")
    tok = _engine_tokenizer(model.files.tokenizer)
    docs, skipped = _documents(texts, tok, single=corpus is None)
    if not docs:
        raise LlmcError(f"every document of {data} is shorter than two tokens; there is nothing to score")
    vocab = model.spec.vocab_size
    every = np.concatenate([d.tokens for d in docs])
    outside = every[(every < 0) | (every >= vocab)]
    if outside.size:
        bad = int(outside[0])
        raise LlmcError(f"the text encodes to token {tok.id_to_token(bad)!r} (id {bad}), outside the model's "
                        f"vocabulary (0..{vocab - 1})")

    ref = None
    if reference is not None:
        ref_cls, ref_model, ref_limit, ref_label, ref_kind = _reference(reference, vocab, tok, docs, context, threads)
    window = context or (model.max_context if reference is None else min(model.max_context, ref_limit))
    if overlap is None:
        overlap = window // 2
    if not 1 <= overlap < window:  # a window's first token has nothing before it to be predicted from
        raise LlmcError(f"--overlap must be at least 1 and less than the window of {window} tokens (got {overlap})")
    main = _EngineScorer(model, window)
    if reference is not None:
        ref = ref_cls(ref_model, window) if ref_cls is _EngineScorer else ref_cls(ref_model)

    with _torch_threads(threads if isinstance(ref, _HFScorer) else None):
        nll, ref_nll, kl, same, plans = _score(docs, window, overlap, chunk_size, main, ref, progress)
    num_bytes = sum(doc.bytes for doc in docs)
    comparison = None if ref is None else _compare(ref_label, ref_kind, nll, ref_nll, kl, same, num_bytes)
    ppl = _perplexity(nll)
    return EvalResult(
        engine=str(model.dir), data=data, documents=len(docs), skipped_documents=skipped,
        bos=tok.bos_id is not None, tokens=sum(len(d.tokens) for d in docs), scored_tokens=len(nll),
        bytes=num_bytes, context=window, overlap=overlap, windows=sum(len(s) for _, s in plans),
        nll=float(nll.sum()), perplexity=ppl, perplexity_stderr=ppl * _stderr_of_mean(nll),
        bits_per_token=float(nll.mean() / math.log(2)), bits_per_byte=float(nll.sum() / math.log(2) / num_bytes),
        seconds=time.perf_counter() - began, reference=comparison)


@contextlib.contextmanager
def _torch_threads(threads: int | None):
    """torch's intra-op threads set to `threads` for the reference's forward passes, then restored."""
    if threads is None:
        yield
        return
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _score(docs: list[_Document], window: int, overlap: int, chunk_size: int, main: _EngineScorer, ref,
           progress: Progress | None):
    """Per scored token, in document and window order: NLL, and with a reference its NLL, the KL
    and whether the top tokens agree (None without one); and each document's windows."""
    plans = [(doc, windows(len(doc.tokens), window, overlap)) for doc in docs]
    total = sum(len(doc.tokens) - 1 for doc in docs)
    nlls, ref_nlls, kls, sames = [], [], [], []
    done = 0
    if progress:
        progress(0, total)
    for doc, spans in plans:
        for begin, end, first in spans:
            tokens = doc.tokens[begin:end]
            need = np.arange(first - 1 - begin, end - 1 - begin, dtype=np.int64)  # predicts first..end-1
            ours = main.window(tokens, need, chunk_size)
            theirs = ref.window(tokens, need, chunk_size) if ref is not None else None
            for sel, logits in ours:
                ref_logits = None
                if theirs is not None:
                    ref_sel, ref_logits = next(theirs)
                    assert np.array_equal(sel, ref_sel)
                if not sel.size:
                    continue
                nll, ref_nll, kl, same = _token_stats(logits, tokens[sel + 1], ref_logits)
                nlls.append(nll)
                if ref is not None:
                    ref_nlls.append(ref_nll)
                    kls.append(kl)
                    sames.append(same)
                done += sel.size
                if progress:
                    progress(done, total)

    if ref is None:
        return np.concatenate(nlls), None, None, None, plans
    return (np.concatenate(nlls), np.concatenate(ref_nlls), np.concatenate(kls), np.concatenate(sames), plans)


# -- the report ---------------------------------------------------------------------------------

def render(result: EvalResult) -> str:
    """The report `llmc eval` prints."""
    r = result
    docs = f"{r.documents} document{'s' * (r.documents != 1)}"
    if r.skipped_documents:
        docs += f" ({r.skipped_documents} of fewer than two tokens skipped)"
    size = f"{r.bytes:,} byte{'s' * (r.bytes != 1)} scored"
    tokens = f"{r.tokens:,} tokens{' (BOS first)' if r.bos else ''}, {r.scored_tokens:,} scored"
    spans = f"{r.windows} window{'s' * (r.windows != 1)} of up to {r.context} tokens, overlap {r.overlap}"
    lines = [
        f"eval of {r.engine} on {r.data}",
        f"  {docs}, {size}, {tokens}",
        f"  {spans}; {r.seconds:.1f}s",
        "",
        f"perplexity        {r.perplexity:.4f} ± {r.perplexity_stderr:.4f}",
        f"bits per token    {r.bits_per_token:.4f}",
        f"bits per byte     {r.bits_per_byte:.4f}",
    ]
    c = r.reference
    if c is not None:
        lines += [
            "",
            f"against {c.reference} ({c.kind})",
            f"reference perplexity   {c.perplexity:.4f}",
            f"reference bits/byte    {c.bits_per_byte:.4f}",
            f"Δ perplexity           {c.delta_perplexity:+.6f} ({(c.perplexity_ratio - 1) * 100:+.4f}%)",
            f"mean KL divergence     {_small(c.kl_mean)} ± {_small(c.kl_mean_stderr)} nats",
            f"median KL divergence   {_small(c.kl_median)}",
            f"P99 KL divergence      {_small(c.kl_p99)}",
            f"max KL divergence      {_small(c.kl_max)}",
            f"same top token         {c.top1_agreement * 100:.3f} ± {c.top1_agreement_stderr * 100:.3f} %",
        ]
    return "\n".join(lines)


def _small(value: float) -> str:
    """Six decimals, or three significant digits where those would show only zeros."""
    return f"{value:.6f}" if value == 0 or abs(value) >= 1e-3 else f"{value:.3e}"


def to_json_text(result: EvalResult) -> str:
    return json.dumps(result.to_json(), indent=2)


__all__ = ["Comparison", "EvalResult", "evaluate", "render", "windows"]
