"""Reading an engine's JSON files (manifest.json, generation_config.json, tuning.json) into an
object, every failure one line. A leaf of the contract: engine_dir and tuning both read through
it, and engine_dir also names tuning.json, so it must not sit in either of them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable


def read_json_object(path: Path, corrupt: Callable[[str], Exception],
                     unreadable: Callable[[str], Exception]) -> dict[str, Any]:
    """Parse the JSON object in `path`; raise corrupt(why) or unreadable(why), why being one line."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise corrupt(f"{e.msg} at line {e.lineno}") from None
    except UnicodeDecodeError:
        raise corrupt("not UTF-8 text") from None
    except RecursionError:  # the parser recurses per level: a file of 100,000 nested objects
        raise corrupt("nested too deeply to be an llmc file") from None
    except OSError as e:
        raise unreadable(str(e.strerror)) from None
    if not isinstance(data, dict):
        raise corrupt(f"expected a JSON object, got {type(data).__name__}")
    return data
