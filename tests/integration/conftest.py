"""Real TRL training runs for the integration tests, trained once per session and shared.

Single-process runs train inside the test process (TRL, transformers and torch are imported once:
on a loaded 2-core machine the imports cost far more than the few seconds of training); the
two-process run goes through ``torchrun`` (gloo on CPU, one thread per rank).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("trl_tiny.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_in_process(out: Path, args: list[str]) -> None:
    import torch

    from tests.integration import trl_tiny

    threads = torch.get_num_threads()
    try:
        trl_tiny.main([str(out), *args])
    finally:
        torch.set_num_threads(threads)


def train_torchrun(out: Path, args: list[str], nproc: int = 2) -> None:
    # the caller's PYTHONPATH is kept (an older TRL put first on it is what the ranks import)
    path = os.pathsep.join(p for p in (str(SCRIPT.parents[2]), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), str(SCRIPT), str(out), *args]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=540)
    if res.returncode != 0:
        raise RuntimeError(f"torchrun failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-6000:]}")


@pytest.fixture(scope="session")
def trl_run(tmp_path_factory):
    """``trl_run(name, *extra, nproc=1)`` -> the output directory of a training run of
    ``trl_tiny.CONFIGS[name]`` (plus ``extra`` arguments); ``OUT/run`` is the grpolens run."""
    pytest.importorskip("trl")
    from tests.integration import trl_tiny

    done: dict[tuple, Path] = {}

    def get(name: str, *extra: str, nproc: int = 1) -> Path:
        key = (name, extra, nproc)
        if key not in done:
            out = tmp_path_factory.mktemp(name)
            args = [*trl_tiny.CONFIGS[name], *extra]
            if nproc == 1:
                train_in_process(out, args)
            else:
                train_torchrun(out, args, nproc)
            done[key] = out
        return done[key]

    return get
