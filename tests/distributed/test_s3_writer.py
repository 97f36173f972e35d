"""The writer writes a run straight to object storage (the real local S3 server): every file
appears whole under its final key, completion markers last, and the run reads back (validate,
recompute) exactly as the same writes to a local directory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from polars.testing import assert_frame_equal

from grpolens.analysis.recompute import recompute
from grpolens.run import format as fmt
from grpolens.run.validate import validate_run
from tests.integration.conftest import trl_run  # noqa: F401  (the fixture: real TRL trainings)

pytestmark = pytest.mark.slow  # the S3 server subprocess

ROOT = Path(__file__).resolve().parents[2]
RANK_WRITER = ROOT / "tests" / "helpers" / "rank_writer.py"


def keys(s3, prefix: str) -> list[str]:
    objs = s3.client().list_objects_v2(Bucket="runs", Prefix=prefix + "/").get("Contents", [])
    return sorted(o["Key"][len(prefix) + 1:] for o in objs if not o["Key"].endswith("/"))


def write_with_hook(run) -> None:
    """Three steps of two loss calls each (ragged, with every optional column) and their samples."""
    from grpolens.capture.hook import GRPOLensHook
    from tests.capture.test_hook import make_batch

    with GRPOLensHook(run, run_name="hooked", config={"loss_type": "dapo"}) as hook:
        for step in range(3):
            for call in range(2):
                d = make_batch(10 * step + call)
                ids = d["sample_ids"] + 1000 * (2 * step + call)
                hook.log_loss_call(step=step, logp=d["logp"], advantages=d["advantages"], sample_ids=ids,
                                   mask=d["mask"], valid=d["valid"], old_logp=d["old_logp"], ref_logp=d["ref_logp"],
                                   rollout_logp=d["rollout_logp"], entropy=d["entropy"], token_ids=d["token_ids"])
                hook.log_samples(step=step, sample_ids=ids, group_ids=ids // 2, completion_lens=d["lens"],
                                 truncated=torch.zeros(len(ids), dtype=torch.bool), reward=d["advantages"].double())
                if call == 0:
                    hook.writer.flush()  # the step's first part goes up on its own: parts, and a rename
            hook.end_step(step)


def test_hook_writes_an_s3_run_that_reads_as_the_local_one(s3_env, tmp_path):
    local, remote = tmp_path / "hooked", f"s3://runs/hooked-{tmp_path.name}"
    write_with_hook(local)
    write_with_hook(remote)
    prefix = remote[len("s3://runs/"):]
    on_s3 = keys(s3_env, prefix)
    on_disk = sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file())
    assert on_s3 == on_disk  # the same files, part files included; no temporary key left behind
    assert "complete/finished.rank=00000.json" in on_s3 and "tokens/step=00000001/rank=00000-0001.parquet" in on_s3
    fmt.forget_listings()
    assert validate_run(remote).problems == validate_run(local).problems
    assert_frame_equal(recompute(remote, write=False), recompute(local, write=False, incremental=False),
                       check_exact=True)


def _rank(run: str, rank: int, steps: int, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen([sys.executable, str(RANK_WRITER), run, str(rank), str(steps), *extra],
                            stdout=subprocess.PIPE, text=True, env=env)


def write_two_ranks_one_killed(run: str) -> None:
    """Rank 0 writes steps 0-2 and closes; rank 1 is killed (SIGKILL) in the middle of step 2."""
    assert _rank(run, 0, 3).wait(timeout=120) == 0
    p = _rank(run, 1, 3, "--die-in-step", "2")
    for line in p.stdout:
        if line.startswith("mid-step 2"):
            break
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=60)


def test_a_killed_writer_leaves_a_step_readers_skip(s3_env, tmp_path, capsys):
    local, remote = tmp_path / "two", f"s3://runs/two-{tmp_path.name}"
    write_two_ranks_one_killed(str(local))
    write_two_ranks_one_killed(remote)
    fmt.forget_listings()
    prefix = remote[len("s3://runs/"):]
    # step 2 of rank 1: its first part is up, whole, but no completion marker was written
    assert "tokens/step=00000002/rank=00001-0000.parquet" in keys(s3_env, prefix)
    assert "complete/step=00000002.rank=00001.json" not in keys(s3_env, prefix)
    assert fmt.list_steps(remote) == fmt.list_steps(local) == [0, 1]
    assert "skipping step 2 is incomplete: rank 1 of 2 has no completion marker" in capsys.readouterr().err
    assert_frame_equal(recompute(remote, write=False), recompute(local, write=False, incremental=False),
                       check_exact=True)
    report = validate_run(remote)
    assert [(p.severity, p.path) for p in report.problems] == [(p.severity, p.path) for p in validate_run(local).problems]
    assert any("shards without a completion marker" in p.message for p in report.errors)


def test_trl_training_writes_its_run_to_the_bucket(s3_env, trl_run, tmp_path, capsys):
    """A real TRL training (the integration) with grpolens_dir=s3://...: the run in the bucket,
    its tokenizer and the trainer's log and state included, recomputes to the metrics of the same
    training written to disk, and reproduces every value TRL logged."""
    from grpolens.cli import main
    from tests.integration.conftest import train_in_process

    local = trl_run("dapo") / "run"
    remote = f"s3://runs/trl-{tmp_path.name}"
    train_in_process(tmp_path / "out", ["--grpolens-dir", remote])
    fmt.forget_listings()
    prefix = remote[len("s3://runs/"):]
    on_s3 = keys(s3_env, prefix)
    assert {"tokenizer.json", "grpolens/trl_log.jsonl", "grpolens/trl_state.json",
            "complete/finished.rank=00000.json"} <= set(on_s3)
    assert [k for k in on_s3 if k.startswith(("tokens/", "samples/"))] == \
        sorted(p.relative_to(local).as_posix() for t in fmt.TABLES for p in (local / t).rglob("*.parquet"))
    assert validate_run(remote).ok
    assert_frame_equal(recompute(remote, write=False, profile="trl"),
                       recompute(local, write=False, incremental=False, profile="trl"), check_exact=True)
    capsys.readouterr()
    try:
        main(["parity", remote])
        code = 0
    except SystemExit as e:
        code = e.code
    assert code == 0, capsys.readouterr().out


def write_with_verl(run) -> None:
    """Two steps of verl's actor loop (tests/integrations/test_verl.py: a DataProto-shaped batch, the
    shuffled mini/micro-batch split, a forward per micro-batch) recorded by VerlCapture, the same
    random draws whatever ``run`` is."""
    from grpolens.integrations.verl import VerlCapture, verl_config
    from tests.integrations.test_verl import EOS, make_batch, update_policy

    rng = np.random.default_rng(11)
    cap = VerlCapture(run, config=verl_config({"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "use_kl_loss": True,
                                                "kl_loss_coef": 0.01, "loss_agg_mode": "token-mean"}),
                      rank=0, world_size=1, eos_token_id=EOS, run_name="verl-s3")
    for step in (1, 2):
        data = make_batch(rng)
        data.meta_info["global_steps"] = step
        update_policy(cap, data, rng)
    cap.close()


def test_verl_capture_writes_an_s3_run_that_reads_as_the_local_one(s3_env, tmp_path):
    """VerlCapture(run_dir="s3://..."): the same files as on disk, no temporary key left, and the run
    validates and recomputes identically to the local copy."""
    local, remote = tmp_path / "verl", f"s3://runs/verl-{tmp_path.name}"
    write_with_verl(local)
    write_with_verl(remote)
    on_s3 = keys(s3_env, remote[len("s3://runs/"):])
    on_disk = sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file())
    assert on_s3 == on_disk and "complete/finished.rank=00000.json" in on_s3
    assert not any(".grpolens-tmp-" in k for k in on_s3)
    fmt.forget_listings()
    report = validate_run(remote)
    assert report.ok and report.problems == validate_run(local).problems
    got = recompute(remote, write=False)
    assert got["step"].to_list() == [1, 2]
    assert_frame_equal(got, recompute(local, write=False, incremental=False), check_exact=True)
