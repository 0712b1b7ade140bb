"""Quantization accuracy against peers: how far llama.cpp's, ORT GenAI's and llmc's fewer-bit models
are from llmc's fp32 engine, on the same held-out tokens, in one table.

    python benchmarks/quant_accuracy.py [--model code-small] [--reference ENGINE_DIR] [--max-tokens 20000]
                                        [--llmc NAME=ENGINE_DIR ...] [--peers llama.cpp,ort-genai]
                                        [--rows SUBSTRING,...] [--threads 2] [--json OUT]

Data and positions. Exactly what `llmc eval ENGINE --corpus heldout --reference REF` scores, cut
short: the held-out standard-library files (llmc.bench.corpus), each tokenized on its own by the
reference engine's tokenizer (BOS first when it adds one), in windows of the engine's max context
(256 tokens for code-small) overlapping by half, as llmc.bench.eval.windows makes them; every
window is an independent sequence from position 0 and scores the tokens after the previous
window's end. When llmc eval's windows score more than --max-tokens tokens (0: no limit), a
subset of them spread evenly over the corpus is taken, whole windows only, so every scored
position is one llmc eval scores, with the same context, and the same for every row.

Reference. llmc's fp32 engine of the model (--reference, or one built once into the peers' cache
dir with `llmc build MODEL`). Its logits at every scored position are written to an .npy file
(cached in the peers' dir, keyed by the engine's manifest and the token windows);
every row runs the same windows and holds its logits, position by position, against that file,
with llmc.bench.eval's arithmetic (float64 log-softmax over the model's vocabulary):
KL(reference || row) in nats per token (mean ± its standard error, median, P99), the share of
positions whose most likely token is the reference's (top-1 agreement), and the row's perplexity
on the same tokens. Only those per-token numbers come back from a peer's worker process.

Rows. Each peer runs in its own worker in the peers' venv (benchmarks/peers_worker.py, set up by
`benchmarks/peers.py --setup`); the conversions are peers.py's, made and cached on demand:
  llama.cpp   the f32 GGUF with an f32 KV cache and flash attention off (a sanity row: KL ~ 0),
              with its defaults (f16 KV cache, flash attention "auto", which is on for the CPU;
              with it on, f32 and f16 KV caches gave bit-identical logits here), with an f16 KV
              cache without flash attention, and with a q8_0 KV cache (flash attention on, which
              a quantized V cache needs); then f16, bf16, Q8_0, Q4_K_M and Q4_0 weights quantized
              from the f32 GGUF by llama.cpp's own quantizer, each with the sanity row's f32 KV
              cache and no flash attention, so only the weights differ from it.
              Token ids go in as llmc's tokenizer makes them; logits are sliced to the model's
              vocabulary (a GGUF's may be padded).
  ORT GenAI   fp32 (sanity), int8 and int4 builds (MatMulNBits, blocks of 32, the accuracy level
              peers.py uses), and int4 with the LM head at int8 (matmul_mixed_precision=
              last_matmul:int8; llama.cpp's Q4 files keep a tied LM head at Q6_K), made without
              prune_lm_head, so the prefill returns every position's
              logits. The worker runs the builder's model.onnx with onnxruntime (the library
              onnxruntime-genai loads) on one window at a time with an empty past.
  llmc        every --llmc NAME=ENGINE_DIR, in this process (llmc.bench.eval's engine scorer).
"bpw" is the bits per weight a decode step reads from the row's own files (peers.py's own-bytes
count: embedding tables that are only gathered count one row) over the safetensors' parameters.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import peers  # (benchmarks/peers.py: the peers' venv and configurations)
from peer_runtimes import accuracy  # (the per-token arithmetic every row shares)
from peer_runtimes import llama_cpp, llmc_engine, ort_genai, roofline, shared  # (conversions, workers, byte counts)

DEFAULT_MAX_TOKENS = 20000
# (row name, peer, variant, KV cache type, flash attention); variants as peers.PEER_ROWS names them.
PEER_ACCURACY_ROWS = (
    ("llama.cpp f32, KV f32, no flash attn (sanity)", "llama.cpp", "f32", "f32", "off"),
    ("llama.cpp f32, KV f16, flash attn auto (its defaults)", "llama.cpp", "f32", "f16", "auto"),
    ("llama.cpp f32, KV f16, no flash attn", "llama.cpp", "f32", "f16", "off"),
    ("llama.cpp f32, KV q8_0, flash attn", "llama.cpp", "f32", "q8_0", "on"),
    ("llama.cpp f16", "llama.cpp", "f16", "f32", "off"),
    ("llama.cpp bf16", "llama.cpp", "bf16", "f32", "off"),
    ("llama.cpp Q8_0", "llama.cpp", "q8_0", "f32", "off"),
    ("llama.cpp Q4_K_M", "llama.cpp", "q4_k_m", "f32", "off"),
    ("llama.cpp Q4_0", "llama.cpp", "q4_0", "f32", "off"),
    ("ort-genai fp32 (sanity)", "ort-genai", "fp32", "fp32", ""),
    ("ort-genai int8", "ort-genai", "int8", "fp32", ""),
    ("ort-genai int4", "ort-genai", "int4", "fp32", ""),
    ("ort-genai int4, LM head int8", "ort-genai", "int4-lm-head-int8", "fp32", ""),
)


# -- the tokens -----------------------------------------------------------------------------------


def plan_windows(ref_dir: Path, context: int | None, overlap: int | None, max_tokens: int):
    """(windows [(document index, tokens, need)], window, overlap, documents, windows in all): llmc
    eval's windows over the held-out corpus, or, when their scored tokens exceed max_tokens, a
    subset of them spread evenly over the whole corpus (the first 20000 tokens would all be one
    large file), each window whole, so every position is scored exactly as llmc eval scores it."""
    from llmc.bench import eval as ev
    from llmc.contract.engine_dir import open_engine

    files = open_engine(ref_dir)
    tok = ev._engine_tokenizer(files.tokenizer)
    _, texts = ev._sources(None, None, "heldout")
    docs, _ = ev._documents(texts, tok, single=False)
    window = context or files.manifest.max_context
    overlap = overlap if overlap is not None else window // 2
    every = [(d, doc.tokens[begin:end], np.arange(first - 1 - begin, end - 1 - begin, dtype=np.int64))
             for d, doc in enumerate(docs) for begin, end, first in ev.windows(len(doc.tokens), window, overlap)]
    total = sum(len(n) for _, _, n in every)
    if not max_tokens or total <= max_tokens:
        return every, window, overlap, docs, len(every)
    pick = np.unique(np.linspace(0, len(every) - 1, max(1, len(every) * max_tokens // total)).round().astype(int))
    plan = [every[i] for i in pick]
    while len(plan) > 1 and sum(len(n) for _, _, n in plan) > max_tokens:
        plan.pop()
    return plan, window, overlap, docs, len(every)


def write_plan(plan, path: Path) -> None:
    """The worker's view of the windows: tokens end to end, and per window (token offset, length,
    first needed position, count, first reference row)."""
    rows, toks, off, row = [], [], 0, 0
    for _, tokens, need in plan:
        rows.append((off, len(tokens), int(need[0]), len(need), row))
        toks.append(tokens)
        off += len(tokens)
        row += len(need)
    np.savez(path, tokens=np.concatenate(toks).astype(np.int64), windows=np.asarray(rows, np.int64))


# -- llmc -------------------------------------------------------------------------------------------


class LlmcScorer:
    def __init__(self, engine_dir: Path, window: int, threads: int):
        from llmc.bench import eval as ev

        self.engine = ev._open_engine(str(engine_dir), window, threads)
        self.scorer = ev._EngineScorer(self.engine, window)
        self.vocab = self.engine.spec.vocab_size

    def window_logits(self, tokens, need):
        out = []
        for sel, logits in self.scorer.window(np.asarray(tokens, np.int64), need, peers_worker_chunk()):
            if sel.size:
                out.append(np.array(logits, dtype=np.float32, copy=True))
        return np.concatenate(out)


def peers_worker_chunk() -> int:
    from llmc.bench.eval import DEFAULT_CHUNK

    return DEFAULT_CHUNK


def reference_logits(ref_dir: Path, plan, window: int, threads: int, out: Path) -> tuple[int, float]:
    """Writes the reference's logits at every scored position to `out` ([rows, vocab] float32)."""
    s = LlmcScorer(ref_dir, window, threads)
    rows = sum(len(need) for _, _, need in plan)
    ref = np.lib.format.open_memmap(out, mode="w+", dtype=np.float32, shape=(rows, s.vocab))
    start, row = time.perf_counter(), 0
    for _, tokens, need in plan:
        logits = s.window_logits(tokens, need)
        ref[row:row + len(need)] = logits[:, :s.vocab]
        row += len(need)
    ref.flush()
    del ref
    return s.vocab, time.perf_counter() - start


# -- summary ------------------------------------------------------------------------------------------


def summarize(res: dict) -> dict:
    kl, same = np.asarray(res["kl"]), np.asarray(res["same"], dtype=float)
    nll, ref_nll = np.asarray(res["nll"]), np.asarray(res["ref_nll"])
    n = len(kl)
    agree = float(same.mean())
    ppl, ref_ppl = math.exp(nll.mean()), math.exp(ref_nll.mean())
    return {"tokens": n, "kl_mean": float(kl.mean()), "kl_mean_stderr": float(kl.std(ddof=1) / math.sqrt(n)),
            "kl_median": float(np.median(kl)), "kl_p99": float(np.percentile(kl, 99)), "kl_max": float(kl.max()),
            "top1_agreement": agree, "top1_agreement_stderr": math.sqrt(agree * (1 - agree) / n),
            "perplexity": ppl, "reference_perplexity": ref_ppl, "perplexity_ratio": ppl / ref_ppl,
            "seconds": res.get("seconds")}


def _num(x: float) -> str:
    return f"{x:.6f}" if x == 0 or abs(x) >= 1e-3 else f"{x:.2e}"


def render(res: dict) -> str:
    s = res["setup"]
    out = [(f"{s['model']}: KL(llmc fp32 || row) and top-1 agreement on {s['scored_tokens']:,} scored tokens of the "
            f"held-out corpus ({s['windows']} of llmc eval's {s['eval_windows']} windows of up to {s['context']} "
            f"tokens, overlap {s['overlap']}, spread over {s['documents']} of {s['corpus_documents']} documents; "
            f"--max-tokens {s['max_tokens']}); reference {s['reference']}, "
            f"perplexity {s['reference_perplexity']:.4f}"),
           "",
           ("| runtime | weights | KV cache | bpw | mean KL (nats/token) | median KL | P99 KL | top-1 agreement | "
            "perplexity (Δ) |"),
           "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for name, r in res["rows"].items():
        if "error" in r:
            out.append(f"| {name} | {r.get('weights', '')} | {r.get('kv', '')} | | failed: {r['error']} | | | | |")
            continue
        m = r["stats"]
        bpw = f"{r['bits_per_weight']:.2f}" if r.get("bits_per_weight") else "-"
        out.append(f"| {name} | {r['weights']} | {r['kv']} | {bpw} | "
                   f"{_num(m['kl_mean'])} ± {_num(m['kl_mean_stderr'])}"
                   f" | {_num(m['kl_median'])} | {_num(m['kl_p99'])} | {m['top1_agreement'] * 100:.2f} ± "
                   f"{m['top1_agreement_stderr'] * 100:.2f} % | {m['perplexity']:.4f} "
                   f"({(m['perplexity_ratio'] - 1) * 100:+.2f}%) |")
    return "\n".join(out)


# -- main ---------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="code-small", help="recipe name or local HF folder")
    ap.add_argument("--reference", type=Path, default=None,
                    help="llmc fp32 engine of --model (default: built once into the peers' cache dir)")
    ap.add_argument("--llmc", action="append", default=[], metavar="NAME=ENGINE_DIR",
                    help="an llmc engine to compare (repeatable)")
    ap.add_argument("--peers", default=",".join(peers.PEERS),
                    help=f"comma-separated subset of {','.join(peers.PEERS)}; \"\" for llmc engines only")
    ap.add_argument("--rows", default="", help="only peer rows whose name contains one of these comma-separated "
                                               "substrings (e.g. 'Q4,sanity')")
    ap.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                    help="score the first windows up to this many tokens (0: the whole held-out corpus)")
    ap.add_argument("--context", type=int, default=None, help="window length [default: the reference's max context]")
    ap.add_argument("--overlap", type=int, default=None, help="[default: half the window]")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ort-accuracy-level", type=int, choices=[1, 2, 3, 4], default=ort_genai.ORT_GENAI_ACCURACY_LEVEL)
    ap.add_argument("--peers-venv", type=Path, default=shared.cache_root() / "peers-venv")
    ap.add_argument("--peers-dir", type=Path, default=shared.cache_root() / "peers")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args()

    from llmc.compiler.recipes import is_recipe, materialize

    folder = materialize(args.model) if is_recipe(args.model) else Path(args.model).resolve()
    chosen = [p for p in args.peers.split(",") if p]
    unknown = set(chosen) - set(peers.PEERS)
    if unknown:
        raise SystemExit(f"error: unknown peer {min(unknown)!r}; peers are {', '.join(peers.PEERS)}")
    wanted_rows = [r for r in PEER_ACCURACY_ROWS if r[1] in chosen
                   and (not args.rows or any(k in r[0] for k in args.rows.split(",") if k))]
    engines = llmc_engine.parse_llmc(args.llmc)
    root = args.peers_dir.expanduser().resolve()

    ref_dir = args.reference
    if ref_dir is None:
        ref_dir = root / "accuracy" / folder.name / "engine-fp32"
        from llmc.contract import MANIFEST

        if not (ref_dir / MANIFEST).is_file():
            ref_dir.parent.mkdir(parents=True, exist_ok=True)
            err = llmc_engine.build_engine(args.model, ref_dir, [])
            if err:
                raise SystemExit(f"error: llmc build {args.model} failed: {err}")

    plan, window, overlap, docs, all_windows = plan_windows(ref_dir, args.context, args.overlap, args.max_tokens)
    scored = sum(len(n) for _, _, n in plan)
    print(f"plan: {len(plan)} of llmc eval's {all_windows} windows of up to {window} tokens (overlap {overlap}), "
          f"over {len({d for d, _, _ in plan})} of {len(docs)} held-out documents, {scored} scored tokens",
          flush=True)

    converted, python = {}, None
    if wanted_rows:
        try:
            python = peers.setup_venv(args.peers_venv.expanduser().resolve(), root, root / "setup.log")
            for _, peer, variant, _, _ in wanted_rows:
                if (peer, variant) in converted:
                    continue
                if peer == "llama.cpp":
                    converted[(peer, variant)] = llama_cpp.convert_gguf(python, root, folder, root / "setup.log",
                                                                        variant)
                else:
                    converted[(peer, variant)] = ort_genai.convert_ort(python, root, folder, root / "setup.log",
                                                                       variant, all_logits=True,
                                                                       accuracy_level=args.ort_accuracy_level)
        except shared.SetupError as exc:
            raise SystemExit(f"error: {exc}") from None

    params = roofline.parameter_count(folder)
    work = Path(tempfile.mkdtemp(prefix="llmc-quant-accuracy-"))
    rows: dict[str, dict] = {}
    ok = True
    try:
        plan_file = work / "plan.npz"
        write_plan(plan, plan_file)
        # The reference's logits are cached next to the conversions, keyed by the engine's manifest
        # (which holds its files' checksums) and the plan, so a later run with another row reuses them.
        key = hashlib.sha256((ref_dir / "manifest.json").read_bytes()
                             + np.load(plan_file)["tokens"].tobytes() + np.load(plan_file)["windows"].tobytes())
        ref_file = root / "accuracy" / folder.name / f"reference-{key.hexdigest()[:16]}.npy"
        if ref_file.is_file():
            vocab = int(np.load(ref_file, mmap_mode="r").shape[1])
            print(f"reference: {ref_dir}, {scored} positions x {vocab} logits cached in {ref_file}", flush=True)
        else:
            ref_file.parent.mkdir(parents=True, exist_ok=True)
            for old in ref_file.parent.glob("reference-*.npy"):  # one cached reference per model
                old.unlink()
            tmp = ref_file.with_suffix(".tmp.npy")
            vocab, secs = reference_logits(ref_dir, plan, window, args.threads, tmp)
            os.replace(tmp, ref_file)
            print(f"reference: {ref_dir}, {scored} positions x {vocab} logits in {secs:.1f}s, cached in "
                  f"{ref_file}", flush=True)

        def bpw(nbytes):
            return nbytes * 8 / params if nbytes else None

        for name, path in engines:
            print(f"row: {name} ({path})", flush=True)
            wb, how, _ = roofline.onnx_weight_bytes(path / "model.onnx")
            row = {"runtime": "llmc", "path": str(path), "weights": "llmc engine", "kv": "fp32",
                   "weight_bytes": wb, "weight_bytes_how": how, "bits_per_weight": bpw(wb)}
            try:
                from llmc.contract.engine_dir import open_engine

                m = open_engine(path).manifest
                row["kv"] = m.kv_cache.dtype
                s = LlmcScorer(path, window, args.threads)
                row["stats"] = summarize(accuracy.accuracy(s.window_logits, str(plan_file), str(ref_file), vocab))
            except Exception as exc:  # noqa: BLE001  (a row that fails is reported, the others still run)
                row["error"] = f"{type(exc).__name__}: {exc}"
                ok = False
            rows[name] = row

        for name, peer, variant, kv, fa in wanted_rows:
            path = converted[(peer, variant)]
            print(f"row: {name} ({path})", flush=True)
            if peer == "llama.cpp":
                wb, how = llama_cpp.gguf_weight_bytes(path)
                wargs = [peer, "--model", str(path), "--threads", str(args.threads), "--max-seqs", "1",
                         "--ctx-per-seq", str(window), "--kv-type", kv, "--flash-attn", fa]
                weights = {"f32": "f32", "f16": "f16", "bf16": "bf16"}.get(variant, variant.upper())
            else:
                wb, how, _ = roofline.onnx_weight_bytes(path / "model.onnx")
                wargs = [peer, "--model", str(path), "--threads", str(args.threads)]
                precision = ort_genai.ORT_GENAI_VARIANTS.get(variant, (variant,))[0]
                weights = variant + (f" (MatMulNBits, block {ort_genai.ORT_GENAI_BLOCK_SIZE}, accuracy_level "
                                     f"{args.ort_accuracy_level})" if precision in ("int4", "int8") else "")
            row = {"runtime": peer, "variant": variant, "path": str(path), "weights": weights,
                   "kv": kv + {"on": ", flash attn", "auto": ", flash attn auto", "off": ""}.get(fa, ""),
                   "weight_bytes": wb, "weight_bytes_how": how,
                   "bits_per_weight": bpw(wb)}
            if peer == "ort-genai":
                row["ort_genai_options"] = list(ort_genai.ort_genai_options(variant, True, args.ort_accuracy_level))
            w = None
            try:
                w = shared.Worker(name, python, wargs, work / f"{peer}-{len(rows)}.log", shared.peer_env())
                row["info"] = w.info
                row["stats"] = summarize(w.call("accuracy", plan=str(plan_file), ref=str(ref_file), vocab=vocab))
            except RuntimeError as exc:
                row["error"] = str(exc)
                ok = False
                print(f"error: {exc}", flush=True)
            finally:
                if w is not None:
                    w.close()
            rows[name] = row
            if "stats" in row:
                m = row["stats"]
                print(f"  mean KL {_num(m['kl_mean'])} nats, top-1 {m['top1_agreement'] * 100:.2f}%, "
                      f"{m['seconds']:.1f}s", flush=True)
    finally:
        if ok:
            shutil.rmtree(work, ignore_errors=True)
        else:
            (work / "plan.npz").unlink(missing_ok=True)
            print(f"worker logs kept in {work}")

    ref_ppl = next((r["stats"]["reference_perplexity"] for r in rows.values() if "stats" in r), float("nan"))
    res = {"setup": {"model": args.model, "folder": str(folder), "reference": str(ref_dir), "corpus": "heldout",
                     "max_tokens": args.max_tokens, "scored_tokens": scored, "windows": len(plan),
                     "eval_windows": all_windows, "documents": len({d for d, _, _ in plan}),
                     "corpus_documents": len(docs), "context": window, "overlap": overlap,
                     "threads": args.threads, "parameters": params, "reference_perplexity": ref_ppl,
                     "llama_cpp_python": llama_cpp.LLAMA_CPP_PYTHON, "onnxruntime_genai": ort_genai.ORT_GENAI},
           "rows": rows}
    print()
    print(render(res))
    if args.json:
        args.json.write_text(json.dumps(res, indent=1) + "\n")
        print(f"\nresults: {args.json}")
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
