"""The event loop's CPU that `llmc serve`'s Python costs, against AsyncLLM in-process: no sockets.

    python benchmarks/serve_cpu.py --engine ENGINE [--rounds 5] [--requests 60] [--streams 4] [--tokens 200]

The server's app (FastAPI, the handler, the event stream) is called as an ASGI app on uvloop, with
the request body handed over and the response's messages dropped, so what is timed is its Python
alone: no HTTP parsing, no socket writes, no client. The in-process side runs the same requests
through the app's own AsyncLLM on the same loop. Both read the loop thread's CPU time
(`time.thread_time`), in rounds that alternate the sides:
- per request: streamed greedy requests of 2 tokens, one at a time (what a request costs the
  loop before and after its tokens);
- per token: streams of --tokens tokens, one at a time (what each streamed token costs it).
What a socket adds on top (the write, TCP over loopback, waking the client) shows in
serve_overhead.py's per-token CPU, which runs the real server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import numpy as np


def _asgi_scope(app, body: bytes) -> dict:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
            "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2),
            "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode())], "state": {}, "app": app}


async def _through_app(app, prompt: list[int], n: int) -> None:
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True,
                       "ignore_eos": True}).encode()
    pending = [{"type": "http.request", "body": body, "more_body": False}]
    done = asyncio.Event()

    async def receive():
        if pending:
            return pending.pop()
        await done.wait()  # the client stays until the response ends
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.body" and not message.get("more_body"):
            done.set()

    await app(_asgi_scope(app, body), receive, send)


async def _in_process(llm, prompt: list[int], n: int) -> None:
    from llmc.runtime.sampling import SamplingParams

    stream = await llm.add_request(prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    async for _ in stream:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=60, help="2-token requests per side and round")
    ap.add_argument("--streams", type=int, default=4, help="long streams per side and round")
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--prompt", type=int, default=128)
    args = ap.parse_args()

    import uvloop

    from llmc.server.app import create_app

    app = create_app(args.engine, model="m", load_before_serving=True)
    rng = np.random.default_rng(0)

    async def run():
        async with app.router.lifespan_context(app):
            llm = app.state.server.engine  # the server's own AsyncLLM: one engine, one loop for both sides
            vocab = llm.llm.engine.spec.vocab_size
            n = min(args.tokens, llm.llm.max_context - args.prompt)

            async def timed(one, count: int, tokens: int) -> float:
                prompts = [rng.integers(3, vocab, args.prompt).tolist() for _ in range(count)]
                start = time.thread_time()
                for prompt in prompts:
                    await one(prompt, tokens)
                return (time.thread_time() - start) / count

            sides = {"llmc serve's app": lambda p, k: _through_app(app, p, k),
                     "AsyncLLM in-process": lambda p, k: _in_process(llm, p, k)}
            for one in sides.values():  # warm
                await timed(one, 3, 2)
            rows = {name: ([], []) for name in sides}
            for rnd in range(args.rounds):  # interleaved, the order alternating: this VM's speed drifts
                for name in list(sides)[rnd % 2:] + list(sides)[:rnd % 2]:
                    rows[name][0].append(await timed(sides[name], args.requests, 2))
                    rows[name][1].append(await timed(sides[name], args.streams, n) / n)
            print(f"engine {args.engine}: event loop CPU (ms), {args.prompt}-token prompts, greedy, one at a time; "
                  f"median of {args.rounds} rounds [range]")
            base = [statistics.median(xs) for xs in rows["AsyncLLM in-process"]]
            for name, (per_request, per_token) in rows.items():
                r, t = statistics.median(per_request), statistics.median(per_token)
                print(f"  {name:>20}: per 2-token request {r * 1e3:6.3f} [{min(per_request) * 1e3:.3f}.."
                      f"{max(per_request) * 1e3:.3f}] {r / base[0]:.2f}x;  per token of {n}-token streams "
                      f"{t * 1e3:6.4f} [{min(per_token) * 1e3:.4f}..{max(per_token) * 1e3:.4f}] {t / base[1]:.2f}x")

    uvloop.run(run())


if __name__ == "__main__":
    main()
