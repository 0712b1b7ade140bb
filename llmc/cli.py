"""`llmc` command line: build, run, inspect.

User errors (LlmcError) print one line `error: ...` and exit 2, without a traceback.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from llmc import __version__
from llmc.errors import LlmcError

DEFAULT_MODEL = "tiny-llama"


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
@click.option("--dtype", type=click.Choice(["float32"]), default="float32", show_default=True,
              help="Weight and activation precision (fp32 on the ORT CPU backend; lower precisions come with quantization).")
@click.option("--block-size", default=16, show_default=True, help="KV cache block size in tokens.")
@click.option("--max-context", type=int, default=None,
              help="Longest sequence (prompt + output) the engine serves [default: model max, at most 4096].")
@click.option("--disable-pass", "disable_passes", multiple=True, help="Skip an optional pass (repeatable).")
@click.option("--passes", "list_passes", is_flag=True, help="List the passes and exit.")
@click.option("--verify/--no-verify", default=False, show_default=True,
              help="Check every pass numerically against the graph before it.")
@click.option("--all-logits", is_flag=True, help="Output logits for every position, not only the last.")
@click.option("--dump-ir", type=click.Path(path_type=Path), default=None,
              help="Write the graph after each pass into this folder.")
@click.option("--overwrite", is_flag=True, help="Replace an existing engine at the output path.")
def build(model, output, dtype, block_size, max_context, disable_passes, list_passes, verify, all_logits,
          dump_ir, overwrite):
    """Compile MODEL (a recipe name, a local HF folder or a hub id) into an engine."""
    if list_passes:
        from llmc.passes import ALL_PASSES, REQUIRED_PASSES, make_passes

        for p in make_passes(list(ALL_PASSES)):
            tag = " (required)" if p.name in REQUIRED_PASSES else ""
            click.echo(f"{p.name:20s} {p.description}{tag}")
        return
    from rich.console import Console

    from llmc.compiler.pipeline import BuildOptions
    from llmc.compiler.pipeline import build as run_build

    output = output or Path("engines") / Path(model).name
    options = BuildOptions(block_size=block_size, max_context=max_context,
                           disable_passes=tuple(disable_passes), verify=verify, dump_ir=dump_ir,
                           overwrite=overwrite, last_token_logits=not all_logits)
    console = Console(stderr=True, highlight=False)
    with console.status(f"building {model}") as status:
        def progress(stage: str, message: str, finished: bool) -> None:
            if finished:
                console.print(f"  [green]✓[/] [bold]{stage:8s}[/] {message}")
            else:
                status.update(f"[bold]{stage}[/] {message}")

        result = run_build(model, output, options, progress)
    total = sum(s.seconds for s in result.stages)
    console.print(f"engine written to [bold]{result.engine_dir}[/] in {total:.1f}s "
                  f"(peak RSS {result.peak_rss_mb:.0f} MB)")


@main.command()
@click.argument("engine", type=click.Path(path_type=Path))
@click.argument("prompt")
@click.option("--max-tokens", default=64, show_default=True)
@click.option("--temperature", default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-k", default=0, show_default=True)
@click.option("--top-p", default=1.0, show_default=True)
@click.option("--seed", type=int, default=None)
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--ignore-eos", is_flag=True, help="Keep generating past EOS (for benchmarks).")
@click.option("--threads", type=int, default=None, help="ONNX Runtime intra-op threads.")
def run(engine, prompt, max_tokens, temperature, top_k, top_p, seed, stop, ignore_eos, threads):
    """Stream a completion of PROMPT from ENGINE."""
    from llmc.runtime.llm import LLM
    from llmc.runtime.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                            seed=seed, stop=tuple(stop), ignore_eos=ignore_eos)
    llm = LLM(engine, num_threads=threads)
    stream = llm.stream(prompt, params)
    click.echo(prompt, nl=False)
    for piece in stream:
        click.echo(piece, nl=False)
    click.echo()
    sys.stdout.flush()  # the summary goes to stderr: keep it after the text when both are piped
    click.echo(summary_line(stream.output), err=True)


def summary_line(output) -> str:
    m = output.metrics
    n = len(output.token_ids)
    tpot = f"{m.tpot * 1e3:.1f} ms" if m.tpot is not None else "n/a"
    rate = f"{(n - 1) / (m.e2e - m.ttft):.1f} tok/s" if n > 1 and m.e2e > m.ttft else "n/a"
    return (f"[{n} tokens, {output.finish_reason}] TTFT {m.ttft * 1e3:.1f} ms · TPOT {tpot} · "
            f"decode {rate} · E2E {m.e2e * 1e3:.1f} ms")


@main.command()
@click.argument("engine", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the raw manifest.")
def inspect(engine, as_json):
    """Describe an engine: model, backend, KV cache layout, passes, files."""
    import json

    from llmc.artifact import format_manifest, load_manifest

    manifest = load_manifest(engine)
    click.echo(json.dumps(manifest, indent=2) if as_json else format_manifest(manifest, engine))


if __name__ == "__main__":
    main()
