"""tuning.json: the runtime options `llmc tune` measured as best for one engine.

It sits beside manifest.json but is not listed in the manifest's files: the manifest describes
the build, and re-tuning must not invalidate its checksums. Rebuilding replaces the whole engine
directory, so a stale tuning.json cannot outlive the build it was measured on.

Format: {"schema_version": 1, "options": {tunable RuntimeOptions}, ...}; the other keys
(objective, workload, measurements) are for people. `LLM` applies `options` unless told
`use_tuning=False` (`--no-tuning`); an option given explicitly wins over its tuned value.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from llmc.contract.options import RuntimeOptions, format_options
from llmc.errors import EngineError, LlmcError

TUNING_FILE = "tuning.json"
TUNING_SCHEMA_VERSION = 1
_FIX = "delete it or pass --no-tuning (use_tuning=False) to ignore it"


def _check(options: Any) -> dict[str, Any]:
    """The options, validated as RuntimeOptions would take them; LlmcError on the first problem."""
    if not isinstance(options, dict):
        raise LlmcError("options is missing or not an object")
    tunable = RuntimeOptions.tunable_names()
    for name in options:
        if name not in tunable:
            raise LlmcError(f"option {name!r} is not tunable; tunable options are {', '.join(tunable)}")
    for name, value in options.items():
        RuntimeOptions.check_value(name, value)
    return dict(options)


def read_tuning(path: Path) -> dict[str, Any]:
    """The tuned options in `path` (an engine's tuning.json, as `open_engine` found it)."""
    from llmc.contract.engine_dir import read_json_object

    def corrupt(why: str) -> EngineError:
        return EngineError(f"corrupt {path} ({why}); {_FIX}")

    data = read_json_object(path, corrupt, lambda why: EngineError(f"cannot read {path} ({why}); {_FIX}"))
    if data.get("schema_version") != TUNING_SCHEMA_VERSION:
        raise corrupt(f"schema_version {data.get('schema_version')!r}, this llmc reads {TUNING_SCHEMA_VERSION}")
    try:
        return _check(data.get("options"))
    except LlmcError as exc:
        raise corrupt(str(exc)) from None


def write_tuning(engine_dir: str | Path, options: dict[str, Any], **info: Any) -> Path:
    """Write tuning.json atomically (temp file + rename): a reader sees the old file or the new one."""
    try:
        _check(options)
    except LlmcError as exc:
        raise ValueError(str(exc)) from None  # a tuner bug: never write a file LLM would reject
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


def tuning_line(applied: dict[str, Any]) -> str:
    """What the CLI prints when an LLM loaded with tuning (`applied` = LLM.tuning)."""
    if not applied:
        return f"tuning: {TUNING_FILE} present, every value in it overridden by explicit options"
    return f"tuning: applied {TUNING_FILE} ({format_options(applied)})"
