"""What HTTP costs: `llmc serve` streaming against the same engine in-process, interleaved.

    python benchmarks/serve_overhead.py --engine ENGINE [--rounds 6] [--prompt 128] [--new 64] [--concurrency 16]

Every side is timed as its caller sees it: request made -> first token in hand (TTFT), (last -
first) / (n - 1) (TPOT), gaps between tokens (ITL). In-process: AsyncLLM in a worker process of its
own, timed where its stream yields ("in-process", the ratios' base) and, for reference, by the
engine's RequestOutput.metrics ("in-process engine": arrival = add_request, a token's time = its
step's end, before it reaches any caller). HTTP: `llmc serve` in its own process, driven from this
one by two clients:
- "openai": the openai package's AsyncOpenAI, streaming;
- "sse": bare asyncio keep-alive connections (one per concurrent stream, opened before the
  timing starts, as a client's pool holds them) that read the event stream's lines and
  json-decode each event. The server's overhead, with the least client CPU on the cores the
  server shares here (a client on another machine takes none).
Each round runs batch 1 (one request at a time, --requests of them) and then --concurrency
streams at once, on every side in turn (order rotating per round); prompts are distinct random
token ids, so nothing hits the prefix cache. Every side decodes greedily: the API's default
temperature (1) would add a sampling pass over the vocabulary per token to the HTTP sides only.
It also prints the batch-1 sse side's CPU a token (Linux: the loop thread's /proc schedstat): what
the server's event loop and the client take from the cores ONNX Runtime's threads use.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np


CLIENTS = ("sse", "openai")
SIDES = ("in-process", "in-process engine", *(f"http {c}" for c in CLIENTS))


def _in_process(conn, engine: str) -> None:
    from llmc.runtime.async_llm import AsyncLLM
    from llmc.runtime.sampling import SamplingParams

    llm = AsyncLLM(engine)

    async def one(prompt, n):
        start = time.perf_counter()
        stream = await llm.add_request(prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        times = []
        async for out in stream:
            times += [time.perf_counter()] * (len(out.token_ids) - len(times))
            last = out
        m = last.metrics
        return _timings(start, times), (m.ttft, m.tpot, m.itl)

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
    stream = await client.completions.create(model="m", prompt=prompt, max_tokens=n, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True})
    times = []
    async for chunk in stream:
        if chunk.choices:  # one event per token, also where its text is empty (a partial UTF-8 character)
            times.append(time.perf_counter())
    return _timings(start, times)


def _timings(start: float, times: list[float]):
    """(TTFT, TPOT, ITL gaps) of one request sent at `start` whose tokens arrived at `times`."""
    return times[0] - start, (times[-1] - times[0]) / (len(times) - 1), [b - a for a, b in zip(times, times[1:])]


async def _sse_one(connection, prompt, n):
    """One streamed request on an open keep-alive connection (as a client's pool keeps them), read
    to the end of its chunked body so that the connection can take the next."""
    reader, writer = connection
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": n, "temperature": 0,
                       "stream": True, "ignore_eos": True}).encode()
    start = time.perf_counter()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    times = []
    while line := await reader.readline():  # chunked transfer: size lines, event lines, blank lines
        if line.startswith(b"data: {"):
            if json.loads(line[6:])["choices"]:
                times.append(time.perf_counter())
        elif line == b"0\r\n":  # the last chunk: its blank line ends the response
            await reader.readline()
            break
    return _timings(start, times)


def _http(url: str, client: str, prompts, n, together: bool):
    async def each(one):  # all at once, or one after another
        if together:
            return await asyncio.gather(*(one(p) for p in prompts))
        return [await one(p) for p in prompts]

    async def run():
        if client == "sse":
            port = int(url.rsplit(":", 1)[1])
            pool = [await asyncio.open_connection("127.0.0.1", port) for _ in range(len(prompts) if together else 1)]
            try:
                if together:
                    return await asyncio.gather(*(_sse_one(c, p, n) for c, p in zip(pool, prompts)))
                return [await _sse_one(pool[0], p, n) for p in prompts]
            finally:
                for _, writer in pool:
                    writer.close()
        import openai

        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as http:
            return await each(lambda p: _http_one(http, p, n))

    return asyncio.run(run())


def _schedstat(pid: int) -> tuple[int, int]:
    """A process's main thread's ns on a CPU and ns runnable but waiting for one (Linux's /proc)."""
    run_ns, wait_ns, _ = Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()
    return int(run_ns), int(wait_ns)


def _cpu_spent(pid: int, before: tuple[int, int], client_before: float, tokens: int) -> tuple[float, float, float]:
    """Seconds a token since `before`: the server's event loop (its main thread) on a CPU and
    runnable but waiting for one, and this client process on a CPU."""
    run_ns, wait_ns = (a - b for a, b in zip(_schedstat(pid), before))
    return run_ns / 1e9 / tokens, wait_ns / 1e9 / tokens, (time.process_time() - client_before) / tokens


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

        def local(ps, together):  # caller-timed, and the engine's metrics of the same requests
            conn.send((ps, args.new, together))
            pairs = conn.recv()
            runs["in-process engine", together] += [engine for _, engine in pairs]
            return [caller for caller, _ in pairs]

        runs = {(name, together): [] for name in SIDES for together in (False, True)}
        cpu = []  # the batch-1 sse side's CPU a token, per round
        for client in CLIENTS:  # warm every side
            _http(url, client, prompts(2), args.new, False)
        local(prompts(2), False)
        runs["in-process engine", False].clear()
        for rnd in range(args.rounds):
            for together, k in ((False, args.requests), (True, args.concurrency)):
                sides = [("in-process", lambda ps: local(ps, together))]
                sides += [(f"http {c}", lambda ps, c=c: _http(url, c, ps, args.new, together)) for c in CLIENTS]
                for name, run in sides[rnd % len(sides):] + sides[:rnd % len(sides)]:
                    time.sleep(0.2)  # the other side's idle threads park
                    ps, watched = prompts(k), name == "http sse" and not together
                    before = (_schedstat(server.pid), time.process_time()) if watched else None
                    runs[name, together] += run(ps)
                    if watched:
                        cpu.append(_cpu_spent(server.pid, *before, tokens=k * args.new))
    finally:
        conn.send(None)
        server.terminate()
        server.wait()

    def mean(xs):
        return statistics.mean(xs) * 1e3

    print(f"engine {args.engine}: {args.prompt}-token prompts, {args.new} new tokens, {args.rounds} rounds, "
          "interleaved; ms")
    print(f"batch 1 ({args.requests} requests per round): TTFT mean, TPOT mean; / in-process")
    base = runs["in-process", False]
    for name in SIDES:
        rs = runs[name, False]
        ttft, tpot = mean([r[0] for r in rs]), mean([r[1] for r in rs])
        print(f"  {name:>12} TTFT {ttft:7.3f}  TPOT {tpot:7.3f}   {ttft / mean([r[0] for r in base]):.3f}x"
              f"  {tpot / mean([r[1] for r in base]):.3f}x")
    if cpu:
        loop, loop_wait, client = (mean([c[i] for c in cpu]) for i in range(3))
        print(f"  http sse, a token's share of the side's CPU (requests and prefills included): server's event "
              f"loop {loop:.3f} (and {loop_wait:.3f} runnable, waiting for a core), client {client:.3f}")
    print(f"{args.concurrency} concurrent streams: TPOT p50 / p99 over requests, ITL p99 over gaps; p99 / in-process")
    base = np.percentile([r[1] for r in runs["in-process", True]], 99)
    for name in SIDES:
        rs = runs[name, True]
        tpot = [r[1] for r in rs]
        itl = [g for r in rs for g in r[2]]
        p99 = np.percentile(tpot, 99)
        print(f"  {name:>12} TPOT p50 {np.percentile(tpot, 50) * 1e3:7.3f}  p99 {p99 * 1e3:7.3f}  "
              f"ITL p99 {np.percentile(itl, 99) * 1e3:7.3f}   {p99 / base:.3f}x")


if __name__ == "__main__":
    main()
