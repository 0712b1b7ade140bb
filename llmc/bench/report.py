"""Benchmark and tuning reports: report.json (schema in report_schema.json), report.md, the
terminal table, and tuning_report.md. Numbers come from the summaries llmc.bench.summary makes;
this module only arranges and formats them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from llmc.bench.runner import BUSY_MACHINE, RunResult, merged_summary
from llmc.bench.slo import format_slo
from llmc.bench.workloads import MAX_QPS, qps_label
from llmc.contract.options import RuntimeOptions, format_options
from llmc.version import __version__

REPORT_SCHEMA_VERSION = 1
# (summary key, column title) of the latency columns the table shows, in ms.
TABLE_LATENCIES = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "E2E"))


def _json_qps(rate: float) -> float | str:
    return "max" if rate == MAX_QPS else rate


def build_report(engines: Sequence[dict[str, Any]], workload: dict[str, Any], rates: Sequence[float],
                 runs: Sequence[RunResult], slo: dict[str, float]) -> dict[str, Any]:
    """The report.json document: settings, every request's timestamps per run, and a summary per
    (engine, rate) merged over repeats. Timestamps are seconds since their run's start. `plots`
    starts empty; the caller lists the PNGs it writes."""
    results = []
    for rate in rates:
        for engine in engines:
            mine = [r for r in runs if r.engine == engine["label"] and r.qps == rate]
            results.append({"engine": engine["label"], "qps": _json_qps(rate), "repeats": len(mine),
                            "summary": merged_summary(mine, slo)})
    return {
        "schema_version": REPORT_SCHEMA_VERSION,
        "llmc_version": __version__,
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "workload": {**workload, "qps": [_json_qps(r) for r in rates]},
        "slo": dict(slo),
        "engines": list(engines),
        "runs": [{"engine": r.engine, "qps": _json_qps(r.qps), "repeat": r.repeat, "wall_time": r.wall_time,
                  "other_cpu": r.other_cpu, "summary": r.summary(slo),
                  "requests": [rec.to_dict(r.start) for rec in r.records]}
                 for r in runs],
        "results": results,
        "plots": [],
    }


def write_json(path: Path, document: dict[str, Any]) -> None:
    path.write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value * 1e3:.1f}"


def _pct(summary: dict, metric: str, p: str) -> float | None:
    return summary[metric].get(p)


def table_rows(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Headers and rows of the summary table (latencies in ms, one row per engine and rate)."""
    several = len(report["engines"]) > 1
    with_slo = bool(report["slo"])
    headers = ["qps"] + (["engine"] if several else []) + ["req/s", "out tok/s"] + (["goodput"] if with_slo else [])
    headers += [f"{title} {p}" for _, title in TABLE_LATENCIES for p in ("p50", "p99")]
    speculating = any((r["summary"].get("speculation") or {}).get("proposed_tokens") for r in report["results"])
    headers += ["accepted", "tok/step"] if speculating else []
    rows = []
    for result in report["results"]:
        s = result["summary"]
        row = [qps_label(result["qps"])] + ([result["engine"]] if several else [])
        row += [f"{s['request_throughput']:.2f}", f"{s['throughput']:.1f}"]
        if with_slo:
            row.append(f"{s['goodput']:.2f} ({s['slo_attainment']:.0%})")
        row += [_ms(_pct(s, key, p)) for key, _ in TABLE_LATENCIES for p in ("p50", "p99")]
        if speculating:
            spec = s.get("speculation") or {}
            rate, per_step = spec.get("acceptance_rate"), spec.get("tokens_per_step")
            row += ["–" if rate is None else f"{rate:.0%}", "–" if per_step is None else f"{per_step:.2f}"]
        rows.append(row)
    return headers, rows


def comparison_rows(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """With two engines: B against A per rate, as percentage changes (negative latency = faster)."""
    a, b = (e["label"] for e in report["engines"][:2])
    by_key = {(r["engine"], qps_label(r["qps"])): r["summary"] for r in report["results"]}
    headers = ["qps", "out tok/s", "TTFT p50", "TPOT p50", "ITL p99", "E2E p99"]
    rows = []
    for qps in dict.fromkeys(qps_label(r["qps"]) for r in report["results"]):
        sa, sb = by_key[(a, qps)], by_key[(b, qps)]
        pairs = [(sa["throughput"], sb["throughput"])]
        pairs += [(_pct(sa, m, p), _pct(sb, m, p)) for m, p in (("ttft", "p50"), ("tpot", "p50"),
                                                               ("itl", "p99"), ("e2e", "p99"))]
        rows.append([qps] + [f"{(vb / va - 1):+.1%}" if va and vb is not None else "–" for va, vb in pairs])
    return headers, rows


def busy_runs_note(report: dict[str, Any]) -> str | None:
    """A warning naming the runs during which other processes used much of the CPU, or None."""
    busy = [r for r in report["runs"] if (r["other_cpu"] or 0) > BUSY_MACHINE]
    if not busy:
        return None
    where = ", ".join(f"{r['engine']} qps {qps_label(r['qps'])} repeat {r['repeat'] + 1} ({r['other_cpu']:.0%})"
                      for r in busy)
    return (f"warning: other processes used over {BUSY_MACHINE:.0%} of the CPU during {len(busy)} of "
            f"{len(report['runs'])} runs ({where}); their latencies include that interference")


def print_table(report: dict[str, Any], console) -> None:
    from rich.table import Table

    def show(title: str, headers: list[str], rows: list[list[str]]) -> None:
        table = Table(title=title, title_justify="left")
        for h in headers:
            table.add_column(h, justify="left" if h in ("qps", "engine") else "right")
        for row in rows:
            table.add_row(*row)
        console.print(table)

    show("latencies in ms", *table_rows(report))
    if len(report["engines"]) == 2:
        a, b = (e["label"] for e in report["engines"])
        show(f"{b} vs {a}", *comparison_rows(report))
    note = busy_runs_note(report)
    if note:
        console.print(note, markup=False)


def md_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    return ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)] + \
           ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def render_markdown(report: dict[str, Any]) -> str:
    w = report["workload"]
    lines = [f"# llmc bench: {' vs '.join(e['label'] for e in report['engines'])}", "",
             f"llmc {report['llmc_version']} · {report['created_at']}", "", "## Workload", "",
             f"{w['num_requests']} requests per run · prompt tokens {w['prompt_len']} · output tokens "
             f"{w['output_len']} (EOS ignored)"
             + (f" · shared prefix {w['shared_prefix']} tokens × {w['num_prefixes']}" if w["shared_prefix"] else "")
             + f" · arrivals: {', '.join(qps_label(q) for q in w['qps'])} req/s (Poisson; max = all at once)"
             + (f" · max concurrency {w['max_concurrency']}" if w["max_concurrency"] else "")
             + f" · {w['repeats']} repeat(s) · {w['warmup']} warm-up requests excluded · seed {w['seed']}"]
    if report["slo"]:
        lines += ["", f"SLOs: `{format_slo(report['slo'])}`; goodput = completed requests/s meeting all of them "
                      "(percentage: share of requests)."]
    lines += ["", "## Engines", ""]
    for e in report["engines"]:
        tuning = f"tuning.json applied ({format_options(e['tuning'])})" if e["tuning"] else "no tuning applied"
        lines.append(f"- **{e['label']}**: `{e['path']}` ({e['source']}); {tuning}; runtime options: "
                     f"{format_options(e['options'])}")
    lines += ["", "## Results", "", "Latencies in ms; rates per second of wall time.", ""]
    lines += md_table(*table_rows(report))
    shares = [r["other_cpu"] for r in report["runs"] if r["other_cpu"] is not None]
    if shares:
        lines += ["", f"Other processes used {min(shares):.0%}–{max(shares):.0%} of the machine's CPU during the runs."]
    note = busy_runs_note(report)
    if note:
        lines += ["", f"**{note[0].upper()}{note[1:]}**"]
    lines += ["", "### All percentiles (ms)", ""]
    several = len(report["engines"]) > 1
    headers = ["qps"] + (["engine"] if several else []) + ["metric", "p50", "p90", "p95", "p99", "count"]
    rows = []
    for result in report["results"]:
        s = result["summary"]
        counts = {"ttft": s["counts"]["with_tokens"], "tpot": s["counts"]["with_tpot"],
                  "itl": s["counts"]["itl_gaps"], "e2e": s["counts"]["with_tokens"]}
        for key, title in TABLE_LATENCIES:
            rows.append([qps_label(result["qps"])] + ([result["engine"]] if several else []) + [title]
                        + [_ms(_pct(s, key, p)) for p in ("p50", "p90", "p95", "p99")] + [str(counts[key])])
    lines += md_table(headers, rows)
    if len(report["engines"]) == 2:
        a, b = (e["label"] for e in report["engines"])
        lines += ["", f"### {b} vs {a}", "", "Change of B against A; runs interleaved A B, B A, ...", ""]
        lines += md_table(*comparison_rows(report))
    if report["plots"]:
        lines += ["", "## Plots", ""] + [f"![{Path(p).stem}]({p})" for p in report["plots"]]
    lines += ["", "## Definitions", "",
              "TTFT = first token − arrival; TPOT = (E2E − TTFT) / (output tokens − 1); ITL = each gap between "
              "consecutive tokens (percentiles over all gaps); E2E = last token − arrival; throughput = output "
              "tokens / wall time (run start to last token). Percentiles interpolate linearly. With speculative "
              "decoding: accepted = proposals the target kept / proposals verified; tok/step = output tokens after "
              "the first / decode steps.", ""]
    return "\n".join(lines)


# -- tuning ---------------------------------------------------------------------------------


def render_tuning_markdown(result, objective, workload: dict[str, Any], engine: str,
                           recommendation: str | None, plot: str | None) -> str:
    """tuning_report.md: settings, every trial (what it changed from the default, median, spread),
    the winner and its margin over the default."""
    default, best = result.default, result.best
    lines = [f"# llmc tune: {engine}", "",
             f"Objective **{objective.name}** ({objective.description}) · {len(result.trials)} trials "
             f"({result.measured} measured now, {len(result.trials) - result.measured} reused from the state file) "
             f"· {result.seconds:.0f} s of {result.budget:.0f} s budget"
             + (" · stopped by the budget" if result.out_of_budget else " · search converged"), "",
             f"Workload: {workload['num_requests']} requests · prompt tokens {workload['prompt_len']} · output tokens "
             f"{workload['output_len']} · qps {workload['qps']} · {workload['repeats']} repeats per trial · "
             f"seed {workload['seed']}", "", "## Winner", ""]
    if best is None or default is None or default.failed:
        lines.append("No successful trial." if best is None else "The default configuration failed.")
    else:
        lines += [f"`{config_changes(best.config, default.config) or 'the default'}` → "
                  f"{objective.format(best.score)} (spread {best.rel_spread:.1%}) vs default "
                  f"{objective.format(default.score)} (spread {default.rel_spread:.1%}): "
                  f"**{result.margin:+.1%}** {objective.better_word}.", "",
                  result.verdict + (" Default and finalists were measured once more back to back at the end; "
                                    "their values pool both rounds." if result.confirmed else
                                    "" if best is default else
                                    " The budget left no time to measure default and best again back to back.")]
    if recommendation:
        lines += ["", recommendation]
    if result.winner is not None:
        runtime = RuntimeOptions.tunable_of(result.winner.config)
        lines += ["", f"tuning.json: `{format_options(runtime)}`"
                      + (" (the default values: nothing beat them beyond noise)" if result.winner is default else "")]
    busy = [i for i, t in enumerate(result.trials, 1) if (other_cpu(t) or 0) > BUSY_MACHINE]
    if busy:
        lines += ["", f"**Warning: other processes used over {BUSY_MACHINE:.0%} of the CPU during trials "
                      f"{', '.join(map(str, busy))}; their values include that interference.**"]
    lines += ["", "## Trials", "", "Each trial: the median over repeats; spread = (max − min) / median; other CPU = "
                  "the most of the machine's CPU other processes used during one of its runs.", ""]
    rows = []
    for i, t in enumerate(result.trials, 1):
        mark = " ★" if t is best else " (default)" if t is default else ""
        value = t.error if t.failed else objective.format(t.score)
        share = other_cpu(t)
        rows.append([f"{i}{mark}", config_changes(t.config, default.config if default else {}) or "default", value,
                     "–" if t.failed else f"{t.rel_spread:.1%}", str(len(t.values)), f"{t.seconds:.1f}",
                     "–" if share is None else f"{share:.0%}"])
    lines += md_table(["trial", "changes from default", objective.name, "spread", "runs", "seconds", "other CPU"],
                      rows)
    if plot:
        lines += ["", f"![trials]({plot})"]
    return "\n".join(lines) + "\n"


def other_cpu(trial) -> float | None:
    """The largest share of the CPU other processes took during one of a trial's runs."""
    shares = [s["other_cpu"] for s in trial.summaries if s.get("other_cpu") is not None]
    return max(shares, default=None)


def config_changes(config: dict[str, Any], default: dict[str, Any]) -> str:
    """The knobs of `config` that differ from `default`, as `name=value, ...` ('' for none)."""
    return format_options({k: v for k, v in config.items() if default.get(k) != v})
