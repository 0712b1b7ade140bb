"""llmc bench: SLO and workload parsing, the client loop, reports that validate, plots, bad input."""

from __future__ import annotations

import builtins
import json
import os
from importlib import resources

import numpy as np
import pytest
from click.testing import CliRunner

from llmc.bench.report import busy_runs_note
from llmc.bench.runner import OtherCpu, plan_runs, run_requests
from llmc.bench.slo import format_slo, parse_duration, parse_slo
from llmc.bench.workloads import MAX_QPS, BenchRequest, LengthDist, Workload, arrival_times, parse_qps
from llmc.cli import main
from llmc.errors import LlmcError
from llmc.runtime.llm import LLM

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _cli(*args: str):
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result, result.output  # click >= 8.2 mixes stderr into output


def _assert_one_line_error(args, expected: str):
    result, text = _cli(*args)
    assert result.exit_code == 2, text
    assert "Traceback" not in text
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, text
    assert expected in errors[0], errors[0]


# -- parsing ----------------------------------------------------------------------------------

def test_parse_slo_units_and_names():
    assert parse_slo("ttft=500ms,tpot=50ms") == {"ttft": 0.5, "tpot": 0.05}
    assert parse_slo(" TTFT = 1.5s , itl=20ms,e2e=2s") == {"ttft": 1.5, "itl": 0.02, "e2e": 2.0}
    assert parse_slo(None) == {} and parse_slo("") == {}
    assert parse_slo(format_slo({"ttft": 0.25, "tpot": 0.04})) == {"ttft": 0.25, "tpot": 0.04}


@pytest.mark.parametrize("text,expected", [
    ("ttft500ms", "malformed SLO"), ("ttft=", "malformed SLO"), ("ttft=500", "malformed SLO value '500'"),
    ("ttft=500us", "malformed SLO value"), ("ttft=fast", "malformed SLO value"), ("latency=5ms", "unknown SLO metric"),
    ("ttft=5ms,ttft=6ms", "given twice"), ("ttft=0ms", "malformed SLO value"),
])
def test_parse_slo_rejects_bad_strings_with_the_expected_form(text, expected):
    with pytest.raises(LlmcError, match=expected) as info:
        parse_slo(text)
    assert "\n" not in str(info.value)
    if "twice" not in expected:
        assert "ttft=500ms,tpot=50ms" in str(info.value)  # says what it expects


def test_parse_duration():
    assert parse_duration("90s", "--budget") == 90
    assert parse_duration("10m", "--budget") == 600
    assert parse_duration("1h30m", "--budget") == 5400
    assert parse_duration("250ms", "x") == pytest.approx(0.25)
    for bad in ("10", "ten minutes", "-5m", "0s", "5d"):
        with pytest.raises(LlmcError):
            parse_duration(bad, "--budget")


def test_length_distributions():
    rng = np.random.default_rng(0)
    assert LengthDist.parse("128", "--prompt-len").sample(rng, 3) == [128] * 3
    uniform = LengthDist.parse("64-256", "--prompt-len").sample(rng, 500)
    assert min(uniform) >= 64 and max(uniform) <= 256 and len(set(uniform)) > 50
    normal = LengthDist.parse("normal:100:10", "--prompt-len")
    values = normal.sample(rng, 2000)
    assert abs(np.mean(values) - 100) < 2 and max(values) <= 130 and min(values) >= 1
    assert str(normal) == "normal:100:10"
    for bad in ("0", "10-5", "abc", "normal:5", "-3"):
        with pytest.raises(LlmcError, match="--prompt-len"):
            LengthDist.parse(bad, "--prompt-len")


def test_parse_qps():
    assert parse_qps("1,4,max") == [1.0, 4.0, MAX_QPS]
    assert parse_qps("0.5") == [0.5]
    for bad, expected in (("0", "> 0"), ("-2", "> 0"), ("1,fast", "requests/s"), ("2,2", "twice"), ("nan", "> 0")):
        with pytest.raises(LlmcError, match=expected):
            parse_qps(bad)


# -- workloads --------------------------------------------------------------------------------

def _workload(**kw) -> Workload:
    args = dict(num_requests=6, prompt_len=LengthDist.parse("5-20", "p"), output_len=LengthDist.parse("3-6", "o"),
                seed=3)
    return Workload(**{**args, **kw})


def test_workload_is_reproducible_and_fresh_per_run():
    vocab = np.arange(10, 500)
    a = _workload().requests(vocab, 2.0, repeat=0, variant=0)
    assert a == _workload().requests(vocab, 2.0, repeat=0, variant=0)  # same seed, same requests
    other_rate = _workload().requests(vocab, MAX_QPS, repeat=0, variant=1)
    # Same lengths at every rate (the sweep changes only the load), fresh tokens (no prefix-cache hits).
    assert [len(r.prompt) for r in a] == [len(r.prompt) for r in other_rate]
    assert [r.output_len for r in a] == [r.output_len for r in other_rate]
    assert all(r.prompt != s.prompt for r, s in zip(a, other_rate))
    assert [r.arrival for r in other_rate] == [0.0] * 6
    assert all(10 <= t < 500 for r in a for t in r.prompt)
    assert _workload(seed=4).requests(vocab, 2.0, 0, 0) != a


def test_poisson_arrivals_scale_with_rate():
    at1 = arrival_times(200, 1.0, np.random.default_rng(5))
    at4 = arrival_times(200, 4.0, np.random.default_rng(5))
    assert at1[0] == 0.0 and all(b >= a for a, b in zip(at1, at1[1:]))
    assert at4 == pytest.approx([t / 4 for t in at1])
    assert 0.8 < np.mean(np.diff(at1)) < 1.2  # exponential gaps with mean 1 / rate


def test_shared_prefix_workload():
    vocab = np.arange(10, 500)
    reqs = _workload(shared_prefix=8, num_prefixes=2, prompt_len=LengthDist.parse("4-30", "p")).requests(
        vocab, MAX_QPS, 0, 0)
    assert all(len(r.prompt) >= 9 for r in reqs)  # prefix plus at least one token of its own
    assert reqs[0].prompt[:8] == reqs[2].prompt[:8] == reqs[4].prompt[:8]
    assert reqs[1].prompt[:8] == reqs[3].prompt[:8] != reqs[0].prompt[:8]


def test_workload_that_cannot_fit_fails_up_front():
    with pytest.raises(LlmcError, match="max context 64"):
        _workload(prompt_len=LengthDist.parse("60", "p")).check_fits(64)


def test_other_cpu_sees_a_busy_neighbour():
    import subprocess
    import sys

    burn = "import time\nend = time.perf_counter() + 0.8\nwhile time.perf_counter() < end: pass"
    with OtherCpu() as other:
        subprocess.run([sys.executable, "-c", burn], check=True)
    # A neighbour spinning one of the cores for most of the block (more if the machine is busier).
    cores = os.cpu_count() or 1
    assert 0.5 / cores < other.share <= 1.0


def test_busy_runs_are_flagged():
    report = {"runs": [{"engine": "a", "qps": 4.0, "repeat": 0, "other_cpu": 0.03},
                       {"engine": "a", "qps": "max", "repeat": 1, "other_cpu": 0.4}]}
    note = busy_runs_note(report)
    assert note.startswith("warning:") and "1 of 2 runs" in note and "a qps max repeat 2 (40%)" in note
    assert busy_runs_note({"runs": report["runs"][:1]}) is None


def test_plan_alternates_which_engine_goes_first():
    order = [(p.qps_index, p.repeat, p.engine) for p in plan_runs(2, 2, 2)]
    assert order == [(0, 0, 0), (0, 0, 1), (0, 1, 1), (0, 1, 0), (1, 0, 0), (1, 0, 1), (1, 1, 1), (1, 1, 0)]


# -- the client loop on the real engine --------------------------------------------------------

def test_run_sends_at_arrival_times_and_caps_concurrency(llama_engine):
    llm = LLM(llama_engine, use_tuning=False)
    rng = np.random.default_rng(0)
    requests = [BenchRequest(rng.integers(3, 200, int(n)).tolist(), 5, 0.002 * i)
                for i, n in enumerate(rng.integers(4, 30, 8))]
    records, start, wall = run_requests(llm, requests, max_concurrency=3)
    assert all(r.completed and len(r.output.token_ids) == 5 for r in records)
    spans = []
    for req, rec in zip(requests, records):
        m = rec.output.metrics
        assert m.arrival >= start + req.arrival - 1e-9  # never charged from before it was sent
        assert m.token_times[0] > m.arrival
        spans.append((m.arrival, m.token_times[-1]))
    # At any moment at most 3 requests are between their (client-side) arrival and last token.
    for t, _ in spans:
        assert sum(1 for a, e in spans if a <= t < e) <= 3
    assert wall == pytest.approx(max(e for _, e in spans) - start)


# -- the command -------------------------------------------------------------------------------

def test_bench_ab_writes_report_that_validates_and_plots(llama_engine, tmp_path):
    jsonschema = pytest.importorskip("jsonschema")
    out = tmp_path / "report"
    result, text = _cli("bench", llama_engine, llama_engine, "--num-requests", 4, "--prompt-len", "8-24",
                        "--output-len", 4, "--qps", "200,max", "--warmup", 1, "--slo", "ttft=2s,tpot=1s", "-o", out)
    assert result.exit_code == 0, text
    for header in ("qps", "TTFT p50", "TPOT p99", "ITL p99", "E2E p99", "goodput", "vs"):
        assert header in text, text

    schema = json.loads(resources.files("llmc.bench").joinpath("report_schema.json").read_text())
    report = json.loads((out / "report.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.validate(report, schema, cls=jsonschema.Draft202012Validator)
    labels = [e["label"] for e in report["engines"]]
    assert len(set(labels)) == 2
    assert [(r["engine"], r["qps"]) for r in report["runs"]] == [
        (labels[0], 200), (labels[1], 200), (labels[0], "max"), (labels[1], "max")]
    for run in report["runs"]:
        assert len(run["requests"]) == 4 and 0 <= run["other_cpu"] <= 1
        assert all(len(r["token_times"]) == 4 and r["ttft"] > 0 for r in run["requests"])
    summary = report["results"][0]["summary"]
    assert summary["goodput"] == pytest.approx(summary["request_throughput"])  # generous SLOs: all met

    md = (out / "report.md").read_text()
    assert "## Results" in md and "TTFT p50" in md and "vs" in md
    assert report["plots"] == ["ttft_cdf.png", "tpot_cdf.png", "itl_cdf.png", "throughput_latency.png",
                               "itl_over_time.png"]
    for name in report["plots"]:
        data = (out / name).read_bytes()
        assert data.startswith(PNG_SIGNATURE) and len(data) > 10_000, name
        assert f"]({name})" in md


def test_bench_without_plots(llama_engine, tmp_path):
    out = tmp_path / "b"
    result, text = _cli("bench", llama_engine, "--num-requests", 2, "--output-len", 2, "--prompt-len", 8,
                        "--warmup", 0, "--no-plots", "-o", out)
    assert result.exit_code == 0, text
    assert sorted(p.name for p in out.iterdir()) == ["report.json", "report.md"]


@pytest.mark.parametrize("args,expected", [
    (["--slo", "ttft:500ms"], "malformed SLO"),
    (["--qps", "0"], "--qps must be > 0"),
    (["--qps", "-1,2"], "--qps must be > 0"),
    (["--prompt-len", "lots"], "--prompt-len takes"),
    (["--max-concurrency", "0"], "--max-concurrency must be >= 1"),
    (["--num-requests", "0"], "--num-requests must be >= 1"),
    (["--prompt-len", "250", "--output-len", "64"], "max context 256"),
])
def test_bench_bad_input_one_line(llama_engine, tmp_path, args, expected):
    _assert_one_line_error(["bench", llama_engine, "--no-plots", "-o", tmp_path / "x", *args], expected)


def test_bench_on_a_folder_that_is_not_an_engine(tmp_path):
    (tmp_path / "notes").mkdir()
    _assert_one_line_error(["bench", tmp_path / "notes", "--no-plots"], "is not an llmc engine")


def test_bench_without_matplotlib_says_how_to_get_it(llama_engine, tmp_path, monkeypatch):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    _assert_one_line_error(["bench", llama_engine, "-o", tmp_path / "x"], "reinstall llmc (pip install -e .) or pass --no-plots")
    assert not (tmp_path / "x").exists()  # failed before measuring anything
