"""`llmc` command line: build, run, bench, tune, inspect.

User errors (LlmcError) print one line `error: ...` and exit 2, without a traceback.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from llmc.cli_options import build_options, grouped, runtime_options, server_options
from llmc.compiler.recipes import DEFAULT_RECIPE as DEFAULT_MODEL
from llmc.errors import LlmcError, RequestError
from llmc.runtime.sampling import SamplingParams
from llmc.version import __version__


class _Group(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except LlmcError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(2)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)


@click.group(cls=_Group)
@click.version_option(__version__, prog_name="llmc")
def main():
    """llmc: compile HuggingFace decoder-only LLMs to engines and serve them."""


@main.command()
@click.argument("model", default=DEFAULT_MODEL)
@click.option("-o", "--output", type=click.Path(path_type=Path), default=None,
              help="Engine directory to write (default: engines/<model name>).")
@click.option("--passes", "list_passes", is_flag=True, help="List the passes and exit.")
@click.option("--dump-ir", type=click.Path(path_type=Path), default=None,
              help="Write the graph after each pass into this folder.")
@click.option("--overwrite", is_flag=True, help="Replace an existing engine at the output path.")
@click.option("--explain", is_flag=True, help="List every rule that matched a candidate but did not fire, and why.")
@build_options()
def build(model, output, list_passes, dump_ir, overwrite, explain, options):
    """Compile MODEL (a recipe name, a local HF folder or a hub id) into an engine."""
    if list_passes:
        _print_passes(options)
        return
    from rich.console import Console

    console = Console(stderr=True, highlight=False)
    result = _build_with_progress(console, model, output or Path("engines") / Path(model).name, options,
                                  overwrite=overwrite, dump_ir=dump_ir)
    total = sum(s.seconds for s in result.stages)
    console.print(f"engine written to [bold]{result.engine_dir}[/] in {total:.1f}s "
                  f"(peak RSS {result.peak_rss_mb:.0f} MB)")
    if explain:
        _print_near_misses(console, result.misses)


def _print_passes(options) -> None:
    """`llmc build --passes`: the pipeline these options make, phase by phase."""
    from llmc.passes.pipeline import phases

    for phase in phases(options):
        if not phase.passes:
            continue
        click.echo(f"{phase.name}:")
        for p in phase.passes:
            tag = " (required)" if p.required else ""
            click.echo(f"  {p.name:20s} {p.description}{tag}")


def _build_with_progress(console, model: str, output: Path, options, *, overwrite: bool, dump_ir: Path | None):
    """Builds, the running stage in a spinner and each finished one on its own line."""
    from llmc.compiler.build import build as run_build

    with console.status(f"building {model}") as status:
        def progress(stage: str, message: str, finished: bool) -> None:
            if finished:
                console.print(f"  [green]✓[/] [bold]{stage:8s}[/] {message}")
            else:
                status.update(f"[bold]{stage}[/] {message}")

        return run_build(model, output, options, overwrite=overwrite, dump_ir=dump_ir, progress=progress)


def _print_near_misses(console, misses: list) -> None:
    console.print(f"{len(misses)} near-misses" + (":" if misses else ""))
    for name, why in misses:
        console.print(f"  {name}: {why}", markup=False)


@main.command()
@click.argument("engine", type=click.Path(path_type=Path))
@click.argument("prompt")
@click.option("--max-tokens", default=SamplingParams.max_tokens, show_default=True)
@click.option("--temperature", default=SamplingParams.temperature, show_default=True, help="0 = greedy.")
@click.option("--top-k", default=SamplingParams.top_k, show_default=True)
@click.option("--top-p", default=SamplingParams.top_p, show_default=True)
@click.option("--seed", type=int, default=None)
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--ignore-eos", is_flag=True, help="Keep generating past EOS (for benchmarks).")
@runtime_options("num_threads", "speculative", "num_speculative_tokens")
@click.option("--no-tuning", is_flag=True, help="Ignore the engine's tuning.json (written by `llmc tune`).")
def run(engine, prompt, max_tokens, temperature, top_k, top_p, seed, stop, ignore_eos, runtime, no_tuning):
    """Stream a completion of PROMPT from ENGINE."""
    from llmc.runtime.llm import LLM

    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                            seed=seed, stop=tuple(stop), ignore_eos=ignore_eos)
    llm = LLM(engine, **runtime, use_tuning=not no_tuning)
    if llm.tuning is not None:
        from llmc.contract.tuning import tuning_line

        click.echo(tuning_line(llm.tuning), err=True)
    stream = llm.stream(prompt, params)
    click.echo(prompt, nl=False)
    for piece in stream:
        click.echo(piece, nl=False)
    click.echo()
    sys.stdout.flush()  # the summary goes to stderr: keep it after the text when both are piped
    if stream.output.error:
        raise LlmcError(stream.output.error)
    click.echo(summary_line(stream.output), err=True)


@main.command()
@click.argument("engine", type=click.Path(path_type=Path))
@click.option("--chat-template", type=click.Path(path_type=Path, exists=True, dir_okay=False), default=None,
              help="Jinja chat template [default: the engine's].")
@click.option("--system", default=None, help="A system message to start the conversation with.")
@click.option("--max-tokens", default=256, show_default=True, help="Most tokens per reply.")
@click.option("--temperature", default=0.7, show_default=True)
@click.option("--top-p", default=0.9, show_default=True)
@click.option("--seed", type=int, default=None)
@runtime_options("num_threads", "speculative")
def chat(engine, chat_template, system, max_tokens, temperature, top_p, seed, runtime):
    """Chat with ENGINE in the terminal through its chat template (`/reset` forgets, Ctrl-D ends)."""
    from llmc.runtime.chat import ChatTemplate
    from llmc.runtime.llm import LLM

    llm = LLM(engine, **runtime)
    template = ChatTemplate.of(llm, chat_template)
    if template is None:
        raise LlmcError(f"engine {engine} has no chat template; pass one with --chat-template FILE")
    start = [{"role": "system", "content": system}] if system else []
    messages = list(start)
    while True:
        try:
            line = input("you> ")
        except EOFError:
            click.echo()
            return
        if line.strip() == "/reset":
            messages = list(start)
            continue
        messages.append({"role": "user", "content": line})
        try:
            prompt = template.prompt(llm, messages)
        except RequestError as exc:  # the line cannot be sent (e.g. undecodable input): say so, keep chatting
            messages.pop()
            click.echo(f"error: {exc}", err=True)
            continue
        room = llm.max_context - len(prompt.ids)
        if room < 1:
            messages.pop()
            click.echo(f"error: the conversation ({len(prompt.ids)} tokens) fills the engine's context of "
                       f"{llm.max_context}; /reset to start over", err=True)
            continue
        params = SamplingParams(max_tokens=min(max_tokens, room), temperature=temperature, top_p=top_p,
                                seed=None if seed is None else seed + len(messages))
        stream = llm.stream(prompt, params)
        for piece in stream:
            click.echo(piece, nl=False)
        click.echo()
        messages.append({"role": "assistant", "content": stream.output.text})


def summary_line(output) -> str:
    m = output.metrics
    n = len(output.token_ids)

    def ms(seconds: float | None) -> str:
        return "n/a" if seconds is None else f"{seconds * 1e3:.1f} ms"

    rate = f"{1 / m.tpot:.1f} tok/s" if m.tpot else "n/a"  # decode rate: one token per TPOT
    line = (f"[{n} tokens, {output.finish_reason}] TTFT {ms(m.ttft)} · TPOT {ms(m.tpot)} · "
            f"decode {rate} · E2E {ms(m.e2e)}")
    if m.proposed_tokens:
        line += (f" · accepted {m.accepted_tokens}/{m.proposed_tokens} proposals ({m.acceptance_rate:.0%}), "
                 f"{m.tokens_per_step:.2f} tokens/step")
    return line


def _workload_options(num_requests: int, prompt_len: str, output_len: str, qps: str, repeats: int):
    """The workload flags `bench` and `tune` share; the command gets them as one WorkloadArgs."""
    def flag(name: str, **kwargs):  # WorkloadArgs' field `name` as --name-with-dashes
        return name, click.option("--" + name.replace("_", "-"), name, **kwargs)

    options = dict([
        flag("num_requests", default=num_requests, show_default=True, help="Requests per run."),
        flag("prompt_len", default=prompt_len, show_default=True,
             help="Prompt tokens: N, LO-HI (uniform) or normal:MEAN:STD."),
        flag("output_len", default=output_len, show_default=True,
             help="Output tokens (EOS is ignored): N, LO-HI or normal:MEAN:STD."),
        flag("shared_prefix", default=0, show_default=True,
             help="Tokens of a shared prefix (system prompt) every prompt starts with."),
        flag("num_prefixes", default=1, show_default=True, help="Distinct shared prefixes, round robin."),
        flag("qps", default=qps, show_default=True,
             help="Poisson arrival rate in requests/s, a sweep like 1,4,max, or max (all at once)."),
        flag("max_concurrency", type=int, default=None, help="Most requests in flight (client side)."),
        flag("seed", default=0, show_default=True, help="Seeds lengths, prompt tokens and arrivals."),
        flag("warmup", default=4, show_default=True, help="Unmeasured warm-up requests per engine."),
        flag("repeats", default=repeats, show_default=True, help="Measured runs per rate (per trial)."),
        flag("slo", default=None, help="SLOs for goodput, e.g. ttft=500ms,tpot=50ms (ttft, tpot, itl, e2e)."),
    ])

    def make(values: dict):
        from llmc.bench.commands import WorkloadArgs

        return WorkloadArgs(**values)

    return grouped(list(options.values()), options, "workload", make)


@main.command()
@click.argument("engines", nargs=-1, type=click.Path(path_type=Path))
@_workload_options(num_requests=32, prompt_len="128", output_len="64", qps="max", repeats=1)
@click.option("--url", "urls", multiple=True,
              help="Benchmark the OpenAI-compatible server at URL (llmc serve, llama.cpp's, vLLM...), alone, "
                   "against one ENGINE or against a second --url.")
@click.option("--model", "model_name", default=None, help="With --url: the model to ask for [default: each server's first].")
@click.option("--vocab-size", type=int, default=None,
              help="With --url: the model's vocabulary size, when the server does not say it (prompts are random ids).")
@click.option("--tokenizer", default=None,
              help="With --url: send prompts as text this tokenizer (an engine folder or tokenizer.json) decodes "
                   "them to, for servers that take no token ids.")
@click.option("-o", "--output", type=click.Path(path_type=Path), default=None,
              help="Folder for report.json, report.md and the plots [default: bench-<engine>].")
@click.option("--no-plots", is_flag=True, help="Skip the PNG plots (no matplotlib needed).")
@runtime_options("num_threads", "max_num_seqs", "max_num_batched_tokens", "chunk_size", "speculative",
                 "num_speculative_tokens")
@click.option("--no-tuning", is_flag=True, help="Ignore the engines' tuning.json.")
def bench(engines, workload, urls, model_name, vocab_size, tokenizer, output, no_plots, runtime, no_tuning):
    """Measure TTFT, TPOT, ITL, E2E, throughput and goodput of ENGINE, of two engines side by side (runs
    interleaved), or of a server over HTTP (--url); writes report.json, report.md and PNG plots."""
    from llmc.bench.commands import bench as run_bench

    run_bench(list(engines), workload, output, not no_plots, runtime, use_tuning=not no_tuning, urls=list(urls),
              model=model_name, vocab_size=vocab_size, tokenizer=tokenizer)


@main.command()
@click.argument("engine", type=click.Path(path_type=Path))
@_workload_options(num_requests=16, prompt_len="128", output_len="32", qps="max", repeats=3)
@click.option("--objective", default="max-throughput", show_default=True,
              help="min-tpot-p99, max-throughput or max-goodput (needs --slo).")
@click.option("--budget", default="10m", show_default=True, help="Time to spend, e.g. 90s, 10m, 1h.")
@click.option("--build-knobs", is_flag=True,
              help="Also search block size, optional passes and --lossless-weights, building engine variants "
                   "into the output folder.")
@click.option("-o", "--output", type=click.Path(path_type=Path), default=None,
              help="Workspace: trial state (for resuming), tuning_report.md, plot [default: tune-<engine>].")
@click.option("--fresh", is_flag=True, help="Forget the trials of an earlier run in the output folder.")
@click.option("--no-plots", is_flag=True, help="Skip the PNG plot (no matplotlib needed).")
def tune(engine, workload, objective, budget, build_knobs, output, fresh, no_plots):
    """Search runtime knobs (and with --build-knobs, build knobs) of ENGINE for an objective within a
    time budget; writes the winner to ENGINE/tuning.json, which the runtime then applies."""
    from llmc.bench.commands import tune as run_tune

    run_tune(engine, workload, output, not no_plots, objective, budget, build_knobs, fresh)


@main.command()
@click.argument("engine", type=click.Path(path_type=Path))
@server_options("host", "port", "max_waiting", "grace_period", "replicas")
@click.option("--model", "model_name", default=None, help="Model name clients send [default: the engine folder's name].")
@click.option("--chat-template", type=click.Path(path_type=Path, exists=True, dir_okay=False), default=None,
              help="Jinja chat template for /v1/chat/completions [default: the engine's].")
@runtime_options("num_threads", "speculative", "num_speculative_tokens")
@click.option("--no-tuning", is_flag=True, help="Ignore the engine's tuning.json.")
def serve(engine, server, model_name, chat_template, runtime, no_tuning):
    """Serve ENGINE over an OpenAI-compatible HTTP API (completions, chat, models, health, metrics)."""
    try:
        import uvicorn

        from llmc.server.app import create_app
    except ImportError as exc:
        raise LlmcError(f"llmc serve needs {exc.name}, which is missing from this install; reinstall llmc (pip install -e .)") from None
    from llmc.contract.engine_dir import open_engine
    from llmc.contract.options import RuntimeOptions

    options = {**RuntimeOptions.given(runtime), "use_tuning": not no_tuning}
    open_engine(engine, verify_checksums=False)  # a bad engine is one line now, not a 503 later
    if server.replicas is not None:
        try:
            from llmc.server import ray_serve
        except ImportError as exc:
            raise LlmcError(f"--replicas needs Ray Serve ({exc.name} is missing); pip install 'llmc[ray]'") from None
        threads = runtime["num_threads"] or ray_serve.THREADS_PER_REPLICA
        click.echo(f"serving {engine} on http://{server.host}:{server.port}/v1 with {server.replicas} replicas of "
                   f"{threads} thread(s) behind Ray Serve", err=True)
        ray_serve.run(engine, host=server.host, port=server.port, replicas=server.replicas, threads=threads,
                      model=model_name, options=options, chat_template=chat_template, max_waiting=server.max_waiting,
                      grace_period=server.grace_period)
        return
    app = create_app(engine, model=model_name, options=options, chat_template=chat_template,
                     max_waiting=server.max_waiting)
    click.echo(f"serving {engine} on http://{server.host}:{server.port}/v1 (model {model_name or Path(engine).name})",
               err=True)
    uvicorn.run(app, host=server.host, port=server.port, log_level="warning",
                timeout_graceful_shutdown=server.grace_period)


@main.command()
@click.argument("engine", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the raw manifest.")
def inspect(engine, as_json):
    """Describe an engine: model, backend, KV cache layout, passes, files."""
    import json

    from llmc.contract.engine_dir import open_engine
    from llmc.describe import describe
    from llmc.plugins import cpu
    from llmc.plugins.cpu.library import library_path

    manifest = open_engine(engine).manifest
    if as_json:
        click.echo(json.dumps(manifest.to_json(), indent=2))
        return
    kernels = None
    if cpu.DOMAIN in manifest.backend.custom_ops and (library := library_path()) is not None:
        from llmc.plugins.cpu.host import use_measured_kernels

        kernels = use_measured_kernels(library)
    click.echo(describe(manifest, engine, kernels))


@main.command("eval")
@click.argument("engine", type=click.Path(path_type=Path))
@click.argument("file", required=False, type=click.Path(path_type=Path))
@click.option("--file", "file_option", type=click.Path(path_type=Path), default=None, help="Text file to evaluate.")
@click.option("--corpus", type=click.Choice(["heldout"]), default=None,
              help="Evaluate on a corpus instead: heldout = the held-out standard-library files, one document each.")
@click.option("--reference", type=click.Path(path_type=Path), default=None,
              help="An engine or HF model folder (run by transformers, fp32) to compare with: KL divergence, "
                   "same top token, Δ perplexity.")
@click.option("--context", type=int, default=None,
              help="Window length in tokens [default: the engine's max context, or the reference's if shorter].")
@click.option("--overlap", type=int, default=None,
              help="Least context, in tokens, of each token scored after the first window [default: half the window].")
@runtime_options("num_threads", tuning=False)  # evaluate() sets torch's threads too, for an HF reference
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
def eval_(engine, file, file_option, corpus, reference, context, overlap, runtime, as_json):
    """Perplexity and bits per byte of ENGINE on FILE (or --corpus heldout); with --reference, how far
    its next-token distributions are from the reference's."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from llmc.bench.eval import evaluate, render, to_json_text

    if file is not None and file_option is not None:
        raise LlmcError("FILE and --file given together; pass the text file once")

    columns = (TextColumn("scoring"), BarColumn(), MofNCompleteColumn(), TextColumn("tokens"), TimeElapsedColumn())
    console = Console(stderr=True)
    bar = Progress(*columns, console=console, transient=True)
    task = None

    def progress(done: int, total: int) -> None:  # the bar starts with the scoring, after every check
        nonlocal task
        if task is None:
            bar.start()
            task = bar.add_task("scoring", total=total)
        bar.update(task, completed=done)

    try:
        result = evaluate(engine, file=file if file is not None else file_option, corpus=corpus, reference=reference,
                          context=context, overlap=overlap, threads=runtime["num_threads"],
                          progress=progress if console.is_terminal else None)
    finally:
        if task is not None:
            bar.stop()
    click.echo(to_json_text(result) if as_json else render(result))


if __name__ == "__main__":
    main()
