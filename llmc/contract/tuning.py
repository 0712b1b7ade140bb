"""tuning.json: the runtime options `llmc tune` measured as best for one engine.

It sits beside manifest.json but is not listed in the manifest's files: the manifest describes
the build, and re-tuning must not invalidate its checksums. Rebuilding replaces the whole engine
directory, so a stale tuning.json cannot outlive the build it was measured on.

Format: {"schema_version": 1, "options": {tunable RuntimeOptions}, ...}; the other keys
(objective, workload, measurements) are for people. `LLM` applies `options` unless told
`use_tuning=False` (`--no-tuning`); an option given explicitly wins over its tuned value.

Nothing vouches for the file (it is outside the checksums) and it may have been tuned on another
machine, so its options are validated like explicit ones (num_threads at most this machine's CPUs,
...). A bad tuning.json (corrupt JSON, another schema, a key that is not tunable, a value or a
combination RuntimeOptions rejects) is IGNORED: the LLM runs as if it were absent, and one warning
line naming the file and the problem goes to the `llmc.contract.tuning` logger. A stale speed-up
must not stop an engine from serving. It is a log record rather than `warnings.warn` so that every
load reports it (not only the first), and so that with logging unconfigured, as under the CLI,
Python prints it to stderr as the bare line, like "tuning: applied ...".
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from llmc.contract.json_file import read_json_object
from llmc.contract.options import RuntimeOptions, format_options
from llmc.errors import EngineError, LlmcError

TUNING_FILE = "tuning.json"
TUNING_SCHEMA_VERSION = 1

log = logging.getLogger(__name__)


def _check(options: Any) -> dict[str, Any]:
    """The options, validated as RuntimeOptions would take them; LlmcError on the first problem."""
    if not isinstance(options, dict):
        raise LlmcError("options is missing or not an object")
    tunable = RuntimeOptions.tunable_names()
    for name in options:
        if name not in tunable:
            raise LlmcError(f"option {name!r} is not tunable; tunable options are {', '.join(tunable)}")
    RuntimeOptions(**options)  # each value, and the values together with the defaults of the others
    return dict(options)


def read_tuning(path: Path) -> dict[str, Any] | None:
    """The tuned options in `path` (an engine's tuning.json, as `open_engine` found it); None, with
    a warning naming the file and the problem, when it is unusable."""
    try:
        data = read_json_object(path, lambda why: LlmcError(f"corrupt: {why}"), LlmcError)
        if data.get("schema_version") != TUNING_SCHEMA_VERSION:
            raise LlmcError(f"schema_version {data.get('schema_version')!r}, this llmc reads {TUNING_SCHEMA_VERSION}")
        return _check(data.get("options"))
    except LlmcError as exc:
        log.warning("tuning: ignored %s (%s); fix or delete it, or run `llmc tune` again", path, exc)
        return None


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
