"""llmc tune: the search on fake cost functions (known best, budget, resume, noise), tuning.json
loading and precedence, and the command end to end on the tiny engine."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from llmc.bench.measure import build_command, make_space, variant_options
from llmc.bench.tuner import OBJECTIVES, Knob, SearchSpace, Tuner, get_objective, parse_budget
from llmc.cli import main
from llmc.contract import open_engine
from llmc.contract.options import BuildOptions, RuntimeOptions
from llmc.contract.tuning import TUNING_FILE, read_tuning, write_tuning
from llmc.errors import LlmcError
from llmc.runtime.llm import LLM

SPACE = SearchSpace(
    [Knob("num_threads", (1, 2)), Knob("max_num_seqs", (4, 8, 16, 32)),
     Knob("max_num_batched_tokens", (256, 512, 1024)), Knob("chunk_size", (64, 128, 256, 512))],
    {"num_threads": 2, "max_num_seqs": 16, "max_num_batched_tokens": 512, "chunk_size": 256})


def _throughput_of(config) -> float:
    """A made-up landscape with one best point (1 thread, 8 seqs, 1024 tokens, chunk 512) and an
    interaction: chunk 512 only helps once the budget allows it."""
    value = 100.0
    value += {1: 20, 2: 0}[config["num_threads"]]
    value -= abs(config["max_num_seqs"] - 8)
    value += config["max_num_batched_tokens"] / 64
    value += config["chunk_size"] / 32 if config["max_num_batched_tokens"] >= 1024 else 0
    return value


class FakeCost:
    def __init__(self, fn=_throughput_of, noise=(0.0,)):
        self.fn, self.noise, self.calls = fn, noise, []

    def __call__(self, config):
        assert SPACE.valid(config), config  # the tuner never asks for a configuration the scheduler rejects
        self.calls.append(dict(config))
        return [{"throughput": self.fn(config) * (1 + n), "tpot": {"p99": 1 / self.fn(config)}} for n in self.noise]


def _grid_best(fn):
    import itertools

    configs = [dict(zip([k.name for k in SPACE.knobs], values))
               for values in itertools.product(*(k.values for k in SPACE.knobs))]
    return max((c for c in configs if SPACE.valid(c)), key=fn)


def test_tuner_picks_the_known_best_of_a_deterministic_cost():
    cost = FakeCost()
    result = Tuner(SPACE, cost, OBJECTIVES["max-throughput"], budget_s=3600).run()
    assert result.best.config == _grid_best(_throughput_of)
    assert result.best.config == {"num_threads": 1, "max_num_seqs": 8, "max_num_batched_tokens": 1024,
                                  "chunk_size": 512}
    assert result.winner is result.best and not result.out_of_budget
    assert result.default.config == SPACE.default and cost.calls[0] == SPACE.default
    assert result.margin == pytest.approx(_throughput_of(result.best.config) / _throughput_of(SPACE.default) - 1)
    assert len(cost.calls) < 40  # coordinate descent, not the 96-point grid


def test_min_objective_picks_the_lowest():
    result = Tuner(SPACE, FakeCost(), OBJECTIVES["min-tpot-p99"], budget_s=3600).run()
    assert result.best.config == _grid_best(_throughput_of)  # tpot = 1 / throughput in the fake
    assert result.margin > 0


def test_budget_stops_the_search():
    now = [0.0]

    def slow_cost(config):
        now[0] += 10.0  # every trial takes 10 fake seconds
        return FakeCost()(config)

    result = Tuner(SPACE, slow_cost, OBJECTIVES["max-throughput"], budget_s=55, clock=lambda: now[0]).run()
    assert result.out_of_budget
    # Trials at 0, 10 and 20 s; a fourth (30-40 s) would leave no room for the final check of the
    # default and the best (40-60 s), which runs from 30 to 50 s instead.
    assert len(result.trials) == 3 and result.confirmed
    assert now[0] == 50


def test_resume_reuses_finished_trials(tmp_path):
    state = tmp_path / "state.json"
    now = [0.0]

    def timed(cost):
        def run(config):
            now[0] += 10.0
            return cost(config)
        return run

    first = FakeCost()
    partial = Tuner(SPACE, timed(first), OBJECTIVES["max-throughput"], 55, state, {"w": 1}, clock=lambda: now[0]).run()
    assert partial.out_of_budget and len(partial.trials) == 3 and len(first.calls) == 5  # 3 trials + final check

    second = FakeCost()
    resumed = Tuner(SPACE, second, OBJECTIVES["max-throughput"], 3600, state, {"w": 1}).run()
    assert resumed.best.config == _grid_best(_throughput_of)
    # Only new trials are measured, then the default and the best once more back to back.
    assert not any(c in first.calls for c in second.calls[:-2])
    assert second.calls[-2:] == [SPACE.default, resumed.best.config] and resumed.confirmed
    assert resumed.measured == len(second.calls) - 2
    assert len(resumed.trials) == resumed.measured + 3

    with pytest.raises(LlmcError, match="different setup .*w.*--fresh"):
        Tuner(SPACE, FakeCost(), OBJECTIVES["max-throughput"], 10, state, {"w": 2})
    state.write_text("{not json")
    with pytest.raises(LlmcError, match="corrupt tuning state"):
        Tuner(SPACE, FakeCost(), OBJECTIVES["max-throughput"], 10, state, {"w": 1})


def test_failed_trials_are_recorded_and_skipped():
    def fragile(config):
        if config["max_num_seqs"] == 8:
            raise LlmcError("out of memory (pretend)")
        return FakeCost()(config)

    result = Tuner(SPACE, fragile, OBJECTIVES["max-throughput"], 3600).run()
    failed = [t for t in result.trials if t.failed]
    assert failed and all(t.config["max_num_seqs"] == 8 for t in failed)
    assert "out of memory" in failed[0].error
    assert result.best.config["max_num_seqs"] != 8


def test_win_within_noise_keeps_the_default():
    def flat(config):  # 1% better than the default, but repeats spread by 10%
        return 101.0 if config != SPACE.default else 100.0

    result = Tuner(SPACE, FakeCost(flat, noise=(-0.05, 0.0, 0.05)), OBJECTIVES["max-throughput"], 3600).run()
    assert result.best is not result.default
    assert result.winner is result.default
    assert "within the repeats' spread" in result.verdict
    assert result.confirmed  # default and best measured again back to back


def test_final_choice_is_among_the_re_measured_finalists():
    space = SearchSpace([Knob("chunk_size", (64, 128, 256))], {"chunk_size": 256})
    calls = []

    def drifting(config):  # 128 measures 150 first, then 120 when checked again at the end
        calls.append(config["chunk_size"])
        value = {256: 100.0, 64: 140.0}.get(config["chunk_size"]) or (150.0 if calls.count(128) == 1 else 120.0)
        return [{"throughput": value}]

    result = Tuner(space, drifting, OBJECTIVES["max-throughput"], 3600).run()
    assert calls == [256, 64, 128, 256, 128] and result.confirmed
    # 128's pooled median (135) is now below 64's single 140, but only the finalists were measured
    # back to back: the winner is chosen among them.
    assert result.best.config == {"chunk_size": 128} and result.best.score == pytest.approx(135.0)
    assert result.winner is result.best


def test_a_default_that_wins_the_final_check_stays():
    space = SearchSpace([Knob("num_threads", (1, 2))], {"num_threads": 2})
    seen = []

    def busy_then_quiet(config):  # 2 threads suffer while another job holds a core, then it ends
        seen.append(config["num_threads"])
        quiet = len(seen) > 2
        return [{"throughput": 110.0 if config["num_threads"] == 1 else (190.0 if quiet else 58.0)}]

    result = Tuner(space, busy_then_quiet, OBJECTIVES["max-throughput"], 3600).run()
    assert seen == [2, 1, 2, 1] and result.confirmed
    assert result.best is result.default and result.winner is result.default
    assert "default came out ahead" in result.verdict


def test_build_knob_winner_leaves_tuning_json_the_best_runtime_configuration():
    space = SearchSpace([Knob("max_num_seqs", (8, 16)), Knob("block_size", (16, 32), "build")],
                        {"max_num_seqs": 16, "block_size": 16})

    def cost(config):
        return [{"throughput": 100.0 + (config["max_num_seqs"] == 8) * 10 + (config["block_size"] == 32) * 20}]

    result = Tuner(space, cost, OBJECTIVES["max-throughput"], 3600).run()
    assert result.best.config == {"max_num_seqs": 8, "block_size": 32}  # needs a rebuild
    assert result.winner.config == {"max_num_seqs": 8, "block_size": 16}  # what the engine as built can apply


def test_objective_and_budget_errors():
    with pytest.raises(LlmcError, match="unknown objective 'fastest'; objectives are: min-tpot-p99, max-throughput"):
        get_objective("fastest", {})
    with pytest.raises(LlmcError, match="needs SLOs"):
        get_objective("max-goodput", {})
    assert parse_budget("10m") == 600 and parse_budget("90s") == 90 and parse_budget("1h") == 3600
    with pytest.raises(LlmcError, match="--budget"):
        parse_budget("10")


def test_build_knobs_come_from_the_manifest(llama_engine):
    manifest = open_engine(llama_engine).manifest
    defaults = RuntimeOptions(num_threads=2)
    space = make_space(defaults, manifest.build_options, max_in_flight=12)
    kinds = {k.name: k.kind for k in space.knobs}
    # Limits above what the workload can have in flight behave alike: only the default stays.
    assert next(k for k in space.knobs if k.name == "max_num_seqs").values == (4, 8, 16)
    assert make_space(defaults, None, max_in_flight=2).knobs[1].values == (2, 16)
    assert "block_size" not in make_space(defaults, None, 64).default
    assert kinds["block_size"] == kinds["disable_passes"] == "build" and kinds["max_num_seqs"] == "runtime"
    assert space.default["block_size"] == 4 and space.default["disable_passes"] == "none"
    cmd = build_command(manifest, llama_engine, {**space.default, "block_size": 16, "disable_passes": "cleanup"})
    assert cmd.startswith("llmc build tiny-llama -o ") and "--block-size 16" in cmd
    assert "--disable-pass cleanup" in cmd and "--max-context 256" in cmd and "--overwrite" in cmd
    assert next(k for k in space.knobs if k.name == "lossless_weights").values == (False, True)
    # an opt-in pass is off unless asked: "disabling" it would only measure the same engine again
    assert "lossless-weights" not in next(k for k in space.knobs if k.name == "disable_passes").values
    assert "--lossless-weights" not in cmd
    assert "--lossless-weights" in build_command(manifest, llama_engine, {**space.default, "lossless_weights": True})
    # A variant is the engine's own build options with the knobs changed, built again.
    variant = variant_options(manifest.build_options, {**space.default, "block_size": 8, "disable_passes": "a+b"})
    # (the engine recorded the KV cache its "auto" resolved to, and a variant keeps it)
    assert variant == BuildOptions(block_size=8, max_context=256, disable_passes=("a", "b"), verify=True,
                                   kv_cache_dtype="fp32")


# -- tuning.json --------------------------------------------------------------------------------

@pytest.fixture
def engine_copy(llama_engine, tmp_path):
    dst = tmp_path / "engine"
    shutil.copytree(llama_engine, dst)
    return dst


def test_tuning_json_is_applied_and_explicit_options_win(engine_copy):
    write_tuning(engine_copy, {"max_num_seqs": 3, "num_threads": 1, "graph_optimization_level": "basic"},
                 objective="max-throughput")
    open_engine(engine_copy)  # an extra file does not break checksum verification
    llm = LLM(engine_copy)
    assert llm.options.max_num_seqs == 3 and llm.engine.num_threads == 1
    assert llm.options.graph_optimization_level == "basic"
    assert llm.tuning == {"max_num_seqs": 3, "num_threads": 1, "graph_optimization_level": "basic"}
    llm = LLM(engine_copy, max_num_seqs=5)
    assert llm.options.max_num_seqs == 5 and llm.tuning == {"num_threads": 1, "graph_optimization_level": "basic"}
    llm = LLM(engine_copy, use_tuning=False)
    assert llm.options.max_num_seqs == 16 and llm.tuning is None
    assert LLM(engine_copy).generate("hi", None).finish_reason in ("stop", "length")


def test_runtime_options_merge_and_round_trip_through_tuning_json(engine_copy):
    options, applied = RuntimeOptions.merge({"max_num_seqs": None, "chunk_size": 64},
                                            {"max_num_seqs": 8, "chunk_size": 128})
    assert (options.max_num_seqs, options.chunk_size, applied) == (8, 64, {"max_num_seqs": 8})
    assert RuntimeOptions.merge({"max_num_seqs": None}, None) == (RuntimeOptions(), {})
    tuned = RuntimeOptions(max_num_seqs=4, chunk_size=64, num_threads=1, allow_spinning=False)
    write_tuning(engine_copy, tuned.tunable())
    assert read_tuning(engine_copy / TUNING_FILE) == tuned.tunable()
    assert LLM(engine_copy).options == tuned
    with pytest.raises(LlmcError, match="unknown option 'turbo'; options are: max_num_seqs"):
        RuntimeOptions.given({"turbo": 1})
    with pytest.raises(LlmcError, match=r"chunk_size \(600\) must be <= max_num_batched_tokens \(512\)"):
        RuntimeOptions(chunk_size=600)
    with pytest.raises(ValueError, match="not tunable"):
        write_tuning(engine_copy, {"kv_cache_blocks": 8})


# -- the command ------------------------------------------------------------------------------

def _cli(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result, result.output


def test_tune_writes_tuning_json_that_run_then_applies(engine_copy, tmp_path):
    out = tmp_path / "tune"
    result, text = _cli("tune", engine_copy, "--budget", "3s", "--num-requests", 3, "--prompt-len", 12,
                        "--output-len", 3, "--repeats", 2, "--warmup", 1, "-o", out)
    assert result.exit_code == 0, text
    tuning = json.loads((engine_copy / TUNING_FILE).read_text())
    assert tuning["objective"] == "max-throughput" and set(tuning["options"]) >= {"max_num_seqs", "num_threads"}
    report = (out / "tuning_report.md").read_text()
    # The default is always trial 1; whether it is also the winner (★) depends on this machine's speed.
    assert "## Winner" in report and "| trial |" in report and "other CPU |" in report
    assert "| 1 ★ | default |" in report or "| 1 (default) | default |" in report
    state = json.loads((out / "tune_state.json").read_text())
    assert all(0 <= s["other_cpu"] <= 1 for t in state["trials"] for s in t["summaries"])
    assert (out / "tuning.png").read_bytes().startswith(b"\x89PNG") and (out / "tune_state.json").is_file()
    open_engine(engine_copy)

    result, text = _cli("run", engine_copy, "Hello", "--max-tokens", 3)
    assert result.exit_code == 0, text
    assert "tuning: applied tuning.json (" in text
    assert "max_num_seqs=" in text.split("tuning: applied tuning.json", 1)[1].splitlines()[0]
    result, text = _cli("run", engine_copy, "Hello", "--max-tokens", 3, "--no-tuning")
    assert result.exit_code == 0 and "tuning:" not in text

    (engine_copy / TUNING_FILE).write_text("{")  # ignored with a warning (tests/test_options.py)
    result, text = _cli("run", engine_copy, "Hello", "--max-tokens", 3)
    assert result.exit_code == 0 and "tuning: applied" not in text


@pytest.mark.parametrize("args,expected", [
    (["--objective", "fastest"],
     "unknown objective 'fastest'; objectives are: min-tpot-p99, max-throughput, max-goodput"),
    (["--objective", "max-goodput"], "needs SLOs"),
    (["--slo", "ttft=fast"], "malformed SLO value 'fast'"),
    (["--budget", "soon"], "--budget 'soon' is not a duration"),
    (["--qps", "1,2"], "one arrival rate"),
    (["--qps", "0"], "--qps must be > 0"),
])
def test_tune_bad_input_one_line(llama_engine, tmp_path, args, expected):
    result, text = _cli("tune", llama_engine, "--no-plots", "-o", tmp_path / "t", *args)
    assert result.exit_code == 2, text
    assert "Traceback" not in text and text.count("error:") == 1 and expected in text, text
    assert not (llama_engine / TUNING_FILE).exists()


def test_tune_on_a_folder_that_is_not_an_engine(tmp_path):
    (tmp_path / "notes").mkdir()
    result, text = _cli("tune", tmp_path / "notes", "--no-plots")
    assert result.exit_code == 2 and text.startswith("error:") and "is not an llmc engine" in text
