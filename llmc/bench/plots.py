"""PNG plots of a benchmark report and of a tuning run (matplotlib, Agg backend, imported lazily:
only the commands that draw pay for the import)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmc.bench.workloads import qps_label
from llmc.errors import LlmcError
from llmc.runtime.metrics import RequestTimes

BENCH_PLOTS = ("ttft_cdf.png", "tpot_cdf.png", "itl_cdf.png", "throughput_latency.png", "itl_over_time.png")
TUNING_PLOT = "tuning.png"


def require_matplotlib() -> None:
    """Fail before any measuring if the plots could not be drawn at the end."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise LlmcError("plots need matplotlib, which is missing from this install; reinstall llmc "
                        "(pip install -e .) or pass --no-plots") from None


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: never needs a display
    import matplotlib.pyplot as plt

    return plt


def _times(request: dict[str, Any]) -> RequestTimes:
    return RequestTimes(request["arrival"], request["first_scheduled"], request["token_times"])


def _series(report: dict[str, Any]) -> dict[tuple[str, str], list[RequestTimes]]:
    """(engine, qps label) -> every request's times over all repeats, in the report's order."""
    series: dict[tuple[str, str], list[RequestTimes]] = {}
    for run in report["runs"]:
        series.setdefault((run["engine"], qps_label(run["qps"])), []).extend(_times(r) for r in run["requests"])
    return series


def _label(engine: str, qps: str, several_engines: bool) -> str:
    rate = "all at once" if qps == "max" else f"{qps} req/s"
    return f"{engine} · {rate}" if several_engines else rate


def _style(key: tuple[str, str], report: dict[str, Any]) -> dict[str, Any]:
    """One color per rate, one line style per engine: A/B pairs at a rate read as a pair."""
    rates = list(dict.fromkeys(qps_label(r["qps"]) for r in report["results"]))
    engines = [e["label"] for e in report["engines"]]
    return {"color": f"C{rates.index(key[1]) % 10}", "linestyle": ("-", "--")[engines.index(key[0]) % 2]}


def _cdf_plot(plt, path: Path, curves: dict[str, list[float]], styles: dict[str, dict[str, Any]], title: str,
              xlabel: str, ylabel: str) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    shown = [v for v in curves.values() if v]
    for name, values in curves.items():
        if values:
            xs = sorted(v * 1e3 for v in values)
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=f"{name} (n={len(xs)})",
                    **styles[name])
    if shown and min(min(v) for v in shown) > 0 and max(max(v) for v in shown) / min(min(v) for v in shown) > 30:
        ax.set_xscale("log")  # queueing at high load stretches the tail over decades
    if not shown:
        ax.text(0.5, 0.5, "no values (e.g. every output had one token)", ha="center", transform=ax.transAxes)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel, ylim=(0, 1.02))
    ax.grid(alpha=0.3)
    if shown:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def bench_plots(report: dict[str, Any], out_dir: Path) -> list[str]:
    """Write BENCH_PLOTS into out_dir; returns their file names."""
    plt = _pyplot()
    several = len(report["engines"]) > 1
    series = _series(report)
    labels = {key: _label(*key, several) for key in series}

    for metric, name, what, unit_of in (("ttft", "TTFT", "time to first token", "requests"),
                                        ("tpot", "TPOT", "time per output token", "requests"),
                                        ("itl", "ITL", "inter-token latency", "token gaps")):
        curves = {}
        for key, times in series.items():
            if metric == "itl":
                curves[labels[key]] = [gap for t in times for gap in t.itl]
            else:
                curves[labels[key]] = [v for v in (getattr(t, metric) for t in times) if v is not None]
        styles = {labels[key]: _style(key, report) for key in series}
        _cdf_plot(plt, out_dir / f"{metric}_cdf.png", curves, styles, f"{name} CDF ({what})", f"{name} (ms)",
                  f"fraction of {unit_of} ≤ x")

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for engine in dict.fromkeys(r["engine"] for r in report["results"]):
        rows = [r for r in report["results"] if r["engine"] == engine]
        xs = [r["summary"]["throughput"] for r in rows]
        for ax, metric, name in ((axes[0], "ttft", "TTFT"), (axes[1], "tpot", "TPOT")):
            for p, style in (("p50", "-o"), ("p99", "--s")):
                ys = [r["summary"][metric].get(p) for r in rows]
                points = [(x, y * 1e3) for x, y in zip(xs, ys) if y is not None]
                if points:
                    prefix = f"{engine} " if several else ""
                    ax.plot(*zip(*points), style, label=f"{prefix}{name} {p.upper()}")
            for r, x in zip(rows, xs):
                y = r["summary"][metric].get("p50")
                if y is not None:
                    ax.annotate(f"qps {qps_label(r['qps'])}", (x, y * 1e3), textcoords="offset points",
                                xytext=(4, 4), fontsize=7)
    for ax, name in ((axes[0], "TTFT"), (axes[1], "TPOT")):
        ax.set(title=f"{name} vs throughput over the QPS sweep", xlabel="throughput (output tokens/s)",
               ylabel=f"{name} (ms)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "throughput_latency.png", dpi=110)
    plt.close(fig)

    rates = list(dict.fromkeys(qps_label(r["qps"]) for r in report["results"]))
    fig, axes = plt.subplots(len(rates), 1, figsize=(10, 2.6 * len(rates) + 0.6), squeeze=False)
    for ax, qps in zip(axes[:, 0], rates):
        for run in report["runs"]:
            if qps_label(run["qps"]) != qps or run["repeat"] != 0:
                continue
            when = [t for r in run["requests"] for t in r["token_times"][1:]]
            gaps = [g * 1e3 for r in run["requests"] for g in _times(r).itl]
            ax.scatter(when, gaps, s=4, alpha=0.6, label=run["engine"] if several else None)
        ax.set(title=f"ITL over time · {_label('', qps, False)} (first repeat)",
               xlabel="time since run start (s)", ylabel="ITL (ms)")
        ax.grid(alpha=0.3)
        if several:
            ax.legend(fontsize=8, markerscale=3)
    fig.tight_layout()
    fig.savefig(out_dir / "itl_over_time.png", dpi=110)
    plt.close(fig)
    return list(BENCH_PLOTS)


def tuning_plot(result, out_dir: Path) -> str:
    """Each trial's objective (median over repeats, bars = min..max), the default as a line."""
    plt = _pyplot()
    objective = result.objective
    scale, unit = objective.shown_unit
    fig, ax = plt.subplots(figsize=(max(6.0, 0.45 * len(result.trials) + 2), 4.5))
    for i, t in enumerate(result.trials, 1):
        if t.failed:  # listed with its error in the report; no value to place
            continue
        lo, hi = min(t.values) * scale, max(t.values) * scale
        mid = t.score * scale
        color = "tab:green" if t is result.best else "tab:gray" if t is result.default else "tab:blue"
        ax.errorbar(i, mid, yerr=[[mid - lo], [hi - mid]], fmt="o", color=color, capsize=3)
    if result.default is not None and not result.default.failed:
        ax.axhline(result.default.score * scale, color="tab:gray", ls="--", lw=1,
                   label=f"default {objective.format(result.default.score)}")
    if result.best is not None:
        ax.plot([], [], "o", color="tab:green", label=f"best {objective.format(result.best.score)}")
    ax.set(title=f"llmc tune: {objective.name} per trial ({objective.better_word} is better)",
           xlabel="trial (in search order; bars: min–max over repeats)", ylabel=f"{objective.description} ({unit})")
    ax.set_xticks(range(1, len(result.trials) + 1))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / TUNING_PLOT, dpi=110)
    plt.close(fig)
    return TUNING_PLOT
