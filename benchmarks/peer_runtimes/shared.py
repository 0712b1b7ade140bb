"""What the peers benchmark's modules share: where things live, the setup steps' plumbing, the
peers' environment, and the driver's handle on a worker process."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent  # benchmarks/
REPO = HERE.parent
WORKER = HERE / "peers_worker.py"


class SetupError(Exception):
    pass


def cache_root() -> Path:
    return Path(os.environ.get("LLMC_CACHE") or Path.home() / ".cache" / "llmc").expanduser()


# -- setup ----------------------------------------------------------------------------------------


def run_step(step: str, cmd: list, log: Path, fix: str, env: dict | None = None, cwd: Path | None = None) -> None:
    """One setup step, its output appended to `log`; a SetupError naming `fix` when it fails."""
    with open(log, "a") as f:
        f.write(f"\n$ {' '.join(map(str, cmd))}\n")
        f.flush()
        rc = subprocess.run([str(c) for c in cmd], stdout=f, stderr=subprocess.STDOUT, env=env, cwd=cwd).returncode
    if rc != 0:
        raise SetupError(f"setup step '{step}' failed (exit {rc}); log: {log}; {fix}")


def peer_env() -> dict:
    # The peers' interpreter must see nothing of the repo's venv.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def read_stamp(path: Path) -> dict | None:
    """A cache's stamp (what it was made from), or None when missing or unreadable."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def source_key(folder: Path) -> dict:
    # The folder name carries the recipe's hash; size and mtime catch a rebuilt folder.
    st = [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in sorted(folder.glob("*.safetensors"))]
    return {"folder": str(folder), "weights": st}


# -- workers -------------------------------------------------------------------------------------------


class Worker:
    def __init__(self, name: str, python: Path, args: list[str], log: Path, env: dict | None = None,
                 src: Path = REPO):
        self.name, self.log = name, log
        self.proc = subprocess.Popen([str(python), str(src / WORKER.relative_to(REPO)), "serve", *args],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(log, "w"), text=True,
                                     bufsize=1, env=env, cwd=src)
        self.info = self._read()["info"]

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name} worker exited; {self._tail()}")
        msg = json.loads(line)
        if "error" in msg:
            raise RuntimeError(f"{self.name}: {msg['error']}; log: {self.log}")
        return msg

    def _tail(self) -> str:
        try:
            lines = [ln for ln in self.log.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            lines = []
        return f"last log line: {lines[-1] if lines else '(empty)'}; log: {self.log}"

    def call(self, cmd: str, **kw):
        self.proc.stdin.write(json.dumps({"cmd": cmd, **kw}) + "\n")
        return self._read()["result"]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write('{"cmd": "quit"}\n')
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
