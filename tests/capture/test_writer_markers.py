"""Incomplete and mixed runs never pass as whole: completion markers, the finished record, readers
that skip incomplete steps (or fail when asked), ``validate`` naming the step and rank, and writers
that refuse, resume or overwrite an existing run.

The inputs are the real ones: a corrupted copy of a synthetic run, a real two-rank run whose rank 1
is killed with SIGKILL between the parts of a step, and a relaunch into the same folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

from grpolens.adapters.synth import synth_run
from grpolens.capture.writer import RunExistsError, ShardWriter
from grpolens.run import format as fmt
from grpolens.run.format import read_completion

ROOT = Path(__file__).resolve().parents[2]
HELPER = ROOT / "tests" / "helpers" / "rank_writer.py"


def cli(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "grpolens.cli", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}, timeout=300)


def problems(run: Path) -> tuple[int, list[dict]]:
    """``grpolens validate --json``: exit status and the problems."""
    v = cli("validate", run, "--json")
    return v.returncode, [json.loads(ln) for ln in v.stdout.splitlines() if ln.startswith("{")]


def tree(path: Path) -> dict[str, str]:
    """Every file under ``path`` with its content hash: to assert that nothing changed."""
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    return synth_run(tmp_path_factory.mktemp("whole") / "run", steps=5, ranks=2, groups=2, generations=3,
                     max_len=24, seed=2)


# -- the format ---------------------------------------------------------------------------------

def test_writer_marks_every_step_and_rank_and_the_finish(synth):
    m = fmt.read_manifest(synth)
    assert m.completion_markers and json.loads((synth / fmt.MANIFEST_NAME).read_text())["completion_markers"] is True
    c = read_completion(synth)
    assert c.complete_steps == [0, 1, 2, 3, 4] and c.run_finished
    marker = json.loads((synth / fmt.marker_relpath(3, 1)).read_text())
    assert marker == {"step": 3, "rank": 1, "world_size": 2,
                      "files": ["samples/step=00000003/rank=00001.parquet", "tokens/step=00000003/rank=00001.parquet"]}
    finished = json.loads((synth / fmt.finished_relpath(0)).read_text())
    assert finished["rank"] == 0 and finished["steps_marked"] == 5 and finished["last_step"] == 4
    assert cli("validate", synth).returncode == 0



# -- a corrupted copy of a synthetic run --------------------------------------------------------

@pytest.mark.slow  # CLI subprocesses: > 10 s on a loaded machine
def test_a_step_missing_a_rank_is_skipped_and_named(synth, tmp_path):
    """Step 4 holds rank 0's rows only (rank 1's shards and marker gone): validate names step and
    rank; recompute leaves step 4 out with one line, and its steps 0-3 equal the whole run's."""
    run = shutil.copytree(synth, tmp_path / "run", ignore=shutil.ignore_patterns("grpolens"))
    for table in fmt.TABLES:
        (run / table / "step=00000004" / "rank=00001.parquet").unlink()
    (run / fmt.marker_relpath(4, 1)).unlink()

    code, probs = problems(run)
    assert code == 1
    assert [(p["severity"], p["path"], p["message"]) for p in probs] == [
        ("error", "complete/step=00000004.rank=00001.json",
         "step 4 rank 1: missing (no shards and no completion marker, world_size 2); readers skip step 4")]

    before = tree(run)
    r = cli("recompute", run)
    assert r.returncode == 0, r.stderr
    skipped = [ln for ln in r.stderr.splitlines() if "skipping" in ln]
    assert skipped == [f"grpolens: {run}: skipping step 4 is incomplete: rank 1 of 2 has no completion marker "
                       f"(`grpolens validate {run}` lists what is missing)"]
    got = pl.read_parquet(run / "grpolens" / "metrics.parquet")
    assert got["step"].to_list() == [0, 1, 2, 3]
    whole = pl.read_parquet(cli_recompute_whole(synth, tmp_path))
    assert got.drop("step").to_dicts() == whole.filter(pl.col("step") < 4).drop("step").to_dicts()
    assert {k: v for k, v in tree(run).items() if not k.startswith("grpolens/")} == before  # the run is untouched

    # asked to fail: one line naming the step and rank, exit 1, nothing written
    shutil.rmtree(run / "grpolens")
    f = cli("recompute", run, env={"GRPOLENS_INCOMPLETE": "fail"})
    assert f.returncode == 2 and f.stdout == ""
    assert f.stderr.strip().splitlines() == [f"error: {run}: step 4 is incomplete: rank 1 of 2 has no completion "
                                             "marker (unset $GRPOLENS_INCOMPLETE to skip such steps)"]
    assert not (run / "grpolens").exists()


def cli_recompute_whole(synth: Path, tmp_path: Path) -> Path:
    whole = shutil.copytree(synth, tmp_path / "whole", ignore=shutil.ignore_patterns("grpolens"))
    assert cli("recompute", whole).returncode == 0
    return whole / "grpolens" / "metrics.parquet"


def test_files_written_after_the_marker_are_named_by_validate(synth, tmp_path):
    """A second run's part file in a marked step (what a relaunch did before writers refused)."""
    run = shutil.copytree(synth, tmp_path / "run", ignore=shutil.ignore_patterns("grpolens"))
    src = run / "tokens/step=00000001/rank=00000.parquet"
    shutil.copy(src, run / "tokens/step=00000001/rank=00000-0001.parquet")
    code, probs = problems(run)
    assert code == 1
    assert ("tokens/step=00000001/rank=00000-0001.parquet", "not named by the completion marker of step 1 rank 0: "
            "written after it (a second run into the same folder?); readers would count its rows twice") in \
        [(p["path"], p["message"]) for p in probs if p["severity"] == "error"]


def test_runs_written_before_markers_are_read_as_before_with_a_warning(synth, tmp_path):
    run = shutil.copytree(synth, tmp_path / "run", ignore=shutil.ignore_patterns("grpolens"))
    shutil.rmtree(run / fmt.COMPLETE_DIR)
    m = json.loads((run / fmt.MANIFEST_NAME).read_text())
    del m["completion_markers"]
    (run / fmt.MANIFEST_NAME).write_text(json.dumps(m))
    assert read_completion(run) is None and fmt.list_steps(run) == [0, 1, 2, 3, 4]
    code, probs = problems(run)
    assert code == 0 and [p["message"][:34] for p in probs] == ["written without completion markers"]


# -- a real writer process killed with SIGKILL ---------------------------------------------------

def start(run: Path, rank: int, steps: int, *extra) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(HELPER), str(run), str(rank), str(steps), *map(str, extra)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})


def wait_for(proc: subprocess.Popen, line: str) -> None:
    for got in proc.stdout:
        if got.strip() == line:
            return
    raise AssertionError(f"the writer ended before printing {line!r}: {proc.stderr.read()}")


@pytest.fixture
def killed(tmp_path):
    """Two ranks; rank 1 is SIGKILLed in step 3 after its first part file; rank 0 writes 4 steps and closes."""
    run = tmp_path / "killed"
    r0 = start(run, 0, 4)
    wait_for(r0, "step 0")  # rank 0 wrote the manifest
    r1 = start(run, 1, 4, "--die-in-step", 3)
    wait_for(r1, "mid-step 3")
    r1.send_signal(signal.SIGKILL)
    r1.wait(timeout=30)
    assert r0.wait(timeout=60) == 0 and r1.returncode == -signal.SIGKILL
    return run


@pytest.mark.slow  # CLI subprocesses: > 10 s on a loaded machine
def test_a_rank_killed_between_the_parts_of_a_step(killed):
    step3 = sorted(p.name for p in (killed / "tokens/step=00000003").iterdir())
    # rank 1 wrote one of its two parts: the step looks like any other, minus a file
    assert step3 == ["rank=00000-0000.parquet", "rank=00000-0001.parquet", "rank=00001-0000.parquet"]
    code, probs = problems(killed)
    assert code == 1
    assert [(p["severity"], p["path"], p["message"]) for p in probs] == [
        ("error", "complete/step=00000003.rank=00001.json", "step 3 rank 1: shards without a completion marker "
         "(its writer stopped before the step ended); readers skip step 3"),
        ("warning", "complete", "no finished record for rank(s) 1: still training, or stopped before the writer "
         "was closed")]
    r = cli("recompute", killed)
    assert r.returncode == 0 and "skipping step 3 is incomplete: rank 1 of 2 has no completion marker" in r.stderr
    got = pl.read_parquet(killed / "grpolens" / "metrics.parquet")
    assert got["step"].to_list() == [0, 1, 2]
    assert got["health/tokens"].to_list() == [160.0] * 3  # 2 ranks x 2 loss calls x 40 tokens: no half step


# -- relaunching into the same folder -----------------------------------------------------------

def test_a_relaunch_into_the_same_folder_is_refused_and_changes_nothing(killed):
    before = tree(killed)
    r0 = start(killed, 0, 4)
    assert r0.wait(timeout=60) != 0
    err = r0.stderr.read()
    assert "RunExistsError" in err and "already holds a grpolens run (3 complete step(s), last 2, not finished); " \
           "pass mode='resume' to continue after its last complete step, or mode='overwrite' to replace it" in err
    assert tree(killed) == before
    with pytest.raises(RunExistsError):
        ShardWriter(killed, rank=0, world_size=2)
    assert tree(killed) == before


@pytest.mark.slow  # CLI subprocesses: > 10 s on a loaded machine
def test_resume_continues_after_the_last_complete_step(killed):
    r0 = start(killed, 0, 5, "--mode", "resume")
    wait_for(r0, "step 0")  # rank 0 has opened (and cleaned) the run, as before any step's collectives
    r1 = start(killed, 1, 5, "--mode", "resume")
    assert [p.wait(timeout=60) for p in (r0, r1)] == [0, 0], [p.stderr.read() for p in (r0, r1)]
    assert cli("validate", killed).returncode == 0
    c = read_completion(killed)
    assert c.complete_steps == [0, 1, 2, 3, 4] and c.run_finished
    # step 3's half-written part is gone; steps 0-2 were kept (their rows logged again were dropped)
    assert sorted(p.name for p in (killed / "tokens/step=00000003").iterdir()) == [
        "rank=00000-0000.parquet", "rank=00000-0001.parquet", "rank=00001-0000.parquet", "rank=00001-0001.parquet"]
    r = cli("recompute", killed)
    assert r.returncode == 0 and "skipping" not in r.stderr
    got = pl.read_parquet(killed / "grpolens" / "metrics.parquet")
    assert got["step"].to_list() == [0, 1, 2, 3, 4] and got["health/tokens"].to_list() == [160.0] * 5


def test_overwrite_replaces_the_run(killed):
    (killed / "grpolens").mkdir(exist_ok=True)
    (killed / "grpolens" / "trl_log.jsonl").write_text('{"step": 1}\n')
    procs = [start(killed, rank, 2, "--mode", "overwrite") for rank in (0,)]
    assert procs[0].wait(timeout=60) == 0
    assert fmt.list_steps(killed, complete_only=False) == [0, 1]
    assert not (killed / "grpolens").exists()  # derived files of the old run went with it


# -- synth: refuse, resume --------------------------------------------------------------------------

@pytest.mark.slow  # CLI subprocesses: > 10 s on a loaded machine
def test_synth_refuses_an_existing_run_and_resumes_an_incomplete_one(synth, tmp_path):
    run = shutil.copytree(synth, tmp_path / "run", ignore=shutil.ignore_patterns("grpolens"))
    before = tree(run)
    args = ["--ranks", 2, "--groups", 2, "--generations", 3, "--max-len", 24, "--seed", 2]
    again = cli("synth", run, "--steps", 5, *args)
    assert again.returncode == 2 and tree(run) == before
    assert again.stderr.strip() == f"error: {run} already exists (pass --overwrite to replace it, or --resume to continue it)"
    # step 4 cut short on rank 1 (its marker gone), then resumed to 7 steps
    (run / fmt.marker_relpath(4, 1)).unlink()
    (run / "tokens/step=00000004/rank=00001.parquet").unlink()
    wrong = cli("synth", run, "--steps", 7, "--resume", *args[:-1], 3)
    assert wrong.returncode == 2 and "--resume: " in wrong.stderr and "seed=2, not 3" in wrong.stderr
    ok = cli("synth", run, "--steps", 7, "--resume", *args)
    assert ok.returncode == 0, ok.stderr
    assert read_completion(run).complete_steps == list(range(7)) and cli("validate", run).returncode == 0
    fresh = synth_run(tmp_path / "fresh", steps=7, ranks=2, groups=2, generations=3, max_len=24, seed=2)
    for table in fmt.TABLES:
        for sh in fmt.list_shards(fresh, table):
            got = pl.read_parquet(run / sh.path.relative_to(fresh))
            assert got.equals(pl.read_parquet(sh.path)), sh.path
    assert fmt.read_manifest(run).extra["synth"]["steps"] == 7
