"""tuning.json: the runtime options `llmc tune` measured as best for one engine.

The file sits beside manifest.json but is not listed in the manifest's files: the manifest
describes the build, and re-tuning must not invalidate its checksums. Rebuilding the engine
replaces the whole directory, so a stale tuning.json cannot outlive the build it was measured on.

Format (a JSON object):
  schema_version  int, TUNING_SCHEMA_VERSION
  options         {name: value} for names in TUNABLE_OPTIONS: what LLM applies
  anything else   (objective, workload, measurements) is for people and is ignored here

`LLM(engine_dir)` applies `options` by default; an option the caller passes explicitly wins over
the tuned value, and `use_tuning=False` (`--no-tuning`) ignores the file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from llmc.artifact import read_json_object
from llmc.errors import EngineError
from llmc.runtime.engine import GRAPH_OPTIMIZATION_LEVELS

__all__ = ["TUNING_FILE", "TUNABLE_OPTIONS", "load_tuning", "merge_tuning", "write_tuning", "format_options",
           "tuning_line", "effective_options"]

TUNING_FILE = "tuning.json"
TUNING_SCHEMA_VERSION = 1
# The LLM options a tuning file may set, with their type. Pool size is deliberately absent: it
# trades memory for capacity, which is the operator's call, not a speed knob.
TUNABLE_OPTIONS: dict[str, type] = {
    "max_num_seqs": int,
    "max_num_batched_tokens": int,
    "chunk_size": int,
    "num_threads": int,
    "allow_spinning": bool,
    "graph_optimization_level": str,
}


def _check_value(name: str, value: Any) -> str | None:
    """Why `value` is not a valid tuned value for option `name` (None when it is)."""
    kind = TUNABLE_OPTIONS[name]
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            return f"{name} must be an integer >= 1 (got {value!r})"
    elif kind is bool:
        if not isinstance(value, bool):
            return f"{name} must be true or false (got {value!r})"
    elif value not in GRAPH_OPTIMIZATION_LEVELS:
        return f"{name} must be one of {', '.join(GRAPH_OPTIMIZATION_LEVELS)} (got {value!r})"
    return None


def load_tuning(engine_dir: str | Path) -> dict[str, Any] | None:
    """The tuned options of the engine at `engine_dir`; None when it has no tuning.json."""
    path = Path(engine_dir) / TUNING_FILE
    if not path.is_file():
        return None
    fix = "delete it or pass --no-tuning (use_tuning=False) to ignore it"

    def corrupt(why: str) -> EngineError:
        return EngineError(f"corrupt {path} ({why}); {fix}")

    data = read_json_object(path, corrupt, lambda why: EngineError(f"cannot read {path} ({why}); {fix}"))
    if data.get("schema_version") != TUNING_SCHEMA_VERSION:
        raise corrupt(f"schema_version {data.get('schema_version')!r}, this llmc reads {TUNING_SCHEMA_VERSION}")
    options = data.get("options")
    if not isinstance(options, dict):
        raise corrupt("options is missing or not an object")
    for name, value in options.items():
        if name not in TUNABLE_OPTIONS:
            raise corrupt(f"unknown option {name!r}; tunable options are {', '.join(TUNABLE_OPTIONS)}")
        problem = _check_value(name, value)
        if problem:
            raise corrupt(problem)
    return dict(options)


def merge_tuning(explicit: dict[str, Any], tuned: dict[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(options to use, tuned options actually applied). An explicit option is one whose value is
    not None; it wins over the tuned value. Options set by neither are left out (defaults apply)."""
    given = {k: v for k, v in explicit.items() if v is not None}
    applied = {k: v for k, v in (tuned or {}).items() if k not in given}
    return {**applied, **given}, applied


def write_tuning(engine_dir: str | Path, options: dict[str, Any], **info: Any) -> Path:
    """Write tuning.json atomically (temp file + rename): a reader sees the old file or the new one."""
    for name, value in options.items():
        problem = _check_value(name, value) if name in TUNABLE_OPTIONS else f"{name!r} is not tunable"
        if problem:
            raise ValueError(problem)  # a tuner bug: never write a file LLM would reject
    path = Path(engine_dir) / TUNING_FILE
    tmp = path.with_name(f".{TUNING_FILE}.{os.getpid()}.tmp")
    text = json.dumps({"schema_version": TUNING_SCHEMA_VERSION, "options": options, **info}, indent=2) + "\n"
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise EngineError(f"cannot write {path} ({e.strerror}); check that the engine folder is writable") from None
    return path


def format_options(options: dict[str, Any]) -> str:
    """`max_num_seqs=8, allow_spinning=false`: the form the CLI prints."""
    return ", ".join(f"{k}={json.dumps(v) if isinstance(v, bool) else v}" for k, v in options.items())


def tuning_line(applied: dict[str, Any]) -> str:
    """What the CLI prints when an LLM loaded with tuning (`applied` = LLM.tuning)."""
    if not applied:
        return f"tuning: {TUNING_FILE} present, every value in it overridden by explicit options"
    return f"tuning: applied {TUNING_FILE} ({format_options(applied)})"


def effective_options(llm) -> dict[str, Any]:
    """The values of the tunable options an LLM actually runs with (defaults filled in)."""
    config, engine = llm.scheduler.config, llm.engine
    return {
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "chunk_size": config.chunk_size,
        "num_threads": engine.num_threads,
        "allow_spinning": engine.allow_spinning,
        "graph_optimization_level": engine.graph_optimization_level,
    }
