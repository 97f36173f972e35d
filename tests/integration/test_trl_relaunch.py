"""Relaunching real TRL training into the folder of an earlier run, as users do after a crash:
refused by default (nothing changes), ``resume`` keeps the run and TRL's log consistent,
``overwrite`` replaces both."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest

from tests.integration import trl_parity
from tests.integration.conftest import train_in_process

pytest.importorskip("trl")
pytestmark = pytest.mark.slow  # three more trainings


def tree(path):
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def log_steps(run):
    return [json.loads(ln)["step"] for ln in (run / "grpolens" / "trl_log.jsonl").read_text().splitlines()]


def test_relaunch_refused_resumed_overwritten(trl_run, tmp_path):
    from grpolens.capture.writer import RunExistsError
    from grpolens.run.format import read_completion
    from grpolens.run.validate import validate_run
    from tests.integration.trl_tiny import CONFIGS

    out = shutil.copytree(trl_run("dapo"), tmp_path / "out", ignore=shutil.ignore_patterns("trainer"))
    run = out / "run"
    before = tree(run)
    first_log = log_steps(run)
    assert read_completion(run).complete_steps == [1, 2, 3, 4] and read_completion(run).run_finished

    with pytest.raises(RunExistsError, match=r"already holds a grpolens run \(4 complete step\(s\), last 4, "
                                             r"finished\); pass mode='resume'"):
        train_in_process(out, CONFIGS["dapo"])
    assert tree(run) == before  # nothing was written: no second set of parts, no log lines

    # resume without a checkpoint: TRL trains steps 1-4 again; the run already has them all
    with pytest.warns(UserWarning, match="rows logged again for steps up to 4 are dropped"):
        train_in_process(out, [*CONFIGS["dapo"], "--grpolens-mode", "resume"])
    assert {k: v for k, v in tree(run).items() if not k.startswith("complete/finished")} == \
        {k: v for k, v in before.items() if not k.startswith("complete/finished")}
    assert log_steps(run) == first_log and validate_run(run).ok

    train_in_process(out, [*CONFIGS["dapo"], "--grpolens-mode", "overwrite"])
    assert validate_run(run).ok and read_completion(run).complete_steps == [1, 2, 3, 4]
    assert log_steps(run) == first_log  # one run's records, not two interleaved
    rows = trl_parity.compare(run)
    assert rows and all(r.status == "ok" for r in rows), [r for r in rows if r.status != "ok"][:5]
