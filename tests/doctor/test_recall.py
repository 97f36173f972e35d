"""Recall and silence. Every pathology ``grpolens synth --inject`` can plant is found by its
detector, with the injected step as the finding's first step, on several seeds, sizes and rank
counts; the clean runs of the same seeds, and the real TRL run in sample_runs/trl-tiny, get no
warning or critical finding (info only)."""

import shutil
from pathlib import Path

import pytest

from grpolens.adapters.synth import PATHOLOGIES, synth_run
from grpolens.analysis.doctor import diagnose
from tests.sample_runs import copy_sample_run

#: which detector each injection is for
DETECTS = {"kl-spike": "kl-spike", "rollout-drift": "rollout-drift", "entropy-collapse": "entropy-collapse",
           "nan": "nonfinite", "clip-drift": "clip-drift", "advantage-collapse": "advantage-collapse",
           "length-growth": "length-pathology", "reward-hacking": "reward-hacking", "clip-inactive": "clip-inactive"}
#: (seed, steps, injected step, synth options): sizes, rank counts and micro-batches vary
SHAPES = [
    (0, 40, 20, {}),
    pytest.param(1, 32, 14, {"ranks": 2, "micro_batches": 2}, marks=pytest.mark.slow),
    pytest.param(2, 48, 33, {"groups": 8, "max_len": 128}, marks=pytest.mark.slow),
    pytest.param(5, 36, 9, {"ranks": 3, "generations": 6, "max_len": 96}, marks=pytest.mark.slow),
]
ROOT = Path(__file__).resolve().parents[2]


def test_every_injection_has_a_detector():
    assert set(DETECTS) == set(PATHOLOGIES)


def _loud(report):
    return [(f.id, f.severity, f.metric, f.summary) for f in report.findings if f.severity != "info"]


@pytest.mark.parametrize("seed,steps,at,opts", SHAPES)
def test_each_injection_is_found_at_its_step_and_the_clean_run_is_silent(tmp_path, seed, steps, at, opts):
    clean = diagnose(synth_run(tmp_path / "clean", steps=steps, seed=seed, **opts), explain=False)
    assert _loud(clean) == []
    assert {d.status for d in clean.detectors} <= {"passed", "skipped"}
    for kind, det in DETECTS.items():
        run = synth_run(tmp_path / kind, steps=steps, seed=seed, inject=[f"{kind}@{at}"], **opts)
        report = diagnose(run, explain=False)
        hits = [f for f in report.findings if f.id == det and f.severity != "info"]
        assert hits, (kind, _loud(report))
        assert any(f.steps[0] == at for f in hits), (kind, [(f.metric, f.steps[:3]) for f in hits])
        assert {d.id: d.status for d in report.detectors}[det] == "fired"
        shutil.rmtree(run)  # keep tmp small: 9 runs per shape


def test_the_real_trl_run_has_no_warning(tmp_path):
    run = copy_sample_run("trl-tiny", tmp_path / "trl-tiny")
    report = diagnose(run, explain=False)
    assert _loud(report) == []
    assert report.profile == "trl"  # the run's own trainer names the settings
    status = {d.id: d.status for d in report.detectors}
    assert status["rollout-drift"] == "skipped"  # no rollout log-probs in that run
    # what it does say: half its steps are the first pass over a generation, and most completions are truncated
    info = {f.id for f in report.findings}
    assert info == {"clip-inactive", "length-pathology"}
    assert report.worst_severity() == "info"


@pytest.mark.slow
def test_a_long_clean_run_with_its_healthy_trends_is_silent(tmp_path):
    # over 400 steps the synthetic policy's entropy falls by half and its KL to the reference grows
    # several-fold, as in real training: neither is a pathology
    report = diagnose(synth_run(tmp_path / "long", steps=400, seed=11, max_len=64), explain=False)
    assert _loud(report) == []


def test_findings_carry_the_explanation_of_their_worst_step(tmp_path):
    run = synth_run(tmp_path / "spike", steps=24, seed=4, inject=["kl-spike@12"])
    f = next(f for f in diagnose(run).findings if f.id == "kl-spike")
    ex = f.evidence["explain"]
    assert ex["step"] == 12 and ex["headline"].startswith("kl/k3 ")
    assert ex["value"] == pytest.approx(f.evidence["value"], rel=1e-9)  # explain's value is the metric's
    rows = ex["by"]["token_id"]
    assert sum(r["contribution"] for r in rows) == pytest.approx(ex["delta"], rel=1e-9)
    assert set(ex["concentration"]) >= {"top_1%_tokens", "top_1_completions"}
    assert set(ex["by"]) == {"token_id", "completion", "group"}
