"""``--ray-address`` joins a Ray cluster that is already running: one started here with
``ray start --head`` (its own processes, its own session), which the command line then joins from a
separate process, as a user's driver joins a team's cluster."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import polars as pl
import pytest
from polars.testing import assert_frame_equal

from grpolens.analysis.recompute import recompute
from grpolens.metrics.engine import ThreadEngine
from grpolens.run import format as fmt

pytestmark = pytest.mark.slow  # a second Ray instance (the cluster) starts for this test

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    """Workers import grpolens from this checkout. The cluster listens on 127.0.0.1 only, without
    Ray's token authentication (on by default since Ray 2.5x, with a token file in ~/.ray that
    other Ray instances of this machine may have written): both ends agree to run without it."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}


@pytest.fixture
def ray_cluster(tmp_path):
    """``ray start --head --block`` in a process group of its own (stopped by killing that group,
    never with ``ray stop``, which would stop every Ray instance of the machine). Its workers
    import grpolens from this checkout (PYTHONPATH)."""
    ray_bin = Path(sys.executable).with_name("ray")
    if not ray_bin.exists():
        pytest.skip("ray (the dev and ray extras) provides `ray start`")
    port = _free_port()
    env = _env()
    log = (tmp_path / "ray-head.log").open("w")
    temp_dir = Path(tempfile.mkdtemp(prefix="gl-ray-", dir="/tmp"))  # short: Ray puts unix sockets in it
    head = subprocess.Popen([str(ray_bin), "start", "--head", "--block", f"--port={port}", "--num-cpus=1",
                             "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp_dir}",
                             "--node-ip-address=127.0.0.1"],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # the head is up once its GCS port accepts connections
            if head.poll() is not None:
                pytest.fail(f"ray start exited with {head.returncode}: {(tmp_path / 'ray-head.log').read_text()[-2000:]}")
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.5)
        else:
            pytest.fail("the Ray head did not start in 120 s")
        yield address, temp_dir
    finally:
        with_group = head.poll() is None
        if with_group:
            os.killpg(head.pid, signal.SIGTERM)
            try:
                head.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(head.pid, signal.SIGKILL)
                head.wait(timeout=30)
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_ray_address_joins_a_running_cluster(ray_cluster, synth_small, tmp_path):
    address, temp_dir = ray_cluster
    run = tmp_path / "run"
    shutil.copytree(synth_small, run, ignore=shutil.ignore_patterns(fmt.DERIVED_DIR))
    env = _env()
    out = tmp_path / "out"
    p = subprocess.Popen([sys.executable, "-m", "grpolens.cli", "recompute", str(run), "--engine", "ray",
                          "--ray-address", address, "--out", str(out), "-q"],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, err = p.communicate(timeout=400)
    assert p.returncode == 0, err[-3000:]
    want = recompute(run, write=False, incremental=False, engine=ThreadEngine())
    assert_frame_equal(pl.read_parquet(out / "metrics.parquet"), want, check_exact=True)
    # the command was a driver of this cluster (Ray logs each driver in the cluster's session), not
    # of a Ray instance of its own
    drivers = [f.name for f in temp_dir.glob("session_*/logs/python-core-driver-*.log")]
    assert any(name.endswith(f"_{p.pid}.log") for name in drivers), drivers
    assert err == ""  # -q: nothing of Ray's ("Connecting to existing Ray cluster ...") either
    # what the cluster's workers print does not reach the user's terminal
    r = subprocess.run([sys.executable, "-c", JOIN_WITH_A_LOUD_VISITOR, str(run), address], env=env,
                       capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "steps 6" and "a line a worker printed" not in r.stdout + r.stderr


JOIN_WITH_A_LOUD_VISITOR = r'''
import sys
from grpolens.analysis.recompute import recompute
from grpolens.metrics.engine_ray import RayEngine

class Loud:
    name = "loud"
    def shard(self, batch, shard):
        print("a line a worker printed", flush=True)
        return 1
    def combine(self, step, pieces):
        return pieces

got = recompute(sys.argv[1], write=False, incremental=False, engine=RayEngine(sys.argv[2]), extra_visitors=[Loud()])
print("steps", got.height)
'''


def test_an_address_with_no_cluster_is_one_line(tmp_path):
    """Ray retries such an address for minutes; grpolens says at once that nothing answers there."""
    pytest.importorskip("ray")
    port = _free_port()  # bound and released: nothing listens there
    for address in (f"127.0.0.1:{port}", f"ray://127.0.0.1:{port}"):
        r = subprocess.run([sys.executable, "-m", "grpolens.cli", "recompute", str(ROOT / "sample_runs" / "tiny"),
                            "--engine", "ray", "--ray-address", address, "--out", str(tmp_path / "out"), "-q"],
                           env=_env(), capture_output=True, text=True, timeout=300)
        assert r.returncode == 2 and r.stderr.strip() == (
            f"error: --ray-address {address}: cannot connect: nothing answers at 127.0.0.1:{port} (Connection refused)")
        assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("option", "env", "where"), [
    (["--ray-address", "localhost"], {}, "--ray-address localhost: cannot connect"),
    ([], {"RAY_ADDRESS": "localhost"}, "RAY_ADDRESS=localhost (set in the environment): cannot connect"),
], ids=["option", "environment"])
def test_an_address_ray_refuses_is_one_line_naming_where_it_came_from(tmp_path, option, env, where):
    """An address Ray cannot parse, given with --ray-address or in RAY_ADDRESS (which ray.init
    reads when no address is given): Ray's own first line, after what named the address."""
    pytest.importorskip("ray")
    base = {k: v for k, v in _env().items() if k != "RAY_ADDRESS"}
    r = subprocess.run([sys.executable, "-m", "grpolens.cli", "recompute", str(ROOT / "sample_runs" / "tiny"),
                        "--engine", "ray", *option, "--out", str(tmp_path / "out"), "-q"],
                       env={**base, **env}, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-3000:]
    line = r.stderr.strip()
    assert "\n" not in line and line.startswith(f"error: {where}: "), line
    assert "localhost" in line.removeprefix(f"error: {where}: ")  # Ray's reason names what it refused
    assert not (tmp_path / "out").exists()
