"""Faults in an engine or while writing one: each ends in one line naming the problem and the fix.

A manifest edited by hand (sizes the graph does not have, zero or negative values), a corrupt
generation_config.json, a tokenizer path out of the engine, a backend that fails every step, and a
build that runs out of room.
"""

from __future__ import annotations

import errno
import hashlib
import json
import resource
import shutil
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from llmc.cli import main, summary_line
from llmc.contract import graph_io
from llmc.contract.engine_dir import MANIFEST, EngineWriter
from llmc.errors import EngineError
from llmc.runtime.engine import Engine
from llmc.runtime.llm import LLM
from llmc.runtime.metrics import RequestTimes
from llmc.runtime.request import RequestOutput

Edit = Callable[[dict[str, Any]], None]


@pytest.fixture
def engine(llama_engine: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "engine"
    shutil.copytree(llama_engine, dst)
    return dst


def edit_manifest(engine: Path, change: Edit) -> None:
    """The manifest is not in its own checksum list: editing it leaves every listed file valid."""
    data = json.loads((engine / MANIFEST).read_text())
    change(data)
    (engine / MANIFEST).write_text(json.dumps(data))


def load_error(engine: Path) -> str:
    with pytest.raises(EngineError) as info:
        LLM(engine)
    message = str(info.value)
    assert "\n" not in message
    return message


def cli(*args: str) -> tuple[int, list[str], str]:
    """(exit code, the `error:` lines, all output) of an `llmc` command run in-process."""
    result = CliRunner().invoke(main, list(args))
    text = result.output  # click >= 8.2 mixes stderr into output
    assert "Traceback" not in text
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    return result.exit_code, [line for line in text.splitlines() if line.startswith("error:")], text


def _set(section: str, **values: Any) -> Edit:
    return lambda d: d[section].update(values)


def _both(**values: Any) -> Edit:
    """The same sizes in model_spec and kv_cache, so the manifest stays consistent with itself."""
    return lambda d: (d["model_spec"].update(values), d["kv_cache"].update(values))


def _layers(n: int) -> Edit:
    def change(d: dict[str, Any]) -> None:
        _both(num_layers=n)(d)
        d["io"]["inputs"] = d["io"]["inputs"][:len(graph_io.STEP_INPUTS)] + [f"kv_cache.{i}" for i in range(n)]
        d["io"]["outputs"] = ["logits"] + [f"kv_cache_out.{i}" for i in range(n)]
    return change


def _block_size(n: int) -> Edit:
    return lambda d: (d["kv_cache"].update(block_size=n), d["build_options"].update(block_size=n))


# --- the manifest against the graph (issue 15, item 5) -------------------------------------------

@pytest.mark.parametrize("change, expected", [
    (_both(num_kv_heads=1), "per the manifest's kv_cache.num_kv_heads"),
    (_both(head_dim=8), "per the manifest's kv_cache.head_dim"),
    (_block_size(8), "per the manifest's kv_cache.block_size"),
    (_set("model_spec", vocab_size=1000),
     "logits has shape [num_logits, 1024] in the graph, [num_logits, 1000] per the manifest's model_spec.vocab_size"),
    (_layers(3), "the graph has 8 inputs, the manifest's io names 9: kv_cache.2 is not in the graph"),
    (_layers(1), "the manifest's io lacks kv_cache.1"),
], ids=["num_kv_heads", "head_dim", "block_size", "vocab_size", "more_layers", "fewer_layers"])
def test_a_manifest_that_disagrees_with_the_graph_fails_at_load(engine: Path, change: Edit, expected: str) -> None:
    edit_manifest(engine, change)
    message = load_error(engine)
    assert message.startswith(f"engine {engine}: model.onnx does not match the manifest (")
    assert expected in message and message.endswith("rebuild it with `llmc build`")


def test_llmc_run_on_a_mismatched_engine_prints_one_line(engine: Path) -> None:
    edit_manifest(engine, _both(num_kv_heads=1))
    code, errors, text = cli("run", str(engine), "hello", "--max-tokens", "2")
    assert code == 2 and len(errors) == 1, text
    assert "does not match the manifest" in errors[0]


def test_llmc_run_shows_the_step_error_when_every_request_fails(llama_engine: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: Any) -> None:
        raise RuntimeError("kernel exploded\nsecond line of detail")

    monkeypatch.setattr(Engine, "_run", fail)  # the session call every step goes through
    code, errors, text = cli("run", str(llama_engine), "hello", "--max-tokens", "4")
    assert code == 2 and errors == ["error: backend step failed: kernel exploded"], text
    assert "TTFT" not in text


def test_summary_of_a_request_without_tokens() -> None:
    output = RequestOutput("r", "hi", [1], finish_reason="abort", metrics=RequestTimes(arrival=0.0))
    assert summary_line(output) == "[0 tokens, abort] TTFT n/a · TPOT n/a · decode n/a · E2E n/a"


# --- values no engine can have (item 6) ----------------------------------------------------------

@pytest.mark.parametrize("change, expected", [
    (_block_size(0), "block-size must be a power of two >= 1 (got 0)"),
    (_block_size(3), "block-size must be a power of two >= 1 (got 3)"),
    (_set("kv_cache", block_size=0), "kv_cache.block_size: expected an integer >= 1, got 0"),
    (_set("build_options", max_context=-5), "max-context must be >= 2 (got -5)"),
    (_set("build_options", max_context=100_000),
     "build_options.max_context 100000 exceeds model_spec.max_position_embeddings 512"),
    (_set("model_spec", vocab_size=0), "model_spec.vocab_size: expected an integer >= 1, got 0"),
    (_both(num_kv_heads=0), "model_spec.num_kv_heads: expected an integer >= 1, got 0"),
    (_both(head_dim=-16), "model_spec.head_dim: expected an integer >= 1, got -16"),
    (_layers(0), "model_spec.num_layers: expected an integer >= 1, got 0"),
    (_set("kv_cache", num_kv_heads=1), "kv_cache.num_kv_heads 1 differs from model_spec.num_kv_heads 2"),
], ids=["block_size_0", "block_size_3", "kv_block_size_0", "max_context_negative", "max_context_too_long",
        "vocab_0", "num_kv_heads_0", "head_dim_negative", "num_layers_0", "kv_heads_differ"])
def test_impossible_manifest_values_are_one_line(engine: Path, change: Edit, expected: str) -> None:
    edit_manifest(engine, change)
    message = load_error(engine)
    assert message.startswith(f"engine {engine}: corrupt manifest (")
    assert expected in message and message.endswith("rebuild it with `llmc build`")


def _rewrite_listed(engine: Path, rel: str, data: bytes) -> None:
    """Replace a file and re-list it with its new checksum: its content is the only fault."""
    (engine / rel).write_bytes(data)
    entry = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    edit_manifest(engine, lambda d: d["files"].update({rel: entry}))


@pytest.mark.parametrize("content, expected", [
    (b'{"eos_token_id": 1,', "Expecting"),
    (b'[1, 2]', "expected a JSON object, got list"),
    (b'{"eos_token_id": "2"}', "eos_token_id: expected a token id >= 0 or a list of them, got '2'"),
    (b'{"eos_token_id": [1, null]}', "got [1, None]"),
    (b'{"eos_token_id": -1}', "got -1"),
], ids=["truncated", "not_an_object", "eos_string", "eos_list_with_null", "eos_negative"])
def test_a_bad_generation_config_is_one_line(engine: Path, content: bytes, expected: str) -> None:
    _rewrite_listed(engine, "generation_config.json", content)
    message = load_error(engine)
    assert message.startswith(f"corrupt {engine / 'generation_config.json'} (")
    assert expected in message and message.endswith("rebuild the engine with `llmc build`")


# --- the tokenizer path (item 12) ----------------------------------------------------------------

@pytest.mark.parametrize("rel", ["../tokenizer.json", "tokenizer/../../tokenizer.json", "/etc/passwd"])
def test_a_tokenizer_path_out_of_the_engine_is_refused(engine: Path, rel: str) -> None:
    outside = engine.parent / "tokenizer.json"
    shutil.copy(engine / "tokenizer" / "tokenizer.json", outside)
    entry = {"sha256": hashlib.sha256(outside.read_bytes()).hexdigest(), "bytes": outside.stat().st_size}

    def point(d: dict[str, Any]) -> None:
        d["tokenizer"]["file"] = rel
        d["files"][rel] = entry

    edit_manifest(engine, point)
    assert f"manifest names unsafe path {rel!r} (outside the engine)" in load_error(engine)


# --- out of room while building (item 7) ---------------------------------------------------------

@pytest.mark.parametrize("code, fix", [(errno.ENOSPC, "free some space"),
                                       (errno.EFBIG, "raise the file-size limit (ulimit -f)")])
def test_a_write_out_of_room_is_one_line_and_leaves_nothing(tmp_path: Path, code: int, fix: str) -> None:
    target = tmp_path / "engine"
    with pytest.raises(EngineError) as info, EngineWriter(target) as writer:
        writer.expected_bytes = 3 * 2**30
        (writer.path / "model.onnx.data").write_bytes(b"partial")
        raise OSError(code, "no room")
    message = str(info.value)
    assert "\n" not in message and info.value.__suppress_context__
    assert message.startswith(f"cannot write engine {target}: no room; it needs about 3.0 GiB and {tmp_path} has ")
    assert message.endswith(f" free; {fix} or choose another -o")
    assert list(tmp_path.iterdir()) == []


def test_other_write_errors_are_not_reported_as_out_of_room(tmp_path: Path) -> None:
    with pytest.raises(PermissionError), EngineWriter(tmp_path / "engine"):
        raise PermissionError(errno.EACCES, "denied")
    assert list(tmp_path.iterdir()) == []


def test_llmc_build_past_a_file_size_limit_is_one_line(llama_engine: Path, tmp_path: Path) -> None:
    """A real EFBIG, not a mock: the kernel refuses the weights' write past 100 kB. (llama_engine
    has materialized the recipe, so the build itself writes only the engine.)"""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if soft != resource.RLIM_INFINITY and soft < 100_000:
        pytest.skip("the file-size limit is already below what the test sets")
    ignored = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills us instead of failing the write
    resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, hard))
    try:
        code, errors, text = cli("build", "tiny-llama", "-o", str(tmp_path / "e"), "--max-context", "64")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, ignored)
    assert code == 2 and len(errors) == 1, text
    assert errors[0].startswith(f"error: cannot write engine {tmp_path / 'e'}: File too large; it needs about ")
    assert errors[0].endswith("free; raise the file-size limit (ulimit -f) or choose another -o")
    assert list(tmp_path.iterdir()) == []
