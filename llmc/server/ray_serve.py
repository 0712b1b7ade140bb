"""Scale-out: replicas of `llmc serve`'s app behind Ray Serve's proxy and a load-aware router.

Each replica is the same FastAPI app as `llmc serve` (one AsyncLLM, loaded before the replica
takes requests) in a Ray actor holding `threads` CPUs. The router ranks replicas by load: the
requests it has in flight on each as a share of the replica's batch slots, plus the share of
its KV cache in use (`vllm:kv_cache_usage_perc` of `/metrics`, which each replica reports to the
router as Ray Serve routing stats). Requests past a replica's `max_ongoing_requests` wait in
the router, where whichever replica frees a slot first takes them; a replica that dies fails
its own requests (the client sees the stream end) and is restarted by Ray while the others
serve on.

    llmc serve ENGINE --replicas 2 --threads 1          # or, with Ray's CLI:
    serve run llmc.server.ray_serve:app_builder engine=ENGINE replicas=2 threads=1
"""

from __future__ import annotations

import random
import signal
import threading
import time
from collections import Counter, defaultdict, deque
from pathlib import Path

from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from llmc.contract.options import RuntimeOptions, ServerOptions, declaration
from llmc.server.app import create_app

REPLICAS = 2  # replicas of an application that does not say (`serve run` without replicas=)
THREADS_PER_REPLICA = 1  # CPUs, and ORT threads, of each replica that does not say
REPLICA_HEADER = b"llmc-replica"  # which replica answered: for users' logs and the scale-out test
STATS_PERIOD_S = 0.5  # how often each replica reports its load to the router
CHOICE_TTL_S = 1.0  # a replica chosen for a request counts as loaded by it until it is sent, or this long


def engine_load(stats: dict, in_flight: int) -> float:
    """A replica's load for routing: the requests this router has in flight there per batch slot,
    plus the share of its KV cache in use as it last reported."""
    slots = stats.get("max_num_seqs", RuntimeOptions.max_num_seqs)
    return in_flight / max(1, slots) + stats.get("kv_usage", 0.0)


class LoadAwareRouter(FIFOMixin, RequestRouter):
    """Ranks every candidate replica by `engine_load`, least loaded first; ties are broken at
    random so equal replicas share the work. A replica that is full (at `max_ongoing_requests`)
    is skipped by Ray for the next rank.

    The in-flight counts are the router's own: requests sent and not completed, plus those it
    chose a replica for and has not sent yet (Ray probes the replica first, and a burst is
    ranked while those probes are out). The replicas' reports are up to `STATS_PERIOD_S` old; a
    burst routed on them alone would all go to whichever replica looked idlest."""

    def initialize_state(self, **kwargs) -> None:
        self.sent: Counter = Counter()
        self.chosen: dict = defaultdict(deque)  # replica -> when it was chosen, for requests not yet sent

    def in_flight(self, replica_id) -> int:
        chosen, now = self.chosen[replica_id], time.monotonic()
        while chosen and now - chosen[0] > CHOICE_TTL_S:  # its request went elsewhere (full, or died)
            chosen.popleft()
        return self.sent[replica_id] + len(chosen)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        shuffled = random.sample(candidate_replicas, len(candidate_replicas))
        ranked = sorted(shuffled, key=lambda r: engine_load(r.routing_stats or {}, self.in_flight(r.replica_id)))
        if ranked:
            self.chosen[ranked[0].replica_id].append(time.monotonic())
        return [[r] for r in ranked]

    def on_send_request(self, replica_id) -> None:
        super().on_send_request(replica_id)
        self.sent[replica_id] += 1
        if self.chosen[replica_id]:
            self.chosen[replica_id].popleft()

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        super().on_request_completed(replica_id, internal_request_id)
        self.sent[replica_id] = max(0, self.sent[replica_id] - 1)

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        self.sent.pop(replica_id, None)
        self.chosen.pop(replica_id, None)


class _ReplicaHeader:
    """ASGI middleware naming the replica in each response's headers."""

    def __init__(self, app):
        self.app = app
        self.replica = b""

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if not self.replica:
            self.replica = serve.get_replica_context().replica_id.unique_id.encode()

        async def named(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (REPLICA_HEADER, self.replica)]
            await send(message)

        await self.app(scope, receive, named)


def application(engine: str | Path, *, replicas: int = REPLICAS, threads: int = THREADS_PER_REPLICA,
                model: str | None = None, options: dict | None = None, chat_template: str | Path | None = None,
                max_waiting: int = ServerOptions.max_waiting, grace_period: float = ServerOptions.grace_period,
                max_ongoing_requests: int | None = None):
    """The Ray Serve application: `replicas` copies of the server, each with `threads` CPUs.
    `max_ongoing_requests` (default: twice the batch slots) bounds what a replica holds; past it
    requests wait in the router, `max_waiting` of them, then 503 with Retry-After."""
    options = {**(options or {}), "num_threads": threads}
    app = create_app(engine, model=model, options=options, chat_template=chat_template, max_waiting=max_waiting,
                     load_before_serving=True)
    app.add_middleware(_ReplicaHeader)

    @serve.deployment(name="llmc", num_replicas=replicas, ray_actor_options={"num_cpus": threads},
                      max_ongoing_requests=max_ongoing_requests or 2 * options.get("max_num_seqs",
                                                                                   RuntimeOptions.max_num_seqs),
                      max_queued_requests=max_waiting, graceful_shutdown_timeout_s=grace_period,
                      request_router_config=RequestRouterConfig(request_router_class=LoadAwareRouter,
                                                                request_routing_stats_period_s=STATS_PERIOD_S))
    @serve.ingress(app)
    class Replica:
        def record_routing_stats(self) -> dict:
            engine = app.state.server.engine
            if engine is None:
                return {}
            llm = engine.llm
            return {"kv_usage": llm.blocks.usage, "max_num_seqs": llm.scheduler.config.max_num_seqs}

    return Replica.bind()


def app_builder(args: dict):
    """For `serve run llmc.server.ray_serve:app_builder engine=DIR [replicas=N threads=T model=NAME
    max_waiting=W grace_period=S max_num_seqs=... (any runtime option)]`."""
    return application(**application_args(args))


# app_builder's arguments that are `application`'s own; the others are declared server or runtime options.
_BUILDER_ARGS = ("engine", "model", "threads")


def application_args(args: dict) -> dict:
    """`application`'s keywords from Ray Serve's config (`key=value` text, or YAML's typed values):
    the server and runtime options by their declared names and types."""
    if "engine" not in args:
        raise ValueError("pass the engine directory: serve run llmc.server.ray_serve:app_builder engine=DIR")
    server = ("replicas", "max_waiting", "grace_period")
    unknown = sorted(set(args) - {*_BUILDER_ARGS, *server, *RuntimeOptions.names()})
    if unknown:
        raise ValueError(f"unknown argument {unknown[0]!r}; app_builder takes {', '.join(_BUILDER_ARGS)}, "
                         f"{', '.join(server)} and the runtime options ({', '.join(RuntimeOptions.names())})")
    kwargs = {"engine": args["engine"], "model": args.get("model")}
    if "threads" in args:
        kwargs["threads"] = declaration(RuntimeOptions, "num_threads").parse(args["threads"])
    kwargs.update({name: declaration(ServerOptions, name).parse(args[name]) for name in server if name in args})
    options = {name: declaration(RuntimeOptions, name).parse(value) for name, value in args.items()
               if name in RuntimeOptions.names()}
    return {**kwargs, "options": RuntimeOptions.given(options)}


def run(engine: Path, *, host: str, port: int, replicas: int, threads: int, model: str | None, options: dict,
        chat_template: Path | None, max_waiting: int, grace_period: float) -> None:
    """`llmc serve --replicas N`: start (or join, with RAY_ADDRESS) a Ray cluster, serve until SIGTERM
    or Ctrl-C, then shut the replicas down, each draining for up to `grace_period`."""
    import ray

    ray.init(include_dashboard=False, log_to_driver=False, logging_level="warning")
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):  # after ray.init, which sets its own
        signal.signal(signum, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(application(engine, replicas=replicas, threads=threads, model=model, options=options,
                              chat_template=chat_template, max_waiting=max_waiting, grace_period=grace_period),
                  name="llmc", route_prefix="/", blocking=False)
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()
