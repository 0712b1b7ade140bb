"""Scale-out: N one-thread replicas behind Ray Serve's router against one, same workload, interleaved.

    python benchmarks/scale_out.py --engine ENGINE [--replicas 1,2] [--rounds 2] [--qps 2,4,max]
        [--num-requests 32] [--prompt-len 128] [--output-len 64]

Each round starts `llmc serve ENGINE --replicas R --threads 1` for every R in turn (the order
alternates per round), drives it with `llmc bench --url` over the QPS sweep, and stops it
(SIGINT, which shuts Ray down). Throughput is output tokens per second of wall time as the
client saw it; the table gives each rate's median over rounds and the ratio to the first R.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(engine: str, replicas: int, port: int) -> subprocess.Popen:
    server = subprocess.Popen([sys.executable, "-m", "llmc.cli", "serve", engine, "--replicas", str(replicas),
                               "--threads", "1", "--port", str(port), "--model", "m"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return server
        except OSError:
            if server.poll() is not None:
                raise SystemExit(f"llmc serve --replicas {replicas} exited with {server.returncode}")
            time.sleep(0.5)
    raise SystemExit(f"llmc serve --replicas {replicas} was not healthy after 180 s")


def _stop(server: subprocess.Popen) -> None:
    server.send_signal(signal.SIGINT)
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine", required=True)
    ap.add_argument("--replicas", default="1,2")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--qps", default="2,4,max")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--prompt-len", default="128")
    ap.add_argument("--output-len", default="64")
    args = ap.parse_args()
    counts = [int(r) for r in args.replicas.split(",")]
    rates = [q if q == "max" else float(q) for q in args.qps.split(",")]

    throughput: dict[tuple[int, str], list[float]] = {(r, q): [] for r in counts for q in rates}
    completed: dict[int, list[str]] = {r: [] for r in counts}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for replicas in counts if round_ % 2 == 0 else counts[::-1]:
                port = _free_port()
                server = _serve(args.engine, replicas, port)
                out = Path(tmp) / f"r{replicas}-{round_}"
                try:
                    subprocess.run([sys.executable, "-m", "llmc.cli", "bench", "--url", f"http://127.0.0.1:{port}",
                                    "--qps", args.qps, "--num-requests", str(args.num_requests), "--prompt-len",
                                    args.prompt_len, "--output-len", args.output_len, "--seed", str(round_),
                                    "--no-plots", "-o", str(out)], check=True, stdout=subprocess.DEVNULL)
                finally:
                    stopping = time.monotonic()
                    _stop(server)
                    print(f"stopped in {time.monotonic() - stopping:.1f} s", file=sys.stderr)
                for run in json.loads((out / "report.json").read_text())["runs"]:
                    throughput[(replicas, run["qps"])].append(run["summary"]["throughput"])
                    c = run["summary"]["counts"]
                    completed[replicas].append(f"{c['completed']}/{c['requests']}")
                print(f"round {round_ + 1}: {replicas} replica(s) done", file=sys.stderr, flush=True)

    base = counts[0]
    print(f"\n{args.num_requests} requests per rate, prompt {args.prompt_len}, output {args.output_len}; "
          f"output tok/s, median of {args.rounds} rounds")
    print("| qps | " + " | ".join(f"{r} replica{'s' * (r > 1)}" for r in counts) + " | "
          + " | ".join(f"{r}/{base}" for r in counts[1:]) + " |")
    print("|---" * (2 * len(counts)) + "|")
    for q in rates:
        med = {r: statistics.median(throughput[(r, q)]) for r in counts}
        label = q if q == "max" else f"{q:g}"
        print(f"| {label} | " + " | ".join(f"{med[r]:.1f}" for r in counts) + " | "
              + " | ".join(f"{med[r] / med[base]:.2f}x" for r in counts[1:]) + " |")
    print("completed/sent per run: " + "; ".join(f"{r}: {' '.join(completed[r])}" for r in counts))


if __name__ == "__main__":
    main()
