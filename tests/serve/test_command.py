"""``grpolens serve``: argument errors, and what --watch relies on."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from grpolens.serve import data


@pytest.mark.parametrize("args, message", [
    (["serve", "/nonexistent/run"], "no such run or directory"),
    (["serve", "RUN", "--port", "0"], "--port must be in 1..65535"),
    (["serve", "RUN", "--baseline", "EMPTY"], "--baseline"),
])
def test_serve_argument_errors(serve_runs, tmp_path, args, message):
    (tmp_path / "empty").mkdir()
    args = [str(serve_runs[1]) if a == "RUN" else str(tmp_path / "empty") if a == "EMPTY" else a for a in args]
    r = subprocess.run([sys.executable, "-m", "grpolens.cli", *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr


def test_port_in_use_is_one_line(serve_runs):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "grpolens.cli", "serve", str(serve_runs[1]), "--port", str(port)],
                           capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and f"--port {port}: cannot listen" in r.stderr and "Traceback" not in r.stderr


def test_run_version_changes_when_a_step_appears(serve_runs, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(serve_runs[1], run)
    before = data.run_version(run)
    assert data.run_version(run) == before
    shutil.copytree(run / "tokens" / "step=00000013", run / "tokens" / "step=00000014")
    assert data.run_version(run) != before


def test_help_does_not_import_dash():
    code = "import sys, grpolens.cli; print(any(m.split('.')[0] in ('dash', 'plotly') for m in sys.modules))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.stdout.strip() == "False"
