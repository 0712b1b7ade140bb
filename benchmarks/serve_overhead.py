"""What HTTP costs: `llmc serve` streaming against the same engine in-process, interleaved.

    python benchmarks/serve_overhead.py --engine ENGINE [--rounds 6] [--prompt 128] [--new 64] [--concurrency 16]

In-process: AsyncLLM in a worker process of its own, timed by RequestOutput.metrics (arrival =
add_request). HTTP: `llmc serve` in its own process, driven by the openai client (AsyncOpenAI,
streaming) from this one and timed as a user sees it: request sent -> first text chunk (TTFT),
(last chunk - first chunk) / (n - 1) (TPOT), gaps between chunks (ITL). Each round runs batch 1
(one request at a time, --requests of them) and then --concurrency streams at once, on both
sides in turn (order alternating per round); prompts are distinct random token ids, so nothing
hits the prefix cache.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

import numpy as np


def _in_process(conn, engine: str) -> None:
    from llmc.runtime.async_llm import AsyncLLM
    from llmc.runtime.sampling import SamplingParams

    llm = AsyncLLM(engine)

    async def one(prompt, n):
        stream = await llm.add_request(prompt, SamplingParams(max_tokens=n, ignore_eos=True))
        async for out in stream:
            last = out
        m = last.metrics
        return m.ttft, m.tpot, m.itl

    async def batch(prompts, n):
        return await asyncio.gather(*(one(p, n) for p in prompts))

    loop = asyncio.new_event_loop()  # one loop for the worker's life: AsyncLLM's step loop lives on it
    conn.send("ready")
    while (job := conn.recv()) is not None:
        prompts, n, together = job
        if together:
            conn.send(loop.run_until_complete(batch(prompts, n)))
        else:
            conn.send([loop.run_until_complete(batch([p], n))[0] for p in prompts])


async def _http_one(client, prompt, n):
    start = time.perf_counter()
    stream = await client.completions.create(model="m", prompt=prompt, max_tokens=n, stream=True,
                                             extra_body={"ignore_eos": True})
    times = []
    async for chunk in stream:
        if chunk.choices:  # one event per token, also where its text is empty (a partial UTF-8 character)
            times.append(time.perf_counter())
    ttft = times[0] - start
    return ttft, (times[-1] - times[0]) / (len(times) - 1), [b - a for a, b in zip(times, times[1:])]


def _http(url: str, prompts, n, together: bool):
    import openai

    async def run():
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client:
            if together:
                return await asyncio.gather(*(_http_one(client, p, n) for p in prompts))
            return [await _http_one(client, p, n) for p in prompts]

    return asyncio.run(run())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine", required=True)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    args = ap.parse_args()

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "llmc.cli", "serve", args.engine, "--port", str(port),
                               "--model", "m"], stderr=subprocess.DEVNULL)
    ctx = multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    worker = ctx.Process(target=_in_process, args=(child, args.engine), daemon=True)
    worker.start()
    try:
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=1)
                break
            except OSError:
                if server.poll() is not None:
                    raise SystemExit(f"llmc serve {args.engine} exited with {server.returncode}")
                time.sleep(0.2)
        assert conn.recv() == "ready"
        from llmc.runtime.llm import LLM

        vocab = LLM(args.engine).engine.spec.vocab_size
        rng = np.random.default_rng(0)

        def prompts(k):
            return [rng.integers(3, vocab, args.prompt).tolist() for _ in range(k)]

        def local(ps, together):
            conn.send((ps, args.new, together))
            return conn.recv()

        runs = {("in-process", False): [], ("http", False): [], ("in-process", True): [], ("http", True): []}
        _http(url, prompts(2), args.new, False)  # warm both
        local(prompts(2), False)
        for rnd in range(args.rounds):
            for together, k in ((False, args.requests), (True, args.concurrency)):
                sides = [("in-process", lambda ps: local(ps, together)),
                         ("http", lambda ps: _http(url, ps, args.new, together))]
                for name, run in (sides if rnd % 2 == 0 else sides[::-1]):
                    time.sleep(0.2)  # the other side's idle threads park
                    runs[name, together] += run(prompts(k))
    finally:
        conn.send(None)
        server.terminate()
        server.wait()

    def mean(xs):
        return statistics.mean(xs) * 1e3

    print(f"engine {args.engine}: {args.prompt}-token prompts, {args.new} new tokens, {args.rounds} rounds, "
          "interleaved; ms")
    b1 = {name: runs[name, False] for name in ("in-process", "http")}
    print(f"batch 1 ({args.requests} requests per round): TTFT mean, TPOT mean")
    for name, rs in b1.items():
        print(f"  {name:>10} TTFT {mean([r[0] for r in rs]):7.3f}  TPOT {mean([r[1] for r in rs]):7.3f}")
    print(f"  http / in-process: TTFT {mean([r[0] for r in b1['http']]) / mean([r[0] for r in b1['in-process']]):.3f}x"
          f"  TPOT {mean([r[1] for r in b1['http']]) / mean([r[1] for r in b1['in-process']]):.3f}x")
    many = {name: runs[name, True] for name in ("in-process", "http")}
    print(f"{args.concurrency} concurrent streams: TPOT p50 / p99 over requests, ITL p99 over gaps")
    p99 = {}
    for name, rs in many.items():
        tpot = [r[1] for r in rs]
        itl = [g for r in rs for g in r[2]]
        p99[name] = np.percentile(tpot, 99)
        print(f"  {name:>10} TPOT p50 {np.percentile(tpot, 50) * 1e3:7.3f}  p99 {p99[name] * 1e3:7.3f}  "
              f"ITL p99 {np.percentile(itl, 99) * 1e3:7.3f}")
    print(f"  http / in-process: TPOT p99 {p99['http'] / p99['in-process']:.3f}x")


if __name__ == "__main__":
    main()
