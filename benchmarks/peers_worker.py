"""Worker side of benchmarks/peers.py: one runtime per process, driven over a JSON-lines pipe.

    python benchmarks/peers_worker.py serve {llmc,llama.cpp,llama.cpp-lookup,ort-genai,bandwidth} --model PATH --threads N
    python benchmarks/peers_worker.py convert-gguf --src HF_DIR --out FILE.gguf --llama-cpp SRC_DIR
    python benchmarks/peers_worker.py quantize-gguf --src F32.gguf --out FILE.gguf --ftype {f16,bf16,q8_0,q4_0,q4_k_m}

This file runs under two interpreters: the repo's venv (llmc, bandwidth) and the peers' venv
(llama.cpp, ORT GenAI), so at module level it and the backends' modules (benchmarks/peer_runtimes/,
one per runtime) import only the standard library and numpy, and each backend imports its own
runtime lazily.

Besides timing, every model backend answers `accuracy` (benchmarks/quant_accuracy.py): the logits
it gives at chosen positions of token windows, held against a reference's logits saved to an .npy
file, so only per-token numbers (KL, NLL, top-1 match) travel back over the pipe.

Protocol: the driver writes one JSON request per line on stdin; the worker answers one JSON line
on the protocol pipe, which is the process's original stdout. fd 1 itself is pointed at stderr
before any runtime loads, so a C library printing to stdout cannot corrupt the protocol.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

from peer_runtimes.bandwidth import BandwidthBackend
from peer_runtimes.llama_cpp import (GGUF_FTYPES, LlamaCppBackend, LlamaCppLookupBackend, run_convert_gguf,
                                     run_quantize_gguf)
from peer_runtimes.llmc_engine import LlmcBackend
from peer_runtimes.ort_genai import OrtGenAIBackend


# -- serving loop -------------------------------------------------------------------------------------


def serve(args) -> None:
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything a runtime prints to stdout now lands in the log, not the protocol
    sys.stdout = sys.stderr

    def send(obj):
        proto.write(json.dumps(obj) + "\n")

    try:
        if args.backend == "llmc":
            backend = LlmcBackend(args.model, args.threads, args.max_seqs, args.speculative,
                                  args.num_speculative_tokens)
        elif args.backend == "llama.cpp-lookup":
            backend = LlamaCppLookupBackend(args.model, args.threads, args.ctx_per_seq, args.lookup, args.max_ngram)
        elif args.backend == "llama.cpp":
            backend = LlamaCppBackend(args.model, args.threads, args.max_seqs, args.ctx_per_seq, args.kv_type,
                                      args.flash_attn)
        elif args.backend == "ort-genai":
            backend = OrtGenAIBackend(args.model, args.threads)
        else:
            backend = BandwidthBackend(args.threads, args.buffer_mib, args.cache)
    except Exception as exc:
        traceback.print_exc()
        send({"error": f"{type(exc).__name__}: {exc}"})
        return
    send({"ready": True, "info": backend.info, "pid": os.getpid()})
    for line in sys.stdin:
        req = json.loads(line)
        cmd = req.pop("cmd")
        if cmd == "quit":
            break
        try:
            send({"result": getattr(backend, cmd)(**req)})
        except Exception as exc:
            traceback.print_exc()
            send({"error": f"{cmd}: {type(exc).__name__}: {exc}"})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="mode", required=True)
    s = sub.add_parser("serve")
    s.add_argument("backend", choices=["llmc", "llama.cpp", "llama.cpp-lookup", "ort-genai", "bandwidth"])
    s.add_argument("--model", default="")
    s.add_argument("--threads", type=int, default=2)
    s.add_argument("--max-seqs", type=int, default=8)
    s.add_argument("--ctx-per-seq", type=int, default=512)
    s.add_argument("--kv-type", choices=["f32", "f16", "q8_0"], default="f16")
    s.add_argument("--flash-attn", choices=["auto", "on", "off"], default="auto", help="llama.cpp only")
    s.add_argument("--buffer-mib", type=int, default=1024)
    s.add_argument("--cache", default="", help="where the bandwidth kernel is compiled to")
    s.add_argument("--speculative", default=None, help="llmc only: ngram or a draft engine")
    s.add_argument("--num-speculative-tokens", type=int, default=None, help="llmc only")
    s.add_argument("--lookup", type=int, default=0, help="llama.cpp-lookup: tokens proposed (0: no draft)")
    s.add_argument("--max-ngram", type=int, default=3, help="llama.cpp-lookup: longest n-gram matched")
    c = sub.add_parser("convert-gguf")
    c.add_argument("--src", required=True)
    c.add_argument("--out", required=True)
    c.add_argument("--llama-cpp", required=True, help="llama.cpp source tree (vendor/llama.cpp of the sdist)")
    c.add_argument("--outtype", default="f32")
    c.add_argument("extra", nargs="*", help="more converter flags, after --")
    q = sub.add_parser("quantize-gguf")
    q.add_argument("--src", required=True, help="the f32 GGUF")
    q.add_argument("--out", required=True)
    q.add_argument("--ftype", required=True, choices=sorted(GGUF_FTYPES))
    q.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.mode == "serve":
        serve(args)
    elif args.mode == "quantize-gguf":
        run_quantize_gguf(args)
    else:
        run_convert_gguf(args)


if __name__ == "__main__":
    main()
