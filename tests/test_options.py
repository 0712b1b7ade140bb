"""Runtime options are type-checked and bounded by the machine (one-line errors, never a hang, a
TypeError or a MemoryError), and a bad tuning.json is ignored with one warning line."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from collections import namedtuple

import psutil
import pytest
from click.testing import CliRunner

from llmc.cli import main
from llmc.contract.options import MAX_NUM_SEQS, MAX_STEP_TOKENS, RuntimeOptions
from llmc.contract.tuning import TUNING_FILE
from llmc.errors import LlmcError
from llmc.runtime.llm import LLM

CPUS = os.cpu_count() or 1
MEMORY = psutil.virtual_memory().total
THREADS_BOUND = f"num_threads must be an integer >= 1 and <= {CPUS}, this machine's logical CPU count"


@pytest.fixture
def engine_copy(llama_engine, tmp_path):
    dst = tmp_path / "engine"
    shutil.copytree(llama_engine, dst)
    return dst


@pytest.fixture(scope="module")
def default_options(llama_engine):
    return LLM(llama_engine).options  # the session engine has no tuning.json


def _tuning(engine, options=None, text=None):
    (engine / TUNING_FILE).write_text(text if text is not None else
                                      json.dumps({"schema_version": 1, "options": options}))


def _llmc_warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.name.startswith("llmc") and r.levelno >= logging.WARNING]


# -- RuntimeOptions -------------------------------------------------------------------------------

BAD_OPTIONS = [
    ({"num_threads": 10**6}, f"{THREADS_BOUND} (got 1000000)"),
    ({"num_threads": CPUS + 1}, f"{THREADS_BOUND} (got {CPUS + 1})"),
    ({"num_threads": -1}, f"{THREADS_BOUND} (got -1)"),
    ({"num_threads": 2.5}, f"{THREADS_BOUND} (got 2.5)"),
    ({"allow_spinning": "no"}, "allow_spinning must be True or False (got 'no')"),
    ({"kv_cache_blocks": "8"}, "kv_cache_blocks must be an integer >= 2 (got '8')"),
    ({"kv_cache_blocks": 2.5}, "kv_cache_blocks must be an integer >= 2 (got 2.5)"),
    ({"kv_cache_blocks": 1}, "kv_cache_blocks must be an integer >= 2 (got 1)"),
    ({"kv_cache_bytes": 10**15}, f"kv_cache_bytes must be an integer >= 1 and <= {MEMORY}, this machine's memory "
                                 f"({MEMORY / 2**30:.1f} GiB) (got {10**15})"),
    ({"max_num_seqs": True}, f"max_num_seqs must be an integer >= 1 and <= {MAX_NUM_SEQS} (got True)"),
    ({"max_num_seqs": MAX_NUM_SEQS + 1},
     f"max_num_seqs must be an integer >= 1 and <= {MAX_NUM_SEQS} (got {MAX_NUM_SEQS + 1})"),
    ({"max_num_batched_tokens": 10**9},
     f"max_num_batched_tokens must be an integer >= 1 and <= {MAX_STEP_TOKENS} (got 1000000000)"),
    ({"chunk_size": MAX_STEP_TOKENS + 1},
     f"chunk_size must be an integer >= 1 and <= {MAX_STEP_TOKENS} (got {MAX_STEP_TOKENS + 1})"),
    ({"graph_optimization_level": ["all"]},
     "graph_optimization_level must be one of disable, basic, extended, all (got ['all'])"),
    ({"verify_checksums": 1}, "verify_checksums must be True or False (got 1)"),
]


@pytest.mark.parametrize("options,expected", BAD_OPTIONS, ids=[json.dumps(o) for o, _ in BAD_OPTIONS])
def test_bad_runtime_option_names_the_option_the_value_and_the_bound(options, expected):
    with pytest.raises(LlmcError) as info:
        RuntimeOptions(**options)
    assert str(info.value) == expected


def test_the_bounds_themselves_are_accepted():
    options = RuntimeOptions(num_threads=CPUS, max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=MAX_STEP_TOKENS,
                             chunk_size=MAX_STEP_TOKENS, kv_cache_blocks=2, kv_cache_bytes=MEMORY)
    assert options.num_threads == CPUS


def test_kv_pool_larger_than_memory_is_an_error_not_a_memory_error(llama_engine):
    with pytest.raises(LlmcError, match=r"^kv_cache_blocks 1000000000 makes a KV pool of [\d,.]+ MiB "
                                        r"\(1000000000 blocks of \d+ bytes\) but this machine has [\d,.]+ MiB "
                                        r"available; lower kv_cache_blocks$"):
        LLM(llama_engine, kv_cache_blocks=10**9)


def test_kv_pool_is_bounded_by_available_memory_not_total(llama_engine, monkeypatch):
    memory = psutil.virtual_memory()
    fake = namedtuple("svmem", "total available")(memory.total, 2**20)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: fake)
    with pytest.raises(LlmcError, match=r"^kv_cache_blocks 1024 makes a KV pool of [\d.]+ MiB \(1024 blocks of "
                                        r"\d+ bytes\) but this machine has 1.0 MiB available"):
        LLM(llama_engine, kv_cache_blocks=1024)


def test_cli_bad_options_are_one_line_errors(llama_engine, tmp_path):
    runs = {
        "run": ["run", llama_engine, "Hello", "--max-tokens", 1, "--threads", CPUS + 1],
        "bench": ["bench", llama_engine, "--max-num-batched-tokens", 10**5, "--num-requests", 1,
                  "--prompt-len", 4, "--output-len", 1, "--warmup", 0, "--no-plots", "-o", tmp_path / "b"],
    }
    expected = {"run": f"error: {THREADS_BOUND} (got {CPUS + 1})",
                "bench": f"error: max_num_batched_tokens must be an integer >= 1 and <= {MAX_STEP_TOKENS} (got 100000)"}
    for name, args in runs.items():
        result = CliRunner().invoke(main, [str(a) for a in args])
        assert (result.exit_code, result.output.strip()) == (2, expected[name])


# -- tuning.json ----------------------------------------------------------------------------------

@pytest.mark.parametrize("options,text,problem", [
    ({"num_threads": 1000000}, None, f"{THREADS_BOUND} (got 1000000)"),
    ({"num_threads": CPUS + 1}, None, f"{THREADS_BOUND} (got {CPUS + 1})"),
    ({"max_num_seqs": "8"}, None, f"max_num_seqs must be an integer >= 1 and <= {MAX_NUM_SEQS} (got '8')"),
    ({"chunk_size": 2.5}, None, f"chunk_size must be an integer >= 1 and <= {MAX_STEP_TOKENS} (got 2.5)"),
    ({"max_num_seqs": 0}, None, f"max_num_seqs must be an integer >= 1 and <= {MAX_NUM_SEQS} (got 0)"),
    ({"allow_spinning": "no"}, None, "allow_spinning must be True or False (got 'no')"),
    ({"graph_optimization_level": "max"}, None, "graph_optimization_level must be one of disable, basic, "),
    ({"turbo": True}, None, "option 'turbo' is not tunable; tunable options are max_num_seqs, "),
    ({"kv_cache_blocks": 8}, None, "option 'kv_cache_blocks' is not tunable"),
    ({"chunk_size": 1024}, None, "chunk_size (1024) must be <= max_num_batched_tokens (512)"),
    (None, "{oops", "corrupt: Expecting property name enclosed in double quotes at line 1"),
    (None, "[1, 2]", "corrupt: expected a JSON object, got list"),
    (None, '{"schema_version": 9, "options": {}}', "schema_version 9, this llmc reads 1"),
    (None, '{"schema_version": 1}', "options is missing or not an object"),
    # A RecursionError traceback until 2026-12-07 (issue 63).
    (None, '{"a": ' * 100_000 + "1" + "}" * 100_000, "corrupt: nested too deeply to be an llmc file"),
], ids=["threads-1000000", "threads-cpus+1", "string", "float", "zero", "bool-string", "unknown-level",
        "unknown-key", "untunable-key", "conflict", "corrupt-json", "not-an-object", "schema-9", "no-options",
        "nested-100000-deep"])
def test_bad_tuning_json_is_ignored_with_one_warning(engine_copy, default_options, caplog, options, text, problem):
    _tuning(engine_copy, options, text)
    llm = LLM(engine_copy)
    [warning] = _llmc_warnings(caplog)
    assert warning.startswith(f"tuning: ignored {engine_copy / TUNING_FILE} ({problem}")
    assert warning.endswith("); fix or delete it, or run `llmc tune` again") and "\n" not in warning
    assert llm.tuning is None and llm.options == default_options


def test_bad_explicit_option_is_reported_before_a_bad_tuning_json(engine_copy, caplog):
    _tuning(engine_copy, text="{oops")
    with pytest.raises(LlmcError, match=r"num_threads must be an integer .* \(got 1000000\)"):
        LLM(engine_copy, num_threads=10**6)
    assert _llmc_warnings(caplog) == []


def test_llmc_run_prints_the_tuning_warning_as_one_line_and_runs(engine_copy):
    _tuning(engine_copy, {"num_threads": CPUS + 1})
    result = subprocess.run([sys.executable, "-m", "llmc.cli", "run", str(engine_copy), "Hello", "--max-tokens", "2"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    assert lines[0] == (f"tuning: ignored {engine_copy / TUNING_FILE} ({THREADS_BOUND} (got {CPUS + 1})); "
                        "fix or delete it, or run `llmc tune` again")
    assert len(lines) == 2 and lines[1].startswith("[2 tokens, ")  # then the usual summary, nothing else
    assert result.stdout.startswith("Hello")
