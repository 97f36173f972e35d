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


def test_watch_waits_for_the_completion_markers(serve_runs, tmp_path):
    """--watch on a local run: a poll that falls between a step's shards and its completion markers
    recomputes without the step, and the markers' arrival (complete/ changes, not tokens/) brings
    it in at the next poll instead of at the next step."""
    from grpolens.serve.watch import Watcher

    run = tmp_path / "run"
    shutil.copytree(serve_runs[1], run)
    held = tmp_path / "held"
    held.mkdir()
    for marker in (run / "complete").glob("step=00000013.*"):
        marker.rename(held / marker.name)
    for f in (run / "complete").glob("finished.*"):
        f.unlink()
    for table in ("tokens", "samples"):
        shutil.move(run / table / "step=00000013", held / table)
    import grpolens

    grpolens.recompute(run, write=True)
    assert data.read_metrics(run)["step"].max() == 12
    errors = []
    w = Watcher({"run": run}, lambda n, e: errors.append(e), every=0)
    assert w.poll() == []  # nothing changed: no recompute
    for table in ("tokens", "samples"):
        shutil.move(held / table, run / table / "step=00000013")
    assert w.poll() == ["run"] and data.read_metrics(run)["step"].max() == 12  # no markers yet: skipped
    for marker in held.glob("step=00000013.*"):
        marker.rename(run / "complete" / marker.name)
    assert w.poll() == ["run"] and errors == []
    assert data.read_metrics(run)["step"].max() == 13


def test_help_does_not_import_dash():
    code = "import sys, grpolens.cli; print(any(m.split('.')[0] in ('dash', 'plotly') for m in sys.modules))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.stdout.strip() == "False"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(port: int, host_header: str) -> int | None:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/csv/runs", headers={"Host": host_header})
        return conn.getresponse().status
    except OSError:
        return None
    finally:
        conn.close()


@pytest.mark.timeout(180)
def test_debug_serves_and_checks_hosts(serve_runs):
    """``serve --debug`` (issue #28): the reloader's child, which serves, does not re-check the port
    its parent holds; the real server refuses a rebinding Host and answers an --allow-host name."""
    import os
    import signal
    import time

    port = _free_port()
    p = subprocess.Popen([sys.executable, "-m", "grpolens.cli", "serve", str(serve_runs[1]), "--debug",
                          "--no-recompute", "--port", str(port), "--allow-host", "dash.example.com"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        status = None
        end = time.time() + 150
        while time.time() < end and p.poll() is None and status != 200:
            time.sleep(0.5)
            status = _get(port, f"127.0.0.1:{port}")
        assert status == 200, p.stderr.read() if p.poll() is not None else "no answer"
        assert _get(port, "evil.example.com") == 403
        assert _get(port, "dash.example.com") == 200
    finally:
        try:
            os.killpg(p.pid, signal.SIGTERM)  # the command and the reloader's child it started
        except ProcessLookupError:
            pass
        out, err = p.communicate(timeout=30)
    assert "Address already in use" not in err and "cannot listen" not in err and "Traceback" not in err, err
    assert err.count("serving 1 run(s)") == 1, err


def test_bad_allow_host_is_one_line(serve_runs):
    r = subprocess.run([sys.executable, "-m", "grpolens.cli", "serve", str(serve_runs[1]), "--allow-host", "a b"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--allow-host 'a b'" in r.stderr and "Traceback" not in r.stderr
