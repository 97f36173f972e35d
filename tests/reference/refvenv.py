"""Virtual environments holding a trainer's own code, to judge grpolens against it.

Each trainer (verl, Twinkle) gets a venv of its own, built from ``requirements-<name>.txt``
(every package pinned and installed with ``--no-deps``: the trainer itself and only what its loss
and metric modules import). Nothing of grpolens' environment is visible in it
(no ``--system-site-packages``), so a driver script run there computes with the trainer's code and
nothing else. The venv is cached across test sessions under ``$GRPOLENS_REFVENV_DIR`` (default
``~/.cache/grpolens/refvenv``), keyed by the requirements file's hash and the Python version; the
first build takes a few minutes (``build_seconds`` in the venv records how long).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent


def cache_dir() -> Path:
    return Path(os.environ.get("GRPOLENS_REFVENV_DIR") or Path.home() / ".cache" / "grpolens" / "refvenv")


def ensure(name: str) -> Path:
    """The Python interpreter of the ``name`` reference venv, built first if needed."""
    req = HERE / f"requirements-{name}.txt"
    key = hashlib.sha256(req.read_bytes() + sys.version.encode()).hexdigest()[:16]
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    venv = root / f"{name}-{key}"
    python = venv / "bin" / "python"
    with open(root / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build at a time; a second waiter reuses it
        if (venv / "build_seconds").is_file():
            return python
        start = time.monotonic()
        shutil.rmtree(venv, ignore_errors=True)  # a build that died half-way has no build_seconds
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        done = subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                               "--no-deps", "-r", str(req)], capture_output=True, text=True)
        if done.returncode != 0:
            shutil.rmtree(venv, ignore_errors=True)
            raise RuntimeError(f"building the {name} reference venv failed:\n{done.stdout}\n{done.stderr}")
        (venv / "build_seconds").write_text(f"{time.monotonic() - start:.1f}\n")
    return python


def run(python: Path, script: str, *args: str, timeout: float = 900) -> str:
    """Run a driver script of this folder with the reference interpreter; its stdout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    done = subprocess.run([str(python), str(HERE / script), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=str(HERE))
    if done.returncode != 0:
        raise RuntimeError(f"{script} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return done.stdout.strip().splitlines()[-1]
