"""What HTTP costs: `llmc serve` streaming against the same engine in-process, interleaved.

    python benchmarks/serve_overhead.py --engine ENGINE [--rounds 6] [--prompt 128] [--new 64]
        [--concurrency 16] [--spacing 2]

Every side is timed as its caller sees it: request made -> first token in hand (TTFT), (last -
first) / (n - 1) (TPOT), gaps between tokens (ITL). In-process: AsyncLLM in a worker process of its
own on uvloop (the loop the server runs), timed where its stream yields ("in-process", the
ratios' base) and, for reference, by the engine's RequestOutput.metrics ("in-process engine":
arrival = add_request, a token's time = its step's end, before it reaches any caller). HTTP:
`llmc serve` in its own process, driven from this one by two clients:
- "openai": the openai package's AsyncOpenAI, streaming;
- "sse": bare keep-alive sockets (one per concurrent stream, each read by a thread of its own
  with blocking recv calls; opened before the timing starts, as a client's pool holds them) that
  json-decode each event. The server's overhead, with the least client CPU on the cores the
  server shares here (a client on another machine takes none): half an asyncio reader's.
Each round starts the server and the in-process worker afresh (a process's memory placement is
worth a few percent of its step times) and runs three loads, each on every side in turn (order
rotating per round): batch 1 (one
request at a time, --requests of them), --concurrency streams sent at once, and as many sent
--spacing ms apart. "At once" is one loop tick in-process, where the engine's first step takes
several prompts, but over HTTP the server parses the requests one by one and the first often
starts alone: its TTFT falls and its TPOT rises (it decodes through the others' prefills) at the
same E2E, which the at-once rows print beside. Spaced requests arrive alike on every side.
A ratio's bracket is a 95% bootstrap interval over rounds (each round's processes are a draw of
their own): one run's ratios move by a few points on a shared 2-core host, as much as a target's
margin, and the interval says how far this run pins them.
Prompts are distinct random token ids, so nothing hits the prefix cache. Every side decodes
greedily: the API's default temperature (1) would add a sampling pass over the vocabulary per
token to the HTTP sides only.
It also prints the batch-1 sse side's CPU a token (Linux: the loop thread's /proc schedstat): what
the server's event loop and the client take from the cores ONNX Runtime's threads use; and each
HTTP side's batch-1 TTFT and TPOT as the server's engine timed them (its /metrics histograms, a
token at its step's end), beside the in-process engine's: where those two agree with the callers'
ratios, HTTP costs the engine's steps (CPU taken from them), not the tokens' way to the client.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import re
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np


CLIENTS = ("sse", "openai")
SIDES = ("in-process", "in-process engine", *(f"http {c}" for c in CLIENTS))


def _in_process(conn, engine: str) -> None:
    from llmc.runtime.async_llm import AsyncLLM
    from llmc.runtime.sampling import SamplingParams

    llm = AsyncLLM(engine)

    async def one(prompt, n, delay=0.0):
        await asyncio.sleep(delay)
        start = time.perf_counter()
        stream = await llm.add_request(prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        times = []
        async for out in stream:
            times += [time.perf_counter()] * (len(out.token_ids) - len(times))
            last = out
        m = last.metrics
        return _timings(start, times), (m.ttft, m.tpot, m.itl)

    async def batch(prompts, n, spacing):
        return await asyncio.gather(*(one(p, n, i * spacing) for i, p in enumerate(prompts)))

    import uvloop  # the loop `llmc serve` runs on (uvicorn[standard]): the sides differ by HTTP alone

    loop = uvloop.new_event_loop()  # one loop for the worker's life: AsyncLLM's step loop lives on it
    conn.send("ready")
    while (job := conn.recv()) is not None:
        prompts, n, spacing = job
        if spacing is None:
            conn.send([loop.run_until_complete(batch([p], n, 0.0))[0] for p in prompts])
        else:
            conn.send(loop.run_until_complete(batch(prompts, n, spacing)))


async def _openai_one(client, prompt, n, delay=0.0):
    await asyncio.sleep(delay)
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


def _sse_one(sock: socket.socket, prompt, n, delay=0.0):
    """One streamed request on an open keep-alive connection, read to the end of its chunked body
    so that the connection can take the next. A token's time is when the read that brought it
    returned."""
    time.sleep(delay)
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": n, "temperature": 0,
                       "stream": True, "ignore_eos": True}).encode()
    start = time.perf_counter()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    times, rest = [], b""
    while not rest.endswith(b"\r\n0\r\n\r\n"):  # chunked transfer's last chunk ends the response
        data = sock.recv(1 << 16)
        if not data:
            raise ConnectionError("the server closed the connection mid-stream")
        now = time.perf_counter()
        if not times and not rest and not data.startswith(b"HTTP/1.1 200"):  # an error has no event stream
            raise SystemExit(f"llmc serve answered {_refusal(sock, data)}")
        *events, rest = (rest + data).split(b"\n\n")  # an event ends with a blank line
        for event in events:
            at = event.find(b"data: {")
            if at >= 0 and json.loads(event[at + 6:])["choices"]:
                times.append(now)
    return _timings(start, times)


def _refusal(sock: socket.socket, data: bytes) -> str:
    """The status line and body of a response that begins with `data`, its body read to its
    Content-Length."""
    while b"\r\n\r\n" not in data and (more := sock.recv(1 << 16)):  # the headers came in pieces
        data += more
    head, _, body = data.partition(b"\r\n\r\n")
    length = re.search(rb"(?im)^content-length: *(\d+)", head)
    while length and len(body) < int(length[1]) and (more := sock.recv(1 << 16)):
        body += more
    status = head.split(b"\r\n", 1)[0].decode()
    return f"{status}: {body[:300].decode(errors='replace')}"


def _http(url: str, client: str, prompts, n, spacing: float | None):
    """Each prompt's timings through `llmc serve`: one after another (spacing None), or all
    streaming together, the i-th sent i * spacing seconds after the first."""
    if client == "openai":
        import openai

        async def run():
            async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as http:
                if spacing is None:
                    return [await _openai_one(http, p, n) for p in prompts]
                return await asyncio.gather(*(_openai_one(http, p, n, i * spacing) for i, p in enumerate(prompts)))

        return asyncio.run(run())
    port = int(url.rsplit(":", 1)[1])
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(1 if spacing is None else len(prompts))]
    try:
        if spacing is None:
            return [_sse_one(socks[0], p, n) for p in prompts]
        with ThreadPoolExecutor(len(prompts)) as threads:
            return list(threads.map(lambda i: _sse_one(socks[i], prompts[i], n, i * spacing), range(len(prompts))))
    finally:
        for sock in socks:
            sock.close()


def _served(url: str) -> tuple[float, float, float]:
    """The server's TTFT and TPOT histograms' sums (seconds) and the requests they count."""
    text = urllib.request.urlopen(url + "/metrics").read().decode()

    def value(name: str) -> float:
        return float(re.search(rf"^{name}{{[^}}]*}} (\S+)$", text, re.M)[1])

    return (value("vllm:time_to_first_token_seconds_sum"), value("vllm:request_time_per_output_token_seconds_sum"),
            value("vllm:request_time_per_output_token_seconds_count"))


def _interval(base: list, side: list, per_round: int, stat, draws: int = 2000) -> str:
    """A 95% bootstrap interval of stat(side) / stat(base), resampling whole rounds: a round's two
    sides ran beside each other in fresh processes, so rounds, not requests, are the independent
    samples. `base` and `side` hold `per_round` records a round, in round order."""
    rounds = len(base) // per_round
    if rounds < 2 or side is base:
        return ""
    split = [[rs[r * per_round:(r + 1) * per_round] for r in range(rounds)] for rs in (base, side)]
    picks = np.random.default_rng(1).integers(0, rounds, (draws, rounds))
    ratios = [stat([x for r in pick for x in split[1][r]]) / stat([x for r in pick for x in split[0][r]])
              for pick in picks]
    low, high = np.percentile(ratios, [2.5, 97.5])
    return f" [{low:.3f}-{high:.3f}]"


def _schedstat(pid: int) -> tuple[int, int]:
    """A process's main thread's ns on a CPU and ns runnable but waiting for one (Linux's /proc)."""
    run_ns, wait_ns, _ = Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()
    return int(run_ns), int(wait_ns)


def _cpu_spent(pid: int, before: tuple[int, int], client_before: float, tokens: int) -> tuple[float, float, float]:
    """Seconds a token since `before`: the server's event loop (its main thread) on a CPU and
    runnable but waiting for one, and this client process on a CPU."""
    run_ns, wait_ns = (a - b for a, b in zip(_schedstat(pid), before))
    return run_ns / 1e9 / tokens, wait_ns / 1e9 / tokens, (time.process_time() - client_before) / tokens


class _Sides:
    """One round's processes: `llmc serve` and the in-process worker, started afresh. A process's
    memory placement alone moves its step times by a few percent (docs/serve_overhead.md), so a
    run that kept its two processes would carry their draw in every ratio; new ones each round
    average it out."""

    def __init__(self, engine: str):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.engine, self.url = engine, f"http://127.0.0.1:{port}"
        self.server = subprocess.Popen([sys.executable, "-m", "llmc.cli", "serve", engine, "--port", str(port),
                                        "--model", "m"], stderr=subprocess.DEVNULL)
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.worker = ctx.Process(target=_in_process, args=(child, engine), daemon=True)
        self.worker.start()

    def __enter__(self) -> "_Sides":
        try:
            while True:
                try:
                    urllib.request.urlopen(self.url + "/health", timeout=1)
                    break
                except OSError:
                    if self.server.poll() is not None:
                        raise SystemExit(f"llmc serve {self.engine} exited with {self.server.returncode}")
                    time.sleep(0.2)
            assert self.conn.recv() == "ready"
        except BaseException:
            self.__exit__()
            raise
        return self

    def local(self, prompts, n, spacing):
        self.conn.send((prompts, n, spacing))
        return self.conn.recv()

    def __exit__(self, *exc) -> None:
        if self.worker.is_alive():
            self.conn.send(None)
            self.worker.join(10)
        self.server.terminate()
        self.server.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine", required=True)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--spacing", type=float, default=2.0,
                    help="ms between the concurrent streams' requests in the spaced load")
    args = ap.parse_args()

    from llmc.contract.engine_dir import open_engine

    vocab = open_engine(args.engine, verify_checksums=False).manifest.model_spec.vocab_size
    rng = np.random.default_rng(0)

    def prompts(k):
        return [rng.integers(3, vocab, args.prompt).tolist() for _ in range(k)]

    loads = ((None, args.requests), (0.0, args.concurrency), (args.spacing / 1e3, args.concurrency))
    runs = {(name, spacing): [] for name in SIDES for spacing, _ in loads}
    served = {c: [] for c in CLIENTS}  # (TTFT, TPOT) as the server's engine timed each batch-1 load
    cpu = []  # the batch-1 sse side's CPU a token, per round
    for rnd in range(args.rounds):
        with _Sides(args.engine) as sides:
            def local(ps, spacing):  # caller-timed, and the engine's metrics of the same requests
                pairs = sides.local(ps, args.new, spacing)
                runs["in-process engine", spacing] += [engine for _, engine in pairs]
                return [caller for caller, _ in pairs]

            url, pid = sides.url, sides.server.pid
            for client in CLIENTS:  # warm every side
                _http(url, client, prompts(2), args.new, None)
            sides.local(prompts(2), args.new, None)
            for spacing, k in loads:
                order = [("in-process", lambda ps: local(ps, spacing))]
                order += [(f"http {c}", lambda ps, c=c: _http(url, c, ps, args.new, spacing)) for c in CLIENTS]
                for name, run in order[rnd % len(order):] + order[:rnd % len(order)]:
                    time.sleep(0.2)  # the other side's idle threads park
                    ps, watched = prompts(k), name == "http sse" and spacing is None
                    counted = _served(url) if name.startswith("http") and spacing is None else None
                    before = (_schedstat(pid), time.process_time()) if watched else None
                    runs[name, spacing] += run(ps)
                    if watched:
                        cpu.append(_cpu_spent(pid, *before, tokens=k * args.new))
                    if counted:
                        while (now := _served(url))[2] < counted[2] + k:  # the last request is counted as it ends
                            time.sleep(0.01)
                        served[name.removeprefix("http ")].append([(a - b) / k for a, b in zip(now[:2], counted[:2])])

    def mean(xs):
        return statistics.mean(xs) * 1e3

    print(f"engine {args.engine}: {args.prompt}-token prompts, {args.new} new tokens, {args.rounds} rounds, "
          "interleaved; ms")
    print(f"batch 1 ({args.requests} requests per round): TTFT mean, TPOT mean; / in-process")
    print("  (in brackets: a 95% interval of the ratio, rounds resampled)")
    base = runs["in-process", None]

    def mean_of(i):
        return lambda rs: mean([r[i] for r in rs])

    for name in SIDES:
        rs = runs[name, None]
        ttft, tpot = mean([r[0] for r in rs]), mean([r[1] for r in rs])
        print(f"  {name:>12} TTFT {ttft:7.3f}  TPOT {tpot:7.3f}   {ttft / mean([r[0] for r in base]):.3f}x"
              f"{_interval(base, rs, args.requests, mean_of(0))}"
              f"  {tpot / mean([r[1] for r in base]):.3f}x{_interval(base, rs, args.requests, mean_of(1))}")
    engine = runs["in-process engine", None]
    for client, sums in served.items():
        ttft, tpot = (mean([s[i] for s in sums]) for i in range(2))
        print(f"  {'server of ' + client:>12} TTFT {ttft:7.3f}  TPOT {tpot:7.3f}   {ttft / mean([r[0] for r in base]):.3f}x"
              f"  {tpot / mean([r[1] for r in base]):.3f}x   (/ in-process engine {ttft / mean([r[0] for r in engine]):.3f}x"
              f"  {tpot / mean([r[1] for r in engine]):.3f}x)")
    if cpu:
        loop, loop_wait, client = (mean([c[i] for c in cpu]) for i in range(3))
        print(f"  http sse, a token's share of the side's CPU (requests and prefills included): server's event "
              f"loop {loop:.3f} (and {loop_wait:.3f} runnable, waiting for a core), client {client:.3f}")
    def p99s(rs):  # TPOT, E2E
        return (np.percentile([r[1] for r in rs], 99),
                np.percentile([r[0] + r[1] * (args.new - 1) for r in rs], 99))

    for (spacing, k), label in zip(loads[1:], ("sent at once", f"sent {args.spacing:g} ms apart")):
        print(f"{k} concurrent streams, {label}: TPOT p50 / p99 and E2E p99 over requests, ITL p99 over "
              "gaps; TPOT p99, E2E p99 / in-process")
        base_runs = runs["in-process", spacing]
        base = p99s(base_runs)
        for name in SIDES:
            rs = runs[name, spacing]
            tpot, e2e = p99s(rs)
            itl = [g for r in rs for g in r[2]]
            print(f"  {name:>12} TPOT p50 {np.percentile([r[1] for r in rs], 50) * 1e3:7.3f}  p99 {tpot * 1e3:7.3f}"
                  f"  E2E p99 {e2e * 1e3:6.0f}  ITL p99 {np.percentile(itl, 99) * 1e3:7.3f}   "
                  f"{tpot / base[0]:.3f}x{_interval(base_runs, rs, k, lambda rs: p99s(rs)[0])}"
                  f"  {e2e / base[1]:.3f}x")


if __name__ == "__main__":
    main()
