"""What HTTP costs: `llmc serve` streaming against the same engine in-process, interleaved.

    python benchmarks/serve_overhead.py --engine ENGINE [--rounds 6] [--prompt 128] [--new 64]
        [--concurrency 16] [--spacing 2]

Every side is timed as its caller sees it: request made -> first token in hand (TTFT), (last -
first) / (n - 1) (TPOT), gaps between tokens (ITL). Both sides run on one `llmc serve` process,
which this script starts as the CLI does, with one addition: between HTTP requests it runs the
in-process side's on the server's own AsyncLLM and event loop (uvloop), so the sides share one
engine and differ by HTTP alone. In-process requests are timed where their stream yields
("in-process", the ratios' base) and, for reference, by the engine's RequestOutput.metrics
("in-process engine": arrival = add_request, a token's time = its step's end, before it reaches
any caller). HTTP requests come from this process, by two clients:
- "openai": the openai package's AsyncOpenAI, streaming;
- "sse": bare keep-alive sockets (one per concurrent stream, each read by a thread of its own
  with blocking recv calls; opened before the timing starts, as a client's pool holds them) that
  json-decode each event. The server's overhead, with the least client CPU on the cores the
  server shares here (a client on another machine takes none): half an asyncio reader's.
Each round starts the server afresh (a process's memory placement is worth a few percent of its
step times: shared by both sides, it cancels in a round's ratios) and runs three loads on every
side: batch 1 (one request at a time, --requests of them, the sides taking turns request by
request), --concurrency streams sent at once, and as many sent --spacing ms apart (a burst per
side's turn); the order of turns rotates. "At once" is one loop tick in-process, where the
engine's first step takes several prompts, but over HTTP the server parses the requests one by
one and the first often starts alone: its TTFT falls and its TPOT rises (it decodes through the
others' prefills) at the same E2E, which the at-once rows print beside. Spaced requests arrive
alike on every side.
A ratio's bracket is a 95% bootstrap interval over rounds (each round's process is a draw of its
own): one run's ratios move by a few points on a shared 2-core host, as much as a target's
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
import os
import re
import select
import socket
import statistics
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np


CLIENTS = ("sse", "openai")
SIDES = ("in-process", "in-process engine", *(f"http {c}" for c in CLIENTS))


async def _in_process(llm, prompts, n, spacing):
    """Each prompt's (caller's, engine's) timings through AsyncLLM `llm` on the running loop: one
    after another (spacing None), or all together, the i-th added i * spacing seconds after the
    first. The caller's are taken where the stream yields, the engine's from RequestOutput.metrics."""
    from llmc.runtime.sampling import SamplingParams

    async def one(prompt, delay=0.0):
        await asyncio.sleep(delay)
        start = time.perf_counter()
        stream = await llm.add_request(prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        times = []
        async for out in stream:
            times += [time.perf_counter()] * (len(out.token_ids) - len(times))
            last = out
        m = last.metrics
        return _timings(start, times), (m.ttft, m.tpot, m.itl)

    if spacing is None:
        return [await one(p) for p in prompts]
    return await asyncio.gather(*(one(p, i * spacing) for i, p in enumerate(prompts)))


def _server(conn, engine: str, port: int) -> None:
    """`llmc serve ENGINE`, run by the CLI as users run it, plus a thread that runs this script's
    in-process requests on the server's own AsyncLLM and event loop when the pipe asks (between
    HTTP requests, never during one). Both sides then share one engine, so a round's ratios
    carry no draw of two processes' memory placements (docs/serve_overhead.md)."""
    import contextlib

    import llmc.server.app as server_app
    from llmc.cli import main as cli

    apps, loops = [], []
    create_app = server_app.create_app

    def capture(*args, **kwargs):  # keeps the app, and its loop once it serves
        app = create_app(*args, **kwargs)
        inner = app.router.lifespan_context

        @contextlib.asynccontextmanager
        async def lifespan(app):
            loops.append(asyncio.get_running_loop())
            async with inner(app) as state:
                yield state

        app.router.lifespan_context = lifespan
        apps.append(app)
        return app

    def jobs():
        while (job := conn.recv()) is not None:  # the first job comes once /health answered 200
            llm = apps[0].state.server.engine
            conn.send(asyncio.run_coroutine_threadsafe(_in_process(llm, *job), loops[0]).result())

    server_app.create_app = capture
    threading.Thread(target=jobs, daemon=True).start()
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)  # the CLI's banner and uvicorn's warnings
    cli(["serve", engine, "--port", str(port), "--model", "m"], standalone_mode=False)


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


class _Http:
    """A round's HTTP clients: the openai package's on an event loop of its own, and the sse
    client's keep-alive connection for batch-1 requests, both kept across the round as a client's
    pool keeps them (a new connection per request would put its set-up in that request's TTFT)."""

    def __init__(self, url: str):
        import openai

        self.port = int(url.rsplit(":", 1)[1])
        self.loop = asyncio.new_event_loop()
        self.openai = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        self.sock = socket.create_connection(("127.0.0.1", self.port))

    def __call__(self, client: str, prompts, n, spacing: float | None):
        """Each prompt's timings through `llmc serve`: one after another (spacing None), or all
        streaming together, the i-th sent i * spacing seconds after the first."""
        if client == "openai":
            if spacing is None:
                return [self.loop.run_until_complete(_openai_one(self.openai, p, n)) for p in prompts]

            async def together():
                return await asyncio.gather(*(_openai_one(self.openai, p, n, i * spacing) for i, p in enumerate(prompts)))

            return self.loop.run_until_complete(together())
        if spacing is None:
            return [_sse_one(self._kept(), p, n) for p in prompts]
        socks = [socket.create_connection(("127.0.0.1", self.port)) for _ in prompts]
        try:
            with ThreadPoolExecutor(len(prompts)) as threads:
                return list(threads.map(lambda i: _sse_one(socks[i], prompts[i], n, i * spacing), range(len(prompts))))
        finally:
            for sock in socks:
                sock.close()

    def _kept(self) -> socket.socket:
        """The batch-1 connection, opened again if the server closed it while it sat idle
        (uvicorn's keep-alive timeout is 5 s; httpx's pool does the same for the openai client)."""
        if select.select([self.sock], [], [], 0)[0]:  # an idle connection reads only at its end
            self.sock.close()
            self.sock = socket.create_connection(("127.0.0.1", self.port))
        return self.sock

    def close(self) -> None:
        self.sock.close()
        self.loop.run_until_complete(self.openai.close())
        self.loop.close()


def _served(url: str) -> tuple[float, float, float]:
    """The server's TTFT and TPOT histograms' sums (seconds) and the requests they count."""
    text = urllib.request.urlopen(url + "/metrics").read().decode()

    def value(name: str) -> float:
        return float(re.search(rf"^{name}{{[^}}]*}} (\S+)$", text, re.M)[1])

    return (value("vllm:time_to_first_token_seconds_sum"), value("vllm:request_time_per_output_token_seconds_sum"),
            value("vllm:request_time_per_output_token_seconds_count"))


def _interval(base: list, side: list, per_round: int, stat, draws: int = 2000) -> str:
    """A 95% bootstrap interval of stat(side) / stat(base), resampling whole rounds: a round's
    sides ran in turns on one fresh process, so rounds, not requests, are the independent
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
    """One round's process: `llmc serve`, started afresh, which also runs the in-process side's
    requests on its own engine. A process's memory placement alone moves its step times by a few
    percent (docs/serve_overhead.md): sharing the engine keeps that draw out of the ratios, and a
    new process each round samples it."""

    def __init__(self, engine: str):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.engine, self.url = engine, f"http://127.0.0.1:{port}"
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.server = ctx.Process(target=_server, args=(child, engine, port), daemon=True)
        self.server.start()

    def __enter__(self) -> "_Sides":
        try:
            while True:
                try:
                    urllib.request.urlopen(self.url + "/health", timeout=1)
                    break
                except OSError:
                    if not self.server.is_alive():
                        raise SystemExit(f"llmc serve {self.engine} exited with {self.server.exitcode}")
                    time.sleep(0.2)
        except BaseException:
            self.__exit__()
            raise
        return self

    def local(self, prompts, n, spacing):
        self.conn.send((prompts, n, spacing))
        return self.conn.recv()

    def __exit__(self, *exc) -> None:
        if self.server.is_alive():
            self.conn.send(None)
            self.server.terminate()  # SIGTERM: the server drains (nothing runs) and exits
            self.server.join(30)


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
    served = {c: [] for c in CLIENTS}  # (TTFT, TPOT) as the server's engine timed each batch-1 turn
    cpu = []  # the batch-1 sse side's CPU a token, per turn
    for rnd in range(args.rounds):
        with _Sides(args.engine) as sides:
            def local(ps, spacing):  # caller-timed, and the engine's metrics of the same requests
                pairs = sides.local(ps, args.new, spacing)
                runs["in-process engine", spacing] += [engine for _, engine in pairs]
                return [caller for caller, _ in pairs]

            url, pid, http = sides.url, sides.server.pid, _Http(sides.url)
            for client in CLIENTS:  # warm every side
                http(client, prompts(2), args.new, None)
            sides.local(prompts(2), args.new, None)
            for spacing, k in loads:
                order = [("in-process", lambda ps: local(ps, spacing))]
                order += [(f"http {c}", lambda ps, c=c: http(c, ps, args.new, spacing)) for c in CLIENTS]
                # Sides take turns a request at a time at batch 1, a burst at a time otherwise: the
                # closer in time two sides' requests run, the less this host's drift parts them.
                per_turn = 1 if spacing is None else k
                for turn in range(k // per_turn):
                    shift = (rnd + turn) % len(order)
                    for name, run in order[shift:] + order[:shift]:
                        time.sleep(0.2)  # each side's turn starts with ORT's threads parked
                        ps, watched = prompts(per_turn), name == "http sse" and spacing is None
                        counted = _served(url) if name.startswith("http") and spacing is None else None
                        before = (_schedstat(pid), time.process_time()) if watched else None
                        runs[name, spacing] += run(ps)
                        if watched:
                            cpu.append(_cpu_spent(pid, *before, tokens=per_turn * args.new))
                        if counted:
                            while (now := _served(url))[2] < counted[2] + per_turn:  # counted as it ends
                                time.sleep(0.01)
                            served[name.removeprefix("http ")].append(
                                [(a - b) / per_turn for a, b in zip(now[:2], counted[:2])])
            http.close()

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
