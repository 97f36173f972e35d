"""Real servers for the object-storage and Ray tests, started once per session.

``s3``: moto's S3 server on 127.0.0.1 in a subprocess (``tests/helpers/s3_server.py``) with
signature and IAM checks on: ``admin`` may do anything, ``lister`` may only list buckets' keys (so
reading an object is a real AccessDenied). ``s3_env`` points the standard AWS variables at it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

HELPER = Path(__file__).resolve().parents[1] / "helpers" / "s3_server.py"
REGION = "us-east-1"


@dataclass
class S3Server:
    endpoint: str
    admin: tuple[str, str]
    lister: tuple[str, str]

    def counts(self, reset: bool = False) -> dict[str, int]:
        req = urllib.request.Request(f"{self.endpoint}/_counts", method="POST" if reset else "GET")
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())

    def reset_counts(self) -> None:
        self.counts(reset=True)

    def client(self, user: str = "admin"):
        import boto3

        key, secret = getattr(self, user)
        return boto3.client("s3", endpoint_url=self.endpoint, region_name=REGION,
                            aws_access_key_id=key, aws_secret_access_key=secret)


def _create_users(endpoint: str) -> tuple[tuple[str, str], tuple[str, str]]:
    """The AUTH_SETUP_ACTIONS requests made before the server starts checking."""
    import boto3

    iam = boto3.client("iam", endpoint_url=endpoint, region_name=REGION,
                       aws_access_key_id="setup", aws_secret_access_key="setup")
    keys = []
    for user, actions in (("admin", ["s3:*"]), ("lister", ["s3:ListBucket"])):
        iam.create_user(UserName=user)
        policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": actions, "Resource": "*"}]}
        iam.put_user_policy(UserName=user, PolicyName="p", PolicyDocument=json.dumps(policy))
        k = iam.create_access_key(UserName=user)["AccessKey"]
        keys.append((k["AccessKeyId"], k["SecretAccessKey"]))
    return keys[0], keys[1]


@pytest.fixture(scope="session")
def s3():
    pytest.importorskip("moto", reason="moto[server] (the dev extra) runs the local S3 server")
    proc = subprocess.Popen([sys.executable, str(HELPER), "--auth"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)
    try:
        line = proc.stdout.readline()
        while line and not line.startswith("port="):  # anything a library prints first is skipped
            line = proc.stdout.readline()
        if not line.startswith("port="):
            raise RuntimeError(f"the local S3 server did not start (exit code {proc.poll()})")
        endpoint = f"http://127.0.0.1:{int(line.split('=')[1])}"
        admin, lister = _create_users(endpoint)
        server = S3Server(endpoint, admin, lister)
        server.client().create_bucket(Bucket="runs")
        yield server
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture
def s3_env(s3, monkeypatch):
    """The standard AWS variables pointing at the local server as ``admin`` (no profile files, no
    instance metadata: nothing leaves the machine)."""
    for k in list(os.environ):
        if k.startswith("AWS_"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3.admin[0])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3.admin[1])
    monkeypatch.setenv("AWS_REGION", REGION)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/credentials")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/config")
    from grpolens.run import storage

    storage._FS_CACHE.clear()
    storage.set_default_options(None)
    yield s3
    storage._FS_CACHE.clear()
    storage.set_default_options(None)  # a command's --storage-option must not outlive its test


def upload(s3, run: Path, prefix: str, keep: tuple[str, ...] = ("trl_log.jsonl", "trl_state.json")) -> str:
    """Every file of the local ``run`` to ``s3://runs/<prefix>``, less grpolens' outputs in
    ``RUN/grpolens/`` (the trainer's own records there, ``keep``, go up with the run)."""
    from grpolens.run import format as fmt

    client = s3.client()
    for f in sorted(run.rglob("*")):
        rel = f.relative_to(run)
        if f.is_file() and (rel.parts[0] != fmt.DERIVED_DIR or (len(rel.parts) == 2 and rel.name in keep)):
            client.put_object(Bucket="runs", Key=f"{prefix}/{f.relative_to(run).as_posix()}", Body=f.read_bytes())
    fmt.forget_listings()
    return f"s3://runs/{prefix}"


@pytest.fixture
def remote(s3_env, synth_small, monkeypatch, tmp_path):
    """``synth_small`` uploaded under a prefix of its own; the test runs in ``tmp_path``, where the
    outputs of an s3:// run go by default (``./<run name>.grpolens``)."""
    monkeypatch.chdir(tmp_path)
    return upload(s3_env, synth_small, f"r-{tmp_path.name}")


@pytest.fixture(scope="session")
def ray_local():
    """A real local Ray instance with 2 worker CPUs, shared by every Ray test of the session."""
    ray = pytest.importorskip("ray", reason="ray (the dev and ray extras) runs the Ray engine tests")
    src = str(Path(__file__).resolve().parents[2])
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}})
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def synth_small(tmp_path_factory):
    """A synthetic run with rollout log-probs, texts, 2 ranks and 2 micro-batches: every visitor has
    something to do (IS histograms, top-K tokens, completions, diversity)."""
    from grpolens.adapters.synth import synth_run

    return synth_run(tmp_path_factory.mktemp("synth") / "run", steps=6, ranks=2, micro_batches=2, groups=4,
                     generations=4, max_len=64, texts=True, inject=["rollout-drift@3"])
