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
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

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


def _content_key(value, outputs: list[Path]) -> str:
    """What an argument holds, without the names of the temporary files it points to: a JSON file
    with every path in it replaced by its file's content key, an ``.npz`` by its arrays (its zip
    entries carry the time they were written), any other file by its bytes. A path to a file that
    does not exist yet (in an existing directory) is one the driver writes: it is collected in
    ``outputs``, in order."""
    if isinstance(value, dict):
        return json.dumps({k: _content_key(v, outputs) for k, v in sorted(value.items())})
    if isinstance(value, list):
        return json.dumps([_content_key(v, outputs) for v in value])
    if not isinstance(value, str) or not value.startswith("/"):
        return json.dumps(value)
    path = Path(value)
    if not path.exists():
        if not path.parent.is_dir():
            return json.dumps(value)
        outputs.append(path)
        return f"<output {len(outputs)}>"
    if path.suffix == ".npz":
        h = hashlib.sha256()
        with np.load(path, allow_pickle=False) as z:
            for name in sorted(z.files):
                a = z[name]
                h.update(f"{name}:{a.dtype.str}:{a.shape}".encode() + a.tobytes())
        return h.hexdigest()
    data = path.read_bytes()
    try:
        return _content_key(json.loads(data), outputs)
    except ValueError:
        return hashlib.sha256(data).hexdigest()


def run(python: Path, script: str, *args: str, timeout: float = 900) -> str:
    """Run a driver script of this folder with the reference interpreter; its stdout's last line.

    The result (that line and the files the driver writes) is cached beside the venvs, keyed by the
    interpreter (whose path holds the requirements' hash), this folder's Python files and what the
    arguments hold: the trainer's code gives the same numbers for the same input, and a session
    that runs the references many times (mutation testing runs a test session per mutant) should
    not start the trainer's code each time. ``GRPOLENS_REFVENV_NO_CACHE=1`` runs the driver regardless."""
    h = hashlib.sha256(str(python).encode())
    for f in sorted(HERE.glob("*.py")):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    outputs: list[Path] = []
    for a in args:
        h.update(b"\0" + _content_key(a, outputs).encode())
    cached = cache_dir() / "outputs" / f"{script}-{h.hexdigest()[:24]}"
    if (cached / "stdout").is_file() and os.environ.get("GRPOLENS_REFVENV_NO_CACHE") != "1":
        for i, out in enumerate(outputs):
            shutil.copyfile(cached / str(i), out)
        return (cached / "stdout").read_text()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    done = subprocess.run([str(python), str(HERE / script), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=str(HERE))
    if done.returncode != 0:
        raise RuntimeError(f"{script} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    stdout = done.stdout.strip().splitlines()[-1]
    if all(out.is_file() for out in outputs):
        tmp = cached.with_name(f"{cached.name}.{os.getpid()}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for i, out in enumerate(outputs):
            shutil.copyfile(out, tmp / str(i))
        (tmp / "stdout").write_text(stdout)
        try:
            os.rename(tmp, cached)  # atomic: a concurrent session sees the whole result or none
        except OSError:  # another session stored it first
            shutil.rmtree(tmp, ignore_errors=True)
    return stdout
